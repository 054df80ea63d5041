"""Ragged batched forward passes of a ``NativeLM`` over a ``PagedKVCache``.

``BatchedLM`` holds a NativeLM's weights (shared on the same device/dtype, copied once
otherwise) and runs one decoder layer for a *ragged batch*: sequence ``i`` contributes
``t_i`` new positions ``[s_i, s_i + t_i)`` (``s_i`` = that sequence's length in that layer),
packed into one ``[N, H]`` tensor (``N = sum t_i``).  Projections, RoPE and the MLP run on the
packed rows (one matmul per weight for the whole batch: where batching pays on CPU and
GPU), new keys/values are scattered into the pool by slot id, and attention goes through
the selected backend (``specflow.paged.attention``).  Per layer and packed row this is
exactly ``NativeLM.run_layer``'s arithmetic (same fused weights, same RoPE tables).

``PagedSession`` is ``ModelSession`` (layered bookkeeping for one sequence: tokens, per-layer
lengths, kept hidden states, rollback by ``set_tokens``) over paged ``LayerKV``s;
``batched_hidden`` / ``batched_logits`` do ``ModelSession.hidden`` / ``logits`` for many
sessions of one model at once, one batched forward per layer.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from specflow.errors import ConfigError, PromptTooLongError
from specflow.models.native import NativeLM, _Layer
from specflow.models.session import ModelSession
from specflow.paged.attention import FLASH_BLOCK_MULTIPLE, AttnBatch, select_backend
from specflow.paged.cache import PagedKVCache, PagedLayerKV

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def as_dtype(dtype: torch.dtype | str | None, default: torch.dtype) -> torch.dtype:
    if dtype is None:
        return default
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ConfigError(f"dtype={dtype!r} is not supported; use one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


def _move_layer(w: _Layer, device: torch.device, dtype: torch.dtype) -> _Layer:
    def mv(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device=device, dtype=dtype).contiguous()

    return _Layer(**{name: mv(getattr(w, name)) for name in w.__dataclass_fields__})


@dataclass
class _Weights:
    """A NativeLM's tensors on one device/dtype (shared by every ``BatchedLM`` of it)."""

    embed: torch.Tensor  # [V, H]
    layers: list[_Layer]
    final_norm: torch.Tensor  # [H]
    lm_head: torch.Tensor  # [V, H]
    cos: torch.Tensor  # [P, D]
    sin_signed: torch.Tensor  # [P, D]
    exit_heads: dict


_MOVED: dict[tuple[int, str, torch.dtype], tuple[NativeLM, _Weights]] = {}


def _weights(native: NativeLM, device: torch.device, dtype: torch.dtype) -> _Weights:
    """The native model's weights on ``device``/``dtype`` (views when nothing changes)."""
    if device == native.device and dtype == native.dtype:
        return _Weights(
            native.embed_weight,
            native.layers,
            native.final_norm,
            native.lm_head,
            native.cos,
            native.sin_signed,
            native.exit_heads,
        )
    key = (id(native), str(device), dtype)
    hit = _MOVED.get(key)
    if hit is not None and hit[0] is native:
        return hit[1]
    with torch.no_grad():
        w = _Weights(
            native.embed_weight.to(device=device, dtype=dtype).contiguous(),
            [_move_layer(layer, device, dtype) for layer in native.layers],
            native.final_norm.to(device=device, dtype=dtype),
            native.lm_head.to(device=device, dtype=dtype).contiguous(),
            native.cos.to(device=device, dtype=dtype),
            native.sin_signed.to(device=device, dtype=dtype),
            {
                e: copy.deepcopy(m).to(device=device, dtype=dtype)
                for e, m in native.exit_heads.items()
            },
        )
    _MOVED[key] = (native, w)
    return w


