"""The schema of a run's results: the per-request record and the run's summary.

Every result the runner writes is one of these dataclasses, built once where the data is
produced and written with its ``to_json()``; readers (resume, ``specflow.results.compare``, the
sweep summary, the plots) get them back with ``from_json()``.  Nothing else knows the JSON
keys, except ``specflow.results.metrics``, whose slash-separated metric names are keyed by them.

``requests.jsonl``, one ``RequestRecord`` per line::

    request_id, category, subcategory, output_text
    turns: [TurnRecord]                    prompt_tokens, output_text, output_tokens, ...
    metrics: RequestMetrics                new_tokens, total_s, tokens_per_s, rounds, ...
        + PoolMetrics inline               arms, arm_rewards, ... (a drafter pool only)
        + BaselineMetrics inline           baseline_tokens, baseline_s, ... (with a baseline)
    task: {"task/<name>": score}
    baseline_task: {"task/<name>": score}  (with a baseline only)

``summary.json``, one ``RunSummary``::

    RunMeta keys (those given)             method, target_model, models, config, machine, ...
    complete
    Aggregate keys, inline                 num_requests, tokens_per_s, speedup, tau, ...,
                                           "task/<name>", "baseline_task/<name>", task_ci95...
    by_category: {category: Aggregate}
    batch: BatchReport                     (absent when recomputed from requests.jsonl)
        + DecodePass, BaselinePass inline

A group written inline (its keys among its parent's) is present or absent as a whole.
``from_json`` also reads files written before some keys existed; the defaults it fills in
are listed where they apply (``RequestMetrics.from_json``, ``Aggregate.from_json``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

Json = dict[str, Any]

TASK_PREFIX = "task/"  # a task score's key; its plain-decoding mean is "baseline_" + key


def sum_parts(*groups: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """Per-part counts (``RequestMetrics.parts``) summed over ``groups``, key by key."""
    out: dict[str, dict[str, int]] = {}
    for parts in groups:
        for key, counts in parts.items():
            total = out.setdefault(key, {})
            for name, n in counts.items():
                total[name] = total.get(name, 0) + n
    return out


def describe_parts(parts: dict[str, dict[str, int]], label: str = "{}") -> str:
    """One line of per-part counts for a report, parts in key order: ``label`` (``{}``:
    the part's key) then its rounds, plain rounds and accepted / drafted tokens."""
    return "; ".join(
        f"{label.format(key)} {c['rounds']} rounds ({c['skipped']} plain), "
        f"{c['accepted']}/{c['drafted']} accepted"
        for key, c in sorted(parts.items()))


def _fields_from(cls: type, data: Json) -> dict[str, Any]:
    """``{name: data[name]}`` for each field of the dataclass ``cls`` (a flat group)."""
    return {f.name: data[f.name] for f in fields(cls)}


def _inline(data: Json, groups: tuple[str, ...]) -> Json:
    """``data`` (an ``asdict``) with each of ``groups`` (a nested dict, or ``None`` when
    absent) spliced in place of its key: how a group is written inline."""
    out: Json = {}
    for key, value in data.items():
        if key in groups:
            out.update(value or {})
        else:
            out[key] = value
    return out


# ----------------------------------------------------------------------------- a request


@dataclass
class TurnRecord:
    """One turn of a conversation: its prompt length and the method's answer.

    ``output_tokens`` is ``None`` (and not written) for a record whose token ids were left
    out to keep it small (the run folders under ``docs/records/runs``).
    """

    prompt_tokens: int
    output_text: str
    output_tokens: list[int] | None
    new_tokens: int
    total_s: float
    stop_reason: str
    ttft_s: float | None = None  # time to first token (``Generation.ttft_s``)

    def to_json(self) -> Json:
        out = asdict(self)
        if self.output_tokens is None:
            del out["output_tokens"]
        return out

    @classmethod
    def from_json(cls, data: Json) -> TurnRecord:
        return cls(
            prompt_tokens=data["prompt_tokens"],
            output_text=data["output_text"],
            output_tokens=data.get("output_tokens"),
            new_tokens=data["new_tokens"],
            total_s=data["total_s"],
            stop_reason=data["stop_reason"],
            ttft_s=data.get("ttft_s"),
        )


@dataclass
class PoolMetrics:
    """A drafter pool's (MetaSD) rounds: the arm chosen and its reward per pool round, how
    often each arm was chosen, and the catch-up of idle arms (positions, seconds)."""

    arms: list[int]
    arm_rewards: list[float]
    arm_counts: list[int]
    catchup_tokens: int
    catchup_s: float

    @classmethod
    def from_json(cls, data: Json) -> PoolMetrics:
        return cls(**_fields_from(cls, data))


@dataclass
class BaselineMetrics:
    """Plain decoding of the same request: its tokens and seconds, whether they came from
    the baseline cache, the speedup (``None`` when plain decoding took no time) and whether
    the outputs match (``None`` when sampling: they need not); its time to first token
    (mean over turns), decode seconds and tokens after the first (``RequestMetrics``) and
    the speedup of the time per output token, plain's TPOT over the method's (``None``
    where either was not measured)."""

    baseline_tokens: int
    baseline_s: float
    baseline_tokens_per_s: float
    baseline_cached: bool
    speedup: float | None
    matches_baseline: bool | None
    baseline_ttft_s: float | None = None
    baseline_decode_s: float | None = None
    baseline_decode_tokens: int = 0
    tpot_speedup: float | None = None

    @classmethod
    def from_json(cls, data: Json) -> BaselineMetrics:
        """Also reads records older than the TTFT keys (``None``, 0)."""
        return cls(
            baseline_tokens=data["baseline_tokens"],
            baseline_s=data["baseline_s"],
            baseline_tokens_per_s=data["baseline_tokens_per_s"],
            baseline_cached=data["baseline_cached"],
            speedup=data["speedup"],
            matches_baseline=data["matches_baseline"],
            baseline_ttft_s=data.get("baseline_ttft_s"),
            baseline_decode_s=data.get("baseline_decode_s"),
            baseline_decode_tokens=data.get("baseline_decode_tokens", 0),
            tpot_speedup=data.get("tpot_speedup"),
        )


@dataclass
class RequestMetrics:
    """A request's measurements over all its turns (the record's ``metrics``).

    ``levels``: ``{level: [drafted, accepted]}`` per verification level;
    ``time_per_stage``: seconds per stage (``prefill_s``... and ``nested/<level>/<stage>``);
    ``k_per_round``: the draft length asked each round (0: the round drafted nothing);
    ``tree_rounds``: rounds whose draft was a token tree (a tree drafter's choice;
    ``drafted`` counts a tree's every node, ``accepted`` its kept path);
    ``parts``: per named part of a drafter of parts (a fallback's ``first`` / ``then``),
    ``{"rounds", "skipped", "drafted", "accepted"}`` (``specflow.state.PartStats``;
    ``skipped``: plain rounds, asked for 0 tokens); ``{}`` for other drafters;
    ``latency_s``: admission to finish (``total_s`` plus nothing at batch size 1);
    ``queued_s``: seconds the turns waited for a batch slot;
    ``ttft_s``: time to first token, the mean over turns (prefill and the first round);
    ``decode_s`` / ``decode_tokens``: the seconds and tokens after each turn's first token,
    summed, and ``tpot_s`` their ratio, the time per output token (``None`` where not
    measured or no token followed the first).
    """

    new_tokens: int
    total_s: float
    tokens_per_s: float
    rounds: int
    target_calls: int
    drafted: int
    accepted: int
    tau: float
    acceptance_rate: float
    levels: dict[str, list[int]]
    time_per_stage: dict[str, float]
    k_per_round: list[int]
    rounds_skipped: int
    tree_rounds: int
    parts: dict[str, dict[str, int]]
    drafted_per_round: list[int]
    accepted_per_round: list[int]
    pool: PoolMetrics | None  # inline; a drafter pool only
    latency_s: float
    queued_s: float
    baseline: BaselineMetrics | None  # inline; when plain decoding ran next to the method
    ttft_s: float | None = None
    decode_s: float | None = None
    decode_tokens: int = 0
    tpot_s: float | None = None

    def to_json(self) -> Json:
        return _inline(asdict(self), ("pool", "baseline"))

    @classmethod
    def from_json(cls, data: Json) -> RequestMetrics:
        """Also reads records older than some keys: ``k_per_round`` ``[]``,
        ``rounds_skipped`` and ``tree_rounds`` 0 when missing, ``parts`` ``{}``,
        ``latency_s`` = ``total_s``, ``queued_s`` 0.0, the TTFT keys ``None`` / 0."""
        return cls(
            new_tokens=data["new_tokens"],
            total_s=data["total_s"],
            tokens_per_s=data["tokens_per_s"],
            rounds=data["rounds"],
            target_calls=data["target_calls"],
            drafted=data["drafted"],
            accepted=data["accepted"],
            tau=data["tau"],
            acceptance_rate=data["acceptance_rate"],
            levels=data["levels"],
            time_per_stage=data["time_per_stage"],
            k_per_round=data.get("k_per_round", []),
            rounds_skipped=data.get("rounds_skipped", 0),
            tree_rounds=data.get("tree_rounds", 0),
            parts=data.get("parts", {}),
            drafted_per_round=data["drafted_per_round"],
            accepted_per_round=data["accepted_per_round"],
            pool=PoolMetrics.from_json(data) if "arms" in data else None,
            latency_s=data.get("latency_s", data["total_s"]),
            queued_s=data.get("queued_s", 0.0),
            baseline=BaselineMetrics.from_json(data) if "baseline_s" in data else None,
            ttft_s=data.get("ttft_s"),
            decode_s=data.get("decode_s"),
            decode_tokens=data.get("decode_tokens", 0),
            tpot_s=data.get("tpot_s"),
        )


@dataclass
class RequestRecord:
    """One finished request: a line of ``requests.jsonl``.

    ``task`` / ``baseline_task``: task scores (``{"task/<name>": score}``) of the method's
    and plain decoding's last answer; ``baseline_task`` is ``None`` (and not written)
    without a baseline.
    """

    request_id: str
    category: str
    subcategory: str | None
    output_text: str
    turns: list[TurnRecord]
    metrics: RequestMetrics
    task: dict[str, float]
    baseline_task: dict[str, float] | None = None

    def to_json(self) -> Json:
        out: Json = {
            "request_id": self.request_id,
            "category": self.category,
            "subcategory": self.subcategory,
            "output_text": self.output_text,
            "turns": [t.to_json() for t in self.turns],
            "metrics": self.metrics.to_json(),
            "task": dict(self.task),
        }
        if self.baseline_task is not None:
            out["baseline_task"] = dict(self.baseline_task)
        return out

    @classmethod
    def from_json(cls, data: Json) -> RequestRecord:
        return cls(
            request_id=data["request_id"],
            category=data["category"],
            subcategory=data["subcategory"],
            output_text=data["output_text"],
            turns=[TurnRecord.from_json(t) for t in data["turns"]],
            metrics=RequestMetrics.from_json(data["metrics"]),
            task=data["task"],
            baseline_task=data.get("baseline_task"),
        )


# ----------------------------------------------------------------------------- the run


@dataclass
class PairedCounts:
    """Pass/fail of the method against plain decoding on the same requests, and the exact
    McNemar p-value of the discordant pairs (``specflow.results.run_folder.paired_counts``)."""

    both: int
    method_only: int
    plain_only: int
    neither: int
    mcnemar_p: float

    @classmethod
    def from_json(cls, data: Json) -> PairedCounts:
        return cls(**_fields_from(cls, data))


@dataclass
class Aggregate:
    """Metrics over a set of request records: the whole run, or one category
    (``specflow.results.run_folder.aggregate``; the module doc there says how each is pooled).

    ``acceptance_by_level`` / ``accepted_by_level``: rate and accepted tokens per level;
    ``tree_rounds``: rounds that verified a token tree (of ``rounds``); ``parts``: per named
    part of a drafter of parts, its counts summed (``RequestMetrics.parts``).
    The baseline fields are ``None`` unless every record has a baseline.  ``task`` and
    ``baseline_task`` (keyed ``task/<name>``) are written inline as ``task/<name>`` and
    ``baseline_task/<name>``; ``task_ci95``, ``baseline_task_ci95`` (95 % Wilson intervals
    of pass/fail scores) and ``task_paired`` are written only when not empty.  An aggregate
    of no requests is written as ``{"num_requests": 0}``.  ``ttft_s``: the mean time to
    first token of the requests; ``tpot_s``: the pooled time per output token after the
    first (all decode seconds over all decode tokens); the ``baseline_`` ones plain
    decoding's, and ``tpot_speedup`` plain's TPOT over the method's (``None`` unless
    every record has them).
    """

    num_requests: int
    new_tokens: int
    total_s: float
    tokens_per_s: float | None
    rounds: int
    target_calls: int
    drafted: int
    accepted: int
    tree_rounds: int
    parts: dict[str, dict[str, int]]
    tau: float | None
    acceptance_rate: float | None
    acceptance_by_level: dict[str, float | None]
    accepted_by_level: dict[str, int]
    time_per_stage: dict[str, float]
    baseline_tokens_per_s: float | None
    speedup: float | None
    speedup_median: float | None
    fidelity: float | None
    task: dict[str, float] = field(default_factory=dict)
    baseline_task: dict[str, float] = field(default_factory=dict)
    task_ci95: dict[str, list[float]] = field(default_factory=dict)
    baseline_task_ci95: dict[str, list[float]] = field(default_factory=dict)
    task_paired: dict[str, PairedCounts] = field(default_factory=dict)
    ttft_s: float | None = None
    tpot_s: float | None = None
    baseline_ttft_s: float | None = None
    baseline_tpot_s: float | None = None
    tpot_speedup: float | None = None

    @classmethod
    def empty(cls) -> Aggregate:
        """The aggregate of no requests (counts 0, rates ``None``)."""
        return cls(
            num_requests=0,
            new_tokens=0,
            total_s=0.0,
            tokens_per_s=None,
            rounds=0,
            target_calls=0,
            drafted=0,
            accepted=0,
            tree_rounds=0,
            parts={},
            tau=None,
            acceptance_rate=None,
            acceptance_by_level={},
            accepted_by_level={},
            time_per_stage={},
            baseline_tokens_per_s=None,
            speedup=None,
            speedup_median=None,
            fidelity=None,
        )

    def to_json(self) -> Json:
        if not self.num_requests:
            return {"num_requests": 0}
        out = asdict(self)
        for name in ("task", "baseline_task", "task_ci95", "baseline_task_ci95", "task_paired"):
            del out[name]
        # Task keys in the order summaries have always had: each score, then its interval
        # and plain decoding's, each dict of intervals / pairs where its first entry falls.
        for key, mean in self.task.items():
            out[key] = mean
            if key in self.task_ci95:
                out.setdefault("task_ci95", {})[key] = list(self.task_ci95[key])
            if key in self.baseline_task:
                out[f"baseline_{key}"] = self.baseline_task[key]
                if key in self.baseline_task_ci95:
                    out.setdefault("baseline_task_ci95", {})[key] = list(
                        self.baseline_task_ci95[key]
                    )
            if key in self.task_paired:
                out.setdefault("task_paired", {})[key] = asdict(self.task_paired[key])
        return out

    @classmethod
    def from_json(cls, data: Json) -> Aggregate:
        """From a ``by_category`` entry or a summary's top level (other keys are ignored).
        Also reads summaries older than ``accepted_by_level`` (``{}``), than ``tree_rounds``
        (0), than ``parts`` (``{}``) and than the task intervals and pairs (``{}``)."""
        if not data["num_requests"]:
            return cls.empty()
        plain = f"baseline_{TASK_PREFIX}"
        return cls(
            num_requests=data["num_requests"],
            new_tokens=data["new_tokens"],
            total_s=data["total_s"],
            tokens_per_s=data["tokens_per_s"],
            rounds=data["rounds"],
            target_calls=data["target_calls"],
            drafted=data["drafted"],
            accepted=data["accepted"],
            tree_rounds=data.get("tree_rounds", 0),
            parts=data.get("parts", {}),
            tau=data["tau"],
            acceptance_rate=data["acceptance_rate"],
            acceptance_by_level=data["acceptance_by_level"],
            accepted_by_level=data.get("accepted_by_level", {}),
            time_per_stage=data["time_per_stage"],
            baseline_tokens_per_s=data["baseline_tokens_per_s"],
            speedup=data["speedup"],
            speedup_median=data["speedup_median"],
            fidelity=data["fidelity"],
            task={k: v for k, v in data.items() if k.startswith(TASK_PREFIX)},
            baseline_task={
                k.removeprefix("baseline_"): v for k, v in data.items() if k.startswith(plain)
            },
            task_ci95=data.get("task_ci95", {}),
            baseline_task_ci95=data.get("baseline_task_ci95", {}),
            task_paired={
                k: PairedCounts.from_json(v) for k, v in data.get("task_paired", {}).items()
            },
            ttft_s=data.get("ttft_s"),
            tpot_s=data.get("tpot_s"),
            baseline_ttft_s=data.get("baseline_ttft_s"),
            baseline_tpot_s=data.get("baseline_tpot_s"),
            tpot_speedup=data.get("tpot_speedup"),
        )


@dataclass
class RunMeta:
    """What the run was: set by the caller (``specflow.app``: method, target and models,
    the resolved config) and the runner (machine, start time, run folder).  Only the fields
    that are set are written."""

    method: str | None = None
    target_model: str | None = None
    models: list[str] | None = None
    config: dict[str, Any] | None = None
    machine: dict[str, Any] | None = None
    row_padding: dict[str, Any] | None = None  # model name -> its row padding, int8 rows
    started: str | None = None
    output_dir: str | None = None

    def to_json(self) -> Json:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_json(cls, data: Json) -> RunMeta:
        """The meta fields among a summary's top-level keys."""
        return cls(**{f.name: data.get(f.name) for f in fields(cls)})


@dataclass
class DecodePass:
    """The method's pass over the requests: the KV store's report (``kv_layout``,
    ``kernels``, ``decode`` and the static path's counters; written inline), the attention
    kernel and block size, and the throughput across the batch."""

    kv: dict[str, Any]
    attention: str
    block_size: int | None
    wall_s: float
    new_tokens: int
    throughput_tokens_per_s: float
    mean_active: float

    def to_json(self) -> Json:
        return _inline(asdict(self), ("kv",))


@dataclass
class BaselinePass:
    """Plain decoding's pass over the same requests, and the method's throughput over it
    (``throughput_speedup``: ``None``, and not written, when plain decoding made no token)."""

    baseline_wall_s: float
    baseline_throughput_tokens_per_s: float
    throughput_speedup: float | None = None

    def to_json(self) -> Json:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass
class BatchReport:
    """The summary's ``batch``: batch size and device, the cached baseline's re-timing
    (``baseline_drift``, only with a cached baseline), the passes as measured (``None`` when
    this run decoded nothing, e.g. a resume with every request done, or crashed first) and
    the request latencies (``None`` without records)."""

    batch_size: int
    device: str
    baseline_drift: float | None = None
    decoding: DecodePass | None = None
    baseline: BaselinePass | None = None
    latency_s_mean: float | None = None
    latency_s_p50: float | None = None
    latency_s_p90: float | None = None

    def to_json(self) -> Json:
        out: Json = {"batch_size": self.batch_size, "device": self.device}
        if self.baseline_drift is not None:
            out["baseline_drift"] = self.baseline_drift
        if self.decoding is not None:
            out.update(self.decoding.to_json())
        if self.baseline is not None:
            out.update(self.baseline.to_json())
        out.update(
            latency_s_mean=self.latency_s_mean,
            latency_s_p50=self.latency_s_p50,
            latency_s_p90=self.latency_s_p90,
        )
        return out

    @classmethod
    def from_json(cls, data: Json) -> BatchReport:
        named = {f.name for c in (cls, DecodePass, BaselinePass) for f in fields(c)}
        decoding = None
        if "wall_s" in data:
            decoding = DecodePass(
                kv={k: v for k, v in data.items() if k not in named},
                attention=data["attention"],
                block_size=data["block_size"],
                wall_s=data["wall_s"],
                new_tokens=data["new_tokens"],
                throughput_tokens_per_s=data["throughput_tokens_per_s"],
                mean_active=data["mean_active"],
            )
        baseline = None
        if "baseline_wall_s" in data:
            baseline = BaselinePass(
                data["baseline_wall_s"],
                data["baseline_throughput_tokens_per_s"],
                data.get("throughput_speedup"),
            )
        return cls(
            batch_size=data["batch_size"],
            device=data["device"],
            baseline_drift=data.get("baseline_drift"),
            decoding=decoding,
            baseline=baseline,
            latency_s_mean=data["latency_s_mean"],
            latency_s_p50=data["latency_s_p50"],
            latency_s_p90=data["latency_s_p90"],
        )


@dataclass
class RunSummary:
    """A run's ``summary.json``: ``meta``, ``complete`` (false when the run was interrupted),
    the aggregate of all requests (``overall``, written inline), ``by_category`` and
    ``batch`` (``None`` for a summary recomputed from ``requests.jsonl``)."""

    meta: RunMeta
    complete: bool
    overall: Aggregate
    by_category: dict[str, Aggregate]
    batch: BatchReport | None = None

    def to_json(self) -> Json:
        out: Json = {**self.meta.to_json(), "complete": self.complete, **self.overall.to_json()}
        out["by_category"] = {cat: agg.to_json() for cat, agg in self.by_category.items()}
        if self.batch is not None:
            out["batch"] = self.batch.to_json()
        return out

    @classmethod
    def from_json(cls, data: Json) -> RunSummary:
        return cls(
            meta=RunMeta.from_json(data),
            complete=data["complete"],
            overall=Aggregate.from_json(data),
            by_category={c: Aggregate.from_json(a) for c, a in data["by_category"].items()},
            batch=BatchReport.from_json(data["batch"]) if "batch" in data else None,
        )
