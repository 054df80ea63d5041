"""A multirun's summary across the sweep, and the objective ``run.py`` returns to sweepers.

``SweepSummary`` is a Hydra callback (registered under ``hydra.callbacks``): when a
``python run.py -m ...`` sweep ends it finds every job's ``summary.json`` under the sweep
folder, and writes there

- ``sweep_summary.csv``: one row per job: ``job`` (its folder), ``overrides`` (as typed),
  one column per overridden key, ``method``, ``complete`` and every slash-named metric;
- ``sweep_summary.txt``: the same as a readable table (key metrics only), also printed.

A failed job stays visible: ``complete`` is false (interrupted run) or empty (no
``summary.json``), and ``error`` holds the last line of its ``error.txt`` (the traceback
``run.py`` writes when a job of a multirun fails).

``objective(summary, metric, accuracy_floor)`` is what ``main`` returns for Hydra sweepers
(Optuna): the chosen metric, or 0.0 when ``quality/accuracy_ratio`` is below the floor.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import yaml
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from callbacks.csv_logger import write_csv
from specflow.metrics import KEY_METRICS, flatten_summary

log = logging.getLogger(__name__)

SUMMARY_CSV = "sweep_summary.csv"
SUMMARY_TXT = "sweep_summary.txt"
ERROR_FILE = "error.txt"


def objective(
    summary: dict[str, Any],
    metric: str = "throughput/speedup",
    accuracy_floor: float | None = None,
) -> float | None:
    """The value a sweeper optimises: ``metric`` of the run, gated by an accuracy floor.

    With ``accuracy_floor`` set, a run whose ``quality/accuracy_ratio`` (task score over plain
    decoding's, see ``specflow.metrics``) is below the floor scores 0.0; a run without task
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


def collect(sweep_dir: str | Path) -> list[dict[str, Any]]:
    """One row per job folder under ``sweep_dir`` (see module doc)."""
    sweep_dir = Path(sweep_dir)
    rows = []
    for job in _job_dirs(sweep_dir):
        row: dict[str, Any] = {"job": str(job.relative_to(sweep_dir)) or "."}
        ov_path = job / ".hydra" / "overrides.yaml"
        overrides = (yaml.safe_load(ov_path.read_text()) or []) if ov_path.exists() else []
        row["overrides"] = " ".join(overrides)
        for ov in overrides:
            key, _, value = ov.partition("=")
            row[key.lstrip("+~")] = value
        summary_path = job / "summary.json"
        if summary_path.exists():
            summary = json.loads(summary_path.read_text())
            row["method"] = summary.get("method")
            row["complete"] = summary.get("complete")
            row.update(flatten_summary(summary))
        error = job / ERROR_FILE
        if error.exists():
            lines = error.read_text().strip().splitlines()
            row["error"] = lines[-1] if lines else "failed"
        rows.append(row)
    return rows


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


def write_sweep_summary(sweep_dir: str | Path) -> Path | None:
    """Write ``sweep_summary.csv`` and ``.txt`` into ``sweep_dir``; the CSV path."""
    sweep_dir = Path(sweep_dir)
    rows = collect(sweep_dir)
    if not rows:
        log.warning("no job folders found under %s", sweep_dir)
        return None
    first = ("job", "overrides", "method", "complete", "error")
    path = write_csv(sweep_dir / SUMMARY_CSV, rows, first)
    table = format_sweep(rows)
    (sweep_dir / SUMMARY_TXT).write_text(table + "\n")
    print(table)
    print(f"sweep summary: {path.resolve()}")
    return path


class SweepSummary(Callback):
    """Hydra callback: ``write_sweep_summary(hydra.sweep.dir)`` when a multirun ends."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        write_sweep_summary(config.hydra.sweep.dir)
