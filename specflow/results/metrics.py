"""The metric names of the core: slash-separated names from records and summaries.

``flatten_record(record)``, ``flatten_summary(summary)`` and ``flatten_by_category(summary)``
turn the typed results of ``specflow.results.records`` into flat ``{name: float}``; the names come
from the JSON keys of a record's ``metrics`` (plus its ``task`` scores) or of a summary
aggregate (overall or one ``by_category`` entry), through ``flatten``:

========================  ===================================================
name                      from
========================  ===================================================
throughput/tokens_per_s   ``tokens_per_s`` (method)
throughput/baseline_...   ``baseline_tokens_per_s`` (plain decoding)
throughput/speedup        ``speedup`` (also ``throughput/speedup_median``)
latency/ttft_s            ``ttft_s``: time to first token (also ``latency/baseline_ttft_s``)
latency/tpot_s            ``tpot_s``: time per output token after the first (also
                          ``latency/baseline_tpot_s``); ``throughput/tpot_speedup``
accept/tau                ``tau`` = 1 + accepted / rounds
accept/rate               ``acceptance_rate``; ``accept/rate/<level>`` per level
accept/drafted, accepted  token counts
count/...                 ``rounds``, ``target_calls``, ``tree_rounds``, ``new_tokens``...
time/<stage>_s            ``time_per_stage``; ``time/total_s``, ``time/baseline_s``
quality/fidelity          ``fidelity`` (summary) or ``matches_baseline`` (record, 0/1)
task/<name>               task scores of the method's output
baseline_task/<name>      task scores of plain decoding's output
task_ratio/<name>         task / baseline_task (1.0 when both are 0)
task_lo/, task_hi/<name>  95 % Wilson interval of a pass/fail task score (summary);
                          also ``baseline_task_lo/`` and ``baseline_task_hi/``
task_paired/<name>/<f>    ``both``, ``method_only``, ``plain_only``, ``neither``, ``mcnemar_p``
accept/accepted/<level>   tokens accepted at a level (summary ``accepted_by_level``)
part/<key>/<count>        per named part of a drafter of parts (``parts``): ``rounds``,
                          ``skipped``, ``drafted``, ``accepted``, and ``rate`` (accepted /
                          drafted)
quality/accuracy_ratio    mean of the ``task_ratio/*`` (absent without task scores)
========================  ===================================================

``None`` values are left out; booleans become 0.0 / 1.0; counts stay integers.  The same
names are used in the JSONL and CSV logs, wandb, the plots, the sweep summary and
``specflow.results.compare``; ``KEY_METRICS`` / ``ordered_columns`` fix the column order of every
table and CSV file.  This module is core (it only reads the record and summary schema of
``specflow.results.records``), so the callbacks and ``specflow.results.compare`` both import it.
"""

from __future__ import annotations

import math
from typing import Any

from specflow.results.records import Aggregate, RequestRecord, RunSummary

SCALARS: dict[str, str] = {
    "tokens_per_s": "throughput/tokens_per_s",
    "baseline_tokens_per_s": "throughput/baseline_tokens_per_s",
    "speedup": "throughput/speedup",
    "speedup_median": "throughput/speedup_median",
    "ttft_s": "latency/ttft_s",
    "baseline_ttft_s": "latency/baseline_ttft_s",
    "tpot_s": "latency/tpot_s",
    "baseline_tpot_s": "latency/baseline_tpot_s",
    "tpot_speedup": "throughput/tpot_speedup",
    "tau": "accept/tau",
    "acceptance_rate": "accept/rate",
    "drafted": "accept/drafted",
    "accepted": "accept/accepted",
    "rounds": "count/rounds",
    "target_calls": "count/target_calls",
    "tree_rounds": "count/tree_rounds",
    "new_tokens": "count/new_tokens",
    "baseline_tokens": "count/baseline_tokens",
    "num_requests": "count/requests",
    "total_s": "time/total_s",
    "baseline_s": "time/baseline_s",
    "fidelity": "quality/fidelity",
    "matches_baseline": "quality/fidelity",
    "baseline_cached": "run/baseline_cached",
    "complete": "run/complete",
}

# Columns shown first, in this order, by tables and CSV files (the rest follow sorted).
KEY_METRICS: tuple[str, ...] = (
    "count/requests",
    "throughput/tokens_per_s",
    "throughput/baseline_tokens_per_s",
    "throughput/speedup",
    "throughput/tpot_speedup",
    "latency/ttft_s",
    "latency/tpot_s",
    "accept/tau",
    "accept/rate",
    "quality/fidelity",
    "quality/accuracy_ratio",
)


