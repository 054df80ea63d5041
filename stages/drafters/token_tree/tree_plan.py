"""Planning a token tree by expected tokens per unit of verify cost.

A training-free tree drafter (``stages.drafters.token_tree.drafter``) knows, for each candidate
child of a node, an estimate ``p`` of the probability that the target keeps it *given
that its parent was kept* (for greedy decoding: that it is the target's argmax there).
A node's **path probability** is the product of ``p`` along its path from the root, the
probability that the target keeps it.  Since at most one child of a node is kept, the
expected number of draft tokens a tree commits is the sum of its nodes' path
probabilities:

    E[accepted] = sum_{v in tree} P(v kept) = sum_v prod_{u on path(v)} p_u

``grow_tree`` adds nodes best first (largest path probability first, a heap): a child's
path probability never exceeds its parent's, so every prefix of the order it returns is a
valid tree (parents before children) and the best tree of its size for the estimates.

``plan_sizes`` then picks how many nodes each request of a batch verifies.  One verify
pass over ``n`` rows costs ``price(n)`` one-token steps (``specflow.costs.
RowPrices`` on a CPU: the target's packed matmuls timed per row count), and a request
commits its accepted tokens plus one.  Over a batch of ``B`` drafting requests whose
candidates are merged into one list by path probability (each request's own order kept),
keeping the first ``M`` costs ``price(B + M)`` and commits ``B + sum of their
probabilities`` in expectation, so

    M* = argmax_M  (B + sum_{j <= M} p_(j)) / price(B + M)

the expected tokens per step-equivalent of the pass.  A node is worth its row only while
its path probability exceeds the marginal price of a row times the current rate: the tree
is as large as pays on this machine and no larger.

``AcceptanceCalibration`` turns a source's raw score (a stored target probability, a
continuation's count ratio) into ``p``: per evidence bin, the kept fraction of the nodes
that were verified with their parent kept, starting from a prior.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Candidate:
    """A possible child of a node.

    Attributes:
        token: the token it proposes.
        prob: the estimate that the target keeps it given its parent was kept, in [0, 1].
        evidence: the calibration bins of the estimate (``AcceptanceCalibration``), one per
            source that proposed the token.
        state: what the proposing source needs to list this node's own children (a suffix
            trie node); ``None`` where none applies.
    """

    token: int
    prob: float
    evidence: tuple[Hashable, ...] = ()
    state: object | None = None


@dataclass
class PlannedTree:
    """Nodes in best-first order (``parents[i] < i``, -1: a child of the last committed
    token), with each node's path probability (non-increasing) and calibration bins."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    path_probs: list[float] = field(default_factory=list)
    evidence: list[tuple[Hashable, ...]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)

    def truncated(self, n: int) -> PlannedTree:
        """The first ``n`` nodes (a valid tree: parents come first)."""
        return PlannedTree(self.tokens[:n], self.parents[:n], self.path_probs[:n],
                           self.evidence[:n])

    @property
    def is_chain(self) -> bool:
        """Every node continues the one before it (or is the single root)."""
        return all(p == i - 1 for i, p in enumerate(self.parents))


Children = Callable[[int, object | None], list[Candidate]]


def grow_tree(children: Children, root_token: int, root_state: object | None,
              max_nodes: int, max_depth: int, min_path_prob: float = 0.0) -> PlannedTree:
    """Up to ``max_nodes`` nodes of depth <= ``max_depth``, best first (module doc).

    ``children(token, state)`` lists a node's candidate children (the root: the last
    committed token and its source state); a candidate with ``prob <= 0`` or a path
    probability below ``min_path_prob`` is never added.
    """
    tree = PlannedTree()
    if max_nodes <= 0 or max_depth <= 0:
        return tree
    heap: list[tuple[float, int, int, int, Candidate]] = []  # (-path p, tie, parent, depth, c)
    tie = 0

    def push(parent: int, depth: int, parent_prob: float, cands: list[Candidate]) -> None:
        nonlocal tie
        for c in cands:
            prob = parent_prob * c.prob
            if c.prob > 0.0 and prob >= min_path_prob and prob > 0.0:
                heapq.heappush(heap, (-prob, tie, parent, depth, c))
                tie += 1

    push(-1, 0, 1.0, children(root_token, root_state))
    while heap and len(tree) < max_nodes:
        neg, _, parent, depth, c = heapq.heappop(heap)
        node = len(tree)
        tree.tokens.append(c.token)
        tree.parents.append(parent)
        tree.path_probs.append(-neg)
        tree.evidence.append(c.evidence)
        if depth + 1 < max_depth:
            push(node, depth + 1, -neg, children(c.token, c.state))
    return tree


def plan_sizes(path_probs: list[list[float]], price: Callable[[float], float],
               max_rows: int | None = None) -> list[int]:
    """How many of each request's best-first nodes to verify (module doc): the prefix of
    the batch's merged candidates maximizing expected committed tokens per step-equivalent,
    ``(B + sum p) / price(B + M)``; ``max_rows`` caps the pass's rows ``B + M``.

    ``path_probs[i]`` must be non-increasing (``grow_tree``'s order).  Ties keep fewer rows.
    """
    b = len(path_probs)
    if b == 0:
        return []
    merged = sorted(((-p, i, j) for i, probs in enumerate(path_probs)
                     for j, p in enumerate(probs)))
    if max_rows is not None:
        merged = merged[: max(0, max_rows - b)]
    best_m, best_value = 0, b / price(b)
    expected = float(b)
    for m, (neg, _, _) in enumerate(merged, start=1):
        expected -= neg
        value = expected / price(b + m)
        if value > best_value * (1.0 + 1e-9):
            best_m, best_value = m, value
    sizes = [0] * b
    for _, i, _ in merged[:best_m]:
        sizes[i] += 1
    return sizes


@dataclass
class AcceptanceCalibration:
    """Kept fractions per evidence bin: ``(kept + s * prior) / (seen + s)``.

    A node is *seen* when it was verified with its parent kept (a root: always), *kept*
    when the target's verdict kept it.  ``prior`` is the bin's prior mean (the source's
    own guess), ``s = strength`` its weight in pseudo-observations.
    """

    strength: float = 4.0
    counts: dict[Hashable, list[float]] = field(default_factory=dict)  # bin -> [kept, seen]

    def estimate(self, key: Hashable, prior: float) -> float:
        kept, seen = self.counts.get(key, (0.0, 0.0))
        return (kept + self.strength * prior) / (seen + self.strength)

    def record(self, key: Hashable, kept: bool) -> None:
        entry = self.counts.setdefault(key, [0.0, 0.0])
        entry[0] += float(kept)
        entry[1] += 1.0

    def record_tree(self, parents: list[int], evidence: list[tuple[Hashable, ...]],
                    kept_nodes: set[int]) -> None:
        """One verified draft: every node whose parent was kept (or a root) is seen."""
        for node, (parent, keys) in enumerate(zip(parents, evidence, strict=True)):
            if parent == -1 or parent in kept_nodes:
                for key in keys:
                    self.record(key, node in kept_nodes)
