"""Compare finished runs side by side.

    python -m specflow.results.compare RUN_DIR ... [--plot F]

Reads each run folder's ``summary.json`` (or, when a run died before writing it, its
``requests.jsonl``) and prints one column per run: method, target model, requests,
tokens/s, plain decoding's tokens/s, speedup, tau, acceptance (overall and per level),
fidelity, task scores, then speedup / tau / acceptance per category.  ``--plot out.png``
draws the speedup per category of every run as grouped bars; ``--csv out.csv`` writes the
table.  Metric names are the slash-separated ones of ``specflow.results.metrics``.  A core
module: it imports nothing from ``callbacks/`` (its one figure uses matplotlib directly).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from specflow.results import metrics as m
from specflow.results.records import RunMeta, RunSummary
from specflow.results.run_folder import (
    REQUESTS_FILE,
    SUMMARY_FILE,
    aggregate,
    aggregate_by_category,
    read_records,
    summarize,
)


def load_summary(run_dir: str | Path, recompute: bool = False) -> RunSummary:
    """A run folder's summary (recomputed from ``requests.jsonl`` when missing).

    ``recompute``: aggregate ``requests.jsonl`` again with this version's ``aggregate``
    (e.g. for the accuracy intervals of a run that predates them), keeping the stored
    summary's meta (method, models, machine), ``complete`` and ``batch``.
    """
    run_dir = Path(run_dir)
    path = run_dir / SUMMARY_FILE
    requests = run_dir / REQUESTS_FILE
    if path.exists():
        summary = RunSummary.from_json(json.loads(path.read_text()))
        if recompute and requests.exists():
            records = read_records(requests)
            summary = replace(
                summary, overall=aggregate(records), by_category=aggregate_by_category(records)
            )
        return summary
    if requests.exists():
        return summarize(read_records(requests), RunMeta(), complete=False)
    raise FileNotFoundError(f"{run_dir}: no {SUMMARY_FILE} or {REQUESTS_FILE} (not a run folder?)")


def labels_for(run_dirs: list[Path], summaries: list[RunSummary]) -> list[str]:
    """Short unique column names: folder names, or ``<i>:<method>`` when those are long."""
    names = [p.resolve().name for p in run_dirs]
    if len(set(names)) == len(names) and max(len(n) for n in names) <= 24:
        return names
    return [f"{i}:{s.meta.method or 'run'}" for i, s in enumerate(summaries)]


def compare_rows(summaries: list[RunSummary]) -> list[tuple[str, list[Any]]]:
    """``(row name, one value per run)`` rows of the comparison table."""
    flats = [m.flatten_summary(s) for s in summaries]
    cats = [m.flatten_by_category(s) for s in summaries]
    rows: list[tuple[str, list[Any]]] = [
        ("method", [s.meta.method for s in summaries]),
        ("target_model", [s.meta.target_model for s in summaries]),
        ("complete", [s.complete for s in summaries]),
    ]
    names = [k for k in m.KEY_METRICS if any(k in f for f in flats)]
    extra = sorted({k for f in flats for k in f} - set(names))
    names += [k for k in extra if k.startswith(("accept/rate/", "accept/accepted/"))]
    names += [k for k in extra if k.startswith(("task", "baseline_task"))]
    names += m.stage_names({k: 0.0 for k in extra}) + [k for k in extra if k == "time/total_s"]
    rows += [(k, [f.get(k) for f in flats]) for k in names]
    for cat in sorted({c for cs in cats for c in cs}):
        for key in ("throughput/speedup", "accept/tau", "accept/rate"):
            values = [cs.get(cat, {}).get(key) for cs in cats]
            if any(v is not None for v in values):
                rows.append((f"{cat}: {key}", values))
    return rows


def format_compare(labels: list[str], rows: list[tuple[str, list[Any]]]) -> str:
    """The rows as a text table, one column per run."""
    def cell(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.3f}"
        return str(v)

    first = max(len("metric"), *(len(name) for name, _ in rows)) + 2
    widths = [
        max(len(label), *(len(cell(vals[i])) for _, vals in rows)) + 2
        for i, label in enumerate(labels)
    ]
    head = f"{'metric':<{first}}" + "".join(f"{lab:>{w}}" for lab, w in zip(labels, widths,
                                                                            strict=True))
    lines = [head, "-" * len(head)]
    for name, vals in rows:
        lines.append(
            f"{name:<{first}}"
            + "".join(f"{cell(v):>{w}}" for v, w in zip(vals, widths, strict=True))
        )
    return "\n".join(lines)


def _pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (no display needed), imported on first use."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_compare(labels: list[str], summaries: list[RunSummary], path: Path) -> Path:
    """Grouped bars: speedup per category (and ALL) of every run, plain decoding at 1.0."""
    cats = sorted({c for s in summaries for c in s.by_category}) + ["ALL"]
    values = []
    for s in summaries:
        by_cat = m.flatten_by_category(s)
        by_cat["ALL"] = m.flatten_summary(s)
        values.append([by_cat.get(c, {}).get("throughput/speedup") or 0.0 for c in cats])
    plt = _pyplot()
    width = 0.8 / len(summaries)
    fig, ax = plt.subplots(figsize=(max(5.0, 0.9 * len(cats) * max(1, len(summaries) / 2)), 3.8))
    for i, (label, vals) in enumerate(zip(labels, values, strict=True)):
        xs = [j + (i - (len(summaries) - 1) / 2) * width for j in range(len(cats))]
        ax.bar(xs, vals, width=width, label=label)
    ax.axhline(1.0, color="k", linestyle="--", linewidth=1, label="plain decoding")
    ax.set_xticks(range(len(cats)), cats, rotation=30)
    ax.set_ylabel("throughput/speedup (x)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m specflow.results.compare", description="Compare run folders side by side."
    )
    parser.add_argument("runs", nargs="+", type=Path, help="run folders (with summary.json)")
    parser.add_argument("--plot", type=Path, help="write speedup-per-category bars here (PNG)")
    parser.add_argument("--csv", type=Path, help="write the table here (CSV)")
    parser.add_argument("--recompute", action="store_true",
                        help="aggregate requests.jsonl again instead of reading summary.json")
    args = parser.parse_args(argv)
    try:
        summaries = [load_summary(p, recompute=args.recompute) for p in args.runs]
    except FileNotFoundError as exc:
        print(f"compare: error: {exc}", file=sys.stderr)
        return 2
    labels = labels_for(args.runs, summaries)
    rows = compare_rows(summaries)
    if labels != [p.resolve().name for p in args.runs]:
        for label, path in zip(labels, args.runs, strict=True):
            print(f"{label}: {path}")
    print(format_compare(labels, rows))
    if args.csv:
        with args.csv.open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["metric", *labels])
            writer.writerows([[name, *vals] for name, vals in rows])
        print(f"table: {args.csv}")
    if args.plot:
        print(f"plot: {plot_compare(labels, summaries, args.plot)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
