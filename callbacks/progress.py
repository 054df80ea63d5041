"""Callback ``progress``: a progress bar over requests with live tokens/s, speedup and tau."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tqdm import tqdm


class ProgressBar:
    """tqdm over the run's requests."""

    def __init__(self) -> None:
        self.bar: tqdm | None = None
        self.tokens = 0
        self.seconds = 0.0
        self.rounds = 0
        self.accepted = 0

    def on_run_start(self, meta: dict[str, Any], num_requests: int) -> None:
        self.bar = tqdm(total=num_requests, desc=str(meta.get("method", "run")), unit="req")

    def on_request_end(self, record: dict[str, Any]) -> None:
        m = record["metrics"]
        self.tokens += m["new_tokens"]
        self.seconds += m["total_s"]
        self.rounds += m["rounds"]
        self.accepted += m["accepted"]
        if self.bar is not None:
            self.bar.set_postfix(
                tok_s=f"{self.tokens / max(self.seconds, 1e-9):.1f}",
                tau=f"{1 + self.accepted / max(self.rounds, 1):.2f}",
                speedup=f"{m.get('speedup') or 0:.2f}",
            )
            self.bar.update(1)

    def on_run_end(self, summary: dict[str, Any], folder: Path) -> None:
        if self.bar is not None:
            self.bar.close()