class BatchedLM:
    """A ``NativeLM`` (or a layer-skipping view of one) run in ragged batches (module doc).

    Args:
        native: the model whose weights are used.
        device, dtype: where to run (default: the native model's).
        attention: ``auto`` | ``sdpa`` | ``flash`` (``specflow.paged.attention``).
        layer_map: run only these native layers (layer ``i`` here is ``layer_map[i]`` there);
            the head is then always the native model's last exit (``LayerSkipView``).
    """

    def __init__(
        self,
        native: NativeLM,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | str | None = None,
        attention: str = "auto",
        layer_map: list[int] | None = None,
        name: str | None = None,
    ) -> None:
        if not isinstance(native, NativeLM):
            raise ConfigError(
                f"batched decoding needs the native backend (model.backend=native); "
                f"{getattr(getattr(native, 'info', None), 'name', native)} is "
                f"{type(native).__name__}"
            )
        self.native = native
        self.device = torch.device(device) if device is not None else native.device
        self.dtype = as_dtype(dtype, native.dtype)
        self.w = _weights(native, self.device, self.dtype)
        self.layer_map = list(layer_map) if layer_map is not None else None
        depth = len(self.layer_map) if self.layer_map is not None else native.info.num_layers
        self.info = replace(native.info, name=name or native.info.name, num_layers=depth)
        self.attention, self.attend = select_backend(attention, self.device, self.dtype)
        self.num_heads, self.num_kv_heads = native.num_heads, native.num_kv_heads
        self.head_dim, self.hidden_size = native.head_dim, native.hidden_size
        self.eps, self.scale = native.eps, native.scale

    @property
    def min_block_size(self) -> int:
        """Block sizes must be a multiple of this (flash: 256)."""
        return FLASH_BLOCK_MULTIPLE if self.attention == "flash" else 1

    def new_cache(self, num_blocks: int, block_size: int) -> PagedKVCache:
        if block_size % self.min_block_size:
            raise ConfigError(
                f"KV block size {block_size} must be a multiple of {self.min_block_size} "
                f"for attention={self.attention}"
            )
        return PagedKVCache(
            self.info.num_layers,
            self.num_kv_heads,
            self.head_dim,
            num_blocks=num_blocks,
            block_size=block_size,
            dtype=self.dtype,
            device=self.device,
        )

    # ------------------------------------------------------------------ LayeredLM parts
    def new_layer_caches(self, max_len: int) -> list[PagedLayerKV]:
        raise TypeError("BatchedLM caches are paged: create a PagedSession instead")

    @torch.inference_mode()
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """``token_ids [N] -> h_0 [N, H]``."""
        return F.embedding(token_ids.to(self.device), self.w.embed)

    def run_layer(self, layer: int, hidden: torch.Tensor, cache: PagedLayerKV) -> torch.Tensor:
        """``LayeredLM.run_layer`` for one sequence (a batch of one)."""
        return self.run_layer_batch(layer, hidden, [(cache, hidden.shape[0])], {})

    @torch.no_grad()
    def head(self, hidden: torch.Tensor, exit_layer: int) -> torch.Tensor:
        """``h_exit [N, H] -> logits [N, V]`` float32 (as ``NativeLM.head``)."""
        if not 1 <= exit_layer <= self.info.num_layers:
            raise ValueError(f"exit layer must be in 1..{self.info.num_layers}, got {exit_layer}")
        exit_head = None if self.layer_map is not None else self.w.exit_heads.get(exit_layer)
        if exit_head is not None:
            x = exit_head(hidden)  # [N, H]
        else:
            x = F.rms_norm(hidden, (self.hidden_size,), self.w.final_norm, self.eps)  # [N, H]
        return F.linear(x, self.w.lm_head).float()  # [N, V]

    # ------------------------------------------------------------------ batched layer
    def _meta(
        self, members: list[tuple[PagedLayerKV, int]], memo: dict
    ) -> tuple[torch.Tensor, torch.Tensor, AttnBatch]:
        """``(positions [N], slots [N], AttnBatch)`` of the members' new positions."""
        key = tuple((kv.seq_id, kv.length, t) for kv, t in members)
        hit = memo.get(key)
        if hit is not None:
            return hit
        cache = members[0][0].cache
        positions: list[int] = []
        slots: list[int] = []
        for kv, t in members:
            s = kv.length
            if s + t > kv.max_len:
                raise PromptTooLongError(
                    f"position {s + t} is beyond this sequence's {kv.max_len} positions"
                )
            cache.reserve(kv.seq_id, s + t)
            positions.extend(range(s, s + t))
            slots.extend(cache.slots(kv.seq_id, s, s + t))
        table = cache.block_table([kv.seq_id for kv, _ in members], self.device)
        batch = AttnBatch.build(
            [t for _, t in members], [kv.length + t for kv, t in members], table, self.device
        )
        out = (
            torch.tensor(positions, dtype=torch.long, device=self.device),
            torch.tensor(slots, dtype=torch.long, device=self.device),
            batch,
        )
        memo[key] = out
        return out

    @torch.inference_mode()
    def run_layer_batch(
        self,
        layer: int,
        hidden: torch.Tensor,
        members: list[tuple[PagedLayerKV, int]],
        memo: dict,
    ) -> torch.Tensor:
        """``h_layer [N, H] -> h_{layer+1} [N, H]`` for a ragged batch (module doc).

        ``members[i] = (kv, t_i)``: rows ``sum(t_<i) ..`` of ``hidden`` are positions
        ``[kv.length, kv.length + t_i)`` of that sequence; every ``kv`` is this layer's and
        belongs to the same cache.  Appends their keys/values (lengths grow by ``t_i``).
        ``memo`` caches the addressing across the layers of one forward.
        """
        w = self.w.layers[self.layer_map[layer] if self.layer_map is not None else layer]
        cache = members[0][0].cache
        positions, slots, batch = self._meta(members, memo)
        n = hidden.shape[0]
        nh, kh, d = self.num_heads, self.num_kv_heads, self.head_dim
        h = self.hidden_size

        x = F.rms_norm(hidden, (h,), w.ln1, self.eps)  # [N, H]
        qkv = F.linear(x, w.wqkv, w.bqkv)  # [N, (NH + 2KH) * D]
        qk = qkv[:, : (nh + kh) * d].view(n, nh + kh, d)  # [N, NH + KH, D]
        v = qkv[:, (nh + kh) * d :].view(n, kh, d)  # [N, KH, D]
        cos = self.w.cos[positions][:, None]  # [N, 1, D]
        sin = self.w.sin_signed[positions][:, None]  # [N, 1, D]
        qk = qk * cos + qk.roll(d // 2, -1) * sin
        k_pool = cache.k[layer]  # [NB, BS, KH, D]
        v_pool = cache.v[layer]
        k_pool.view(-1, kh, d).index_copy_(0, slots, qk[:, nh:])
        v_pool.view(-1, kh, d).index_copy_(0, slots, v)
        for kv, t in members:
            cache.set_length(kv.seq_id, layer, kv.length + t)
        att = self.attend(qk[:, :nh], k_pool, v_pool, batch, self.scale)  # [N, NH, D]
        x = F.linear(att.reshape(n, nh * d), w.wo, w.bo)  # [N, H]
        hidden = hidden + x

        x = F.rms_norm(hidden, (h,), w.ln2, self.eps)  # [N, H]
        gate, up = F.linear(x, w.w_gate_up, w.b_gate_up).chunk(2, dim=-1)  # [N, I] each
        return hidden + F.linear(F.silu(gate) * up, w.w_down, w.b_down)  # [N, H]


class PagedSession(ModelSession):
    """``ModelSession`` bookkeeping for one sequence whose caches are paged (module doc).

    The sequence is registered in ``cache`` under ``seq_id`` with ``max_len`` positions
    promised; ``release`` frees its blocks.  ``set_tokens`` / ``truncate`` roll back exactly
    as in ``ModelSession`` and free whole blocks beyond the longest layer.
    """

    def __init__(self, model: BatchedLM, cache: PagedKVCache, seq_id: int, max_len: int) -> None:
        if max_len > model.info.max_positions:
            raise PromptTooLongError(
                f"requested a context of {max_len} positions but {model.info.name} supports "
                f"{model.info.max_positions}; shorten the prompt or lower max_new_tokens"
            )
        self.model = model
        self.cache = cache
        self.seq_id = seq_id
        self.max_len = max_len
        self.tokens: list[int] = []
        self.caches = cache.add_sequence(seq_id, max_len)
        self.kept: list[torch.Tensor | None] = [None] * (model.info.num_layers + 1)
        self.final_hidden: torch.Tensor | None = None
        self.final_start = 0
        self.layer_evals = 0

    def release(self) -> None:
        """Free this sequence's blocks (the session is unusable afterwards)."""
        self.cache.remove_sequence(self.seq_id)

    def _empty(self) -> torch.Tensor:
        return torch.empty(0, self.model.info.hidden_size, device=self.model.device)

    def hidden(self, exit_layer: int, end: int) -> tuple[torch.Tensor, int]:
        """``ModelSession.hidden`` as a batch of one."""
        return batched_hidden([(self, exit_layer, end)])[0]


def batched_hidden(
    requests: list[tuple[PagedSession, int, int]],
) -> list[tuple[torch.Tensor, int]]:
    """``ModelSession.hidden(exit, end)`` for many sessions of one model, batched per layer.

    ``requests[i] = (session, exit_layer, end)``; the sessions must be distinct sequences.
    Returns ``(h, start)`` per request, as ``ModelSession.hidden``.
    """
    if not requests:
        return []
    model = requests[0][0].model
    for sess, exit_layer, end in requests:
        if sess.model is not model:
            raise ValueError("batched_hidden needs sessions of one model")
        if not 1 <= exit_layer <= sess.num_layers:
            raise ValueError(f"exit layer must be in 1..{sess.num_layers}, got {exit_layer}")
        if end > len(sess.tokens):
            raise ValueError(f"position {end} is beyond the sequence ({len(sess.tokens)} tokens)")
    memo: dict = {}
    for layer in range(max(e for _, e, _ in requests)):
        todo = [
            (sess, sess.computed(layer), end)
            for sess, exit_layer, end in requests
            if exit_layer > layer and sess.computed(layer) < end
        ]
        if not todo:
            continue
        if layer == 0:
            ids = [tok for sess, done, end in todo for tok in sess.tokens[done:end]]
            inp = model.embed(torch.tensor(ids, dtype=torch.long))  # [N, H]
        else:
            parts = [sess._take_kept(layer, done, end) for sess, done, end in todo]
            inp = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)  # [N, H]
        members = [(sess.caches[layer], end - done) for sess, done, end in todo]
        out = model.run_layer_batch(layer, inp, members, memo)  # [N, H]
        row = 0
        for sess, done, end in todo:
            sess._store(layer, done, out[row : row + end - done])
            row += end - done
    return [sess._result(exit_layer) for sess, exit_layer, _ in requests]


