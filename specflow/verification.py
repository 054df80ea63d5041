"""Scoring a draft at one exit of a model: the work of every verifier stage."""

from __future__ import annotations

import torch

from specflow.models.base import LayeredLM
from specflow.state import DecodeState, Draft


def score_at_exit(state: DecodeState, lm: LayeredLM, exit_layer: int, draft: Draft) -> torch.Tensor:
    """Logits ``[k+1, V]`` at ``exit_layer`` for ``[last committed token] + draft``.

    Row i is the distribution of draft position i (row k: the bonus position).  Layers this
    request's session already computed for these positions (a shallower drafter or
    verifier on the same model) are reused, never recomputed.
    """
    session = state.session(lm)
    n = len(state.tokens)
    session.set_tokens(state.tokens + draft.tokens)
    return session.logits(exit_layer, n - 1, n + draft.k)


def prefill(state: DecodeState, lm: LayeredLM, exit_layer: int) -> None:
    """Compute the committed tokens but the last at layers ``< exit_layer``."""
    session = state.session(lm)
    session.set_tokens(state.tokens)
    session.prefill(exit_layer)
