"""Acceptor ``exact``: greedy verification (keep the longest prefix equal to the target's
argmax, then the target's argmax token).  Lossless for greedy decoding."""

from __future__ import annotations

import torch

from specflow.acceptance import greedy_accept
from specflow.errors import ConfigError
from specflow.state import Acceptance, DecodeState, Draft


class ExactAcceptor:
    """Greedy exact-match acceptor (see module doc)."""

    lossless = True

    def check(self, greedy: bool) -> None:
        if not greedy:
            raise ConfigError(
                "acceptor=exact is greedy-only but sampling.temperature > 0; use "
                "acceptor=rejection for lossless speculative sampling"
            )

    def check_draft_length(self, k: int) -> None:
        pass

    def accept(self, state: DecodeState, draft: Draft, target_logits: torch.Tensor) -> Acceptance:
        return greedy_accept(draft.tokens, target_logits)
