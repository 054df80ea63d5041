"""Target verifier ``full``: score the whole draft with the target in one forward pass."""

from __future__ import annotations

from typing import Any

import torch

from specflow.models.resolve import as_layered_lm
from specflow.state import DecodeState, Draft
from specflow.verification import prefill, score_at_exit


class FullVerifier:
    """Runs the target over ``[last committed token] + draft`` (k+1 positions).

    Layers that an earlier stage already computed for these positions (an early-exit
    drafter or an intermediate verifier on the same model) are not recomputed.
    """

    def __init__(self, model: Any) -> None:
        self.lm = as_layered_lm(model)
        self.info = self.lm.info

    def begin(self, state: DecodeState) -> None:
        prefill(state, self.lm, self.info.num_layers)

    def score(self, state: DecodeState, draft: Draft) -> torch.Tensor:
        return score_at_exit(state, self.lm, self.info.num_layers, draft)  # [k+1, V]
