"""Results nothing can lose: a run folder written as results are produced.

- ``requests.jsonl``: one JSON line per finished request, appended, flushed and fsync'ed
  before the next request starts; a rerun with ``resume=true`` skips the ids found there.
- ``summary.json``: the aggregate (written atomically at the end, and as a partial summary
  with ``"complete": false`` when the run is interrupted).

Aggregation (``summarize``): throughput is total new tokens / total seconds (so long
requests weigh more, as in Spec-Bench); ``speedup`` is the method's tokens/s over plain
decoding's tokens/s on the same requests; ``tau = 1 + accepted / rounds`` over all rounds.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

REQUESTS_FILE = "requests.jsonl"
SUMMARY_FILE = "summary.json"


class RunFolder:
    """Appends request records and writes the summary in one run folder."""

    def __init__(self, path: str | Path, resume: bool) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.requests_path = self.path / REQUESTS_FILE
        self.records: list[dict[str, Any]] = []
        if self.requests_path.exists():
            if resume:
                self.records = read_records(self.requests_path)
            else:  # never lose an earlier run: keep it beside the new one
                stamp = time.strftime("%Y%m%d-%H%M%S")
                self.requests_path.rename(self.path / f"requests.{stamp}.jsonl")

    @property
    def done_ids(self) -> set[str]:
        return {r["request_id"] for r in self.records}

    def append(self, record: dict[str, Any]) -> None:
        with self.requests_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.records.append(record)

    def write_summary(self, summary: dict[str, Any]) -> Path:
        target = self.path / SUMMARY_FILE
        tmp = target.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(summary, indent=2))
        tmp.replace(target)
        return target


def read_records(path: Path) -> list[dict[str, Any]]:
    """Read a requests.jsonl, ignoring a torn last line (a crash mid-write)."""
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def aggregate(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Aggregate metrics over request records (see module doc)."""
    if not records:
        return {"num_requests": 0}
    m = [r["metrics"] for r in records]
    new_tokens = sum(x["new_tokens"] for x in m)
    total_s = sum(x["total_s"] for x in m)
    rounds = sum(x["rounds"] for x in m)
    accepted = sum(x["accepted"] for x in m)
    drafted = sum(x["drafted"] for x in m)
    out: dict[str, Any] = {
        "num_requests": len(records),
        "new_tokens": new_tokens,
        "total_s": total_s,
        "tokens_per_s": _ratio(new_tokens, total_s),
        "rounds": rounds,
        "target_calls": sum(x["target_calls"] for x in m),
        "drafted": drafted,
        "accepted": accepted,
        "tau": 1.0 + accepted / rounds if rounds else None,
        "acceptance_rate": _ratio(accepted, drafted),
    }
    levels: dict[str, list[int]] = {}
    for x in m:
        for level, (d, a) in x.get("levels", {}).items():
            acc = levels.setdefault(level, [0, 0])
            acc[0] += d
            acc[1] += a
    out["acceptance_by_level"] = {k: _ratio(a, d) for k, (d, a) in levels.items()}
    stage_keys = sorted({k for x in m for k in x["time_per_stage"]})
    out["time_per_stage"] = {k: sum(x["time_per_stage"].get(k, 0.0) for x in m) for k in stage_keys}
    base = [x for x in m if x.get("baseline_s") is not None]
    if len(base) == len(m):
        b_tokens = sum(x["baseline_tokens"] for x in m)
        b_s = sum(x["baseline_s"] for x in m)
        out["baseline_tokens_per_s"] = _ratio(b_tokens, b_s)
        out["speedup"] = _ratio(out["tokens_per_s"] or 0.0, out["baseline_tokens_per_s"] or 0.0)
        out["speedup_median"] = statistics.median(x["speedup"] for x in m)
        same = [x["matches_baseline"] for x in m if x.get("matches_baseline") is not None]
        out["fidelity"] = sum(same) / len(same) if same else None
    else:
        out["baseline_tokens_per_s"] = out["speedup"] = out["speedup_median"] = None
        out["fidelity"] = None
    task_keys = sorted({k for r in records for k in r.get("task", {})})
    for key in task_keys:
        vals = [r["task"][key] for r in records if key in r.get("task", {})]
        out[key] = sum(vals) / len(vals)
        base_vals = [r["baseline_task"][key] for r in records if key in r.get("baseline_task", {})]
        if base_vals:
            out[f"baseline_{key}"] = sum(base_vals) / len(base_vals)
    return out


def summarize(records: list[dict[str, Any]], meta: dict[str, Any]) -> dict[str, Any]:
    """The run's summary: ``meta`` (method, models, machine...) + overall + by_category."""
    summary = dict(meta)
    summary.update(aggregate(records))
    cats = sorted({r["category"] for r in records})
    summary["by_category"] = {
        c: aggregate([r for r in records if r["category"] == c]) for c in cats
    }
    return summary


def format_table(summary: dict[str, Any]) -> str:
    """A readable per-category table of the summary."""
    cols = (
        "tokens_per_s",
        "baseline_tokens_per_s",
        "speedup",
        "tau",
        "acceptance_rate",
        "fidelity",
    )
    head = f"{'category':<16}{'n':>4}" + "".join(f"{c.replace('_per_s', '/s'):>16}" for c in cols)
    lines = [head, "-" * len(head)]

    def row(name: str, agg: dict[str, Any]) -> str:
        cells = "".join(
            f"{agg.get(c):>16.3f}" if isinstance(agg.get(c), float) else f"{'-':>16}" for c in cols
        )
        return f"{name:<16}{agg.get('num_requests', 0):>4}" + cells

    for cat, agg in summary.get("by_category", {}).items():
        lines.append(row(cat, agg))
    lines.append(row("ALL", summary))
    return "\n".join(lines)
