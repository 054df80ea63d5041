"""Callback ``wandb``: Weights & Biases logging, offline by default (no network, no login).

- at the start: ``wandb.init`` with the resolved run config; ``dir`` is the run folder, so
  an offline run lands in ``<run folder>/wandb/offline-run-*`` (``wandb sync`` uploads it
  later).  ``mode: online`` (and ``project`` / ``entity``) logs live instead.
- per request: its slash-named scalars (``specflow.results.metrics.flatten_record``), step = the
  request's index in this run.
- at the end: the run's scalars into the wandb summary (same names: ``throughput/speedup``,
  ``accept/tau``, ``accept/rate/<level>``, ``time/<stage>_s``, ``task/...``,
  ``quality/fidelity``), the per-category table ``tables/by_category`` and the plots of
  ``callbacks.plots`` as images ``plots/<name>`` (drawn here when the ``plots`` callback
  has not written them).  ``finish()`` is always called, marking an interrupted run
  (``complete: false``) as failed, so one crashed job never leaves a dangling wandb run
  in a multirun.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from callbacks.folders import run_dir
from callbacks.plots import PLOT_FILES, make_plots, run_records
from specflow.results.metrics import (
    flatten_by_category,
    flatten_record,
    flatten_summary,
    ordered_columns,
)
from specflow.results.records import RequestRecord, RunMeta, RunSummary
from specflow.workload import Request


class WandbLogger:
    """Logs a run to wandb (see module doc); arguments are ``wandb.init``'s."""

    wants_rounds = False  # on_round_end is not needed after every round

    def __init__(
        self,
        project: str = "specflow",
        name: str | None = None,
        tags: list[str] | None = None,
        mode: str = "offline",
        dir: str | None = None,
        entity: str | None = None,
        group: str | None = None,
        log_plots: bool = True,
        console: str = "auto",
    ) -> None:
        self.project = project
        self.name = name
        self.tags = list(tags or [])
        self.mode = mode
        self.dir = dir
        self.entity = entity
        self.group = group
        self.log_plots = log_plots
        self.console = console
        self.run: Any = None
        self.step = 0
        self.records: list[RequestRecord] = []

    def on_run_start(self, meta: RunMeta, num_requests: int) -> None:
        import wandb

        folder = run_dir(meta, self.dir)
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
        config = dict(meta.config or {})
        config["meta"] = {
            "method": meta.method,
            "target_model": meta.target_model,
            "models": meta.models,
            "machine": meta.machine,
            "started": meta.started,
            "num_requests": num_requests,
        }
        self.run = wandb.init(
            project=self.project,
            name=self.name or meta.method,
            tags=self.tags or None,
            mode=self.mode,
            dir=str(folder) if folder is not None else None,
            entity=self.entity,
            group=self.group,
            config=config,
            settings=wandb.Settings(console=self.console),
        )
        self.step = 0

    def on_request_end(self, record: RequestRecord) -> None:
        self.records.append(record)
        if self.run is None:
            return
        self.run.log(flatten_record(record), step=self.step)
        self.step += 1

    def on_run_end(self, summary: RunSummary, folder: Path) -> None:
        if self.run is None:
            return
        try:
            self._log_end(summary, Path(folder))
        finally:
            self.run.finish(exit_code=0 if summary.complete else 1)
            self.run = None

    def _log_end(self, summary: RunSummary, folder: Path) -> None:
        import wandb

        flat = flatten_summary(summary)
        self.run.summary.update(flat)
        self.run.summary["run/method"] = summary.meta.method
        by_cat = flatten_by_category(summary)
        rows = [{"category": c, **f} for c, f in by_cat.items()]
        rows.append({"category": "ALL", **flat})
        columns = ordered_columns(rows, ("category",))
        table = wandb.Table(columns=columns, data=[[r.get(c) for c in columns] for r in rows])
        self.run.log({"tables/by_category": table}, step=self.step)
        if not self.log_plots:
            return
        paths = [folder / f for f in PLOT_FILES if (folder / f).exists()]
        if not paths:
            paths = make_plots(summary, run_records(folder, self.records), folder)
        if paths:
            self.run.log({f"plots/{p.stem}": wandb.Image(str(p)) for p in paths}, step=self.step)

    def on_request_start(self, request: Request) -> None:
        pass

    def on_round_end(self, request: Request, event: dict[str, int]) -> None:
        pass
