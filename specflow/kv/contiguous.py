"""Contiguous KV: one preallocated buffer per (sequence, layer), the fast CPU path.

A model's decoder layer (``NativeLM.run_layer``) is one function for every batch size and KV
layout.  It computes q/k/v for the packed rows of a ragged batch (``[N, ...]``, sequence
after sequence) and hands them to the backend named by the batch's ``AttendedKV``s
(``specflow.kv.base.AttentionBackend``):

- ``ContiguousAttention`` (here): one preallocated ``KVCache`` per (sequence, layer); each
  sequence attends to its own buffer with two ``bmm``s (the fast CPU batch-1 path).
- ``specflow.kv.paged.PagedAttention``: blocks of a shared pool + block tables.

``layer_caches(lm, max_len)`` builds one sequence's caches from the model's ``KVSpec`` (or
asks a model that keeps its own cache for them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specflow.errors import PromptTooLongError
from specflow.kv.base import KVSpec, LayeredLM, LayerKV, SelfManagedKV
from specflow.kv.kernels import causal_prefill
from specflow.kv.tree import TreeLayout
from specflow.quant.attention import attend_rows


def layer_caches(lm: LayeredLM, max_len: int, seq_id: int = 0) -> list[LayerKV]:
    """One empty contiguous cache per layer of ``lm`` for ``max_len`` positions."""
    spec = lm.kv
    if isinstance(spec, SelfManagedKV):
        return spec.new_caches(max_len)
    return [KVCache(spec, max_len, layer, seq_id) for layer in range(spec.num_layers)]


class KVCache:
    """Keys/values of one (sequence, layer): positions ``[0, length)`` of preallocated buffers.

    ``k``, ``v``: ``[kv_heads, max_len, head_dim]``; RoPE is already applied to ``k``.
    ``truncate`` only lowers ``length``; stale rows beyond it are overwritten on the next write.
    An ``AttendedKV`` whose backend is ``CONTIGUOUS``; ``tree`` (set by its owner) makes the
    rows from ``tree.start`` on a token tree (``specflow.kv.tree``).
    """

    def __init__(self, spec: KVSpec, max_len: int, layer: int = 0, seq_id: int = 0) -> None:
        shape = (spec.kv_heads, max_len, spec.head_dim)
        self.k = torch.zeros(shape, dtype=spec.dtype, device=spec.device)  # [KH, L, D]
        self.v = torch.zeros(shape, dtype=spec.dtype, device=spec.device)  # [KH, L, D]
        self.max_len = max_len
        self.length = 0
        self.layer = layer
        self.seq_id = seq_id
        self.attention = CONTIGUOUS
        self.tree: TreeLayout | None = None
        self.row_exact = spec.row_exact  # attend each row as a one-row step (KVSpec)

    def truncate(self, n: int) -> None:
        """Forget positions ``>= n`` (no-op when ``n >= length``)."""
        if n < 0:
            raise ValueError(f"cannot truncate a KV cache to {n} positions")
        self.length = min(self.length, n)

    def keep_rows(self, start: int, rows: list[int]) -> None:
        """Keep, of the positions from ``start`` on, rows ``rows`` (increasing offsets):
        position ``start + rows[j]`` moves to ``start + j``; the length becomes
        ``start + len(rows)`` (a tree's accepted path, see ``specflow.kv.tree``)."""
        end = start + len(rows)
        if rows_move(self.length, start, rows):
            src = torch.tensor(rows, device=self.k.device) + start
            self.k[:, start:end] = self.k[:, src]  # advanced indexing copies first
            self.v[:, start:end] = self.v[:, src]
        self.length = end


def rows_move(length: int, start: int, rows: list[int]) -> bool:
    """Whether ``keep_rows(start, rows)`` moves any position: False when ``rows`` are
    ``0..len(rows)-1`` (increasing, so the last one says it), already in place.
    ``ValueError`` unless ``rows`` are increasing offsets of held positions from ``start``."""
    if any(b <= a for a, b in zip(rows, rows[1:], strict=False)) or (
        rows and (rows[0] < 0 or start + rows[-1] >= length)
    ):
        raise ValueError(f"cannot keep rows {rows} from position {start} of {length}")
    return bool(rows) and rows[-1] != len(rows) - 1


class ContiguousAttention:
    """Attention over per-sequence contiguous ``KVCache``s, one sequence at a time.

    GQA: the ``r = NH / KH`` query heads of a KV group are folded into the query axis
    (``[KH, r*T, D]``), so K/V are never repeated: two ``bmm``s, the fastest on CPU for the
    few rows of a decoding step or a verification.  A causal block of ``SDPA_ROWS`` rows or
    more (a prefill) goes to ``scaled_dot_product_attention``'s fused kernel instead.
    """

    name = "contiguous"

    def positions(self, batch: list[tuple[KVCache, int]], memo: dict) -> slice | torch.Tensor:
        trees = tuple(kv.tree if _in_tree(kv, t) else None for kv, t in batch)
        if len(batch) == 1 and trees[0] is None:
            kv, t = batch[0]
            return slice(kv.length, kv.length + t)
        key = ("positions", tuple((kv.length, t) for kv, t in batch), trees)
        hit = memo.get(key)
        if hit is None:
            device = batch[0][0].k.device
            hit = torch.tensor([p for (kv, t), tree in zip(batch, trees, strict=True)
                                for p in (range(kv.length, kv.length + t) if tree is None
                                          else tree.positions(kv.length, t))],
                               dtype=torch.long)
            hit = memo[key] = hit.to(device)
        return hit

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        batch: list[tuple[KVCache, int]],
        scale: float,
        memo: dict,
    ) -> torch.Tensor:
        if len(batch) == 1:
            return self._one(q, k, v, batch[0][0], scale, memo)
        outs, row = [], 0
        for kv, t in batch:
            rows = slice(row, row + t)
            outs.append(self._one(q[rows], k[rows], v[rows], kv, scale, memo))
            row += t
        return torch.cat(outs)  # [N, NH, D]

    @staticmethod
    def _one(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache, scale: float, memo: dict
    ) -> torch.Tensor:
        """One sequence: ``q [T, NH, D]``, ``k, v [T, KH, D]`` -> ``[T, NH, D]``."""
        t, nh, d = q.shape
        kh = k.shape[1]
        s = cache.length
        tree = cache.tree if _in_tree(cache, t) else None
        e = s + t
        if e > cache.max_len:
            raise PromptTooLongError(
                f"position {e} is beyond this KV cache's {cache.max_len} positions"
            )
        cache.k[:, s:e] = k.transpose(0, 1)  # [KH, T, D]
        cache.v[:, s:e] = v.transpose(0, 1)
        cache.length = e
        if tree is None and t >= SDPA_ROWS:
            return _sdpa_block(q, cache, s, e, scale, memo)
        if cache.row_exact:
            return _rows_as_steps(q, cache, s, tree, memo, scale)
        qf = q.transpose(0, 1).reshape(kh, (nh // kh) * t, d)  # [KH, r*T, D]
        keys_t = cache.k[:, :e].transpose(1, 2)  # [KH, D, e]
        if t == 1 and tree is None:
            scores = torch.bmm(qf, keys_t).mul_(scale)  # [KH, r, e]
        else:
            mask = (causal_mask(s, t, nh // kh, q.dtype, q.device, memo) if tree is None
                    else tree_mask(tree, s, t, nh // kh, q.dtype, q.device, memo))
            scores = torch.baddbmm(mask, qf, keys_t, alpha=scale)  # [KH, r*T, e]
        probs = scores.softmax(-1, dtype=torch.float32).to(q.dtype)
        return torch.bmm(probs, cache.v[:, :e]).view(nh, t, d).transpose(0, 1)  # [T, NH, D]


def _rows_as_steps(q: torch.Tensor, cache: KVCache, start: int, tree: TreeLayout | None,
                   memo: dict, scale: float) -> torch.Tensor:
    """``q [T, NH, D]`` of positions from ``start`` (written to the cache) -> ``[T, NH, D]``,
    each row attended exactly as a one-row step at its position attends it (the row-exact
    kernel, ``specflow.quant.attention``): a chain's row ``i`` over the keys ``[0, start +
    i]``, a tree's node over the prefix and then its own path in order (what decoding that
    path holds).  The same bits as decoding, whatever the rows beside it
    (``KVSpec.row_exact``)."""
    t = q.shape[0]
    key = ("rows_exact", start, t, id(tree))
    hit = memo.get(key)
    if hit is None or hit[0] is not tree:
        if tree is None:
            prefix = torch.arange(start + 1, start + t + 1, dtype=torch.long)  # [T]
            extra = None
        else:
            seen = tree_rows_seen(tree, start, t)
            if seen is None:
                raise ValueError("a tree row that does not see the whole prefix")
            prefix, extra = seen
        hit = memo[key] = (tree, prefix, extra)
    return attend_rows(q, cache.k, cache.v, hit[1], hit[2], scale)


def tree_rows_seen(tree: TreeLayout, start: int, t: int
                   ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]] | None:
    """What each of ``t`` token-tree rows from ``start`` sees, as ``attend_rows`` takes it:
    ``prefix [T]`` (every row the keys ``[0, start)``) and ``(offsets [T + 1], columns)``
    int64 (row ``i`` then the new rows' positions ``columns[offsets[i]:offsets[i + 1]]``, its
    ancestors and itself, in order); ``None`` where a row does not see the whole prefix."""
    visible = tree.visible(start, t, torch.device("cpu"))  # [T, s+T] bool
    if not bool(visible[:, :start].all()):
        return None
    rows, cols = visible[:, start:].nonzero(as_tuple=True)  # row-major: in order
    offsets = torch.zeros(t + 1, dtype=torch.long)
    offsets[1:] = torch.bincount(rows, minlength=t).cumsum(0)
    return torch.full((t,), start, dtype=torch.long), (offsets, (cols + start).contiguous())


# A causal block of at least this many new rows (a prefill, a long catch-up) is attended by
# ``scaled_dot_product_attention``'s fused kernel instead of two bmms over a materialised
# [KH, r*T, e] score matrix: on a 2-core EPYC 1200 rows from position 0 took 37 ms against
# 115 ms a layer, 300 rows after 900 took 14 ms against 27; at 16-64 rows after 1000 the two
# are level, and below that the bmms win (2 rows: 0.21 against 0.45 ms).
SDPA_ROWS = 64


def _sdpa_block(
    q: torch.Tensor, cache: KVCache, start: int, end: int, scale: float, memo: dict
) -> torch.Tensor:
    """``q [T, NH, D]`` (positions ``[start, end)``) over the cache's keys ``[0, end)``
    with the lower-right causal rule -> ``[T, NH, D]``.  From position 0 that is the paged
    path's ``causal_prefill`` (SDPA's ``is_causal``); after cached keys an explicit boolean
    mask (memoised per forward).  GQA through ``enable_gqa``: K/V are not repeated."""
    keys = cache.k[:, :end]  # [KH, e, D]
    values = cache.v[:, :end]
    if start == 0:
        return causal_prefill(q, keys.transpose(0, 1), values.transpose(0, 1), [end], scale)
    t = end - start
    key = ("visible", start, t)
    visible = memo.get(key)
    if visible is None:  # query i sees keys <= start + i
        visible = memo[key] = torch.ones(
            t, end, dtype=torch.bool, device=q.device).tril(start)  # [T, e]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], keys[None], values[None], attn_mask=visible, scale=scale,
        enable_gqa=True)  # [1, NH, T, D]
    return out[0].transpose(0, 1)  # [T, NH, D]


def causal_mask(
    start: int, t: int, r: int, dtype: torch.dtype, device: torch.device, memo: dict
) -> torch.Tensor:
    """Additive mask ``[r*t, start+t]`` for GQA-folded queries (memoised per forward).

    Row ``j*t + i`` is query position ``start+i`` of the ``j``-th head in a KV group: 0 for
    keys ``<= start+i``, -inf after (lower-right aligned).
    """
    key = ("mask", start, t, r)
    mask = memo.get(key)
    if mask is None:
        keys = torch.arange(start + t, device=device)  # [start+t]
        queries = torch.arange(start, start + t, device=device)  # [t]
        mask = torch.zeros(t, start + t, dtype=dtype, device=device)
        mask.masked_fill_(keys[None, :] > queries[:, None], float("-inf"))
        mask = memo[key] = mask.repeat(r, 1)  # [r*t, start+t]
    return mask


def tree_mask(
    tree: TreeLayout, start: int, t: int, r: int, dtype: torch.dtype, device: torch.device,
    memo: dict,
) -> torch.Tensor:
    """``causal_mask`` for a block whose rows from ``tree.start`` on form a token tree:
    0 where ``tree.visible`` allows, -inf elsewhere (``[r*t, start+t]``, memoised)."""
    key = ("tree_mask", tree, start, t, r)
    mask = memo.get(key)
    if mask is None:
        vis = tree.visible(start, t, device)  # [t, start+t]
        mask = torch.zeros(t, start + t, dtype=dtype, device=device)
        mask.masked_fill_(~vis, float("-inf"))
        mask = memo[key] = mask.repeat(r, 1)  # [r*t, start+t]
    return mask


def _in_tree(kv: KVCache, t: int) -> bool:
    """Whether the block of ``t`` new rows of ``kv`` has rows in its token tree."""
    return kv.tree is not None and kv.tree.covers(kv.length, t)


CONTIGUOUS = ContiguousAttention()
