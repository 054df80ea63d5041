"""Acceptor ``rejection``: lossless speculative sampling (math in
``specflow.acceptance.rejection_accept``).  With temperature 0 it is exact greedy matching."""

from __future__ import annotations

import torch

from specflow.acceptance import greedy_accept, rejection_accept
from specflow.sampling import warp
from specflow.state import Acceptance, DecodeState, Draft


class RejectionAcceptor:
    """Lossless speculative sampling (see module doc)."""

    lossless = True

    def check(self, greedy: bool) -> None:
        pass

    def check_draft_length(self, k: int) -> None:
        pass

    def accept(self, state: DecodeState, draft: Draft, target_logits: torch.Tensor) -> Acceptance:
        if state.sampling.greedy:
            return greedy_accept(draft.tokens, target_logits)
        target_probs = warp(target_logits, state.sampling)  # [k+1, V]
        return rejection_accept(draft.tokens, draft.probs, target_probs, state.generator)
