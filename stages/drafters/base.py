"""What most drafters write the same way, written once.

A drafter is any class with the members of ``specflow.protocols.Drafter`` (the role is the
protocol, not a base class).  Most drafters share some of those members word for word, so
they live here and a drafter writes only what differs:

- ``check_k``: the ``drafter.k >= 1`` check and its message.
- ``DrafterDefaults``: a drafter of one part that drafts chains and learns nothing from its
  rounds: ``branches = 1``, ``next_part`` drafting its ``k`` whenever asked, ``begin`` and
  ``observe`` doing nothing, no model (``models``, ``uses``).  A drafter overrides what it
  does otherwise (a model drafter: ``models``, ``uses``; prompt lookup: ``next_part``).
- ``ComposedDrafter``: a drafter made of drafters (``parts``): their models, their model
  sessions and their ``begin``, each forwarded in one place.
"""

from __future__ import annotations

import torch

from specflow.errors import ConfigError
from specflow.kv.base import ModelInfo
from specflow.protocols import Drafter, DraftPart, ModelUse
from specflow.state import Acceptance, DecodeState, Draft


def check_k(k: int) -> int:
    """``k`` (config ``drafter.k``, the most tokens drafted per round) when it is >= 1."""
    if k < 1:
        raise ConfigError(f"drafter.k must be >= 1, got {k}")
    return k


class DrafterDefaults:
    """The members a drafter of one part, drafting chains and learning nothing from its
    rounds, writes the same way (module doc); a subclass sets ``k`` and writes
    ``propose``."""

    name: str
    k: int
    branches = 1  # chains only (Drafter.branches)

    def begin(self, states: list[DecodeState]) -> None:
        """Nothing to reset or prefill."""

    def next_part(self, state: DecodeState) -> DraftPart:
        """One part, drafting its k whenever asked (``Drafter.next_part``)."""
        return DraftPart("", self.k, self.k)

    def observe(
        self,
        states: list[DecodeState],
        drafts: list[Draft],
        target_logits: list[torch.Tensor],
        verdicts: list[Acceptance],
    ) -> None:
        """Nothing learned from a round."""

    def models(self) -> list[ModelInfo]:
        """No model (a model-free drafter)."""
        return []

    def uses(self) -> list[ModelUse]:
        """No model session (a model-free drafter)."""
        return []


class ComposedDrafter(DrafterDefaults):
    """A drafter made of drafters: ``models``, ``uses`` and ``begin`` are its ``parts``'s,
    in order.  A subclass sets ``parts`` (and ``k``, ``branches`` from them) and writes
    ``propose`` and what else it does otherwise."""

    parts: tuple[Drafter, ...]

    def models(self) -> list[ModelInfo]:
        """Every part's models, in order."""
        return [info for part in self.parts for info in part.models()]

    def uses(self) -> list[ModelUse]:
        """Every part's model sessions, in order."""
        return [use for part in self.parts for use in part.uses()]

    def begin(self, states: list[DecodeState]) -> None:
        """Every part begins the requests, in order."""
        for part in self.parts:
            part.begin(states)
