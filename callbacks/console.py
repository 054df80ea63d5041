"""Callback ``console``: a readable report printed at the end of the run.

The per-category table of ``specflow.results.run_folder.format_table`` (tokens/s, plain decoding's
tokens/s, speedup, tau, acceptance, fidelity), then acceptance per verification level, the
rounds of each part of a drafter of parts and the rounds that verified a tree, time per
stage and task scores (method vs plain decoding), all with the slash-separated metric names
used by every logger.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TextIO

from specflow.results.metrics import flatten_by_category, flatten_summary, stage_names
from specflow.results.records import RequestRecord, RunMeta, RunSummary, describe_parts
from specflow.results.run_folder import format_table
from specflow.workload import Request


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def format_report(summary: RunSummary) -> str:
    """The whole end-of-run report as text."""
    flat = flatten_summary(summary)
    status = "complete" if summary.complete else "INCOMPLETE (interrupted)"
    method, target = summary.meta.method, summary.meta.target_model
    lines = [
        f"== {'run' if method is None else method} on {'?' if target is None else target}: "
        f"{summary.overall.num_requests} requests, {status}",
        format_table(summary),
    ]
    levels = sorted(k for k in flat if k.startswith("accept/rate/"))
    if levels:
        lines.append("acceptance per level: " + ", ".join(f"{k}={_fmt(flat[k])}" for k in levels))
    overall = summary.overall
    if overall.parts:
        lines.append("by part: " + describe_parts(overall.parts, "part/{}:"))
    if overall.tree_rounds:
        lines.append(f"count/tree_rounds: {overall.tree_rounds} of {overall.rounds} rounds "
                     "verified a tree")
    stages = stage_names(flat)
    total = flat.get("time/total_s") or 0.0
    if stages and total:
        lines.append(
            "time per stage: "
            + ", ".join(f"{k}={flat[k]:.2f} ({100 * flat[k] / total:.0f}%)" for k in stages)
        )
    tasks = sorted(k for k in flat if k.startswith("task/"))
    if tasks:
        by_cat = flatten_by_category(summary)
        head = f"{'task metric':<32}{'category':<20}{'method':>10}{'baseline':>10}"
        lines += [head, "-" * len(head)]
        for key in tasks:
            for cat, cflat in [*by_cat.items(), ("ALL", flat)]:
                if key in cflat:
                    base = cflat.get(f"baseline_{key}")
                    lines.append(f"{key:<32}{cat:<20}{cflat[key]:>10.3f}{_fmt(base):>10}")
    return "\n".join(lines)


class ConsoleTable:
    """Prints ``format_report(summary)`` when the run ends."""

    wants_rounds = False  # on_round_end is not needed after every round

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream

    def on_run_end(self, summary: RunSummary, folder: Path) -> None:
        print(format_report(summary), file=self.stream or sys.stdout, flush=True)

    def on_run_start(self, meta: RunMeta, num_requests: int) -> None:
        pass

    def on_request_start(self, request: Request) -> None:
        pass

    def on_round_end(self, request: Request, event: dict[str, int]) -> None:
        pass

    def on_request_end(self, record: RequestRecord) -> None:
        pass
