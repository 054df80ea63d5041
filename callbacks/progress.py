"""Callback ``progress``: a progress bar over requests with live tokens/s, speedup and tau.

The postfix shows running totals over the requests done so far: ``tok_s`` (the method's
tokens/s), ``speedup`` (over plain decoding's tokens/s on the same requests, when the
baseline runs) and ``tau`` (1 + accepted / rounds).
"""

from __future__ import annotations

from pathlib import Path

from tqdm import tqdm

from specflow.results.records import RequestRecord, RunMeta, RunSummary
from specflow.workload import Request


class ProgressBar:
    """tqdm over the run's requests (``leave``, ``disable``: tqdm's)."""

    wants_rounds = False  # on_round_end is not needed after every round

    def __init__(self, leave: bool = True, disable: bool | None = False) -> None:
        self.leave = leave
        self.disable = disable
        self.bar: tqdm | None = None
        self.tokens = 0
        self.seconds = 0.0
        self.base_tokens = 0
        self.base_seconds = 0.0
        self.rounds = 0
        self.accepted = 0

    def on_run_start(self, meta: RunMeta, num_requests: int) -> None:
        self.bar = tqdm(
            total=num_requests,
            desc=str("run" if meta.method is None else meta.method),
            unit="req",
            leave=self.leave,
            disable=self.disable,
        )

    def postfix(self) -> dict[str, str]:
        """The live numbers shown next to the bar."""
        out = {"tok_s": f"{self.tokens / max(self.seconds, 1e-9):.1f}"}
        if self.base_seconds and self.base_tokens and self.seconds:
            speedup = (self.tokens / self.seconds) / (self.base_tokens / self.base_seconds)
            out["speedup"] = f"{speedup:.2f}"
        out["tau"] = f"{1 + self.accepted / max(self.rounds, 1):.2f}"
        return out

    def on_request_end(self, record: RequestRecord) -> None:
        m = record.metrics
        self.tokens += m.new_tokens
        self.seconds += m.total_s
        self.rounds += m.rounds
        self.accepted += m.accepted
        if m.baseline is not None:
            self.base_tokens += m.baseline.baseline_tokens
            self.base_seconds += m.baseline.baseline_s
        if self.bar is not None:
            self.bar.set_postfix(self.postfix())
            self.bar.update(1)

    def on_run_end(self, summary: RunSummary, folder: Path) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def on_request_start(self, request: Request) -> None:
        pass

    def on_round_end(self, request: Request, event: dict[str, int]) -> None:
        pass
