"""Methods decoded side by side over the same requests, reported against a reference.

``scripts/bench_interleaved.py`` decodes several experiments request by request in one
process; this module turns their request records into one report.  For each method, over
the requests the reference (plain decoding) also decoded:

    speedup (pooled)  = Σ reference seconds / Σ method seconds
    speedup (median)  = median over requests of reference seconds / method seconds
    τ                 = 1 + Σ accepted / Σ rounds;  acceptance = Σ accepted / Σ drafted
    per level         = Σ accepted / Σ drafted of each verification level
    fidelity          = share of requests whose every turn's tokens equal the reference's

plus the seconds per stage (summed), the rounds each pool arm was chosen, the rounds that
verified a token tree (a tree drafter's choice), and the speedup and τ per category.  A core
module: it imports nothing from ``callbacks/`` or ``stages/``.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from itertools import zip_longest
from typing import Any

from specflow.cpu.detect import probe_cpu
from specflow.results.records import RequestRecord, describe_parts, sum_parts


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def add_padded(a: list[int], b: list[int]) -> list[int]:
    """Elementwise ``a + b``, the shorter list read as padded with zeros (a request's
    ``arm_counts`` stops at the highest arm it chose)."""
    return [x + y for x, y in zip_longest(a, b, fillvalue=0)]


def paired_report(records: Mapping[str, list[RequestRecord]], reference: str) -> dict[str, Any]:
    """Per method: pooled and per-category figures against ``reference`` (module doc), over
    the requests the reference decoded; a method with none of them is left out."""
    ref = {r.request_id: r for r in records[reference]}
    out: dict[str, Any] = {"reference": reference, "cpu": probe_cpu().describe(), "methods": {}}
    for name, decoded in records.items():
        recs = [r for r in decoded if r.request_id in ref]
        if not recs:
            continue
        pairs = [(r, ref[r.request_id]) for r in recs]
        tokens = sum(r.metrics.new_tokens for r in recs)
        seconds = sum(r.metrics.total_s for r in recs)
        rounds = sum(r.metrics.rounds for r in recs)
        accepted = sum(r.metrics.accepted for r in recs)
        drafted = sum(r.metrics.drafted for r in recs)
        levels: dict[str, list[int]] = {}
        stages: dict[str, float] = {}
        for r in recs:
            for level, (d, a) in r.metrics.levels.items():
                acc = levels.setdefault(level, [0, 0])
                acc[0] += d
                acc[1] += a
            for k, v in r.metrics.time_per_stage.items():
                stages[k] = stages.get(k, 0.0) + v
        same = [
            [t.output_tokens for t in r.turns] == [t.output_tokens for t in b.turns]
            for r, b in pairs
        ]
        by_cat: dict[str, dict[str, float | None]] = {}
        for cat in sorted({r.category for r in recs}):
            cp = [(r, b) for r, b in pairs if r.category == cat]
            c_rounds = sum(r.metrics.rounds for r, _ in cp)
            by_cat[cat] = {
                "speedup": _ratio(sum(b.metrics.total_s for _, b in cp),
                                  sum(r.metrics.total_s for r, _ in cp)),
                "tau": 1 + sum(r.metrics.accepted for r, _ in cp) / c_rounds if c_rounds else None,
            }
        arms: list[int] = []  # rounds per pool arm (index = arm, conf/drafter/pool.yaml)
        for r in recs:
            if r.metrics.pool is not None:
                counts = r.metrics.pool.arm_counts  # up to the highest arm it chose
                arms = add_padded(arms, counts)
        out["methods"][name] = {
            "requests": len(recs),
            "tokens": tokens,
            "seconds": seconds,
            "tokens_per_s": _ratio(tokens, seconds),
            "speedup": _ratio(sum(b.metrics.total_s for _, b in pairs), seconds),
            "speedup_median": statistics.median(
                b.metrics.total_s / r.metrics.total_s for r, b in pairs
            ),
            "tau": 1 + accepted / rounds if rounds else None,
            "rounds": rounds,
            "tree_rounds": sum(r.metrics.tree_rounds for r in recs),
            "parts": sum_parts(*(r.metrics.parts for r in recs)),
            "acceptance": _ratio(accepted, drafted),
            "levels": {k: {"drafted": d, "accepted": a, "rate": _ratio(a, d)}
                       for k, (d, a) in levels.items()},
            "time_per_stage_s": stages,
            "fidelity": sum(same) / len(same),
            "arm_rounds": arms or None,
            "by_category": by_cat,
        }
    return out


def _f(x: float | None, fmt: str = "{:.2f}") -> str:
    return "–" if x is None else fmt.format(x)


def paired_markdown(rep: dict[str, Any], requests: list[tuple[str, str]],
                    overrides: Mapping[str, str]) -> str:
    """``paired_report`` as markdown tables, the requests (id, category) named in the order
    they were decoded, each method's overrides."""
    lines = [f"CPU: {rep['cpu']}", "",
             "Requests: " + ", ".join(f"{rid} ({cat})" for rid, cat in requests),
             "", "| experiment | overrides |", "|---|---|"]
    lines += [f"| {n} | `{o}` |" for n, o in overrides.items()]
    lines += ["", "| experiment | tok/s | × plain (pooled) | × plain (median) | τ | acceptance "
              "| per level (accepted / drafted) | fidelity |", "|---|---|---|---|---|---|---|---|"]
    for name, m in rep["methods"].items():
        levels = "; ".join(f"{k} {v['accepted']}/{v['drafted']}" for k, v in m["levels"].items())
        lines.append(
            f"| {name} | {_f(m['tokens_per_s'])} | {_f(m['speedup'])} | "
            f"{_f(m['speedup_median'])} | {_f(m['tau'])} | {_f(m['acceptance'])} | "
            f"{levels or '–'} | {m['fidelity'] * m['requests']:.0f}/{m['requests']} |"
        )
    cats = sorted({c for m in rep["methods"].values() for c in m["by_category"]})
    lines += ["", "× plain (τ) per category:", "",
              "| experiment | " + " | ".join(cats) + " |", "|---" * (len(cats) + 1) + "|"]
    for name, m in rep["methods"].items():
        cells = [f"{_f(m['by_category'][c]['speedup'])} ({_f(m['by_category'][c]['tau'])})"
                 if c in m["by_category"] else "–" for c in cats]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    stages = sorted({k for m in rep["methods"].values() for k in m["time_per_stage_s"]})
    lines += ["", "Seconds per stage (all requests):", "",
              "| experiment | " + " | ".join(stages) + " |", "|---" * (len(stages) + 1) + "|"]
    for name, m in rep["methods"].items():
        cells = [_f(m["time_per_stage_s"].get(k), "{:.1f}") for k in stages]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    arms = {n: m["arm_rounds"] for n, m in rep["methods"].items() if m["arm_rounds"]}
    for name, counts in arms.items():
        lines += ["", f"{name}: rounds per arm {counts}"]
    for name, m in rep["methods"].items():
        if m["tree_rounds"]:
            lines += ["", f"{name}: {m['tree_rounds']} of {m['rounds']} rounds verified a tree"]
    for name, m in rep["methods"].items():
        if m["parts"]:
            lines += ["", f"{name} by part: " + describe_parts(m["parts"])]
    return "\n".join(lines) + "\n"
