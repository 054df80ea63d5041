"""Draft length ``heuristic``: Hugging Face's rule, +2 after a fully accepted draft, -1
otherwise."""

from __future__ import annotations

from specflow.costs import RowPrices
from specflow.errors import ConfigError
from specflow.state import DecodeState, RequestLocal, RoundReport


class HeuristicDraftLength:
    """HF's assisted-generation schedule: k += 2 after full acceptance, else k -= 1 (>= 1);
    one k per part of the drafter."""

    def __init__(self, initial: int = 4) -> None:
        if initial < 1:
            raise ConfigError(f"draft_length.initial must be >= 1, got {initial}")
        self.initial = initial
        # Per request: each part's current k.
        self._k: RequestLocal[dict[str, int]] = RequestLocal(lambda _state: {})

    def begin(self, state: DecodeState) -> None:
        self._k.set(state, {})

    def use_prices(self, prices: RowPrices | None) -> None:
        pass

    def forget(self) -> None:
        pass  # nothing carried from request to request

    def choose(self, state: DecodeState, limit: int, part: str = "") -> int:
        return min(self._k.get(state).get(part, self.initial), limit)

    def observe(self, state: DecodeState, report: RoundReport) -> None:
        if report.drafted == 0:
            return
        ks = self._k.get(state)
        k = ks.get(report.part, self.initial)
        ks[report.part] = k + 2 if report.accepted == report.drafted else max(1, k - 1)
