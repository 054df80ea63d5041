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
``specflow.kv.contiguous``): it scatters the new keys/values into the pool by slot id
and runs the selected kernel; both kernels expect the new keys/values already written.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specflow.errors import ConfigError

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


def paged_sdpa(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    table: torch.Tensor,
    visible: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The paged SDPA kernel: ``q [B, T, NH, D]`` -> ``[B, T, NH, D]``.

    ``table [B, W]`` block ids, ``visible [B, T, L]`` bool (key ``j`` visible to query row
    ``t``; ``L <= W * BS``).  Keys are gathered through the first ``ceil(L / BS)`` blocks of
    each table row and cut at ``L``; GQA folds the ``r = NH / KH`` query heads of a KV group
    into the query axis (``[B, KH, r*T, D]``), so K/V are never repeated.
    """
    b, t, nh, d = q.shape
    bs, kh = k_pool.shape[1], k_pool.shape[2]
    r = nh // kh
    length = visible.shape[-1]
    need = -(-length // bs)
    blocks = table[:, :need].long()  # [B, need]
    keys = k_pool[blocks].view(b, need * bs, kh, d)[:, :length].transpose(1, 2)  # [B, KH, L, D]
    values = v_pool[blocks].view(b, need * bs, kh, d)[:, :length].transpose(1, 2)
    qf = q.view(b, t, kh, r, d).permute(0, 2, 3, 1, 4).reshape(b, kh, r * t, d)
    mask = visible[:, None, None].expand(b, 1, r, t, length).reshape(b, 1, r * t, length)
    out = F.scaled_dot_product_attention(qf, keys, values, attn_mask=mask, scale=scale)
    return out.view(b, kh, r, t, d).permute(0, 3, 1, 2, 4).reshape(b, t, nh, d)


def sdpa_paged(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    batch: AttnBatch,
    scale: float,
) -> torch.Tensor:
    """``q [N, NH, D]`` packed -> ``[N, NH, D]``: ``paged_sdpa`` over the left-padded batch
    with the lower-right causal mask of the module doc."""
    out = paged_sdpa(batch.pad(q), k_pool, v_pool, batch.block_table, causal_mask(batch), scale)
    return batch.unpad(out)


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
