"""Static-shape decode/verify forwards over a paged pool, replayed as CUDA graphs.

A decode or verify step of a batch is many small kernels; launched one by one from Python
it runs at a fraction of the GPU's pace.  The cure (vLLM, gpt-fast) is to give the step
*fixed shapes* and capture it once per shape in a CUDA graph, then replay it.  Shapes are
bucketed: a batch of ``b`` sequences runs in the smallest bucket ``B >= b`` of
``BATCH_BUCKETS``, each sequence with ``T`` query rows (the longest ``t_i`` of the step:
1 when decoding, ``k + 1`` when verifying); the block table has a fixed width ``W`` (the
pool's blocks per sequence).  Padding rows (sequences ``b..B-1``, rows ``t_i..T-1``) read
and write only the pool's scratch block (``PagedKVCache.null_block``).

Everything the step reads sits in static buffers filled before each replay (token ids,
positions, slots, block table: four host-to-device copies); nothing in it depends on a
Python number taken from the data, so the same code runs eagerly on the CPU (tests) and
is captured on CUDA.  Attention is the one paged kernel (``specflow.kv.kernels.paged_sdpa``)
over the fixed-width gather of each sequence's blocks with a mask from the query positions
(key ``j`` visible to a query at position ``p`` iff ``j <= p``), so a sequence never sees
another's keys or its own future.  The decoder layer is the model's one ``run_layer``: only
its attention backend is the static one.

A step takes the static path only when it is a full forward from layer 0 to the last
exit for every sequence with no partial layers pending (plain decoding, and verification
by a target whose session no early-exit stage shares: the session checks that,
``specflow.kv.session.forward_logits``) and fits the buckets and ``max_rows`` (checked here);
anything else (prefill, early exits, HiSpec) runs eagerly.  ``StaticDecoder`` is the
``specflow.kv.base.StaticPath`` a paged session holds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from specflow.kv.base import LayeredLM, StaticRow
from specflow.kv.kernels import paged_sdpa
from specflow.kv.paged import PagedKVCache

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32)
MODES = ("eager", "static", "graphs")  # eager: no static path; static: eager replays (CPU)


def bucket_for(n: int, buckets: tuple[int, ...] = BATCH_BUCKETS) -> int | None:
    """The smallest bucket holding ``n`` sequences (``None``: more than the largest)."""
    return next((b for b in buckets if b >= n), None)


@dataclass
class StaticStats:
    """What the static path did: shapes captured, seconds capturing, steps run."""

    captured: list[tuple[int, int]] = field(default_factory=list)  # (batch bucket, rows)
    capture_s: float = 0.0
    steps: int = 0
    eager_steps: int = 0  # steps that did not fit (shape, partial layers): run eagerly


class _StaticLayer:
    """What ``run_layer`` sees as a layer's KV on the static path (an ``AttendedKV``): the
    layer index and the static backend; the real per-sequence bookkeeping is done around the
    replay, so ``length`` stays 0 and the buffers hold the positions.  Never a token tree
    (sessions with one run eagerly), never compacted."""

    seq_id = -1  # the rows of every sequence of the step
    tree = None  # static steps are chains

    def keep_rows(self, start: int, rows: list[int]) -> None:  # pragma: no cover
        raise TypeError("a static layer belongs to no session")

    def __init__(self, layer: int, attention: StaticAttention, max_len: int) -> None:
        self.layer = layer
        self.attention = attention
        self.length = 0
        self.max_len = max_len

    def truncate(self, n: int) -> None:  # pragma: no cover - never part of a session
        raise TypeError("a static layer belongs to no session")


class StaticAttention:
    """The attention backend of one static shape: writes k/v at the slot buffer, attends
    with ``paged_sdpa`` masked by position (module doc)."""

    name = "static_sdpa"

    def __init__(self, pool: PagedKVCache, buffers: StaticForward) -> None:
        self.pool = pool
        self.buffers = buffers

    def positions(self, batch: list[tuple[_StaticLayer, int]], memo: dict) -> torch.Tensor:
        return self.buffers.positions  # [B*T]

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        batch: list[tuple[_StaticLayer, int]],
        scale: float,
        memo: dict,
    ) -> torch.Tensor:
        buf = self.buffers
        layer = batch[0][0].layer
        kh, d = k.shape[1], k.shape[2]
        k_pool, v_pool = self.pool.k[layer], self.pool.v[layer]  # [NB+1, BS, KH, D]
        k_pool.view(-1, kh, d).index_copy_(0, buf.slots, k)
        v_pool.view(-1, kh, d).index_copy_(0, buf.slots, v)
        shape = (buf.batch, buf.rows, q.shape[1], q.shape[2])
        positions = buf.positions.view(buf.batch, buf.rows)  # [B, T]
        visible = buf.key_positions[None, None, :] <= positions[:, :, None]  # [B, T, W*BS]
        out = paged_sdpa(q.reshape(shape), k_pool, v_pool, buf.table, visible, scale)
        return out.reshape(q.shape)  # [B*T, NH, D]


class StaticForward:
    """The static buffers and the forward of one shape (``batch`` x ``rows``) of one model.

    ``run()`` computes ``logits [batch * rows, V]`` (float32) from the buffers: eagerly, or
    by replaying a CUDA graph captured on the first call (``graphs=True``).
    """

    def __init__(
        self, model: LayeredLM, pool: PagedKVCache, batch: int, rows: int, graphs: bool
    ) -> None:
        self.model, self.pool = model, pool
        self.batch, self.rows = batch, rows
        self.width = pool.max_blocks_per_sequence  # table width: a sequence's most blocks
        device = pool.k.device
        n = batch * rows
        self.null_slot = pool.null_block * pool.block_size
        self.ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slots = torch.full((n,), self.null_slot, dtype=torch.long, device=device)
        self.table = torch.full(
            (batch, self.width), pool.null_block, dtype=torch.long, device=device
        )
        self.key_positions = torch.arange(self.width * pool.block_size, device=device)
        attention = StaticAttention(pool, self)
        max_len = self.width * pool.block_size
        self.layers = [_StaticLayer(i, attention, max_len) for i in range(model.info.num_layers)]
        self.graphs = graphs
        self.graph: torch.cuda.CUDAGraph | None = None
        self.hidden: torch.Tensor | None = None  # [B*T, H] the last layer's output
        self.logits: torch.Tensor | None = None  # [B*T, V]

    def _forward(self) -> None:
        n = self.batch * self.rows
        memo: dict = {}
        h = self.model.embed(self.ids)  # [N, H]
        for i, layer in enumerate(self.layers):
            h = self.model.run_layer(i, h, [(layer, n)], memo)
        self.hidden = h
        self.logits = self.model.head(h, self.model.info.num_layers)

    def run(self) -> float:
        """One step; returns the seconds spent capturing (0 after the first call)."""
        if not self.graphs:
            self._forward()
            return 0.0
        if self.graph is not None:
            self.graph.replay()
            return 0.0
        start = time.perf_counter()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up outside the graph (allocator, kernels)
            self._forward()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=_graph_pool()):
            self._forward()
        self.graph = graph
        graph.replay()
        return time.perf_counter() - start

    def load(self, rows: list[tuple[int, list[int], int]]) -> None:
        """Fill the buffers: ``rows[i] = (seq_id, token ids, first position)`` for the real
        sequences (the rest are padding).  Four host-to-device copies."""
        bs, t = self.pool.block_size, self.rows
        ids = [0] * (self.batch * t)
        positions = [0] * (self.batch * t)
        slots = [self.null_slot] * (self.batch * t)
        table = [[self.pool.null_block] * self.width for _ in range(self.batch)]
        for b, (seq_id, tokens, start) in enumerate(rows):
            blocks = self.pool.blocks_of(seq_id)
            table[b][: len(blocks)] = blocks
            for j, tok in enumerate(tokens):
                p = start + j
                ids[b * t + j] = tok
                positions[b * t + j] = p
                slots[b * t + j] = blocks[p // bs] * bs + p % bs
        self.ids.copy_(torch.tensor(ids), non_blocking=True)
        self.positions.copy_(torch.tensor(positions), non_blocking=True)
        self.slots.copy_(torch.tensor(slots), non_blocking=True)
        self.table.copy_(torch.tensor(table), non_blocking=True)


_GRAPH_POOL: tuple | None = None


def _graph_pool() -> tuple:
    """One memory pool shared by every captured graph (their buffers do not overlap in
    time: one replay at a time)."""
    global _GRAPH_POOL
    if _GRAPH_POOL is None:
        _GRAPH_POOL = torch.cuda.graph_pool_handle()
    return _GRAPH_POOL


class StaticDecoder:
    """Static (or CUDA-graph) decode/verify steps of one model over its pool (module doc);
    the ``StaticPath`` of the model's paged sessions.

    Args:
        model: the placed model (``NativeLM`` or a view of one).
        pool: its paged pool.
        max_rows: the most query rows per sequence taken statically: the pipeline's largest
            draft length + 1 (``KVStores`` passes it).
        graphs: capture CUDA graphs (CUDA only); else run the static forward eagerly.
    """

    def __init__(self, model: LayeredLM, pool: PagedKVCache, max_rows: int, graphs: bool) -> None:
        self.model, self.pool = model, pool
        self.max_rows = max_rows
        self.graphs = graphs
        self.shapes: dict[tuple[int, int], StaticForward] = {}
        self.stats = StaticStats()

    def note_eager(self) -> None:
        """A step whose sessions had partial layers pending: it ran eagerly."""
        self.stats.eager_steps += 1

    def fits(self, rows: list[StaticRow]) -> bool:
        """Whether a step of these rows fits a static shape (batch bucket, ``max_rows``,
        the block-table width)."""
        capacity = self.pool.max_blocks_per_sequence * self.pool.block_size
        return bucket_for(len(rows)) is not None and all(
            0 < len(tokens) <= self.max_rows and start + len(tokens) <= capacity
            for _, tokens, start in rows
        )

    def run(self, rows: list[StaticRow]) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """One static full forward: ``(h_N [t_i, H], logits [t_i, V])`` per row (on the
        model's device), the pool's lengths set to each row's end; ``None`` (nothing ran,
        counted as an eager step) when the step does not fit."""
        if not self.fits(rows):
            self.stats.eager_steps += 1
            return None
        t = max(len(tokens) for _, tokens, _ in rows)
        batch = bucket_for(len(rows))
        assert batch is not None
        shape = self.shapes.get((batch, t))
        if shape is None:
            shape = self.shapes[(batch, t)] = StaticForward(
                self.model, self.pool, batch, t, self.graphs
            )
        for seq_id, tokens, start in rows:
            self.pool.reserve(seq_id, start + len(tokens))
        shape.load(rows)
        spent = shape.run()
        if spent:
            self.stats.captured.append((batch, t))
            self.stats.capture_s += spent
        self.stats.steps += 1
        assert shape.hidden is not None and shape.logits is not None
        out = []
        for b, (seq_id, tokens, start) in enumerate(rows):
            self.pool.set_lengths(seq_id, start + len(tokens))
            span = slice(b * t, b * t + len(tokens))
            out.append((shape.hidden[span].clone(), shape.logits[span]))
        return out
