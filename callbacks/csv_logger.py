"""Callback ``csv``: the run's metrics as spreadsheets in the run folder.

- ``requests.csv``: one row per request of this run (``request_id``, ``category``, then the
  slash-named scalars of ``specflow.results.metrics.flatten_record``).
- ``summary.csv``: one row per category and a last ``ALL`` row (scalars of the summary).

Written at the end of the run (also after a crash: the runner always calls ``on_run_end``);
columns are the union over rows, key metrics first.  ``requests.jsonl`` is the streamed
record; these files are for reading.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from specflow.results.metrics import (
    flatten_by_category,
    flatten_record,
    flatten_summary,
    ordered_columns,
)
from specflow.results.records import RequestRecord, RunMeta, RunSummary
from specflow.workload import Request


def write_csv(path: Path, rows: list[dict[str, Any]], first: tuple[str, ...] = ()) -> Path:
    """Write ``rows`` (dicts) with the union of their keys as columns; returns ``path``."""
    columns = ordered_columns(rows, first)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, restval="")
        writer.writeheader()
        writer.writerows(rows)
    return path


class CsvLogger:
    """Writes ``requests.csv`` and ``summary.csv`` (names configurable)."""

    wants_rounds = False  # on_round_end is not needed after every round

    def __init__(
        self, requests_file: str = "requests.csv", summary_file: str = "summary.csv"
    ) -> None:
        self.requests_file = requests_file
        self.summary_file = summary_file
        self.rows: list[dict[str, Any]] = []

    def on_run_start(self, meta: RunMeta, num_requests: int) -> None:
        self.rows = []

    def on_request_end(self, record: RequestRecord) -> None:
        self.rows.append(
            {
                "request_id": record.request_id,
                "category": record.category,
                **flatten_record(record),
            }
        )

    def on_run_end(self, summary: RunSummary, folder: Path) -> None:
        folder = Path(folder)
        write_csv(folder / self.requests_file, self.rows, ("request_id", "category"))
        rows = [{"category": c, **flat} for c, flat in flatten_by_category(summary).items()]
        rows.append({"category": "ALL", **flatten_summary(summary)})
        write_csv(folder / self.summary_file, rows, ("category",))

    def on_request_start(self, request: Request) -> None:
        pass

    def on_round_end(self, request: Request, event: dict[str, int]) -> None:
        pass
