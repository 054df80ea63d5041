"""Attention over a paged KV cache for a ragged batch of query blocks.

Queries arrive *packed* (``[N, NH, D]``, sequence after sequence, ``N = sum(q_lens)``): the
projections and the MLP run on the packed rows, with no padding.  Only attention pads,
per batch, to ``[B, T_max, NH, D]``, *left*-padded (a sequence's real queries are its last
``q_lens[i]`` rows).  Why padded and not varlen: decoding batches are near-uniform (1 token
per sequence when drafting, ``k_i + 1`` when verifying), so padding costs at most ``k`` rows
of attention; and ``flash_attn_with_kvcache`` (the paged flash kernel) takes ``[B, T, ...]``.
Why left: both backends then use the same *lower-right aligned* causal rule
``key j visible to row r  <=>  j <= kv_len - T_max + r``, which is what flash's
``causal=True`` computes (bottom-right aligned since flash-attn 2.1).  A padding row's bound
is negative; SDPA would give NaN for a fully masked row, so the bound is clamped at 0
(padding rows see key 0 and are dropped).  ``is_causal=True`` in SDPA is upper-left aligned:
wrong whenever the query block is shorter than the keys.

``PagedAttention`` is the model's attention backend for a ``PagedKVCache`` (see
``specflow.models.attention``): it scatters the new keys/values into the pool by slot id
and runs the selected kernel; both kernels expect the new keys/values already written.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from specflow.errors import ConfigError, PromptTooLongError

if TYPE_CHECKING:
    from specflow.models.base import LayerBatch
    from specflow.paged.cache import PagedKVCache

log = logging.getLogger(__name__)

FLASH_BLOCK_MULTIPLE = 256  # flash_attn_with_kvcache: page_block_size % 256 == 0


@dataclass
class AttnBatch:
    """Where a ragged batch's queries and keys are.

    Attributes:
        q_lens: new positions per sequence (python ints, length B).
        t_max: ``max(q_lens)``.
        kv_lens: ``[B]`` int32, valid key positions per sequence *including* the new ones.
        max_kv: ``max(kv_lens)`` as a python int.
        block_table: ``[B, max_blocks]`` int32 block ids (padded with 0).
        pad_index: ``[N]`` int64, row of each packed query in the left-padded ``[B * t_max]``.
    """

    q_lens: list[int]
    t_max: int
    kv_lens: torch.Tensor  # [B] int32
    max_kv: int
    block_table: torch.Tensor  # [B, max_blocks] int32
    pad_index: torch.Tensor  # [N] int64

    @classmethod
    def build(
        cls, q_lens: list[int], kv_lens: list[int], block_table: torch.Tensor, device
    ) -> AttnBatch:
        t_max = max(q_lens)
        rows = [b * t_max + t_max - t + j for b, t in enumerate(q_lens) for j in range(t)]
        return cls(
            q_lens=q_lens,
            t_max=t_max,
            kv_lens=torch.tensor(kv_lens, dtype=torch.int32, device=device),
            max_kv=max(kv_lens),
            block_table=block_table,
            pad_index=torch.tensor(rows, dtype=torch.long, device=device),
        )

    @property
    def batch(self) -> int:
        return len(self.q_lens)

    def pad(self, q: torch.Tensor) -> torch.Tensor:
        """``[N, NH, D] -> [B, t_max, NH, D]`` left-padded with zeros."""
        if self.batch * self.t_max == q.shape[0]:  # uniform: nothing to pad
            return q.view(self.batch, self.t_max, *q.shape[1:])
        out = q.new_zeros(self.batch * self.t_max, *q.shape[1:])
        out[self.pad_index] = q
        return out.view(self.batch, self.t_max, *q.shape[1:])

    def unpad(self, out: torch.Tensor) -> torch.Tensor:
        """``[B, t_max, NH, D] -> [N, NH, D]``."""
        flat = out.reshape(self.batch * self.t_max, *out.shape[2:])
        if self.batch * self.t_max == self.pad_index.shape[0]:
            return flat
        return flat[self.pad_index]


AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttnBatch, float], torch.Tensor]


def causal_mask(batch: AttnBatch) -> torch.Tensor:
    """``[B, t_max, max_kv]`` bool, True = visible (lower-right aligned, see module doc)."""
    device = batch.kv_lens.device
    keys = torch.arange(batch.max_kv, device=device)  # [L]
    rows = torch.arange(batch.t_max, device=device)  # [T]
    bound = batch.kv_lens.long()[:, None] - batch.t_max + rows[None, :]  # [B, T]
    return keys[None, None, :] <= bound.clamp_min(0)[:, :, None]


def gather_kv(pool: torch.Tensor, batch: AttnBatch) -> torch.Tensor:
    """``pool [NB, BS, KH, D]`` -> ``[B, KH, max_kv, D]`` through the block table."""
    bs = pool.shape[1]
    need = -(-batch.max_kv // bs)
    table = batch.block_table[:, :need].long()  # [B, need]
    blocks = pool[table]  # [B, need, BS, KH, D]
    flat = blocks.view(batch.batch, need * bs, *pool.shape[2:])[:, : batch.max_kv]
    return flat.transpose(1, 2)  # [B, KH, max_kv, D]


def sdpa_paged(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    batch: AttnBatch,
    scale: float,
) -> torch.Tensor:
    """``q [N, NH, D]`` packed -> ``[N, NH, D]`` with ``scaled_dot_product_attention``.

    GQA: the ``r = NH / KH`` query heads of a KV group are folded into the query axis
    (``[B, KH, r*T, D]``), so K/V are never repeated.
    """
    b, t = batch.batch, batch.t_max
    nh, d = q.shape[1], q.shape[2]
    kh = k_pool.shape[2]
    r = nh // kh
    qp = batch.pad(q)  # [B, T, NH, D]
    qf = qp.view(b, t, kh, r, d).permute(0, 2, 3, 1, 4).reshape(b, kh, r * t, d)
    keys = gather_kv(k_pool, batch)  # [B, KH, L, D]
    values = gather_kv(v_pool, batch)  # [B, KH, L, D]
    mask = causal_mask(batch)  # [B, T, L]
    mask = mask[:, None, None].expand(b, 1, r, t, batch.max_kv).reshape(b, 1, r * t, -1)
    out = F.scaled_dot_product_attention(qf, keys, values, attn_mask=mask, scale=scale)
    out = out.view(b, kh, r, t, d).permute(0, 3, 1, 2, 4)  # [B, T, KH, r, D]
    return batch.unpad(out.reshape(b, t, nh, d))


def flash_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def flash_paged(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    batch: AttnBatch,
    scale: float,
) -> torch.Tensor:
    """Same contract as ``sdpa_paged`` via ``flash_attn_with_kvcache`` (CUDA, fp16/bf16).

    The pool layout ``[NB, BS, KH, D]`` is flash's paged ``k_cache``; ``cache_seqlens`` are
    the lengths including the new (already written) keys, and ``causal=True`` is
    bottom-right aligned, which with left-padded queries is the rule of the module doc.
    """
    from flash_attn import flash_attn_with_kvcache

    out = flash_attn_with_kvcache(
        batch.pad(q),  # [B, T, NH, D]
        k_pool,
        v_pool,
        cache_seqlens=batch.kv_lens,
        block_table=batch.block_table,
        softmax_scale=scale,
        causal=True,
    )  # [B, T, NH, D]
    return batch.unpad(out)


BACKENDS = ("auto", "sdpa", "flash")


def select_backend(
    name: str, device: torch.device | str, dtype: torch.dtype
) -> tuple[str, AttentionFn]:
    """``(resolved name, attention function)`` for ``runner.attention``.

    ``auto`` picks flash on CUDA when flash-attn is installed and the dtype is fp16/bf16,
    else SDPA, saying why in one log line.  ``flash`` refuses to run anywhere else.
    """
    if name not in BACKENDS:
        raise ConfigError(f"runner.attention={name!r} is unknown; use one of {BACKENDS}")
    device = torch.device(device)
    why = None
    if device.type != "cuda":
        why = f"device is {device.type}"
    elif dtype not in (torch.float16, torch.bfloat16):
        why = f"dtype {dtype} (flash needs float16/bfloat16)"
    elif not flash_available():
        why = "flash-attn is not installed (pip install flash-attn)"
    if name == "sdpa":
        return "sdpa", sdpa_paged
    if why is None:
        return "flash", flash_paged
    if name == "flash":
        raise ConfigError(f"runner.attention=flash is unavailable: {why}; use sdpa or auto")
    log.info("attention: flash unavailable (%s); using sdpa", why)
    return "sdpa", sdpa_paged


class PagedAttention:
    """The attention backend of one ``PagedKVCache`` (module doc).

    Per forward, the addressing of a batch (positions, slots, block table, padding) is
    computed once and shared by every layer through ``memo``.
    """

    def __init__(
        self, cache: PagedKVCache, attention: str, device: torch.device, dtype: torch.dtype
    ) -> None:
        self.cache = cache
        self.device = device
        self.name, self.kernel = select_backend(attention, device, dtype)
        self.used: set[str] = set()  # the kernels that ran (for the run's summary)
        if cache.block_size % self.min_block_size:
            raise ConfigError(
                f"KV block size {cache.block_size} must be a multiple of {self.min_block_size} "
                f"for attention={self.name}"
            )

    @property
    def min_block_size(self) -> int:
        return FLASH_BLOCK_MULTIPLE if self.name == "flash" else 1

    def _meta(self, batch: LayerBatch, memo: dict) -> tuple[torch.Tensor, torch.Tensor, AttnBatch]:
        """``(positions [N], slots [N], AttnBatch)`` of the batch's new positions."""
        key = ("paged", tuple((kv.seq_id, kv.length, t) for kv, t in batch))  # type: ignore[attr-defined]
        hit = memo.get(key)
        if hit is not None:
            return hit
        cache = self.cache
        positions: list[int] = []
        slots: list[int] = []
        for kv, t in batch:
            s = kv.length
            if s + t > kv.max_len:  # type: ignore[attr-defined]
                raise PromptTooLongError(
                    f"position {s + t} is beyond this sequence's {kv.max_len} positions"  # type: ignore[attr-defined]
                )
            cache.reserve(kv.seq_id, s + t)  # type: ignore[attr-defined]
            positions.extend(range(s, s + t))
            slots.extend(cache.slots(kv.seq_id, s, s + t))  # type: ignore[attr-defined]
        table = cache.block_table([kv.seq_id for kv, _ in batch], self.device)  # type: ignore[attr-defined]
        attn = AttnBatch.build(
            [t for _, t in batch], [kv.length + t for kv, t in batch], table, self.device
        )
        hit = memo[key] = (
            torch.tensor(positions, dtype=torch.long, device=self.device),
            torch.tensor(slots, dtype=torch.long, device=self.device),
            attn,
        )
        return hit

    def positions(self, batch: LayerBatch, memo: dict) -> torch.Tensor:
        return self._meta(batch, memo)[0]

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        batch: LayerBatch,
        scale: float,
        memo: dict,
    ) -> torch.Tensor:
        """Scatter ``k, v [N, KH, D]`` into the pool, then ``q [N, NH, D] -> [N, NH, D]``.

        A fresh prefill (no sequence has cached keys) attends to the new rows directly with
        ``causal_prefill``; anything else reads the pool with the selected kernel.
        """
        fresh = all(kv.length == 0 for kv, _ in batch)
        _, slots, attn = self._meta(batch, memo)
        layer = batch[0][0].layer  # type: ignore[attr-defined]
        kh, d = k.shape[1], k.shape[2]
        k_pool, v_pool = self.cache.k[layer], self.cache.v[layer]  # [NB, BS, KH, D]
        k_pool.view(-1, kh, d).index_copy_(0, slots, k)
        v_pool.view(-1, kh, d).index_copy_(0, slots, v)
        for kv, t in batch:
            self.cache.set_length(kv.seq_id, layer, kv.length + t)  # type: ignore[attr-defined]
        if fresh:
            self.used.add("sdpa_causal_prefill")
            return causal_prefill(q, k, v, [t for _, t in batch], scale)
        self.used.add(f"{self.name}_paged")
        return self.kernel(q, k_pool, v_pool, attn, scale)


def causal_prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_lens: list[int], scale: float
) -> torch.Tensor:
    """Causal attention of packed fresh sequences over their own rows (no cache, no mask):
    ``q [N, NH, D]``, ``k, v [N, KH, D]`` -> ``[N, NH, D]``.

    ``is_causal=True`` without an explicit mask is what lets SDPA pick its FlashAttention
    kernel on CUDA (fp16/bf16); with no cached keys, its upper-left alignment is the
    lower-right rule.  GQA through ``enable_gqa`` (no K/V copies).
    """
    outs, row = [], 0
    for t in q_lens:
        span = slice(row, row + t)
        out = F.scaled_dot_product_attention(
            q[span].transpose(0, 1)[None],  # [1, NH, t, D]
            k[span].transpose(0, 1)[None],  # [1, KH, t, D]
            v[span].transpose(0, 1)[None],
            is_causal=True,
            scale=scale,
            enable_gqa=True,
        )  # [1, NH, t, D]
        outs.append(out[0].transpose(0, 1))
        row += t
    return outs[0] if len(outs) == 1 else torch.cat(outs)
