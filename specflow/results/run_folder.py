"""Results nothing can lose: a run folder written as results are produced.

- ``requests.jsonl``: one JSON line per finished request (a
  ``specflow.results.records.RequestRecord``), appended, flushed and fsync'ed before the
  next request starts; a rerun with ``resume=true`` reads them back and skips their ids.
- ``summary.json``: the aggregate (a ``specflow.results.records.RunSummary``, written
  atomically at the end, and as a partial summary with ``"complete": false`` when the run is
  interrupted); the temporary file and the folder are fsync'ed, so a crash leaves the old
  summary or the new one, never a torn one.
- ``fingerprint.json``: the settings that determine results (``results_fingerprint``); a
  resume with different settings is refused instead of mixing two configurations.

A crash mid-write can leave a torn last line in ``requests.jsonl``; a resume truncates the
file to its last newline (with a warning saying what was dropped). A broken line anywhere
else is an error naming the file and the line: nothing is skipped silently.

Aggregation (``summarize``): throughput is total new tokens / total seconds (so long
requests weigh more, as in Spec-Bench); ``speedup`` is the method's tokens/s over plain
decoding's tokens/s on the same requests; ``tau = 1 + accepted / rounds`` over all rounds.
Time to first token (``ttft_s``, the prefill and the first round) is a mean over requests;
the time per output token after it (``tpot_s``) is all decode seconds over all decode
tokens, and ``tpot_speedup`` plain decoding's TPOT over the method's: speculation changes
the second only, so short answers, whose time is mostly prefill, show it apart.
Task scores are means over requests; for pass/fail scores the summary adds
``task_ci95`` / ``baseline_task_ci95`` (95 % Wilson intervals) and ``task_paired`` (both /
method-only / plain-only / neither counts and the exact McNemar p-value), and
``accepted_by_level`` counts the tokens each acceptance level accepted (e.g. FLy's loosely
accepted tokens: ``accepted_by_level["fly_loose"] / new_tokens`` of the output).
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

from specflow.errors import ConfigError, SpecflowError
from specflow.results.records import (
    Aggregate,
    BatchReport,
    PairedCounts,
    RequestRecord,
    RunMeta,
    RunSummary,
    sum_parts,
)

log = logging.getLogger(__name__)

REQUESTS_FILE = "requests.jsonl"
SUMMARY_FILE = "summary.json"
FINGERPRINT_FILE = "fingerprint.json"

# The top-level config keys whose values determine a run's results, and the runner keys that
# do; everything else (callbacks, resume, runner.warmup, threads, cache_dir, ...) does not.
FINGERPRINT_KEYS = (
    "method",
    "model",
    "drafter",
    "intermediate_verifier",
    "draft_length",
    "target_verifier",
    "acceptor",
    "selector",
    "sampling",
    "workload",
)
FINGERPRINT_RUNNER_KEYS = (
    "max_new_tokens",
    "seed",
    "use_chat_template",
    "system_prompt",
    "batch_size",
    "device",
    "dtype",
    "attention",
    "baseline",
)


class CorruptRecordsError(SpecflowError, ValueError):
    """A ``requests.jsonl`` line that is not a request record (not a torn last line)."""


def results_fingerprint(cfg_container: dict[str, Any]) -> dict[str, Any]:
    """The part of a resolved run config (``OmegaConf.to_container(cfg, resolve=True)``)
    that determines results: the method, every stage, sampling, the workload and the runner
    settings in ``FINGERPRINT_RUNNER_KEYS``. Keys absent from the config are left out."""
    out = {k: cfg_container[k] for k in FINGERPRINT_KEYS if k in cfg_container}
    runner = cfg_container.get("runner") or {}
    picked = {k: runner[k] for k in FINGERPRINT_RUNNER_KEYS if k in runner}
    if picked:
        out["runner"] = picked
    return json.loads(json.dumps(out, sort_keys=True, default=str))  # plain, JSON-stable


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict) and d:
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: d}


def fingerprint_diff(old: dict[str, Any], new: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``{dotted.key: (old, new)}`` for every leaf that differs (missing = ``<unset>``)."""
    a, b = _flatten(old), _flatten(new)
    unset = "<unset>"
    return {
        k: (a.get(k, unset), b.get(k, unset))
        for k in sorted(set(a) | set(b))
        if a.get(k, unset) != b.get(k, unset)
    }


