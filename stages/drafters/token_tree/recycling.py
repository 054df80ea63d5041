"""Token recycling's successor table: each token's top-w next tokens, as the target saw them.

Every verification pass computes the target's distribution at each verified position,
rejected draft positions included.  Position j's input token ``x_j`` and the target's
``top-w`` of its distribution there are a guess of what follows ``x_j`` next time, free of
any model of its own.  The table keeps, per token, the latest such guess (overwritten: the
most recent context wins) and the target's probability of each successor:

    ids[x]   = top-w token ids of softmax(logits at a position whose input token was x)
    probs[x] = their probabilities (float16)

Drafting reads it level by level (``stages.drafters.token_tree.drafter``): a node's children are
``ids[node.token]``.  The table lives as long as the drafter (a run: every request of it),
so later requests start from what earlier ones taught.  Memory: ``V * w * 6`` bytes, e.g.
Qwen2.5's 151,936-token vocabulary at w = 8: 7.3 MB (int32 ids and float16 probabilities),
allocated on the first update.
"""

from __future__ import annotations

import torch


class RecyclingTable:
    """The successor table (module doc).

    Args:
        width: successors kept per token (w >= 1).
    """

    def __init__(self, width: int = 8) -> None:
        if width < 1:
            raise ValueError(f"the recycling table's width must be >= 1, got {width}")
        self.width = width
        self.ids: torch.Tensor | None = None  # [V, w] int32, -1: no successor known
        self.probs: torch.Tensor | None = None  # [V, w] float16

    @property
    def nbytes(self) -> int:
        """Bytes the table holds (0 before its first update)."""
        if self.ids is None or self.probs is None:
            return 0
        return self.ids.numel() * self.ids.element_size() + \
            self.probs.numel() * self.probs.element_size()

    def update(self, inputs: list[int], logits: torch.Tensor) -> None:
        """Overwrite the successors of ``inputs[j]`` with the top-w of ``logits[j]``
        (``logits [R, V]``, ``R = len(inputs)``; a later row wins over an earlier one of the
        same token)."""
        if not inputs:
            return
        vocab = logits.shape[-1]
        if self.ids is None or self.probs is None or self.ids.shape[0] < vocab:
            self._grow(vocab)
        assert self.ids is not None and self.probs is not None
        w = min(self.width, vocab)
        top = torch.softmax(logits.float(), dim=-1).topk(w, dim=-1)  # [R, w]
        rows = torch.tensor(inputs, dtype=torch.long)
        self.ids[rows, :w] = top.indices.to(torch.int32)
        self.probs[rows, :w] = top.values.to(torch.float16)

    def successors(self, token: int) -> tuple[list[int], list[float]]:
        """The known successors of ``token`` and their probabilities, most likely first."""
        if self.ids is None or self.probs is None or not 0 <= token < self.ids.shape[0]:
            return [], []
        ids = self.ids[token].tolist()
        probs = self.probs[token].tolist()
        n = next((i for i, t in enumerate(ids) if t < 0), len(ids))
        return ids[:n], probs[:n]

    def _grow(self, vocab: int) -> None:
        ids = torch.full((vocab, self.width), -1, dtype=torch.int32)
        probs = torch.zeros((vocab, self.width), dtype=torch.float16)
        if self.ids is not None and self.probs is not None:
            ids[: self.ids.shape[0]] = self.ids
            probs[: self.probs.shape[0]] = self.probs
        self.ids, self.probs = ids, probs
