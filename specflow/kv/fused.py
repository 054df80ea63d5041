"""A quantized model's full forward of a few rows in one kernel call.

A decoding step (or a short verification) of a GGUF-quantized model runs, per layer, the
layer kernel before the attention, the cache write, the row-exact attention and the layer
kernel after it (``specflow.models.native.NativeLM.forward_layer``): four calls and a few
tensor views a layer, and the session's bookkeeping between layers: 4--5 ms of interpreter a
step on the 1.5B and SmolLM2-135M, 2.5 on the 0.5B, while the second thread waits.
``quant_model_forward`` (``specflow/quant/kernels/layer_rows.cpp``) runs the same calls for
every layer in C: the same bits as the layer loop, without the interpreter between them (a
1-row step over 300 positions 1.15x / 1.20x / 1.59x cheaper on the 1.5B / 0.5B / SmolLM2 on an
AVX2 EPYC, docs/performance.md).

``FusedForward`` is what a session of such a model holds over its contiguous caches
(``fused_path``; the model describes its layers with ``LayeredLM.fused_layers``, and
``specflow.kv.session.forward_hidden`` asks it): a full forward of a batch of sequences, each
of ``1 .. SDPA_ROWS - 1`` chain rows (decoding steps, chains' verifications, a drafter's steps
and catch-ups), runs here as the layer loop runs it -- each layer's products over all the
batch's rows, each sequence attended over its own cache (a token tree's rows over the prefix
and their ancestors); a prefill block that the layer loop attends with SDPA returns ``None``
and runs in the layer loop.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from specflow.errors import PromptTooLongError
from specflow.kv.base import FusedLayers, LayeredLM, LayerKV
from specflow.kv.contiguous import SDPA_ROWS, KVCache, tree_rows_seen
from specflow.quant.matrix import quant_library

# A forward's rows in a token tree: rotary positions [T], prefix [T], offsets [T + 1] and the
# new rows' columns each row sees (``FusedForward.tree_rows``).
TreeRows = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


class _ModelDesc(ctypes.Structure):
    _fields_ = [("layers", ctypes.c_int), ("layer", ctypes.POINTER(ctypes.c_void_p)),
                ("cos", ctypes.c_void_p), ("sin_signed", ctypes.c_void_p),
                ("table_rows", ctypes.c_long), ("scale", ctypes.c_float)]


class FusedForward:
    """Full forwards of a quantized model (``model``) over one sequence's ``caches`` (one
    contiguous ``KVCache`` a layer, their buffers never moving), with the other sequences of
    a batch, in one kernel call (module doc)."""

    def __init__(self, model: FusedLayers, caches: Sequence[KVCache]) -> None:
        n = len(model.layers)
        self.model = model
        self.caches = list(caches)
        self.steps = 0  # forwards of this sequence run here
        self.max_len = self.caches[0].max_len
        self.table_rows = model.cos.shape[0]
        self.key_ptrs = [c.k.data_ptr() for c in self.caches]  # [layers]
        self.value_ptrs = [c.v.data_ptr() for c in self.caches]
        self._layer_ptrs = (ctypes.c_void_p * n)(*model.layers)
        self._desc = _ModelDesc(
            layers=n, layer=ctypes.cast(self._layer_ptrs, ctypes.POINTER(ctypes.c_void_p)),
            cos=model.cos.data_ptr(), sin_signed=model.sin_signed.data_ptr(),
            table_rows=self.table_rows, scale=model.scale)
        self._address = ctypes.addressof(self._desc)

    def fits(self, tokens: list[int]) -> bool:
        """Whether a forward of ``tokens`` runs here: ``1 .. SDPA_ROWS - 1`` rows (longer
        blocks: the layer loop's SDPA prefill), every layer's cache laying out the same token
        tree (or none)."""
        tree = self.caches[0].tree
        return 0 < len(tokens) < SDPA_ROWS and all(c.tree is tree for c in self.caches)

    def tree_rows(self, t: int, start: int) -> TreeRows | None | bool:
        """How a forward of ``t`` rows from ``start`` attends, as the layer loop attends it
        (``specflow.kv.contiguous.tree_rows_seen``): ``None`` for a chain; for rows in the
        token tree ``(positions [T], prefix [T], offsets [T + 1], columns)`` int64 -- each
        row's rotary position (its depth), then what it sees; ``False`` where a row does not
        see the whole prefix (the layer loop refuses it)."""
        tree = self.caches[0].tree
        if tree is None or not tree.covers(start, t):
            return None
        seen = tree_rows_seen(tree, start, t)
        if seen is None:
            return False
        prefix, (offsets, columns) = seen
        return torch.tensor(tree.positions(start, t), dtype=torch.long), prefix, offsets, columns

    def hidden(self, rows: list[tuple[FusedForward, list[int], int]]
               ) -> list[torch.Tensor] | None:
        """``h_N [T_i, H]`` per ``rows[i] = (the path of sequence i, its T_i tokens, first
        position)`` -- sequences of this path's model, this one among them, each with every
        layer's cache holding ``start_i`` positions (the session checks) -- after one forward
        of them all (every layer's cache of sequence i then holds ``start_i + T_i``
        positions); ``None`` (nothing ran) where a path is another model's (other layers) or a
        forward does not fit its path (``fits``, ``tree_rows``)."""
        fused = [path for path, _, _ in rows]
        if not all(p.model.layers == self.model.layers and p.fits(tokens)
                   for p, tokens, _ in rows):
            return None
        layouts = [p.tree_rows(len(tokens), start) for p, tokens, start in rows]
        if any(lay is False for lay in layouts):
            return None
        for p, (_, tokens, start) in zip(fused, rows, strict=True):
            end = start + len(tokens)
            if end > p.max_len:
                raise PromptTooLongError(f"position {end} is beyond this KV cache's "
                                         f"{p.max_len} positions")
            if end > self.table_rows:
                raise PromptTooLongError(f"position {end - 1} is beyond the model's "
                                         f"{self.table_rows} RoPE positions")
        b = len(rows)
        counts = [len(tokens) for _, tokens, _ in rows]
        trees = [lay for lay in layouts if isinstance(lay, tuple)]
        positions = prefix = extra_off = extra = None
        if trees:  # every row's position and prefix given; a chain's as the kernel's own
            chains = [(torch.arange(start, start + len(tokens)),
                       torch.arange(start + 1, start + len(tokens) + 1))
                      for _, tokens, start in rows]
            parts = [lay[:2] if isinstance(lay, tuple) else chain
                     for lay, chain in zip(layouts, chains, strict=True)]
            positions = torch.cat([pos for pos, _ in parts]).contiguous()  # [N]
            prefix = torch.cat([pre for _, pre in parts]).contiguous()  # [N]
            extra_off = (ctypes.c_void_p * b)(*(
                lay[2].data_ptr() if isinstance(lay, tuple) else None for lay in layouts))
            extra = (ctypes.c_void_p * b)(*(
                lay[3].data_ptr() if isinstance(lay, tuple) else None for lay in layouts))
        ids = torch.tensor([tok for _, tokens, _ in rows for tok in tokens], dtype=torch.long)
        h0 = self.model.embed(ids).to(torch.float32).contiguous()  # [N, H]
        out = torch.empty_like(h0)  # [N, H]
        keys = [ptr for p in fused for ptr in p.key_ptrs]  # [B * layers]
        values = [ptr for p in fused for ptr in p.value_ptrs]
        err = quant_library().quant_model_forward(
            self._address, b, (ctypes.c_int * b)(*counts),
            (ctypes.c_long * b)(*(start for _, _, start in rows)),
            (ctypes.c_void_p * len(keys))(*keys), (ctypes.c_void_p * len(values))(*values),
            (ctypes.c_long * b)(*(p.max_len for p in fused)),
            None if positions is None else positions.data_ptr(),
            None if prefix is None else prefix.data_ptr(), extra_off, extra, h0.data_ptr(),
            out.data_ptr(), torch.get_num_threads())
        if err:
            raise ValueError(f"quant_model_forward: rows {counts} from positions "
                             f"{[start for _, _, start in rows]}")
        for p, (_, tokens, start) in zip(fused, rows, strict=True):
            for cache in p.caches:
                cache.length = start + len(tokens)
            p.steps += 1
        return list(out.split(counts))


def fused_path(model: LayeredLM, caches: Sequence[LayerKV]) -> FusedForward | None:
    """The fused path of a session of ``model`` over ``caches``: where the model runs its
    layers in one kernel call (``LayeredLM.fused_layers``) and each cache is a contiguous
    ``KVCache`` attended row-exact, one a layer; ``None`` otherwise (the layer loop runs every
    forward: float weights, a paged sequence's blocks, a model that keeps its own cache)."""
    layers = model.fused_layers()
    if layers is None:
        return None
    kept = [c for c in caches if isinstance(c, KVCache) and c.row_exact]
    if len(kept) != len(caches) or len(kept) != len(layers.layers):
        return None
    return FusedForward(layers, kept)