def batched_logits(requests: list[tuple[PagedSession, int, int, int]]) -> list[torch.Tensor]:
    """``ModelSession.logits(exit, start, end)`` for many sessions of one model.

    ``requests[i] = (session, exit_layer, start, end)`` -> logits ``[end - start, V]``
    (float32, on the model's device).  One head call per distinct exit.
    """
    hs = batched_hidden([(s, e, end) for s, e, _, end in requests])
    rows: list[torch.Tensor] = []
    for (_, exit_layer, start, end), (h, h_start) in zip(requests, hs, strict=True):
        if start < h_start:
            raise RuntimeError(
                f"positions from {start} at exit {exit_layer} were consumed by a deeper layer "
                f"(kept from {h_start}); ask for them before running deeper"
            )
        rows.append(h[start - h_start : end - h_start])
    out: list[torch.Tensor | None] = [None] * len(requests)
    model = requests[0][0].model if requests else None
    for exit_layer in sorted({r[1] for r in requests}):
        idx = [i for i, r in enumerate(requests) if r[1] == exit_layer]
        logits = model.head(torch.cat([rows[i] for i in idx], dim=0), exit_layer)  # [R, V]
        row = 0
        for i in idx:
            n = rows[i].shape[0]
            out[i] = logits[row : row + n]
            row += n
    return out  # type: ignore[return-value]