def _number(value: Any) -> float | None:
    """``value`` as a JSON-friendly number (ints stay ints), else ``None``."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float) and not math.isnan(value):
        return value
    return None


def _task_name(key: str) -> str:
    return key if key.startswith("task/") else f"task/{key}"


def flatten(metrics: dict[str, Any], task: dict[str, Any] | None = None,
            baseline_task: dict[str, Any] | None = None) -> dict[str, float]:
    """Slash-named scalars of the JSON form of a record's ``metrics`` or of a summary
    aggregate (module doc): the one place JSON keys become metric names.

    A summary aggregate carries its task scores inline (``task/x``, ``baseline_task/x``);
    a record passes them as ``task`` and ``baseline_task``.
    """
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if key in SCALARS:
            v = _number(value)
            if v is not None:
                out[SCALARS[key]] = v
        elif key == "time_per_stage" and isinstance(value, dict):
            for stage, secs in value.items():
                if (v := _number(secs)) is not None:
                    out[f"time/{stage}"] = v
        elif key == "levels" and isinstance(value, dict):  # record: {level: [drafted, acc]}
            for level, (drafted, accepted) in value.items():
                if drafted:
                    out[f"accept/rate/{level}"] = accepted / drafted
        elif key == "acceptance_by_level" and isinstance(value, dict):  # summary
            for level, rate in value.items():
                if (v := _number(rate)) is not None:
                    out[f"accept/rate/{level}"] = v
        elif key in ("task_ci95", "baseline_task_ci95") and isinstance(value, dict):
            prefix = key.removesuffix("_ci95")  # task_lo/<name>, baseline_task_hi/<name>
            for task_key, (lo, hi) in value.items():
                name = task_key.removeprefix("task/")
                out[f"{prefix}_lo/{name}"] = float(lo)
                out[f"{prefix}_hi/{name}"] = float(hi)
        elif key == "task_paired" and isinstance(value, dict):
            for task_key, counts in value.items():
                name = task_key.removeprefix("task/")
                for field, count in counts.items():
                    if (v := _number(count)) is not None:
                        out[f"task_paired/{name}/{field}"] = v
        elif key == "parts" and isinstance(value, dict):  # {part: {count: n}}
            for part, counts in value.items():
                for name, count in counts.items():
                    if (v := _number(count)) is not None:
                        out[f"part/{part}/{name}"] = v
                if counts.get("drafted"):
                    out[f"part/{part}/rate"] = counts["accepted"] / counts["drafted"]
        elif key == "accepted_by_level" and isinstance(value, dict):
            for level, count in value.items():
                if (v := _number(count)) is not None:
                    out[f"accept/accepted/{level}"] = v
        elif key.startswith(("task/", "baseline_task/")):
            if (v := _number(value)) is not None:
                out[key] = v
    for key, value in (task or {}).items():
        if (v := _number(value)) is not None:
            out[_task_name(key)] = v
    for key, value in (baseline_task or {}).items():
        if (v := _number(value)) is not None:
            out[f"baseline_{_task_name(key)}"] = v
    out.update(task_ratios(out))
    return out


def task_ratios(flat: dict[str, float]) -> dict[str, float]:
    """``task_ratio/<name>`` per task score with a baseline, and their mean."""
    ratios: dict[str, float] = {}
    for key, value in flat.items():
        if not key.startswith("task/"):
            continue
        base = flat.get(f"baseline_{key}")
        if base is None:
            continue
        name = key.removeprefix("task/")
        if base:
            ratios[f"task_ratio/{name}"] = value / base
        elif not value:
            ratios[f"task_ratio/{name}"] = 1.0
    if ratios:
        ratios["quality/accuracy_ratio"] = sum(ratios.values()) / len(ratios)
    return ratios


def flatten_record(record: RequestRecord) -> dict[str, float]:
    """Slash-named scalars of one request record (``metrics`` + task scores)."""
    return flatten(record.metrics.to_json(), record.task, record.baseline_task)


def flatten_aggregate(agg: Aggregate) -> dict[str, float]:
    """Slash-named scalars of one aggregate (a summary's overall or a category's)."""
    return flatten(agg.to_json())


def flatten_summary(summary: RunSummary) -> dict[str, float]:
    """Slash-named scalars of a summary's top level: ``run/complete`` and the overall
    aggregate (``by_category`` excluded)."""
    data = summary.to_json()
    del data["by_category"]
    return flatten(data)


STAGES = ("prefill_s", "draft_s", "intermediate_s", "verify_s", "accept_s", "other_s")


def stage_names(flat: dict[str, float]) -> list[str]:
    """The ``time/<stage>_s`` names in ``flat``, in pipeline order (unknown stages last)."""
    names = [k for k in flat if k.startswith("time/") and k not in ("time/total_s",
                                                                     "time/baseline_s")]
    order = {f"time/{s}": i for i, s in enumerate(STAGES)}
    return sorted(names, key=lambda k: (order.get(k, len(order)), k))


def flatten_by_category(summary: RunSummary) -> dict[str, dict[str, float]]:
    """``{category: scalars}`` of a summary's ``by_category``."""
    return {cat: flatten_aggregate(agg) for cat, agg in summary.by_category.items()}


def ordered_columns(rows: list[dict[str, Any]], first: tuple[str, ...] = ()) -> list[str]:
    """Every key of ``rows``: ``first``, then ``KEY_METRICS``, then the rest sorted."""
    seen = {k for row in rows for k in row}
    head = [k for k in (*first, *KEY_METRICS) if k in seen]
    head = list(dict.fromkeys(head))
    return head + sorted(seen - set(head))
