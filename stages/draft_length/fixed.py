"""Draft length ``fixed``: always the limit (the default when no policy is set)."""

from __future__ import annotations

from specflow.costs import RowPrices
from specflow.state import DecodeState, RoundReport


class FixedDraftLength:
    """Always the limit (the drafter's k, capped near the end of generation)."""

    def begin(self, state: DecodeState) -> None:
        pass

    def use_prices(self, prices: RowPrices | None) -> None:
        pass

    def forget(self) -> None:
        pass  # nothing carried from request to request

    def choose(self, state: DecodeState, limit: int, part: str = "") -> int:
        return limit

    def observe(self, state: DecodeState, report: RoundReport) -> None:
        pass
