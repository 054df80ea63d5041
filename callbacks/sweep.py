"""A multirun's summary across the sweep, and the objective ``run.py`` returns to sweepers.

``SweepSummary`` is a Hydra callback (registered under ``hydra.callbacks``): when a
``python run.py -m ...`` sweep ends it finds every job's ``summary.json`` under the sweep
folder, and writes there

- ``sweep_summary.csv``: one row per job: ``job`` (its folder), ``overrides`` (as typed),
  one column per overridden key, ``method``, ``complete`` and every slash-named metric;
- ``sweep_summary.txt``: the same as a readable table (key metrics only), also printed;
- ``sweep_pareto.png``: when the jobs have a task score and a speedup, accuracy (with its
  95 % Wilson interval) against speedup, one point per job, the Pareto front joined and
  plain decoding's accuracy and 99 % of it drawn as lines.

``python -m callbacks.sweep SWEEP_DIR [RUN_DIR ...]`` writes the same for a finished sweep,
with single runs (e.g. exact acceptance of the same drafter) added as rows and points.

A failed job stays visible: ``complete`` is false (interrupted run) or empty (no
``summary.json``), and ``error`` holds the last line of its ``error.txt`` (the traceback
``run.py`` writes when a job of a multirun fails).

``objective(summary, metric, accuracy_floor)`` is what ``main`` returns for Hydra sweepers
(Optuna): the chosen metric, or 0.0 when ``quality/accuracy_ratio`` is below the floor.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from callbacks.csv_logger import write_csv
from callbacks.plots import pyplot
from specflow.results.metrics import KEY_METRICS, flatten_summary
from specflow.results.records import RunSummary

log = logging.getLogger(__name__)

SUMMARY_CSV = "sweep_summary.csv"
SUMMARY_TXT = "sweep_summary.txt"
PARETO_PNG = "sweep_pareto.png"
SPEED = "throughput/speedup"
ERROR_FILE = "error.txt"


def objective(
    summary: RunSummary,
    metric: str = "throughput/speedup",
    accuracy_floor: float | None = None,
) -> float | None:
    """The value a sweeper optimises: ``metric`` of the run, gated by an accuracy floor.

    With ``accuracy_floor`` set, a run whose ``quality/accuracy_ratio`` (task score over plain
    decoding's, see ``specflow.results.metrics``) is below the floor scores 0.0; a run without task
    scores is not gated.  ``None`` when the metric is missing (e.g. no baseline).
    """
    flat = flatten_summary(summary)
    value = flat.get(metric)
    if value is None:
        return None
    ratio = flat.get("quality/accuracy_ratio")
    if accuracy_floor is not None and ratio is not None and ratio < accuracy_floor:
        return 0.0
    return value


def _job_dirs(sweep_dir: Path) -> list[Path]:
    """Job folders: those with a ``.hydra/overrides.yaml`` or a ``summary.json``."""
    found = {p.parent.parent for p in sweep_dir.rglob(".hydra/overrides.yaml")}
    found |= {p.parent for p in sweep_dir.rglob("summary.json")}
    return sorted(found, key=_job_key)


def _job_key(path: Path) -> tuple[int, str]:
    head = path.name.split("_", 1)[0]
    return (int(head) if head.isdigit() else 1 << 30, str(path))


def collect(sweep_dir: str | Path, extra_runs: Sequence[str | Path] = ()) -> list[dict[str, Any]]:
    """One row per job folder under ``sweep_dir`` (see module doc), then one per run folder
    of ``extra_runs`` (single runs to compare with the sweep, e.g. exact acceptance)."""
    sweep_dir = Path(sweep_dir)
    rows = [_row(job, str(job.relative_to(sweep_dir)) or ".") for job in _job_dirs(sweep_dir)]
    rows += [_row(Path(run), str(run)) for run in extra_runs]
    return rows


def _row(job: Path, name: str) -> dict[str, Any]:
    """A job folder's row: its overrides (one column per key) and flat summary metrics."""
    row: dict[str, Any] = {"job": name}
    ov_path = job / ".hydra" / "overrides.yaml"
    overrides = (yaml.safe_load(ov_path.read_text()) or []) if ov_path.exists() else []
    row["overrides"] = " ".join(overrides)
    for ov in overrides:
        key, _, value = ov.partition("=")
        row[key.lstrip("+~")] = value
    summary_path = job / "summary.json"
    if summary_path.exists():
        summary = RunSummary.from_json(json.loads(summary_path.read_text()))
        row["method"] = summary.meta.method
        row["complete"] = summary.complete
        row.update(flatten_summary(summary))
    error = job / ERROR_FILE
    if error.exists():
        lines = error.read_text().strip().splitlines()
        row["error"] = lines[-1] if lines else "failed"
    return row


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point dominates, both coordinates maximised.

    ``q`` dominates ``p`` when ``q >= p`` in both coordinates and ``q != p``; ties (equal
    points) are all kept.  Returned in order of increasing first coordinate.
    """
    front = [
        i
        for i, (x, y) in enumerate(points)
        if not any(qx >= x and qy >= y and (qx, qy) != (x, y) for qx, qy in points)
    ]
    return sorted(front, key=lambda i: points[i])


def accuracy_metric(rows: list[dict[str, Any]]) -> str | None:
    """The task score the Pareto plot uses: the first ``task/*`` that every row with a
    speedup has (pass@1, GSM8K exact match...); ``None`` when there is none."""
    with_speed = [r for r in rows if r.get(SPEED) is not None]
    names = sorted({k for r in with_speed for k in r if k.startswith("task/")})
    for name in names:
        if all(r.get(name) is not None for r in with_speed):
            return name
    return None


def point_labels(rows: list[dict[str, Any]]) -> list[str]:
    """Short point names: the method, then ``key=value`` (last part of the key) for each
    override the row has whose value varies across the rows (compared case-insensitively,
    so ``True`` and ``true`` do not count as a difference; the experiment is the method)."""
    parsed = []
    for r in rows:
        pairs = dict(o.partition("=")[::2] for o in r.get("overrides", "").split())
        parsed.append({k.lstrip("+~"): v for k, v in pairs.items()})
    keys = sorted({k for p in parsed for k in p} - {"experiment"})
    varying = [k for k in keys if len({str(p.get(k)).lower() for p in parsed}) > 1]
    labels = []
    for r, p in zip(rows, parsed, strict=True):
        parts = [f"{k.split('.')[-1]}={p[k]}" for k in varying if k in p]
        labels.append(" ".join([str(r.get("method") or r["job"]), *parts]))
    return labels


def plot_pareto(rows: list[dict[str, Any]], path: Path) -> Path | None:
    """``path``: task accuracy against speedup over plain decoding, one point per job (with
    its 95 % interval), the Pareto front joined, plain decoding's accuracy and 99 % of it as
    horizontal lines.  ``None`` (nothing drawn) without rows that have both numbers."""
    metric = accuracy_metric(rows)
    if metric is None:
        return None
    rows = [r for r in rows if r.get(SPEED) is not None]
    name = metric.removeprefix("task/")
    labels = point_labels(rows)
    xs = [float(r[SPEED]) for r in rows]
    ys = [float(r[metric]) for r in rows]
    los = [float(r.get(f"task_lo/{name}", y)) for r, y in zip(rows, ys, strict=True)]
    his = [float(r.get(f"task_hi/{name}", y)) for r, y in zip(rows, ys, strict=True)]
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 5))
    ax.errorbar(xs, ys, yerr=[[y - lo for y, lo in zip(ys, los, strict=True)],
                              [hi - y for y, hi in zip(ys, his, strict=True)]],
                fmt="o", color="tab:blue", ecolor="lightsteelblue", capsize=3)
    for i, (x, y, label) in enumerate(zip(xs, ys, labels, strict=True)):
        ax.annotate(label, (x, y), textcoords="offset points", xytext=(5, 4 - 10 * (i % 3)),
                    fontsize=7)
    front = pareto_front(list(zip(xs, ys, strict=True)))
    ax.plot([xs[i] for i in front], [ys[i] for i in front], "-", color="tab:red",
            label="Pareto front")
    base = [float(r[f"baseline_{metric}"]) for r in rows if r.get(f"baseline_{metric}") is not None]
    if base:
        plain = sum(base) / len(base)
        ax.axhline(plain, color="gray", linestyle="--", label=f"plain decoding {plain:.3f}")
        ax.axhline(0.99 * plain, color="gray", linestyle=":", label="99 % of plain")
    ax.axvline(1.0, color="lightgray", linewidth=0.8)
    ax.set_xlabel("speedup over plain decoding (tokens/s ratio)")
    ax.set_ylabel(f"{name} (95 % Wilson interval)")
    counts = sorted({int(r["count/requests"]) for r in rows if r.get("count/requests")})
    ax.set_title(f"{name} vs speedup" + (f" (n = {counts[0]} per point)" if len(counts) == 1
                                         else ""), fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    return "-" if value is None else str(value)


def format_sweep(rows: list[dict[str, Any]]) -> str:
    """A readable table of the jobs: the overrides that vary, then key metrics."""
    split = [r["overrides"].split() for r in rows]
    common = [o for o in split[0] if all(o in s for s in split[1:])] if split else []
    varying = [" ".join(o for o in s if o not in common) or "-" for s in split]
    metrics = [m for m in KEY_METRICS if any(m in r for r in rows)]
    metrics += sorted({k for r in rows for k in r if k.startswith("task/")})
    width = max([len("overrides"), *(len(v) for v in varying)]) + 2
    head = f"{'job':<5}{'overrides':<{width}}" + "".join(
        f"{m.split('/', 1)[-1][:15]:>16}" for m in metrics
    )
    lines = [f"common overrides: {' '.join(common) or '-'}"] if common else []
    lines += [head, "-" * len(head)]
    for i, (r, v) in enumerate(zip(rows, varying, strict=True)):
        cells = "".join(f"{_cell(r.get(m)):>16}" for m in metrics)
        failed = f"  FAILED: {r['error']}" if r.get("error") else ""
        lines.append(f"{i:<5}{v:<{width}}{cells}{failed}")
    return "\n".join(lines)


def write_sweep_summary(
    sweep_dir: str | Path, extra_runs: Sequence[str | Path] = ()
) -> Path | None:
    """Write ``sweep_summary.csv`` and ``.txt`` (and ``sweep_pareto.png`` where the jobs have
    task scores and speedups) into ``sweep_dir``; the CSV path."""
    sweep_dir = Path(sweep_dir)
    rows = collect(sweep_dir, extra_runs)
    if not rows:
        log.warning("no job folders found under %s", sweep_dir)
        return None
    first = ("job", "overrides", "method", "complete", "error")
    path = write_csv(sweep_dir / SUMMARY_CSV, rows, first)
    table = format_sweep(rows)
    (sweep_dir / SUMMARY_TXT).write_text(table + "\n")
    print(table)
    print(f"sweep summary: {path.resolve()}")
    plot = plot_pareto(rows, sweep_dir / PARETO_PNG)
    if plot is not None:
        print(f"pareto plot: {plot.resolve()}")
    return path


class StudyStorageFolder(Callback):
    """Hydra callback: create the folder of an Optuna ``sqlite:///PATH`` storage before the
    sweep opens the study (SQLite creates the file, not its folder).  Registered by
    ``conf/hparams_search/*.yaml``."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        storage = config.hydra.sweeper.get("storage")
        if isinstance(storage, str) and storage.startswith("sqlite:///"):
            Path(storage.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)


class SweepSummary(Callback):
    """Hydra callback: ``write_sweep_summary(hydra.sweep.dir)`` when a multirun ends."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        write_sweep_summary(config.hydra.sweep.dir)


def main(argv: list[str] | None = None) -> None:
    """``python -m callbacks.sweep SWEEP_DIR [RUN_DIR ...]``: (re)write the sweep summary and
    Pareto plot of a finished multirun, with single runs added as extra rows."""
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0].startswith("-"):
        raise SystemExit("usage: python -m callbacks.sweep SWEEP_DIR [RUN_DIR ...]")
    for run in args:
        if not Path(run).is_dir():
            raise SystemExit(f"{run}: not a folder (give a multirun folder, then run folders)")
    write_sweep_summary(args[0], args[1:])


if __name__ == "__main__":
    main()
