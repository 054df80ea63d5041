"""Offline oracle for MetaSD's regret: the best single drafter per request, in hindsight.

    python -m specflow.results.oracle RUN_DIR ... [--metasd RUN_DIR]

Give the run folders of single-drafter runs (e.g. ``drafter=pool selector=fixed
selector.arm=0``, ``arm=1``, ... or ``+experiment=sps``, ``pld``...) over the same requests.
For every request present in all of them the oracle takes the run with the highest
``metrics.tokens_per_s``; its aggregate is

    oracle tokens/s = sum of the chosen records' new_tokens / sum of their total_s

(the same pooling as a run's own ``tokens_per_s``).  Also reported: each run's aggregate
over those requests, the best single run (the best *fixed* drafter for the whole
workload), how often each run is the per-request best and, with ``--metasd``, the bandit
run's tokens/s and its ratio to the oracle (1.0 = no regret).

``--by speedup`` ranks by each request's side-by-side speedup instead (runs made with
``runner.baseline_cache=false`` measure plain decoding right next to every request), and
pools as ``sum(baseline_s) / sum(total_s)``: on a machine whose speed drifts between runs,
absolute tokens/s of different runs are not comparable, their speedups are.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from specflow.results.run_folder import REQUESTS_FILE, read_json_lines


def _tokens_per_s(records: list[dict[str, Any]]) -> float:
    tokens = sum(r["metrics"]["new_tokens"] for r in records)
    seconds = sum(r["metrics"]["total_s"] for r in records)
    return tokens / seconds if seconds else 0.0


def _speedup(records: list[dict[str, Any]]) -> float:
    baseline = sum(r["metrics"]["baseline_s"] for r in records)
    seconds = sum(r["metrics"]["total_s"] for r in records)
    return baseline / seconds if seconds else 0.0


POOLED = {"tokens_per_s": _tokens_per_s, "speedup": _speedup}


def load_runs(run_dirs: list[str | Path]) -> dict[str, dict[str, dict[str, Any]]]:
    """``{run name: {request_id: record}}`` from each folder's ``requests.jsonl``."""
    runs: dict[str, dict[str, dict[str, Any]]] = {}
    for run_dir in run_dirs:
        path = Path(run_dir) / REQUESTS_FILE
        if not path.exists():
            raise FileNotFoundError(f"{run_dir}: no {REQUESTS_FILE} (not a run folder?)")
        name = str(run_dir)
        runs[name] = {r["request_id"]: r for r in read_json_lines(path)}
    return runs


def oracle_report(
    runs: dict[str, dict[str, dict[str, Any]]],
    metasd: dict[str, dict[str, Any]] | None = None,
    by: str = "tokens_per_s",
) -> dict[str, Any]:
    """The oracle over ``runs`` (see module doc), restricted to requests every run has.

    ``by``: ``tokens_per_s`` or ``speedup``; the report's keys are named after it
    (``oracle_<by>``, ``runs_<by>``, ``metasd_<by>``).
    """
    if not runs:
        raise ValueError("the oracle needs at least one single-drafter run")
    if by not in POOLED:
        raise ValueError(f"by={by!r}: use one of {sorted(POOLED)}")
    pooled = POOLED[by]
    common = set.intersection(*(set(recs) for recs in runs.values()))
    if metasd is not None:
        common &= set(metasd)
    ids = sorted(common)
    best: dict[str, str] = {}
    for rid in ids:
        best[rid] = max(runs, key=lambda name: runs[name][rid]["metrics"][by])
    per_run = {name: pooled([recs[rid] for rid in ids]) for name, recs in runs.items()}
    report: dict[str, Any] = {
        "num_requests": len(ids),
        f"oracle_{by}": pooled([runs[best[rid]][rid] for rid in ids]),
        f"runs_{by}": per_run,
        "best_single_run": max(per_run, key=per_run.__getitem__) if per_run else None,
        "oracle_choice_counts": {name: list(best.values()).count(name) for name in runs},
        "oracle_choice": best,
    }
    if metasd is not None:
        value = pooled([metasd[rid] for rid in ids])
        report[f"metasd_{by}"] = value
        oracle = report[f"oracle_{by}"]
        report["metasd_vs_oracle"] = value / oracle if oracle else None
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="run folders of single-drafter runs")
    parser.add_argument("--metasd", help="run folder of the bandit (pool) run to compare")
    parser.add_argument(
        "--by", choices=sorted(POOLED), default="tokens_per_s",
        help="rank and pool by tokens/s, or by side-by-side speedup over plain decoding",
    )
    args = parser.parse_args(argv)
    metasd = None
    if args.metasd:
        metasd = next(iter(load_runs([args.metasd]).values()))
    report = oracle_report(load_runs(args.runs), metasd, by=args.by)
    report.pop("oracle_choice")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
