"""A request's measurements from its generations: the ``RequestMetrics`` of its record.

The runner decodes a request turn by turn (``Generation`` per turn) with the method and,
when asked, with plain decoding; these functions turn those generations into the typed
record fields of ``specflow.results.records``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from specflow.results.records import BaselineMetrics, PoolMetrics, RequestMetrics, sum_parts

if TYPE_CHECKING:
    from specflow.scheduler import Generation
    from specflow.workload import Request


def task_scores(request: Request, text: str) -> dict[str, float]:
    """The task scores (``{"task/<name>": score}``) of ``text`` as the answer to ``request``;
    empty for a category without a scorer, or when the task extras are not installed."""
    try:
        from specflow.tasks.scoring import score_request
    except ImportError:  # pragma: no cover - tasks are optional extras
        return {}
    return score_request(request.category, text, request.reference, request.extra.get("problem"))


@dataclass(frozen=True)
class DecodeTimes:
    """A request's time to first token (mean over its turns) and the seconds and tokens
    after each turn's first token, summed; ``None`` seconds where any turn lacks a TTFT."""

    ttft_s: float | None
    decode_s: float | None
    decode_tokens: int

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first (``None``: nothing to divide)."""
        if self.decode_s is None or self.decode_tokens <= 0:
            return None
        return self.decode_s / self.decode_tokens


def decode_times(gens: list[Generation]) -> DecodeTimes:
    """``DecodeTimes`` of a request's turns (turns of no token count for neither)."""
    made = [g for g in gens if g.tokens]
    if not made or any(g.ttft_s is None for g in made):
        return DecodeTimes(None, None, sum(max(0, len(g.tokens) - 1) for g in made))
    return DecodeTimes(
        ttft_s=sum(g.ttft_s or 0.0 for g in made) / len(made),
        decode_s=sum(g.decode_s or 0.0 for g in made),
        decode_tokens=sum(len(g.tokens) - 1 for g in made),
    )


def generation_metrics(
    gens: list[Generation], queued_s: float = 0.0, baseline: BaselineMetrics | None = None
) -> RequestMetrics:
    """A request's metrics over its turns' generations (``latency_s`` = ``total_s``).

    ``queued_s``: seconds the turns waited for a batch slot; ``baseline``: plain decoding
    of the same turns (``baseline_metrics``), when it ran.
    """
    rounds = sum(g.stats.rounds for g in gens)
    accepted = sum(g.stats.accepted for g in gens)
    drafted = sum(g.stats.drafted for g in gens)
    total_s = sum(g.total_s for g in gens)
    new_tokens = sum(len(g.tokens) for g in gens)
    times: dict[str, float] = {}
    for g in gens:
        for k, v in g.times.as_dict(g.total_s).items():
            times[k] = times.get(k, 0.0) + v
        for level, nested in g.nested_times.items():
            for k, v in vars(nested).items():
                key = f"nested/{level}/{k}"
                times[key] = times.get(key, 0.0) + v
    levels: dict[str, list[int]] = {}
    for g in gens:
        for level, d in g.stats.level_drafted.items():
            acc = levels.setdefault(level, [0, 0])
            acc[0] += d
            acc[1] += g.stats.level_accepted[level]
        for level, nested in g.nested_stats.items():
            acc = levels.setdefault(level, [0, 0])
            acc[0] += nested.drafted
            acc[1] += nested.accepted
    asked = [k for g in gens for k in g.stats.asked_per_round]
    parts = sum_parts(*({k: asdict(v) for k, v in g.stats.parts.items()} for g in gens))
    decode = decode_times(gens)
    return RequestMetrics(
        new_tokens=new_tokens,
        total_s=total_s,
        tokens_per_s=new_tokens / total_s if total_s else 0.0,
        rounds=rounds,
        target_calls=sum(g.stats.target_calls for g in gens),
        drafted=drafted,
        accepted=accepted,
        tau=1.0 + accepted / rounds if rounds else 0.0,
        acceptance_rate=accepted / drafted if drafted else 0.0,
        levels=levels,
        time_per_stage=times,
        k_per_round=asked,
        rounds_skipped=sum(1 for k in asked if k == 0),
        tree_rounds=sum(g.stats.tree_rounds for g in gens),
        parts=parts,
        drafted_per_round=[k for g in gens for k in g.stats.drafted_per_round],
        accepted_per_round=[a for g in gens for a in g.stats.accepted_per_round],
        pool=pool_metrics(gens),
        latency_s=total_s,
        queued_s=queued_s,
        baseline=baseline,
        ttft_s=decode.ttft_s,
        decode_s=decode.decode_s,
        decode_tokens=decode.decode_tokens,
        tpot_s=decode.tpot_s,
    )


def pool_metrics(gens: list[Generation]) -> PoolMetrics | None:
    """A drafter pool's (MetaSD) per-round arms and rewards, arm counts and catch-up cost;
    ``None`` when no round chose an arm (no pool)."""
    stats = [s for g in gens for s in (g.stats, *g.nested_stats.values())]
    arms = [a for s in stats for a in s.arms]
    if not arms:
        return None
    return PoolMetrics(
        arms=arms,
        arm_rewards=[r for s in stats for r in s.rewards],
        arm_counts=[arms.count(i) for i in range(max(arms) + 1)],
        catchup_tokens=sum(s.catchup_tokens for s in stats),
        catchup_s=sum(s.catchup_s for s in stats),
    )


def baseline_metrics(
    gens: list[Generation], base: list[Generation], cached: bool, greedy: bool
) -> BaselineMetrics:
    """Plain decoding's turns ``base`` next to the method's ``gens``: tokens, seconds, the
    speedup of the method's tokens/s, and (``greedy`` only) whether every turn matches;
    plain decoding's TTFT and decode time, and the speedup of the time per output token."""
    tokens = sum(len(g.tokens) for g in gens)
    seconds = sum(g.total_s for g in gens)
    tokens_per_s = tokens / seconds if seconds else 0.0
    b_tokens = sum(len(g.tokens) for g in base)
    b_s = sum(g.total_s for g in base)
    matches = all(g.tokens == b.tokens for g, b in zip(gens, base, strict=True))
    mine, plain = decode_times(gens), decode_times(base)
    tpot, plain_tpot = mine.tpot_s, plain.tpot_s
    return BaselineMetrics(
        baseline_tokens=b_tokens,
        baseline_s=b_s,
        baseline_tokens_per_s=b_tokens / b_s if b_s else 0.0,
        baseline_cached=cached,
        speedup=tokens_per_s / (b_tokens / b_s) if b_s else None,
        matches_baseline=matches if greedy else None,
        baseline_ttft_s=plain.ttft_s,
        baseline_decode_s=plain.decode_s,
        baseline_decode_tokens=plain.decode_tokens,
        tpot_speedup=plain_tpot / tpot if tpot and plain_tpot is not None else None,
    )


def percentile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile of ``values`` (nearest rank), ``None`` when there are none."""
    if not values:
        return None
    vals = sorted(values)
    return vals[min(len(vals) - 1, round(q * (len(vals) - 1)))]
