"""Scoring drafts at one exit of a model: the work of every verifier stage (batched)."""

from __future__ import annotations

import torch

from specflow.models.base import LayeredLM
from specflow.models.session import forward_hidden, forward_logits
from specflow.state import DecodeState, Draft


def score_at_exit(
    states: list[DecodeState], lm: LayeredLM, exit_layer: int, drafts: list[Draft]
) -> list[torch.Tensor]:
    """Logits ``[k_i+1, V]`` at ``exit_layer`` for ``[last committed token] + draft_i``, for
    every request in one batched forward.

    Row j is the distribution of draft position j (row k_i: the bonus position).  Layers a
    request's session already computed for these positions (a shallower drafter or verifier
    on the same model) are reused, never recomputed.
    """
    queries = []
    for st, draft in zip(states, drafts, strict=True):
        session = st.session(lm)
        n = len(st.tokens)
        session.set_tokens(st.tokens + draft.tokens)
        queries.append((session, exit_layer, n - 1, n + draft.k))
    return forward_logits(queries)


def prefill(states: list[DecodeState], lm: LayeredLM, exit_layer: int) -> None:
    """Compute every request's committed tokens but the last at layers ``< exit_layer``
    (one batched forward)."""
    todo = []
    for st in states:
        session = st.session(lm)
        session.set_tokens(st.tokens)
        if len(st.tokens) > 1:
            todo.append((session, exit_layer, len(st.tokens) - 1))
    forward_hidden(todo)
