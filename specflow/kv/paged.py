"""A paged KV cache: fixed-size blocks from a free list, one block table per sequence.

Layout (one ``PagedKVCache`` per model; every model of a pipeline has its own pool, all with
the same block size)::

    k, v: [num_layers, num_blocks, block_size, kv_heads, head_dim]

``[num_blocks, block_size, kv_heads, head_dim]`` per layer is exactly the ``k_cache`` layout
of ``flash_attn_with_kvcache(..., block_table=...)``, so the flash backend reads the pool
without a copy; the SDPA backend gathers through the block table.

A sequence owns a list of blocks shared by all layers (position ``p`` lives in block
``blocks[p // block_size]`` at offset ``p % block_size``, in every layer) and one length per
layer, so the layered bookkeeping of ``specflow.kv.session`` works per sequence:
``PagedLayerKV`` is the ``AttendedKV`` of one (sequence, layer), and ``PagedAttention`` its
attention backend (the kernels are ``specflow.kv.kernels``).

Invariants:
    * a block is either free or owned by exactly one sequence (``check_no_leaks``);
    * a sequence owns exactly ``ceil(max_layer_length / block_size)`` blocks after any
      ``truncate`` (rollback frees whole blocks beyond the longest layer) and at least that
      many after ``reserve``;
    * admission control: a sequence is added with its worst-case length and that many blocks
      are *promised* to it (``BlockAllocator.promise``), so a running sequence never finds
      the pool empty.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from specflow.errors import ConfigError, PromptTooLongError, SpecflowError
from specflow.kv.base import KVSpec, LayeredLM, SelfManagedKV
from specflow.kv.contiguous import rows_move
from specflow.kv.kernels import (
    FLASH_BLOCK_MULTIPLE,
    AttnBatch,
    causal_mask,
    causal_prefill,
    paged_sdpa,
    select_backend,
)
from specflow.kv.tree import TreeLayout


class CacheFullError(SpecflowError):
    """The block pool cannot hold what was asked for."""


class BlockAllocator:
    """``num_blocks`` block ids handed out from a free list, with promised capacity.

    ``available`` = free blocks not promised to admitted sequences; ``admit`` checks it.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() gives 0, 1, ...
        self._used: set[int] = set()
        self.promised = 0  # blocks promised to admitted sequences but not allocated yet

    @property
    def num_used(self) -> int:
        return len(self._used)

    @property
    def available(self) -> int:
        """Free blocks nobody has been promised."""
        return len(self._free) - self.promised

    def allocate(self, promised: bool = False) -> int:
        """One free block id; ``promised``: it was promised (consumes the promise)."""
        if not self._free or (not promised and self.available <= 0):
            raise CacheFullError(
                f"KV block pool exhausted ({self.num_blocks} blocks); lower runner.batch_size "
                f"or max_new_tokens"
            )
        block = self._free.pop()
        self._used.add(block)
        if promised:
            self.promised -= 1
        return block

    def free(self, blocks: list[int]) -> None:
        """Return blocks to the free list (a double free is an error)."""
        for b in blocks:
            if b not in self._used:
                raise RuntimeError(f"block {b} freed twice or never allocated")
            self._used.remove(b)
            self._free.append(b)

    def promise(self, n: int) -> None:
        if n > self.available:
            raise CacheFullError(f"cannot promise {n} blocks; {self.available} available")
        self.promised += n

    def unpromise(self, n: int) -> None:
        self.promised -= n
        assert self.promised >= 0

    def check_no_leaks(self) -> None:
        """Raise unless every block is free and nothing is promised."""
        if self._used or self.promised or len(self._free) != self.num_blocks:
            raise RuntimeError(
                f"KV block leak: {len(self._used)} blocks in use, {self.promised} promised, "
                f"{len(self._free)}/{self.num_blocks} free"
            )


@dataclass
class SequenceBlocks:
    """One sequence's share of a ``PagedKVCache``.

    Attributes:
        blocks: block ids; position ``p`` is in ``blocks[p // block_size]``.
        lengths: per layer, positions ``[0, lengths[l])`` are valid in layer ``l``.
        max_len: the worst-case length this sequence was admitted with.
        promised: blocks still promised (``ceil(max_len / bs) - ever allocated``, >= 0).
    """

    blocks: list[int]
    lengths: list[int]
    max_len: int
    promised: int = 0
    table: torch.Tensor | None = field(default=None, repr=False)  # [len(blocks)] int32 cache


