"""Attention backends: where a layer's keys/values live and how a ragged batch attends to them.

A model's decoder layer (``NativeLM.run_layer``) is one function for every batch size and KV
layout.  It computes q/k/v for the packed rows of a ragged batch (``[N, ...]``, sequence
after sequence) and hands them to the backend named by the batch's ``LayerKV``s:

- ``ContiguousAttention`` (here): one preallocated ``KVCache`` per (sequence, layer); each
  sequence attends to its own buffer with two ``bmm``s (the fast CPU batch-1 path).
- ``specflow.paged.attention.PagedAttention``: blocks of a shared pool + block tables
  (SDPA over the gathered blocks, or ``flash_attn_with_kvcache``).

Backend contract, for a batch ``[(kv_i, t_i)]`` of one layer:
  ``positions(batch, memo)``: the absolute positions of the packed rows (``[N]`` or a slice);
  ``attend(q [N, NH, D], k [N, KH, D], v [N, KH, D], batch, scale, memo)``: write the new
  keys/values (RoPE already applied), advance every ``kv_i.length`` by ``t_i``, and return
  ``[N, NH, D]`` with *lower-right aligned* causal attention: query ``s_i + j`` sees keys
  ``<= s_i + j`` of its own sequence.
"""

from __future__ import annotations

from typing import Protocol

import torch

from specflow.errors import PromptTooLongError
from specflow.models.base import LayerBatch


class AttentionBackend(Protocol):
    """How one layer's ragged batch writes and reads its keys/values (module doc)."""

    name: str

    def positions(self, batch: LayerBatch, memo: dict) -> slice | torch.Tensor: ...

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        batch: LayerBatch,
        scale: float,
        memo: dict,
    ) -> torch.Tensor: ...


class KVCache:
    """Keys/values of one (sequence, layer): positions ``[0, length)`` of preallocated buffers.

    ``k``, ``v``: ``[kv_heads, max_len, head_dim]``; RoPE is already applied to ``k``.
    ``truncate`` only lowers ``length``; stale rows beyond it are overwritten on the next write.
    """

    def __init__(
        self, kv_heads: int, max_len: int, head_dim: int, dtype: torch.dtype, device
    ) -> None:
        self.k = torch.zeros(kv_heads, max_len, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros(kv_heads, max_len, head_dim, dtype=dtype, device=device)
        self.max_len = max_len
        self.length = 0
        self.attention: AttentionBackend = CONTIGUOUS

    def truncate(self, n: int) -> None:
        """Forget positions ``>= n`` (no-op when ``n >= length``)."""
        if n < 0:
            raise ValueError(f"cannot truncate a KV cache to {n} positions")
        self.length = min(self.length, n)


class ContiguousAttention:
    """Attention over per-sequence contiguous ``KVCache``s, one sequence at a time.

    GQA: the ``r = NH / KH`` query heads of a KV group are folded into the query axis
    (``[KH, r*T, D]``), so K/V are never repeated: two ``bmm``s, 3-20x faster on CPU than
    ``scaled_dot_product_attention`` (which falls back to its math path with GQA/masks).
    """

    name = "contiguous"

    def positions(self, batch: LayerBatch, memo: dict) -> slice | torch.Tensor:
        if len(batch) == 1:
            kv, t = batch[0]
            return slice(kv.length, kv.length + t)
        key = ("positions", tuple((kv.length, t) for kv, t in batch))
        hit = memo.get(key)
        if hit is None:
            device = batch[0][0].k.device  # type: ignore[attr-defined]
            hit = torch.cat([torch.arange(kv.length, kv.length + t) for kv, t in batch])
            hit = memo[key] = hit.to(device)
        return hit

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        batch: LayerBatch,
        scale: float,
        memo: dict,
    ) -> torch.Tensor:
        if len(batch) == 1:
            return self._one(q, k, v, batch[0][0], scale, memo)  # type: ignore[arg-type]
        outs, row = [], 0
        for kv, t in batch:
            rows = slice(row, row + t)
            outs.append(self._one(q[rows], k[rows], v[rows], kv, scale, memo))  # type: ignore[arg-type]
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
        e = s + t
        if e > cache.max_len:
            raise PromptTooLongError(
                f"position {e} is beyond this KV cache's {cache.max_len} positions"
            )
        cache.k[:, s:e] = k.transpose(0, 1)  # [KH, T, D]
        cache.v[:, s:e] = v.transpose(0, 1)
        cache.length = e
        qf = q.transpose(0, 1).reshape(kh, (nh // kh) * t, d)  # [KH, r*T, D]
        keys_t = cache.k[:, :e].transpose(1, 2)  # [KH, D, e]
        if t == 1:
            scores = torch.bmm(qf, keys_t).mul_(scale)  # [KH, r, e]
        else:
            mask = causal_mask(s, t, nh // kh, q.dtype, q.device, memo)
            scores = torch.baddbmm(mask, qf, keys_t, alpha=scale)  # [KH, r*T, e]
        probs = scores.softmax(-1, dtype=torch.float32).to(q.dtype)
        return torch.bmm(probs, cache.v[:, :e]).view(nh, t, d).transpose(0, 1)  # [T, NH, D]


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


CONTIGUOUS = ContiguousAttention()
