"""Autoregressive drafting with a model at one exit: the work of every model drafter."""

from __future__ import annotations

import time

import torch

from specflow.models.base import LayeredLM
from specflow.sampling import choose
from specflow.state import DecodeState, Draft


def draft_with_model(
    state: DecodeState, lm: LayeredLM, exit_layer: int, k: int, min_confidence: float = 0.0
) -> Draft:
    """Propose up to ``k`` tokens from ``lm`` at ``exit_layer``, one forward pass each.

    Drafting stops early when the drafter's top probability (temperature 1) falls below
    ``min_confidence`` (the token is still proposed: it is often right, and stopping after
    it saves the next, likelier-wrong steps).

    The model's session first syncs to the committed tokens: it catches up on tokens
    committed since it last ran and drops its rejected drafts.  Greedy: argmax, q = None;
    sampling: tokens drawn from the warped distributions, returned as q ``[k, V]``.
    The catch-up (every position before the last committed one) runs first and is timed
    apart (``Draft.catchup_s``), so the time of the k drafting steps is measurable.
    """
    session = state.session(lm)
    session.set_tokens(state.tokens)
    start = time.perf_counter()
    session.hidden(exit_layer, len(session.tokens) - 1)  # catch up (computes only what is missing)
    catchup_s = time.perf_counter() - start
    tokens: list[int] = []
    q_rows: list[torch.Tensor] = []
    for _ in range(k):
        n = len(session.tokens)
        logits = session.logits(exit_layer, n - 1, n)  # [1, V]
        ids, probs = choose(logits, state.sampling, state.generator)
        session.extend(ids)
        tokens += ids
        if probs is not None:
            q_rows.append(probs)
        if min_confidence > 0.0 and float(logits.softmax(-1).max()) < min_confidence:
            break
    return Draft(tokens, torch.cat(q_rows) if q_rows else None, catchup_s=catchup_s)
