"""Drafter ``medusa``: published Medusa heads draft from the target's last hidden state.

Head ``j`` reads ``a = RMSNorm_g(h_N)`` of the last position the target processed (the one
before the last committed token, whose logits gave that token) and predicts the token
``j + 2`` positions on (``specflow.models.medusa_head`` has the math).  The heads run no
layer of the target and keep no cache: a round is one batched pass of the first ``depth``
heads over one row per request, read from the target's session (``ModelSession.
final_features``; ``retain_final_from`` keeps it across rounds the drafter sits out).

Greedy requests with ``top = [m_0, m_1, ...]`` (any ``m_j > 1``) draft the *Cartesian
tree* of the heads' top tokens: the ``m_0`` best tokens of head 0 as roots, under each node
of level ``j - 1`` the ``m_j`` best tokens of head ``j`` (``m_0 * ... * m_j`` nodes at level
``j``), verified by the target in one forward with a tree mask (``Draft.parents``,
``ModelSession.set_tree``).  Sampled requests, and requests too close to their context limit
for the tree, draft a chain: one token per head, sampled from the head's warped
distribution (``Draft.probs``), so the acceptor's rejection sampling keeps the target's law.
Lossless either way: the target verifies every token.
"""

from __future__ import annotations

import torch

from specflow.errors import ConfigError, ModelNotFoundError
from specflow.kv.base import ModelInfo
from specflow.models.medusa_head import (
    MedusaDraftModel,
    default_medusa_path,
    load_medusa_folder,
)
from specflow.models.native import NativeLM
from specflow.models.resolve import as_layered_lm
from specflow.protocols import ModelUse
from specflow.sampling import choose
from specflow.state import DecodeState, Draft
from stages.drafters.base import DrafterDefaults, check_k


def cartesian_tree(top_ids: list[list[int]]) -> tuple[list[int], list[int]]:
    """``top_ids[j]``: head ``j``'s best tokens, best first -> (nodes, parents) of the tree
    whose level ``j`` is every level ``j - 1`` node followed by each of ``top_ids[j]``
    (topological order: level by level, a parent's children together)."""
    nodes: list[int] = []
    parents: list[int] = []
    level = [-1]
    for ids in top_ids:
        nxt = []
        for parent in level:
            for tok in ids:
                nxt.append(len(nodes))
                nodes.append(tok)
                parents.append(parent)
        level = nxt
    return nodes, parents


class MedusaDrafter(DrafterDefaults):
    """Draft with Medusa heads of the target ``model`` (module doc).

    Args:
        model: the target (the drafter reads the target verifier's session of it).
        heads: the Medusa checkpoint folder (or hub id), or ``default`` for
            ``<cache>/heads/<model>/medusa/``.
        k: the most tokens (heads) a round drafts (``Drafter.k``); at most the heads held.
        top: the tree's branching per level (an int for every level, or one per head:
            ``[3, 2, 1]``); 1 everywhere drafts chains.
    """

    name = "medusa"

    def __init__(self, model: object, heads: str = "default", k: int = 4, top: int | list[int] = 1
                 ) -> None:
        check_k(k)
        self.lm = as_layered_lm(model)
        if not isinstance(self.lm, NativeLM):
            raise ConfigError(
                f"drafter=medusa needs the native backend (the target's final norm and last "
                f"hidden states); {self.lm.info.name} runs on another backend: set "
                "model.backend=native")
        folder = default_medusa_path(self.lm.info.name) if heads == "default" else heads
        if heads == "default" and not folder.exists():
            raise ModelNotFoundError(
                f"drafter.heads=default: no Medusa heads at {folder}; put a published Medusa "
                "checkpoint folder there or pass its path (drafter.heads=<folder>), or pick "
                "another drafter (drafter=pld)")
        self.heads = load_medusa_folder(str(folder), self.lm.info)
        self.k = min(k, self.heads.num_heads)
        tops = [top] * self.k if isinstance(top, int) else list(top)[: self.k]
        if len(tops) < self.k or any(m < 1 for m in tops):
            raise ConfigError(f"drafter.top must be >= 1 for each of the {self.k} heads, "
                              f"got {top}")
        self.tops = tops
        self.branches = max(tops)
        self._placed: dict[int, MedusaDraftModel] = {}  # by id(placed target)

    def models(self) -> list[ModelInfo]:
        return [self.lm.info]

    def uses(self) -> list[ModelUse]:
        return [ModelUse(self.lm, self.lm.info.num_layers, reads_only=True)]

    def begin(self, states: list[DecodeState]) -> None:
        for st in states:
            st.session(self.lm).retain_final_from(0)

    def _model(self, state: DecodeState) -> MedusaDraftModel:
        placed = state.session(self.lm).model
        dm = self._placed.get(id(placed))
        if dm is None:
            dm = self._placed[id(placed)] = MedusaDraftModel(self.heads, placed)
        return dm

    def _tree_nodes(self, depth: int) -> int:
        total, width = 0, 1
        for m in self.tops[:depth]:
            width *= m
            total += width
        return total

    def propose(self, states: list[DecodeState], asked: list[int]) -> list[Draft]:
        drafts = [Draft([]) for _ in states]
        todo, rows = [], []
        for i, (st, n) in enumerate(zip(states, asked, strict=True)):
            sess = st.session(self.lm)
            end = len(st.tokens) - 1  # the last committed token: not processed yet
            if n < 1 or end < 1:
                continue
            sess.set_tokens(st.tokens)
            if sess.final_end() < end:  # its feature is not computed (provisional tokens)
                continue
            rows.append(sess.final_features(end - 1, end))  # [1, H]
            todo.append(i)
        if not todo:
            return drafts
        depth = min(self.k, max(asked[i] for i in todo))
        logits = self._model(states[todo[0]]).logits(torch.cat(rows), depth).cpu()  # [K, A, V]
        for a, i in enumerate(todo):
            st, d = states[i], min(asked[i], depth)
            block = logits[:d, a]  # [d, V]: head j's logits for token j + 2 on
            tree = (self.branches > 1 and st.sampling.greedy
                    and len(st.tokens) + self._tree_nodes(d) <= st.max_len)
            if tree:
                tops = [block[j].topk(m).indices.tolist() for j, m in enumerate(self.tops[:d])]
                nodes, parents = cartesian_tree(tops)
                drafts[i] = Draft(nodes, parents=parents)
            else:
                picked, probs = choose(block, st.sampling, st.generator)
                drafts[i] = Draft([int(t) for t in picked], probs)
            st.session(self.lm).retain_final_from(len(st.tokens) - 1)
        return drafts
