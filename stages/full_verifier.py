"""Target verifier ``full``: score the whole draft with the target in one forward pass."""

from __future__ import annotations

from typing import Any

import torch

from specflow.models.resolve import as_layered_lm
from specflow.state import DecodeState, Draft


class FullVerifier:
    """Runs the target over ``[last committed token] + draft`` (k+1 positions).

    Layers that an earlier stage already computed for these positions (an early-exit
    drafter or an intermediate verifier on the same model) are not recomputed.
    """

    def __init__(self, model: Any) -> None:
        self.lm = as_layered_lm(model)
        self.info = self.lm.info

    def begin(self, state: DecodeState) -> None:
        session = state.session(self.lm)
        session.set_tokens(state.tokens)
        session.prefill()

    def score(self, state: DecodeState, draft: Draft) -> torch.Tensor:
        session = state.session(self.lm)
        n = len(state.tokens)
        session.set_tokens(state.tokens + draft.tokens)
        return session.logits(self.info.num_layers, n - 1, n + draft.k)  # [k+1, V]
