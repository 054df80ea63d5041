"""Where the keys/values of a batch of requests live: one KV store per model.

The engine's scheduler owns a ``KVStores``; every request's ``DecodeState`` opens its model
sessions through it (``DecodeState.session``), so stages never know the layout:

- ``contiguous``: each (request, model) gets preallocated per-layer buffers of its own
  (``specflow.kv.contiguous.KVCache``): the fast CPU path, any batch size.
- ``paged``: each model has one pool of fixed-size blocks shared by the batch
  (``specflow.kv.paged.PagedKVCache``); a request owns a block table, admission control
  promises each admitted request its worst-case blocks, and rollback frees whole blocks.
  With ``decode=static|graphs`` each pool also gets a static step runner
  (``specflow.kv.static.StaticDecoder``) sized for the pipeline's largest draft.

Every buffer is built from the model's ``KVSpec`` (``LayeredLM.kv``): the stores never
import a model class.

``KVStores`` also places the models: with ``device`` / ``dtype`` set, a model is moved once
(``LayeredLM.to``) and every session of it runs there; stages keep the model they were built
with, sessions are keyed by it.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from specflow.cpu.detect import DTYPE_NAMES
from specflow.errors import ConfigError
from specflow.kv.base import LayeredLM
from specflow.kv.kernels import FLASH_BLOCK_MULTIPLE, select_backend
from specflow.kv.paged import PagedKVCache, paged_pool
from specflow.kv.session import ModelSession
from specflow.kv.static import MODES, StaticDecoder

LAYOUTS = ("contiguous", "paged")


def as_dtype(dtype: torch.dtype | str | None, default: torch.dtype) -> torch.dtype:
    """``None`` -> ``default``; a name of ``DTYPE_NAMES`` (specflow.cpu.detect) -> that dtype."""
    if dtype is None:
        return default
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPE_NAMES:
        raise ConfigError(
            f"dtype={dtype!r} is not supported; use one of {sorted(DTYPE_NAMES)}"
        )
    return DTYPE_NAMES[dtype]


@dataclass(frozen=True)
class KVLayout:
    """How and where a run keeps its models' keys/values (``runner.kv_layout`` etc.).

    Attributes:
        kind: ``contiguous`` or ``paged``.
        device: run the models here (``None``: where they were loaded).
        dtype: run the models in this dtype (``None``: as loaded).
        attention: paged attention kernel: ``auto`` | ``sdpa`` | ``flash``.
        block_size: paged block size (``None``: 16, or 256 with flash).
        decode: paged decode/verify steps: ``eager``; ``static`` (fixed shapes, run eagerly:
            the CPU check of the graph path); ``graphs`` (fixed shapes replayed as CUDA
            graphs, ``specflow.kv.static``).
    """

    kind: str = "contiguous"
    device: str | None = None
    dtype: str | None = None
    attention: str = "auto"
    block_size: int | None = None
    decode: str = "eager"

    def __post_init__(self) -> None:
        if self.kind not in LAYOUTS:
            raise ConfigError(f"runner.kv_layout={self.kind!r} is unknown; use one of {LAYOUTS}")
        if self.decode not in MODES:
            raise ConfigError(f"KV decode mode {self.decode!r} is unknown; use one of {MODES}")
        if self.decode != "eager" and self.kind != "paged":
            raise ConfigError(f"decode={self.decode} needs the paged KV layout")
        if self.decode == "graphs" and (self.device or "cpu").split(":")[0] != "cuda":
            raise ConfigError("CUDA graphs need runner.device=cuda")
        if self.block_size is not None and self.block_size < 1:
            raise ConfigError(f"runner.block_size must be >= 1, got {self.block_size}")


class KVStores:
    """The KV stores of every model a set of requests runs (module doc).

    Args:
        layout: contiguous or paged, device, dtype, kernel.
        max_seqs: paged: how many sequences the pools must hold at once.
        max_context: paged: the longest sequence (positions) the pools are sized for.
        max_draft: the most draft tokens one round verifies (the pipeline's cap): a
            static step takes up to ``max_draft + 1`` query rows per sequence.
    """

    def __init__(
        self,
        layout: KVLayout | None = None,
        max_seqs: int = 1,
        max_context: int = 2048,
        max_draft: int = 0,
    ) -> None:
        self.layout = layout or KVLayout()
        self.max_seqs = max_seqs
        self.max_context = max_context
        self.max_draft = max_draft
        self._placed: dict[int, tuple[LayeredLM, LayeredLM]] = {}  # id(lm) -> (lm, placed)
        self._pools: dict[int, PagedKVCache] = {}  # id(lm) -> its pool (paged)
        self._static: dict[int, StaticDecoder] = {}  # id(lm) -> its static steps
        self._seq_ids = itertools.count()

    # ---------------------------------------------------------------- models
    def place(self, lm: LayeredLM) -> LayeredLM:
        """``lm`` on the layout's device/dtype (moved once)."""
        hit = self._placed.get(id(lm))
        if hit is not None and hit[0] is lm:
            return hit[1]
        placed = lm
        if self.layout.device is not None or self.layout.dtype is not None:
            device = torch.device(self.layout.device) if self.layout.device else lm.device
            dtype = as_dtype(self.layout.dtype, lm.dtype)
            placed = lm.to(device, dtype)
        self._placed[id(lm)] = (lm, placed)
        return placed

    def register(self, models: list[LayeredLM]) -> None:
        """Place ``models`` and, when paged, build their pools now (admission needs them)."""
        for lm in models:
            placed = self.place(lm)
            if self.layout.kind == "paged" and id(lm) not in self._pools:
                pool = self._pools[id(lm)] = self._new_pool(placed)
                if self.layout.decode != "eager":
                    graphs = self.layout.decode == "graphs"
                    rows = self.max_draft + 1
                    self._static[id(lm)] = StaticDecoder(placed, pool, rows, graphs)

    def _new_pool(self, placed: LayeredLM) -> PagedKVCache:
        kernel, _ = select_backend(self.layout.attention, placed.device, placed.dtype)
        multiple = FLASH_BLOCK_MULTIPLE if kernel == "flash" else 1
        bs = self.layout.block_size or max(16, multiple)
        if bs % multiple:
            raise ConfigError(
                f"runner.block_size={bs} must be a multiple of {multiple} for attention={kernel}"
            )
        per_sequence = math.ceil(self.max_context / bs)
        pool = paged_pool(placed, self.max_seqs * per_sequence, bs, self.layout.attention)
        pool.max_blocks_per_sequence = per_sequence
        return pool

    @property
    def pools(self) -> list[PagedKVCache]:
        return list(self._pools.values())

    # ---------------------------------------------------------------- sequences
    def new_sequence(self) -> int:
        """A fresh sequence id (one per request: its paged block tables)."""
        return next(self._seq_ids)

    def can_admit(self, max_len: int) -> bool:
        """Whether every pool can promise a sequence of ``max_len`` positions now."""
        return all(pool.can_admit(max_len) for pool in self._pools.values())

    def open(self, lm: LayeredLM, max_len: int, seq_id: int) -> ModelSession:
        """A session of ``lm`` for sequence ``seq_id`` (``release()`` frees its storage)."""
        placed = self.place(lm)
        if self.layout.kind == "contiguous":
            return ModelSession(placed, max_len, seq_id=seq_id)
        pool = self._pools.get(id(lm))
        if pool is None:
            self.register([lm])
            pool = self._pools[id(lm)]
        caches = pool.add_sequence(seq_id, max_len)
        release = lambda: pool.remove_sequence(seq_id)  # noqa: E731
        static = self._static.get(id(lm))
        return ModelSession(placed, max_len, caches, release, static, seq_id)

    def report(self) -> dict:
        """Which kernels ran and what the static path did (for the run's summary)."""
        kernels = sorted({k for pool in self._pools.values() for k in pool.attention.used})
        if self.layout.kind == "contiguous":
            kernels = ["contiguous_bmm"]
        out: dict = {"kv_layout": self.layout.kind, "kernels": kernels, "decode": "eager"}
        if self._static:
            stats = [st.stats for st in self._static.values()]
            out.update(
                {
                    "decode": self.layout.decode,
                    "static_steps": sum(s.steps for s in stats),
                    "eager_steps": sum(s.eager_steps for s in stats),
                    "graphs_captured": sum(len(s.captured) for s in stats)
                    if self.layout.decode == "graphs"
                    else 0,
                    "capture_s": sum(s.capture_s for s in stats),
                }
            )
            if any(s.steps for s in stats):
                out["kernels"] = sorted({*out["kernels"], "static_sdpa"})
        return out

    def check_no_leaks(self) -> None:
        """Raise unless every block of every pool is free."""
        for pool in self._pools.values():
            pool.allocator.check_no_leaks()
