"""Token trees in a KV cache: which earlier rows a row attends to, and at which position.

A draft tree (EAGLE, SpecInfer, Medusa) is verified in ONE forward: its nodes are laid out
one after the other in the cache, in topological order, and each node attends to the
committed positions and to its own ancestors only.  A ``TreeLayout`` describes the cache
rows from ``start`` on as such a tree:

    row r = position start + r of the cache (r = 0 .. R-1, R = len(parents))
    parents[r] in {-1, 0 .. r-1}     (-1: a root, whose only context is positions < start)
    depth(r) = 0 for a root, depth(parents[r]) + 1 otherwise
    row r attends to every position < start and to the rows on its path to a root (itself
    included); its rotary position is start + depth(r), the position the token would have
    in the sequence the path spells.

A chain (every ``parents[r] = r - 1``) is ordinary causal attention.  Rows of a forward
that lie before ``start`` are ordinary causal rows.  The attention backends
(``specflow.kv.contiguous``, ``specflow.kv.paged``) read a cache's layout from
``AttendedKV.tree``; ``ModelSession.set_tree`` sets it for a verification, and the session's
next ``set_tokens`` moves the accepted path's keys/values into place (``keep_rows``).
This module imports nothing of specflow.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class TreeLayout:
    """Cache rows ``[start, start + len(parents))`` form a tree (module doc)."""

    start: int
    parents: tuple[int, ...]
    depths: tuple[int, ...] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        depths: list[int] = []
        for r, p in enumerate(self.parents):
            if not -1 <= p < r:
                raise ValueError(f"tree row {r} has parent {p}: parents must precede their "
                                 "children (-1 for a root)")
            depths.append(0 if p < 0 else depths[p] + 1)
        object.__setattr__(self, "depths", tuple(depths))

    @property
    def rows(self) -> int:
        """R: the cache rows the tree spans."""
        return len(self.parents)

    @property
    def end(self) -> int:
        """The first position after the tree."""
        return self.start + len(self.parents)

    def covers(self, s: int, t: int) -> bool:
        """Whether a forward of positions ``[s, s+t)`` has rows in the tree (then it must
        end at the tree's end: ``ValueError`` otherwise)."""
        if s + t <= self.start:
            return False
        if s + t != self.end:
            raise ValueError(f"a forward of positions [{s}, {s + t}) does not end where the "
                             f"tree of rows [{self.start}, {self.end}) ends")
        return True

    def positions(self, s: int, t: int) -> list[int]:
        """Rotary positions of the forward's rows ``[s, s+t)`` (causal rows before
        ``start``, ``start + depth`` in the tree)."""
        return [q if q < self.start else self.start + self.depths[q - self.start]
                for q in range(s, s + t)]

    def visible(self, s: int, t: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """``[t, s+t]`` bool: key position j visible to the forward's row ``s + i``."""
        keys = torch.arange(s + t, device=device)
        queries = torch.arange(s, s + t, device=device)
        vis = keys[None, :] <= queries[:, None]  # [t, s+t] causal
        first = max(s, self.start)
        anc = self.ancestry(device)  # [R, R]
        vis[first - s :, self.start :] = anc[first - self.start :]
        return vis

    def ancestry(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """``[R, R]`` bool: row c is row r's ancestor or r itself."""
        n = self.rows
        anc = torch.zeros(n, n, dtype=torch.bool)
        for r, p in enumerate(self.parents):
            if p >= 0:
                anc[r] = anc[p]
            anc[r, r] = True
        return anc.to(device)


def path_rows(parents: list[int] | tuple[int, ...], tokens: list[int], wanted: list[int]
              ) -> list[int]:
    """The longest path of tree nodes spelling a prefix of ``wanted``: node indices, root
    level first (node i has token ``tokens[i]`` and parent ``parents[i]``, -1 = above the
    roots).  Greedy walk: at each level, the first child whose token is the next wanted one.
    """
    path: list[int] = []
    current = -1
    for want in wanted:
        nxt = next((i for i, p in enumerate(parents) if p == current and tokens[i] == want),
                   None)
        if nxt is None:
            break
        path.append(nxt)
        current = nxt
    return path