class PagedKVCache:
    """The K/V pools of one model and the block tables of its sequences (see module doc)."""

    def __init__(
        self,
        spec: KVSpec,
        *,
        num_blocks: int,
        block_size: int = 16,
        attention: str = "auto",
        max_blocks_per_sequence: int | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        num_layers = self.num_layers = spec.num_layers
        self.block_size = block_size
        # One block past the allocator's: a scratch block that padding rows of static
        # (fixed-shape, CUDA-graph) forwards write to and read from; never handed out.
        self.null_block = num_blocks
        # The most blocks one sequence may hold (the fixed block-table width of static steps).
        self.max_blocks_per_sequence = max_blocks_per_sequence or num_blocks
        shape = (num_layers, num_blocks + 1, block_size, spec.kv_heads, spec.head_dim)
        self.k = torch.zeros(shape, dtype=spec.dtype, device=spec.device)  # [NL, NB, BS, KH, D]
        self.v = torch.zeros(shape, dtype=spec.dtype, device=spec.device)  # [NL, NB, BS, KH, D]
        self.allocator = BlockAllocator(num_blocks)
        self.seqs: dict[int, SequenceBlocks] = {}
        # How this pool's keys are read (SDPA over gathered blocks, or flash); its kernel
        # may need block sizes of a multiple (flash: 256).
        self.attention = PagedAttention(self, attention, torch.device(spec.device), spec.dtype)

    # ---------------------------------------------------------------- sequences
    def blocks_for(self, length: int) -> int:
        return math.ceil(length / self.block_size)

    def can_admit(self, max_len: int) -> bool:
        return self.blocks_for(max_len) <= self.allocator.available

    def add_sequence(self, seq_id: int, max_len: int) -> list[PagedLayerKV]:
        """Register a sequence of at most ``max_len`` positions; its per-layer ``LayerKV``s."""
        if seq_id in self.seqs:
            raise ValueError(f"sequence {seq_id} is already in the cache")
        need = self.blocks_for(max_len)
        if need > self.allocator.num_blocks:
            raise CacheFullError(
                f"a sequence of {max_len} positions needs {need} KV blocks but the pool has "
                f"{self.allocator.num_blocks}; raise the pool size or lower max_new_tokens"
            )
        self.allocator.promise(need)
        self.seqs[seq_id] = SequenceBlocks([], [0] * self.num_layers, max_len, need)
        return [PagedLayerKV(self, seq_id, layer) for layer in range(self.num_layers)]

    def remove_sequence(self, seq_id: int) -> None:
        """Free every block of the sequence and what it was still promised."""
        seq = self.seqs.pop(seq_id)
        self.allocator.free(seq.blocks)
        self.allocator.unpromise(seq.promised)

    def reserve(self, seq_id: int, length: int) -> None:
        """Make sure positions ``[0, length)`` of the sequence have blocks."""
        seq = self.seqs[seq_id]
        if length > seq.max_len:
            raise CacheFullError(
                f"sequence {seq_id} grew to {length} positions, beyond its {seq.max_len}"
            )
        need = self.blocks_for(length)
        while len(seq.blocks) < need:
            from_promise = seq.promised > 0
            seq.blocks.append(self.allocator.allocate(promised=from_promise))
            seq.promised -= from_promise
            seq.table = None

    def set_length(self, seq_id: int, layer: int, length: int) -> None:
        self.seqs[seq_id].lengths[layer] = length

    def truncate(self, seq_id: int, layer: int, n: int) -> None:
        """Layer ``layer`` of the sequence forgets positions ``>= n``; free unused blocks."""
        if n < 0:
            raise ValueError(f"cannot truncate a KV cache to {n} positions")
        seq = self.seqs[seq_id]
        seq.lengths[layer] = min(seq.lengths[layer], n)
        keep = self.blocks_for(max(seq.lengths))
        if keep < len(seq.blocks):
            dropped = seq.blocks[keep:]
            del seq.blocks[keep:]
            self.allocator.free(dropped)
            # The freed blocks go back to this sequence's promise: it may need them again.
            self.allocator.promised += len(dropped)
            seq.promised += len(dropped)
            seq.table = None

    # ---------------------------------------------------------------- addressing
    def block_table(self, seq_ids: list[int], device: torch.device | str) -> torch.Tensor:
        """``[B, max_blocks]`` int32 block ids, padded with 0 (masked by the lengths)."""
        tables = []
        for sid in seq_ids:
            seq = self.seqs[sid]
            if seq.table is None:
                seq.table = torch.tensor(seq.blocks, dtype=torch.int32)
            tables.append(seq.table)
        width = max(1, max(t.shape[0] for t in tables))
        out = torch.zeros(len(tables), width, dtype=torch.int32)
        for i, t in enumerate(tables):
            out[i, : t.shape[0]] = t
        return out.to(device)

    def blocks_of(self, seq_id: int) -> list[int]:
        """The sequence's block ids (position ``p`` is in ``blocks[p // block_size]``)."""
        return self.seqs[seq_id].blocks

    def set_lengths(self, seq_id: int, length: int) -> None:
        """Every layer of the sequence holds positions ``[0, length)``."""
        lengths = self.seqs[seq_id].lengths
        lengths[:] = [length] * len(lengths)

    def slots(self, seq_id: int, start: int, end: int) -> list[int]:
        """Flat slot ids (``block * block_size + offset``) of positions ``[start, end)``."""
        seq, bs = self.seqs[seq_id], self.block_size
        return [seq.blocks[p // bs] * bs + p % bs for p in range(start, end)]


class PagedLayerKV:
    """The ``AttendedKV`` of one (sequence, layer) of a ``PagedKVCache``; ``tree`` (set by
    its owner) makes the positions from ``tree.start`` on a token tree
    (``specflow.kv.tree``)."""

    def __init__(self, cache: PagedKVCache, seq_id: int, layer: int) -> None:
        self.cache = cache
        self.seq_id = seq_id
        self.layer = layer
        self.attention = cache.attention
        self.tree: TreeLayout | None = None

    @property
    def length(self) -> int:
        return self.cache.seqs[self.seq_id].lengths[self.layer]

    @property
    def max_len(self) -> int:
        return self.cache.seqs[self.seq_id].max_len

    def truncate(self, n: int) -> None:
        """Forget positions ``>= n`` (no-op when ``n >= length``); frees whole blocks."""
        self.cache.truncate(self.seq_id, self.layer, n)

    def keep_rows(self, start: int, rows: list[int]) -> None:
        """``KVCache.keep_rows``: position ``start + rows[j]`` moves to ``start + j`` in this
        layer's pool; the length becomes ``start + len(rows)``."""
        cache, end = self.cache, start + len(rows)
        if rows_move(self.length, start, rows):
            src = torch.tensor(cache.slots(self.seq_id, start, self.length), dtype=torch.long)
            src = src[torch.tensor(rows, dtype=torch.long)].to(cache.k.device)
            dst = torch.tensor(cache.slots(self.seq_id, start, end), dtype=torch.long,
                               device=cache.k.device)
            for pool in (cache.k[self.layer], cache.v[self.layer]):  # [NB, BS, KH, D]
                flat = pool.view(-1, *pool.shape[2:])
                flat[dst] = flat[src]  # advanced indexing copies first
        cache.set_length(self.seq_id, self.layer, end)
        cache.truncate(self.seq_id, self.layer, end)  # frees blocks no layer needs


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

    def _meta(
        self, batch: list[tuple[PagedLayerKV, int]], memo: dict
    ) -> tuple[torch.Tensor, torch.Tensor, AttnBatch]:
        """``(positions [N], slots [N], AttnBatch)`` of the batch's new positions."""
        trees = _trees(batch)
        key = ("paged", tuple((kv.seq_id, kv.length, t) for kv, t in batch), trees)
        hit = memo.get(key)
        if hit is not None:
            return hit
        cache = self.cache
        positions: list[int] = []
        slots: list[int] = []
        for (kv, t), tree in zip(batch, trees, strict=True):
            s = kv.length
            if s + t > kv.max_len:
                raise PromptTooLongError(
                    f"position {s + t} is beyond this sequence's {kv.max_len} positions"
                )
            cache.reserve(kv.seq_id, s + t)
            positions.extend(range(s, s + t) if tree is None else tree.positions(s, t))
            slots.extend(cache.slots(kv.seq_id, s, s + t))
        table = cache.block_table([kv.seq_id for kv, _ in batch], self.device)
        attn = AttnBatch.build(
            [t for _, t in batch], [kv.length + t for kv, t in batch], table, self.device
        )
        hit = memo[key] = (
            torch.tensor(positions, dtype=torch.long, device=self.device),
            torch.tensor(slots, dtype=torch.long, device=self.device),
            attn,
        )
        return hit

    def positions(self, batch: list[tuple[PagedLayerKV, int]], memo: dict) -> torch.Tensor:
        return self._meta(batch, memo)[0]

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        batch: list[tuple[PagedLayerKV, int]],
        scale: float,
        memo: dict,
    ) -> torch.Tensor:
        """Scatter ``k, v [N, KH, D]`` into the pool, then ``q [N, NH, D] -> [N, NH, D]``.

        A fresh prefill (no sequence has cached keys) attends to the new rows directly with
        ``causal_prefill``; anything else reads the pool with the selected kernel.
        """
        trees = _trees(batch)
        fresh = all(kv.length == 0 for kv, _ in batch) and not any(trees)
        _, slots, attn = self._meta(batch, memo)
        layer = batch[0][0].layer
        kh, d = k.shape[1], k.shape[2]
        k_pool, v_pool = self.cache.k[layer], self.cache.v[layer]  # [NB, BS, KH, D]
        k_pool.view(-1, kh, d).index_copy_(0, slots, k)
        v_pool.view(-1, kh, d).index_copy_(0, slots, v)
        for kv, t in batch:
            self.cache.set_length(kv.seq_id, layer, kv.length + t)
        if fresh:
            self.used.add("sdpa_causal_prefill")
            return causal_prefill(q, k, v, [t for _, t in batch], scale)
        if any(trees):  # a token tree: SDPA with the tree's mask (no flash kernel takes one)
            self.used.add("sdpa_paged_tree")
            visible = tree_visible(batch, trees, attn, memo)
            return attn.unpad(paged_sdpa(attn.pad(q), k_pool, v_pool, attn.block_table,
                                         visible, scale))
        self.used.add(f"{self.name}_paged")
        return self.kernel(q, k_pool, v_pool, attn, scale)


def _trees(batch: list[tuple[PagedLayerKV, int]]) -> tuple[TreeLayout | None, ...]:
    """Per sequence, its token tree when the block of new rows has rows in it."""
    return tuple(kv.tree if kv.tree is not None and kv.tree.covers(kv.length, t) else None
                 for kv, t in batch)


def tree_visible(
    batch: list[tuple[PagedLayerKV, int]], trees: tuple[TreeLayout | None, ...],
    attn: AttnBatch, memo: dict,
) -> torch.Tensor:
    """``[B, t_max, max_kv]`` bool: the lower-right causal mask of ``kernels.causal_mask``
    with each tree sequence's rows replaced by its tree's visibility (``TreeLayout.visible``;
    the lengths are read before this layer's write, as ``_meta`` read them)."""
    key = ("paged_tree_mask", id(attn))
    hit = memo.get(key)
    if hit is not None:
        return hit
    visible = causal_mask(attn).clone()  # [B, T, L]
    for b, ((_, t), tree) in enumerate(zip(batch, trees, strict=True)):
        if tree is not None:
            s = int(attn.kv_lens[b]) - t
            rows = tree.visible(s, t, visible.device)  # [t, s+t]
            visible[b, attn.t_max - t :, : s + t] = rows
            visible[b, attn.t_max - t :, s + t :] = False
    memo[key] = visible
    return visible


def paged_pool(lm: LayeredLM, num_blocks: int, block_size: int, attention: str) -> PagedKVCache:
    """A paged pool for ``lm``'s layers (``ConfigError`` if the model keeps its own cache)."""
    spec = lm.kv
    if isinstance(spec, SelfManagedKV):
        raise ConfigError(spec.why_not_paged)
    if spec.row_exact:
        raise ConfigError(
            f"{lm.info.name} needs each row attended exactly as a one-row step attends it "
            f"(GGUF-quantized weights: their 8-bit activations can turn a last-bit difference "
            f"into another token), which the paged layout's padded batches do not give: set "
            f"runner.kv_layout=contiguous (or auto, contiguous on a CPU)")
    return PagedKVCache(spec, num_blocks=num_blocks, block_size=block_size, attention=attention)
