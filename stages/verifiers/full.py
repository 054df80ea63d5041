"""Target verifier ``full``: score the whole draft with the target in one forward pass."""

from __future__ import annotations

from typing import Any

import torch

from specflow.catchup import catch_up
from specflow.costs import RowPrices
from specflow.cpu.row_padding import row_prices
from specflow.models.resolve import as_layered_lm
from specflow.protocols import ModelUse
from specflow.state import DecodeState, Draft
from specflow.verification import score_at_exit


class FullVerifier:
    """Runs the target over ``[last committed token] + draft`` (k+1 positions).

    Layers that an earlier stage already computed for these positions (an early-exit
    drafter or an intermediate verifier on the same model) are not recomputed.
    """

    def __init__(self, model: Any) -> None:
        self.lm = as_layered_lm(model)
        self.info = self.lm.info

    def uses(self) -> list[ModelUse]:
        return [ModelUse(self.lm, self.info.num_layers)]

    def row_prices(self, states: list[DecodeState]) -> RowPrices | None:
        """The pass price by row count of the model the sessions run (``row_prices``)."""
        return row_prices(states[0].session(self.lm).model) if states else None

    def begin(self, states: list[DecodeState]) -> None:
        catch_up(states, self.lm, self.info.num_layers)

    def score(self, states: list[DecodeState], drafts: list[Draft]) -> list[torch.Tensor]:
        return score_at_exit(states, self.lm, self.info.num_layers, drafts)  # [k_i+1, V] each
