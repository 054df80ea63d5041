"""The roles a stage can play.  Stages are plain classes chosen by config (``_target_``);
they satisfy these protocols structurally, with no base class to inherit from.

A round (see ``specflow.state``) is::

    draft = drafter.propose(state, k)                    # k tokens (+ q when sampling)
    logits = target_verifier.score(state, draft)         # [k+1, V] target logits
    verdict = acceptor.accept(state, draft, logits)      # accepted prefix + bonus token
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from specflow.models.base import ModelInfo
from specflow.state import Acceptance, DecodeState, Draft


@runtime_checkable
class Drafter(Protocol):
    """Proposes draft tokens continuing ``state.tokens``.

    ``k`` is the drafter's default draft length (the pipeline caps it near the end).
    """

    name: str
    k: int

    def begin(self, state: DecodeState) -> None:
        """A new request starts (reset per-request state; prefill may happen here)."""

    def propose(self, state: DecodeState, k: int) -> Draft:
        """Propose up to ``k`` tokens continuing ``state.tokens`` (may return fewer, even 0)."""

    def models(self) -> list[ModelInfo]:
        """Models this drafter runs (for tokenizer / depth checks); [] for model-free ones."""


@runtime_checkable
class TargetVerifier(Protocol):
    """Scores a draft with the target model in one forward pass."""

    info: ModelInfo

    def begin(self, state: DecodeState) -> None:
        """A new request starts: prefill the prompt."""

    def score(self, state: DecodeState, draft: Draft) -> torch.Tensor:
        """Target logits ``[k+1, V]``: row i is the target's distribution for draft
        position i given the committed tokens and ``draft.tokens[:i]`` (row k: the bonus)."""


@runtime_checkable
class IntermediateVerifier(TargetVerifier, Protocol):
    """Pre-verifies drafts at an early exit before the target sees them (HiSpec).

    It scores like a target verifier (``score`` at its exit layer); the engine runs
    ``drafter -> intermediate`` as an inner pipeline with the lossless rule until
    ``accumulate`` (N_i) provisionally accepted tokens are collected.
    """

    accumulate: int


@runtime_checkable
class Acceptor(Protocol):
    """Decides how much of a draft to keep, and the target's bonus / correction token."""

    lossless: bool

    def check(self, greedy: bool) -> None:
        """Raise ``ConfigError`` when this acceptor cannot work with the sampling mode.

        An acceptor may also define ``check_draft_length(k)``, called when the pipeline is
        built, to refuse a draft length it cannot work with (FLy: window >= k).
        """

    def accept(self, state: DecodeState, draft: Draft, target_logits: torch.Tensor) -> Acceptance:
        """``target_logits [k+1, V]`` -> accepted prefix length and next token."""


@runtime_checkable
class Selector(Protocol):
    """Chooses which drafter of a pool drafts this round (MetaSD); ``single`` always arm 0."""

    def begin(self, num_arms: int) -> None: ...

    def select(self) -> int: ...

    def update(self, arm: int, reward: float) -> None: ...


@runtime_checkable
class DraftLengthPolicy(Protocol):
    """Chooses the draft length k of each round (0 = skip drafting: a plain round)."""

    def begin(self, state: DecodeState) -> None: ...

    def choose(self, state: DecodeState, k_max: int) -> int:
        """A draft length in ``0..k_max``."""

    def observe(
        self,
        state: DecodeState,
        drafted: int,
        accepted: int,
        draft_s: float,
        verify_s: float,
        catchup_s: float = 0.0,
    ) -> None:
        """What the round did: tokens drafted and accepted, seconds drafting (without the
        drafter's catch-up) and verifying, and seconds the drafter spent catching up."""