def _fsync_dir(path: Path) -> None:
    """fsync a directory so a rename or a new file in it survives a crash (POSIX)."""
    if os.name != "posix":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json_atomic(target: Path, data: Any) -> None:
    tmp = target.with_name(target.name + ".tmp")
    with tmp.open("w") as f:
        f.write(json.dumps(data, indent=2))
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(target)
    _fsync_dir(target.parent)


def _is_record(raw: bytes) -> bool:
    try:
        return isinstance(json.loads(raw), dict)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False


def repair_torn_tail(path: Path) -> bytes:
    """Truncate ``path`` after its last newline; returns the bytes dropped (a torn last line
    left by a crash mid-write; empty when the file already ends with a newline). A last line
    that is a whole JSON object (only its newline missing) is kept and gets its newline: no
    prefix of a serialized object is itself an object."""
    with path.open("rb+") as f:
        data = f.read()
        if not data or data.endswith(b"\n"):
            return b""
        keep = data.rfind(b"\n") + 1
        if _is_record(data[keep:]):
            f.write(b"\n")
            dropped = b""
        else:
            f.truncate(keep)
            dropped = data[keep:]
        f.flush()
        os.fsync(f.fileno())
    return dropped


class RunFolder:
    """Appends request records and writes the summary in one run folder.

    Args:
        path: the run folder (created if needed).
        resume: keep the records already there (their ids are skipped by the runner);
            otherwise an earlier ``requests.jsonl`` is renamed aside, never overwritten.
        fingerprint: the settings that determine results (``results_fingerprint(cfg)``),
            stored in ``fingerprint.json``; a resume whose fingerprint differs from the
            stored one raises ``ConfigError`` before anything in the folder is touched.
    """

    def __init__(
        self, path: str | Path, resume: bool, fingerprint: dict[str, Any] | None = None
    ) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.requests_path = self.path / REQUESTS_FILE
        self.fingerprint_path = self.path / FINGERPRINT_FILE
        self.records: list[RequestRecord] = []
        if fingerprint is not None:
            fingerprint = json.loads(json.dumps(fingerprint, sort_keys=True, default=str))
        if resume:
            self._check_fingerprint(fingerprint)  # first: a refused resume changes nothing
        if self.requests_path.exists():
            if resume:
                dropped = repair_torn_tail(self.requests_path)
                if dropped:
                    log.warning(
                        "%s: dropped a torn last line (%d bytes, a crash mid-write): %r",
                        self.requests_path,
                        len(dropped),
                        dropped[:200].decode("utf-8", errors="replace"),
                    )
                self.records = read_records(self.requests_path)
            else:  # never lose an earlier run: keep it beside the new one
                stamp = time.strftime("%Y%m%d-%H%M%S")
                self.requests_path.rename(self.path / f"requests.{stamp}.jsonl")
                if self.fingerprint_path.exists():
                    self.fingerprint_path.rename(self.path / f"fingerprint.{stamp}.json")
        if fingerprint is not None and not (resume and self.fingerprint_path.exists()):
            _write_json_atomic(self.fingerprint_path, fingerprint)

    def _check_fingerprint(self, fingerprint: dict[str, Any] | None) -> None:
        if fingerprint is None or not self.fingerprint_path.exists():
            return
        try:
            stored = json.loads(self.fingerprint_path.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(
                f"resume=true: {self.fingerprint_path} is not valid JSON ({exc}); "
                "resume into a new output folder"
            ) from None
        diff = fingerprint_diff(stored, fingerprint)
        if diff:
            shown = "; ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in diff.items())
            raise ConfigError(
                f"resume=true into {self.path}, but settings that determine results differ "
                f"from the run stored there ({len(diff)} key(s)): {shown}. Resuming would mix "
                "two configurations in one result: rerun with the original settings, or "
                "without resume=true into a new output folder (hydra.run.dir=...)"
            )

    @property
    def done_ids(self) -> set[str]:
        return {r.request_id for r in self.records}

    def append(self, record: RequestRecord) -> None:
        """Append one record as a line, flushed and fsync'ed; a file that does not end with
        a newline (a torn line) gets one first, so the new record is never glued to it."""
        line = (json.dumps(record.to_json()) + "\n").encode("utf-8")
        new_file = not self.requests_path.exists()
        with self.requests_path.open("ab+") as f:
            f.seek(0, os.SEEK_END)
            if f.tell() > 0:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    f.seek(0, os.SEEK_END)
                    f.write(b"\n")
            f.seek(0, os.SEEK_END)
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        if new_file:
            _fsync_dir(self.path)
        self.records.append(record)

    def write_summary(self, summary: RunSummary) -> Path:
        """Write ``summary.json`` atomically: temp file, fsync, rename, fsync the folder."""
        target = self.path / SUMMARY_FILE
        _write_json_atomic(target, summary.to_json())
        return target


def read_records(path: Path) -> list[RequestRecord]:
    """The request records of a requests.jsonl (``read_json_lines``); a JSON object that is
    not a record raises ``CorruptRecordsError`` naming the file, the record's number and its
    ``request_id``."""
    out = []
    for number, data in enumerate(read_json_lines(path), start=1):
        try:
            out.append(RequestRecord.from_json(data))
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptRecordsError(
                f"{path}: record {number} (request_id {data.get('request_id')!r}) is not a "
                f"request record: {type(exc).__name__}: {exc}"
            ) from None
    return out


def read_json_lines(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a requests.jsonl, as written. A torn last line (no final newline:
    a crash mid-write) is left out with a warning; any other line that is not a JSON object
    raises ``CorruptRecordsError`` naming the file and the line number."""
    data = path.read_bytes()
    lines = data.split(b"\n")
    torn = lines.pop() if lines else b""  # the text after the last newline
    out = []
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CorruptRecordsError(
                f"{path}, line {number}: not a JSON record ({exc}): "
                f"{raw[:120].decode('utf-8', errors='replace')!r}. Fix or delete that line "
                "(the lines around it are intact)"
            ) from None
        if not isinstance(record, dict):
            raise CorruptRecordsError(
                f"{path}, line {number}: expected a JSON object, got {type(record).__name__}"
            )
        out.append(record)
    if _is_record(torn):  # a whole record, only its newline missing
        out.append(json.loads(torn))
    elif torn.strip():
        log.warning(
            "%s: ignoring a torn last line %d (%d bytes without a newline; a crash "
            "mid-write; resume=true truncates it)",
            path,
            len(lines) + 1,
            len(torn),
        )
    return out


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def aggregate(records: list[RequestRecord]) -> Aggregate:
    """Aggregate metrics over request records (see module doc)."""
    if not records:
        return Aggregate.empty()
    m = [r.metrics for r in records]
    new_tokens = sum(x.new_tokens for x in m)
    total_s = sum(x.total_s for x in m)
    rounds = sum(x.rounds for x in m)
    accepted = sum(x.accepted for x in m)
    drafted = sum(x.drafted for x in m)
    tokens_per_s = _ratio(new_tokens, total_s)
    levels: dict[str, list[int]] = {}
    for x in m:
        for level, (d, a) in x.levels.items():
            acc = levels.setdefault(level, [0, 0])
            acc[0] += d
            acc[1] += a
    stage_keys = sorted({k for x in m for k in x.time_per_stage})
    out = Aggregate(
        num_requests=len(records),
        new_tokens=new_tokens,
        total_s=total_s,
        tokens_per_s=tokens_per_s,
        rounds=rounds,
        target_calls=sum(x.target_calls for x in m),
        drafted=drafted,
        accepted=accepted,
        tree_rounds=sum(x.tree_rounds for x in m),
        parts=sum_parts(*(x.parts for x in m)),
        tau=1.0 + accepted / rounds if rounds else None,
        acceptance_rate=_ratio(accepted, drafted),
        acceptance_by_level={k: _ratio(a, d) for k, (d, a) in levels.items()},
        accepted_by_level={k: a for k, (_, a) in levels.items()},
        time_per_stage={
            k: sum(x.time_per_stage.get(k, 0.0) for x in m) for k in stage_keys
        },
        baseline_tokens_per_s=None,
        speedup=None,
        speedup_median=None,
        fidelity=None,
    )
    ttfts = [x.ttft_s for x in m]
    if all(t is not None for t in ttfts):
        out.ttft_s = statistics.fmean(t or 0.0 for t in ttfts)
    decode_tokens = sum(x.decode_tokens for x in m)
    if all(x.decode_s is not None for x in m) and decode_tokens:
        out.tpot_s = sum(x.decode_s or 0.0 for x in m) / decode_tokens
    base = [x.baseline for x in m if x.baseline is not None]
    if len(base) == len(m):
        b_tokens = sum(b.baseline_tokens for b in base)
        b_s = sum(b.baseline_s for b in base)
        out.baseline_tokens_per_s = _ratio(b_tokens, b_s)
        out.speedup = _ratio(tokens_per_s or 0.0, out.baseline_tokens_per_s or 0.0)
        out.speedup_median = statistics.median(b.speedup for b in base)
        same = [b.matches_baseline for b in base if b.matches_baseline is not None]
        out.fidelity = sum(same) / len(same) if same else None
        b_ttft = [b.baseline_ttft_s for b in base]
        if all(t is not None for t in b_ttft):
            out.baseline_ttft_s = statistics.fmean(t or 0.0 for t in b_ttft)
        b_decode = [b.baseline_decode_s for b in base]
        b_decode_tokens = sum(b.baseline_decode_tokens for b in base)
        if all(d is not None for d in b_decode) and b_decode_tokens:
            out.baseline_tpot_s = sum(d or 0.0 for d in b_decode) / b_decode_tokens
        if out.baseline_tpot_s is not None and out.tpot_s:
            out.tpot_speedup = out.baseline_tpot_s / out.tpot_s
    _add_task_scores(out, records)
    return out


def _add_task_scores(out: Aggregate, records: list[RequestRecord]) -> None:
    """Mean task scores of the method and of plain decoding, with their intervals and the
    paired counts of pass/fail scores (see module doc)."""
    for key in sorted({k for r in records for k in r.task}):
        vals = [r.task[key] for r in records if key in r.task]
        out.task[key] = sum(vals) / len(vals)
        if _binary(vals):
            out.task_ci95[key] = wilson_interval(int(sum(vals)), len(vals))
        plain = [r.baseline_task for r in records if r.baseline_task and key in r.baseline_task]
        base_vals = [b[key] for b in plain]
        if base_vals:
            out.baseline_task[key] = sum(base_vals) / len(base_vals)
            if _binary(base_vals):
                out.baseline_task_ci95[key] = wilson_interval(int(sum(base_vals)), len(base_vals))
        paired = [
            (r.task[key], r.baseline_task[key])
            for r in records
            if key in r.task and r.baseline_task and key in r.baseline_task
        ]
        if paired and _binary([v for pair in paired for v in pair]):
            out.task_paired[key] = paired_counts(paired)


def _binary(values: list[Any]) -> bool:
    return all(v in (0, 1) for v in values)


def wilson_interval(successes: int, n: int, z: float = 1.959964) -> list[float]:
    """The 95 % Wilson score interval ``[lo, hi]`` of a proportion ``successes / n``.

    With p = k/n: (p + z²/2n ± z·sqrt(p(1-p)/n + z²/4n²)) / (1 + z²/n).  Unlike the normal
    interval it stays inside [0, 1] and is sensible at k = 0 or k = n.
    """
    if n <= 0:
        raise ValueError(f"wilson_interval needs n >= 1, got {n}")
    p = successes / n
    denom = 1.0 + z * z / n
    centre = p + z * z / (2 * n)
    half = z * math.sqrt(p * (1.0 - p) / n + z * z / (4.0 * n * n))
    return [max(0.0, (centre - half) / denom), min(1.0, (centre + half) / denom)]


def paired_counts(pairs: list[tuple[Any, Any]]) -> PairedCounts:
    """Pass/fail of the method against plain decoding on the same requests.

    ``both``, ``method_only``, ``plain_only``, ``neither`` (counts) and ``mcnemar_p``: the
    exact two-sided McNemar test, i.e. the binomial test of the b = method_only and
    c = plain_only discordant pairs against p = 1/2: p = min(1, 2·P[Bin(b+c, ½) <= min(b, c)]);
    1.0 when there is no discordant pair.
    """
    both = sum(1 for m, b in pairs if m and b)
    method_only = sum(1 for m, b in pairs if m and not b)
    plain_only = sum(1 for m, b in pairs if b and not m)
    n = method_only + plain_only
    tail = sum(math.comb(n, i) for i in range(min(method_only, plain_only) + 1)) / 2**n
    return PairedCounts(
        both=both,
        method_only=method_only,
        plain_only=plain_only,
        neither=len(pairs) - both - method_only - plain_only,
        mcnemar_p=min(1.0, 2.0 * tail),
    )


def aggregate_by_category(records: list[RequestRecord]) -> dict[str, Aggregate]:
    """``{category: aggregate of its records}``, categories sorted."""
    cats = sorted({r.category for r in records})
    return {c: aggregate([r for r in records if r.category == c]) for c in cats}


def summarize(
    records: list[RequestRecord],
    meta: RunMeta,
    complete: bool,
    batch: BatchReport | None = None,
) -> RunSummary:
    """The run's summary: ``meta`` (method, models, machine...), whether the run completed,
    the aggregate overall and by category, and the runner's ``batch`` report."""
    return RunSummary(meta, complete, aggregate(records), aggregate_by_category(records), batch)


def format_table(summary: RunSummary) -> str:
    """A readable per-category table of the summary."""
    labels = [
        "tokens/s",
        "baseline_tokens/s",
        "speedup",
        "ttft_ms",
        "tpot_ms",
        "tpot_speedup",
        "tau",
        "acceptance_rate",
        "fidelity",
    ]
    w = max(len(label) for label in labels) + 2  # every header cell keeps 2 spaces before it
    head = f"{'category':<16}{'n':>4}" + "".join(f"{label:>{w}}" for label in labels)
    lines = [head, "-" * len(head)]

    def row(name: str, agg: Aggregate) -> str:
        values = (
            agg.tokens_per_s,
            agg.baseline_tokens_per_s,
            agg.speedup,
            None if agg.ttft_s is None else agg.ttft_s * 1e3,
            None if agg.tpot_s is None else agg.tpot_s * 1e3,
            agg.tpot_speedup,
            agg.tau,
            agg.acceptance_rate,
            agg.fidelity,
        )
        cells = "".join(
            f"{v:>{w}.3f}" if isinstance(v, float) else f"{'-':>{w}}" for v in values
        )
        return f"{name:<16}{agg.num_requests:>4}" + cells

    for cat, agg in summary.by_category.items():
        lines.append(row(cat, agg))
    lines.append(row("ALL", summary.overall))
    return "\n".join(lines)
