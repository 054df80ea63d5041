"""Scoring drafts at one exit of a model: the work of every verifier stage (batched).

A verifier's prefill is ``specflow.catchup.catch_up`` (a new request is behind by its prompt).
"""

from __future__ import annotations

import torch

from specflow.kv.base import LayeredLM
from specflow.kv.session import forward_logits
from specflow.state import DecodeState, Draft


def score_at_exit(
    states: list[DecodeState], lm: LayeredLM, exit_layer: int, drafts: list[Draft]
) -> list[torch.Tensor]:
    """Logits ``[d_i+1, V]`` at ``exit_layer`` for ``[last committed token] + draft_i``
    (``d_i = len(draft_i.tokens)``, the tokens drafted), every request in one batched forward.

    Row j is the distribution of draft position j (row d_i: the bonus position).  Layers a
    request's session already computed for these positions (a shallower drafter or verifier
    on the same model) are reused, never recomputed.
    """
    queries = []
    for st, draft in zip(states, drafts, strict=True):
        session = st.session(lm)
        n = len(st.tokens)
        session.set_tokens(st.tokens + draft.tokens)
        queries.append((session, exit_layer, n - 1, n + len(draft.tokens)))
    return forward_logits(queries)

