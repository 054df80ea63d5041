"""Callback ``jsonl``: slash-named metrics, one JSON line per event, in ``metrics.jsonl``.

Lines (each has ``"event"``): ``run_start`` (method, models, number of requests), one
``request`` per finished request (``request_id``, ``category`` and the scalars of
``specflow.results.metrics.flatten_record``), one ``category`` per category and a final
``summary`` (scalars of the whole run, and ``complete``).  Lines are appended and flushed
as they come when the run folder is known at the start (``meta["output_dir"]``, the
``dir`` argument or Hydra's run folder); otherwise they are kept until ``on_run_end``.
``requests.jsonl`` stays the full record; this file is the metrics view of it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from callbacks.folders import run_dir
from specflow.results.metrics import flatten_by_category, flatten_record, flatten_summary
from specflow.results.records import RequestRecord, RunMeta, RunSummary
from specflow.workload import Request


class JsonlLogger:
    """Appends metric events to ``<run folder>/<filename>``."""

    wants_rounds = False  # on_round_end is not needed after every round

    def __init__(self, filename: str = "metrics.jsonl", dir: str | None = None) -> None:
        self.filename = filename
        self.dir = dir
        self.path: Path | None = None
        self.pending: list[dict[str, Any]] = []

    def _write(self, event: dict[str, Any]) -> None:
        if self.path is None:
            self.pending.append(event)
            return
        with self.path.open("a") as f:
            for e in [*self.pending, event]:
                f.write(json.dumps(e) + "\n")
        self.pending = []

    def on_run_start(self, meta: RunMeta, num_requests: int) -> None:
        folder = run_dir(meta, self.dir)
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
            self.path = folder / self.filename
        self._write(
            {
                "event": "run_start",
                "method": meta.method,
                "target_model": meta.target_model,
                "models": meta.models,
                "num_requests": num_requests,
            }
        )

    def on_request_end(self, record: RequestRecord) -> None:
        self._write(
            {
                "event": "request",
                "request_id": record.request_id,
                "category": record.category,
                **flatten_record(record),
            }
        )

    def on_run_end(self, summary: RunSummary, folder: Path) -> None:
        if self.path is None:
            self.path = Path(folder) / self.filename
        for cat, flat in flatten_by_category(summary).items():
            self._write({"event": "category", "category": cat, **flat})
        self._write(
            {
                "event": "summary",
                "method": summary.meta.method,
                "complete": summary.complete,
                **flatten_summary(summary),
            }
        )

    def on_request_start(self, request: Request) -> None:
        pass

    def on_round_end(self, request: Request, event: dict[str, int]) -> None:
        pass
