"""Scoring drafts at one exit of a model: the work of every verifier stage (batched).

A verifier's prefill is ``specflow.catchup.catch_up`` (a new request is behind by its prompt).
"""

from __future__ import annotations

import torch

from specflow.errors import ConfigError
from specflow.kv.base import LayeredLM
from specflow.kv.session import forward_logits
from specflow.state import DecodeState, Draft


def score_at_exit(
    states: list[DecodeState], lm: LayeredLM, exit_layer: int, drafts: list[Draft]
) -> list[torch.Tensor]:
    """Logits ``[d_i+1, V]`` at ``exit_layer`` for ``[last committed token] + draft_i``
    (``d_i = len(draft_i.tokens)``, the tokens drafted), every request in one batched forward.

    Row j is the distribution of draft position j (row d_i: the bonus position); for a tree
    draft (``Draft.parents``) row 0 follows the committed tokens and row i+1 node i.  Layers a
    request's session already computed for these positions (a shallower drafter or verifier
    on the same model) are reused, never recomputed.
    """
    queries = []
    for st, draft in zip(states, drafts, strict=True):
        session = st.session(lm)
        n = len(st.tokens)
        if draft.parents is None:
            session.set_tokens(st.tokens + draft.tokens)
        elif exit_layer != lm.info.num_layers:
            raise ConfigError(
                f"a token tree is verified at the last exit only, not at exit {exit_layer} "
                "(an intermediate verifier); draft chains (drafter.branches=1; "
                "drafter.then.branches in eagle_pld)"
            )
        else:  # one forward over the tree, every node seeing its ancestors only
            session.set_tree(st.tokens, draft.tokens, draft.parents)
        queries.append((session, exit_layer, n - 1, n + len(draft.tokens)))
    return forward_logits(queries)

