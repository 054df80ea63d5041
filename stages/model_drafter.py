"""Drafter ``model``: an independent draft model with its own KV cache.

Each round the draft model's session syncs to the committed tokens (catching up on the
tokens committed since it last ran, and dropping its rejected drafts), then proposes k
tokens one forward pass each, greedily or sampled with the request's sampling params
(returning q, the distributions it sampled from).
"""

from __future__ import annotations

from typing import Any

import torch

from specflow.errors import ConfigError
from specflow.models.base import ModelInfo
from specflow.models.resolve import as_layered_lm
from specflow.sampling import choose
from specflow.state import DecodeState, Draft


class ModelDrafter:
    """Draft with a separate (smaller) model of the target's tokenizer.

    Args:
        model: the draft model (config mapping, name/path, or a loaded model).
        k: draft length.
        exit_layer: draft from this exit of the draft model (default: its last layer).
    """

    name = "model"

    def __init__(self, model: Any, k: int = 4, exit_layer: int | None = None) -> None:
        if k < 1:
            raise ConfigError(f"drafter.k must be >= 1, got {k}")
        self.lm = as_layered_lm(model)
        depth = self.lm.info.num_layers
        self.exit_layer = depth if exit_layer is None else exit_layer
        if not 1 <= self.exit_layer <= depth:
            raise ConfigError(
                f"drafter.exit_layer={exit_layer} is outside 1..{depth} "
                f"({self.lm.info.name} has {depth} layers)"
            )
        self.k = k

    def models(self) -> list[ModelInfo]:
        return [self.lm.info]

    def begin(self, state: DecodeState) -> None:
        session = state.session(self.lm)
        session.set_tokens(state.tokens)
        session.prefill(self.exit_layer)

    def propose(self, state: DecodeState, k: int) -> Draft:
        session = state.session(self.lm)
        session.set_tokens(state.tokens)
        tokens: list[int] = []
        q_rows: list[torch.Tensor] = []
        for _ in range(k):
            n = len(session.tokens)
            logits = session.logits(self.exit_layer, n - 1, n)  # [1, V]
            ids, probs = choose(logits, state.sampling, state.generator)
            session.extend(ids)
            tokens += ids
            if probs is not None:
                q_rows.append(probs)
        return Draft(tokens, torch.cat(q_rows) if q_rows else None)
