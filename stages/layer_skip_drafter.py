"""Drafter ``layer_skip``: self-speculation with the target minus a set of skipped layers.

No second model in memory: the view shares the target's weights (its KV caches are its
own, since skipping layers changes every later hidden state).
"""

from __future__ import annotations

from typing import Any

import torch

from specflow.catchup import catch_up
from specflow.drafting import draft_with_model
from specflow.errors import ConfigError
from specflow.kv.base import ModelInfo
from specflow.models.resolve import as_layered_lm
from specflow.models.views import LayerSkipView
from specflow.protocols import DraftPart, ModelUse
from specflow.state import Acceptance, DecodeState, Draft


class LayerSkipDrafter:
    """Draft with ``model`` skipping ``skip_layers`` (0-based decoder layer indices)."""

    name = "layer_skip"
    branches = 1  # chains only (Drafter.branches)

    def __init__(self, model: Any, skip_layers: list[int], k: int = 4) -> None:
        if k < 1:
            raise ConfigError(f"drafter.k must be >= 1, got {k}")
        self.view = LayerSkipView(as_layered_lm(model), list(skip_layers))
        self.k = k

    def models(self) -> list[ModelInfo]:
        return [self.view.info]

    def uses(self) -> list[ModelUse]:
        return [ModelUse(self.view, self.view.info.num_layers)]

    def begin(self, states: list[DecodeState]) -> None:
        catch_up(states, self.view, self.view.info.num_layers)

    def next_part(self, state: DecodeState) -> DraftPart:
        """One part, drafting its k whenever asked (``Drafter.next_part``)."""
        return DraftPart("", self.k, self.k)

    def propose(self, states: list[DecodeState], asked: list[int]) -> list[Draft]:
        return draft_with_model(states, self.view, self.view.info.num_layers, asked)

    def observe(
        self,
        states: list[DecodeState],
        drafts: list[Draft],
        target_logits: list[torch.Tensor],
        verdicts: list[Acceptance],
    ) -> None:
        pass
