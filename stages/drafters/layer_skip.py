"""Drafter ``layer_skip``: self-speculation with the target minus a set of skipped layers.

No second model in memory: the view shares the target's weights (its KV caches are its
own, since skipping layers changes every later hidden state).
"""

from __future__ import annotations

from typing import Any

from specflow.catchup import catch_up
from specflow.drafting import draft_with_model
from specflow.kv.base import ModelInfo
from specflow.models.resolve import as_layered_lm
from specflow.models.views import LayerSkipView
from specflow.protocols import ModelUse
from specflow.state import DecodeState, Draft
from stages.drafters.base import DrafterDefaults, check_k


class LayerSkipDrafter(DrafterDefaults):
    """Draft with ``model`` skipping ``skip_layers`` (0-based decoder layer indices)."""

    name = "layer_skip"

    def __init__(self, model: Any, skip_layers: list[int], k: int = 4) -> None:
        self.k = check_k(k)
        self.view = LayerSkipView(as_layered_lm(model), list(skip_layers))

    def models(self) -> list[ModelInfo]:
        return [self.view.info]

    def uses(self) -> list[ModelUse]:
        return [ModelUse(self.view, self.view.info.num_layers)]

    def begin(self, states: list[DecodeState]) -> None:
        catch_up(states, self.view, self.view.info.num_layers)

    def propose(self, states: list[DecodeState], asked: list[int]) -> list[Draft]:
        return draft_with_model(states, self.view, self.view.info.num_layers, asked)
