"""Markdown rows of task accuracy next to speed, one per run folder (issue #15's tables).

    python scripts/accuracy_table.py RUN_DIR [RUN_DIR ...] [--plain-from RUN_DIR]

Per run: requests, the method's accuracy with its 95 % Wilson interval, plain decoding's
(from the same run, or from ``--plain-from``'s run when the run had no baseline: plain
greedy decoding is deterministic, so the same requests give the same answers), the ratio,
the paired counts (plain-only / method-only) with the exact McNemar p, tau, the share of
output tokens FLy accepted loosely, speedup (tokens/s over plain decoding of the same run)
and fidelity.  Summaries are recomputed from ``requests.jsonl``
(``specflow.compare.load_summary(recompute=True)``), so runs that predate the intervals
get them too.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specflow.compare import load_summary  # noqa: E402
from specflow.results import (  # noqa: E402
    REQUESTS_FILE,
    paired_counts,
    read_json_lines,
    wilson_interval,
)

LOOSE = "fly_loose"


def _acc(k: float, n: int) -> str:
    lo, hi = wilson_interval(round(k), n)
    return f"{round(k)}/{n} = {k / n:.3f} [{lo:.2f}, {hi:.2f}]"


def row(run: Path, s: dict[str, Any], plain_records: list[dict[str, Any]]) -> str:
    """One markdown table row for ``run`` with its (recomputed) summary ``s``; plain
    decoding's task scores come from the run itself, else from ``plain_records``."""
    records = read_json_lines(run / REQUESTS_FILE)
    n = len(records)
    keys = sorted({k for r in records for k in r.get("task", {})})
    key = keys[0] if keys else None
    method = sum(r["task"][key] for r in records) if key else None
    plain_by_id: dict[str, Any] = {}
    source = records if s.get("speedup") is not None else plain_records
    for r in source:
        if key and key in r.get("baseline_task", {}):
            plain_by_id[r["request_id"]] = r["baseline_task"][key]
    cells = [str(run), str(n), _acc(method, n) if key else "-"]
    if key and len(plain_by_id) >= n and all(r["request_id"] in plain_by_id for r in records):
        plain = sum(plain_by_id[r["request_id"]] for r in records)
        pairs = [(r["task"][key], plain_by_id[r["request_id"]]) for r in records]
        pc = paired_counts(pairs)
        ratio = f"{method / plain:.2f}" if plain else "-"
        cells += [_acc(plain, n), ratio,
                  f"{pc.plain_only} / {pc.method_only} (p = {pc.mcnemar_p:.3g})"]
    else:
        cells += ["-", "-", "-"]
    loose = (s.get("accepted_by_level") or {}).get(LOOSE, 0)
    new_tokens = s.get("new_tokens") or 0
    drafted = s.get("drafted") or 0
    cells += [
        f"{s['tau']:.2f}" if s.get("tau") else "-",
        f"{100 * loose / new_tokens:.2f} % / {100 * loose / drafted:.2f} %"
        if new_tokens and drafted else "-",
        f"{s['speedup']:.2f}" if s.get("speedup") else "-",
        f"{s['fidelity']:.2f}" if s.get("fidelity") is not None else "-",
        f"{sum(r['turns'][-1]['stop_reason'] == 'length' for r in records)}",
    ]
    return "| " + " | ".join(cells) + " |"


HEADER = (
    "| run | n | method acc. [95 % CI] | plain acc. [95 % CI] | ratio | plain-only / "
    "method-only (McNemar p) | τ | loose (of output / of drafted) | speedup | fidelity | "
    "at the token limit |\n|---|---|---|---|---|---|---|---|---|---|---|"
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--plain-from", type=Path, default=None,
                        help="a run of the same requests with plain decoding's task scores")
    parser.add_argument("--json", action="store_true", help="also print each recomputed summary")
    args = parser.parse_args(argv)
    plain_records = read_json_lines(args.plain_from / REQUESTS_FILE) if args.plain_from else []
    summaries = [load_summary(run, recompute=True).to_json() for run in args.runs]
    print(HEADER)
    for run, s in zip(args.runs, summaries, strict=True):
        print(row(run, s, plain_records))
    if args.json:
        for run, s in zip(args.runs, summaries, strict=True):
            overall = {k: v for k, v in s.items() if k != "by_category"}
            print(json.dumps({"run": str(run), **overall}, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
