"""Intermediate verifier ``early_exit`` (HiSpec): pre-verify drafts at exit L_i.

It scores drafts at an early exit of the target model itself, continuing from the hidden
states the drafter left at its own (shallower) exit, so layers <= L_d never run twice.
The engine wraps ``drafter -> this verifier`` into an inner pipeline with the lossless
rule, which accumulates ``accumulate`` (N_i) provisionally accepted tokens before the
target verifier continues from this exit's hidden states (see ``specflow.engine``).
"""

from __future__ import annotations

from typing import Any

import torch

from specflow.catchup import catch_up
from specflow.costs import RowPrices
from specflow.cpu.row_padding import row_prices
from specflow.errors import ConfigError
from specflow.models.resolve import as_layered_lm
from specflow.protocols import ModelUse
from specflow.state import DecodeState, Draft
from specflow.verification import score_at_exit


class EarlyExitVerifier:
    """Scores drafts at ``exit_layer`` of ``model`` (see module doc).

    Args:
        model: the target model (the same instance the target verifier uses).
        exit_layer: L_i, 1 <= L_i < N.
        accumulate: N_i, provisionally accepted tokens to collect before the target runs.
    """

    def __init__(self, model: Any, exit_layer: int, accumulate: int = 4) -> None:
        self.lm = as_layered_lm(model)
        depth = self.lm.info.num_layers
        if not 1 <= exit_layer < depth:
            raise ConfigError(
                f"intermediate_verifier.exit_layer={exit_layer} must be in 1..{depth - 1} "
                f"({self.lm.info.name} has {depth} layers; the last one is the target's)"
            )
        if accumulate < 1:
            raise ConfigError(f"intermediate_verifier.accumulate must be >= 1, got {accumulate}")
        self.exit_layer = exit_layer
        self.accumulate = accumulate
        self.info = self.lm.info

    def uses(self) -> list[ModelUse]:
        return [ModelUse(self.lm, self.exit_layer)]

    def row_prices(self, states: list[DecodeState]) -> RowPrices | None:
        """The pass price by row count of the model the sessions run (``row_prices``)."""
        return row_prices(states[0].session(self.lm).model) if states else None

    def begin(self, states: list[DecodeState]) -> None:
        catch_up(states, self.lm, self.exit_layer)

    def score(self, states: list[DecodeState], drafts: list[Draft]) -> list[torch.Tensor]:
        return score_at_exit(states, self.lm, self.exit_layer, drafts)  # [k_i+1, V] each
