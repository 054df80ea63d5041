"""Drafter ``merged_tree``: a draft model's chain and a free token tree, verified as one tree.

Each round, for a greedy request, ``chain`` (typically the small draft model) drafts its
chain and ``tree`` (typically the token tree of suffix matches and recycled logits, free to
query) its tree; the two are merged by their tokens into one tree: the chain's nodes first
(``Draft.first_chain`` is the chain), then the tree's nodes in the tree's own order (best
first), a node whose parent already has a child of the same token taken as that child, at
most ``extra_nodes`` nodes added beyond the chain.  So where the model guesses wrong at some
depth, a branch from the free sources may hold the target's token, and where the sources
match long continuations the model's chain and theirs share rows.  The target verifies the
merged tree in one forward; the acceptor keeps one path.

Sampled requests draft the chain alone (with the model's q: rejection sampling stays
lossless); so does a request whose tree is empty.  After verification each drafter observes
its own draft: the tree drafter its nodes' rows of the target's logits and the kept path
among them (its recycling table and calibration learn as when it drafts alone), the chain
drafter its chain and how much of it was kept.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specflow.errors import ConfigError
from specflow.protocols import Drafter, draft_limit
from specflow.state import Acceptance, DecodeState, Draft, RequestLocal
from stages.drafters.base import ComposedDrafter


@dataclass
class MergedRound:
    """One request's round: the two drafts and where the tree's nodes went.

    ``chain`` and ``tree``: each drafter's own draft (``tree`` ``None``: not asked);
    ``tree_at[j]``: the merged node of the tree's node ``j`` (``-1``: left out, beyond
    ``extra_nodes`` or under a left-out parent).
    """

    chain: Draft = field(default_factory=lambda: Draft([]))
    tree: Draft | None = None
    tree_at: list[int] = field(default_factory=list)


def merge(chain: list[int], tree: list[int], tree_parents: list[int] | None,
          extra_nodes: int) -> tuple[list[int], list[int], list[int]]:
    """``(tokens, parents, tree_at)`` of the merged tree (module doc): the chain's nodes
    ``0 .. c-1`` first, then the tree's nodes (``tree_parents`` ``None``: a chain) mapped
    onto an equal child or appended, at most ``extra_nodes`` appended.  ``parents[i] < i``,
    ``-1``: the last committed token."""
    tokens = list(chain)
    parents = list(range(-1, len(chain) - 1))
    children: dict[tuple[int, int], int] = {(p, t): i for i, (p, t)
                                            in enumerate(zip(parents, tokens, strict=True))}
    tree_at: list[int] = []
    added = 0
    for j, token in enumerate(tree):
        parent = -1 if j == 0 and tree_parents is None else (
            j - 1 if tree_parents is None else tree_parents[j])
        at = -1 if parent == -1 else tree_at[parent]
        if parent != -1 and at == -1:  # its parent was left out
            tree_at.append(-1)
            continue
        node = children.get((at, token))
        if node is None and added < extra_nodes:
            node = len(tokens)
            tokens.append(token)
            parents.append(at)
            children[(at, token)] = node
            added += 1
        tree_at.append(-1 if node is None else node)
    return tokens, parents, tree_at


def _kept_prefix(path: list[int], nodes: list[int]) -> list[int]:
    """The leading nodes of ``path`` that are ``nodes``' merged nodes, as indices into
    ``nodes`` (a root-to-node path leaves a drafter's nodes once and never returns)."""
    index = {m: j for j, m in enumerate(nodes) if m >= 0}
    kept: list[int] = []
    for m in path:
        if m not in index:
            break
        kept.append(index[m])
    return kept


class MergedTreeDrafter(ComposedDrafter):
    """``chain``'s chain and ``tree``'s tree, merged into one tree a round (module doc).

    Args:
        chain: the drafter whose chain is the merged tree's first branch (a draft model).
        tree: the drafter whose nodes are merged in after it (the token tree drafter).
        extra_nodes: the most nodes the tree adds beyond the chain (each is a verify row).
    """

    name = "merged_tree"

    def __init__(self, chain: Drafter, tree: Drafter, extra_nodes: int = 4) -> None:
        if extra_nodes < 0:
            raise ConfigError(f"drafter.extra_nodes must be >= 0, got {extra_nodes}")
        if chain.branches != 1:
            raise ConfigError(f"drafter.chain must draft chains (branches 1), got "
                              f"{chain.branches}: put the tree drafter in drafter.tree")
        self.chain = chain
        self.tree = tree
        self.parts = (chain, tree)
        self.extra_nodes = extra_nodes
        self.k = max(chain.k, tree.k)
        self.branches = max(2, tree.branches)
        self._rounds: RequestLocal[MergedRound] = RequestLocal(lambda _state: MergedRound())

    def propose(self, states: list[DecodeState], asked: list[int]) -> list[Draft]:
        chains = self.chain.propose(states, [draft_limit(self.chain, n) for n in asked])
        greedy = [i for i, st in enumerate(states)
                  if st.sampling.greedy and asked[i] > 0
                  and len(st.tokens) + len(chains[i].tokens) + self.extra_nodes <= st.max_len]
        trees = self.tree.propose([states[i] for i in greedy],
                                  [draft_limit(self.tree, asked[i]) for i in greedy])
        tree_of = dict(zip(greedy, trees, strict=True))
        drafts: list[Draft] = []
        for i, st in enumerate(states):
            chain, tree = chains[i], tree_of.get(i)
            if tree is None or not tree.tokens:
                self._rounds.set(st, MergedRound(chain, tree, []))
                drafts.append(chain)
                continue
            tokens, parents, tree_at = merge(chain.tokens, tree.tokens, tree.parents,
                                             self.extra_nodes)
            self._rounds.set(st, MergedRound(chain, tree, tree_at))
            is_chain = parents == list(range(-1, len(tokens) - 1))
            drafts.append(Draft(tokens, None, catchup_s=chain.catchup_s,
                                parents=None if is_chain else parents))
        return drafts

    def observe(
        self,
        states: list[DecodeState],
        drafts: list[Draft],
        target_logits: list[torch.Tensor],
        verdicts: list[Acceptance],
    ) -> None:
        """Each drafter observes its own draft, rows and kept path (module doc)."""
        chain_in: list[tuple[Draft, torch.Tensor, Acceptance]] = []
        tree_in: list[tuple[DecodeState, Draft, torch.Tensor, Acceptance]] = []
        for st, logits, verdict in zip(states, target_logits, verdicts, strict=True):
            rnd = self._rounds.get(st)
            self._rounds.set(st, MergedRound())
            path = verdict.path if verdict.path is not None else list(
                range(verdict.num_accepted))
            c = len(rnd.chain.tokens)
            kept_chain = len(_kept_prefix(path, list(range(c))))
            chain_in.append((rnd.chain, logits[: c + 1],
                             Acceptance(kept_chain, verdict.next_token)))
            if rnd.tree is not None:
                own = [j for j, m in enumerate(rnd.tree_at) if m >= 0]
                rows = [0] + [rnd.tree_at[j] + 1 for j in own]
                sub = _subdraft(rnd.tree, own)
                kept = _kept_prefix(path, [rnd.tree_at[j] for j in own])
                tree_in.append((st, sub, logits[rows], Acceptance(
                    len(kept), verdict.next_token, None if sub.parents is None else kept)))
        chains, chain_logits, chain_verdicts = (list(x) for x in zip(*chain_in, strict=True))
        self.chain.observe(states, chains, chain_logits, chain_verdicts)
        if tree_in:
            self.tree.observe(*(list(x) for x in zip(*tree_in, strict=True)))


def _subdraft(tree: Draft, own: list[int]) -> Draft:
    """The tree draft restricted to its nodes ``own`` (ascending; every kept node's parent
    kept), renumbered."""
    if len(own) == len(tree.tokens):
        return tree
    new = {j: n for n, j in enumerate(own)}
    tokens = [tree.tokens[j] for j in own]
    if tree.parents is None:
        return Draft(tokens)
    return Draft(tokens, parents=[-1 if tree.parents[j] == -1 else new[tree.parents[j]]
                                  for j in own])
