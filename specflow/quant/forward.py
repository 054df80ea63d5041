"""A quantized model's whole forward of one sequence in one kernel call.

A decoding step (or a short verification) of a GGUF-quantized model runs, per layer, the
layer kernel before the attention, the cache write, the row-exact attention and the layer
kernel after it (``specflow.models.native.NativeLM.forward_layer``): four calls and a few
tensor views a layer, and the session's bookkeeping between layers.  From Python that costs
about 0.1--0.2 ms a layer -- 5 % of the 1.5B's step, 8 % of the 0.5B's, a quarter of
SmolLM2's.  ``quant_model_forward`` (``kernels/layer_rows.cpp``) runs the same calls for
every layer in C: the same bits as the layer loop, without the interpreter between them.

``FusedForward`` is the ``specflow.kv.base.FusedPath`` a session of such a model holds over
its contiguous caches (``NativeLM.fused_forward``; ``specflow.kv.session.forward_hidden``
asks it): a full forward of a batch of sequences, each of ``1 .. SDPA_ROWS - 1`` chain rows
(decoding steps, chains' verifications, a drafter's steps and catch-ups), runs here as the
layer loop runs it -- each layer's products over all the batch's rows, each sequence
attended over its own cache; a token tree or a prefill block that the layer loop attends
with SDPA returns ``None`` and runs in the layer loop.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence

import torch

from specflow.errors import PromptTooLongError
from specflow.kv.base import FusedPath, LayerKV
from specflow.kv.contiguous import SDPA_ROWS, KVCache
from specflow.quant.layer import QuantLayer
from specflow.quant.matrix import quant_library


class _ModelDesc(ctypes.Structure):
    _fields_ = [("layers", ctypes.c_int), ("layer", ctypes.POINTER(ctypes.c_void_p)),
                ("cos", ctypes.c_void_p), ("sin_signed", ctypes.c_void_p),
                ("table_rows", ctypes.c_long), ("scale", ctypes.c_float)]


class FusedForward:
    """Full forwards of a quantized model over one sequence's ``caches`` (one contiguous
    ``KVCache`` a layer), with the other sequences of a batch, in one kernel call (module doc).

    Args:
        layers: the model's layer kernels, in order.
        caches: the sequence's caches, one a layer (their buffers never move).
        embed: ``token_ids [T] -> h_0 [T, H]``.
        cos, sin_signed: the RoPE tables ``[P, D]`` (float32, contiguous).
        scale: the attention's ``1 / sqrt(D)``.
    """

    def __init__(self, layers: Sequence[QuantLayer], caches: Sequence[KVCache],
                 embed: Callable[[torch.Tensor], torch.Tensor], cos: torch.Tensor,
                 sin_signed: torch.Tensor, scale: float) -> None:
        n = len(layers)
        self.caches = list(caches)
        self.embed = embed
        self.steps = 0  # forwards of this sequence run here
        self.max_len = self.caches[0].max_len
        self.table_rows = cos.shape[0]
        self._keep = (cos, sin_signed, list(layers))
        # which model's layers (sequences of one model share a forward)
        self.model_key = tuple(layer.address for layer in layers)
        self.key_ptrs = [c.k.data_ptr() for c in self.caches]  # [layers]
        self.value_ptrs = [c.v.data_ptr() for c in self.caches]
        self._layer_ptrs = (ctypes.c_void_p * n)(*self.model_key)
        self._desc = _ModelDesc(
            layers=n, layer=ctypes.cast(self._layer_ptrs, ctypes.POINTER(ctypes.c_void_p)),
            cos=cos.data_ptr(), sin_signed=sin_signed.data_ptr(), table_rows=self.table_rows,
            scale=scale)
        self._address = ctypes.addressof(self._desc)

    def fits(self, tokens: list[int]) -> bool:
        """Whether a forward of ``tokens`` from the sequence's end runs here: a chain (no
        token tree laid out) of ``1 .. SDPA_ROWS - 1`` rows."""
        return 0 < len(tokens) < SDPA_ROWS and all(c.tree is None for c in self.caches)

    def hidden(self, rows: list[tuple[FusedPath, list[int], int]]) -> list[torch.Tensor] | None:
        """``h_N [T_i, H]`` per ``rows[i] = (path of sequence i, its T_i tokens, first
        position)`` after one forward of them all (every layer's cache of sequence i then
        holds ``start_i + T_i`` positions); ``None`` (nothing ran) where a path is not this
        model's ``FusedForward`` or a forward does not fit it (``fits``)."""
        paths = [path for path, _, _ in rows]
        fused = [p for p in paths if isinstance(p, FusedForward) and p.model_key == self.model_key]
        if len(fused) != len(paths) or not all(
                p.fits(tokens) for p, (_, tokens, _) in zip(fused, rows, strict=True)):
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
        ids = torch.tensor([tok for _, tokens, _ in rows for tok in tokens], dtype=torch.long)
        h0 = self.embed(ids).to(torch.float32).contiguous()  # [N, H]
        out = torch.empty_like(h0)  # [N, H]
        keys = [ptr for p in fused for ptr in p.key_ptrs]  # [B * layers]
        values = [ptr for p in fused for ptr in p.value_ptrs]
        err = quant_library().quant_model_forward(
            self._address, b, (ctypes.c_int * b)(*counts),
            (ctypes.c_long * b)(*(start for _, _, start in rows)),
            (ctypes.c_void_p * len(keys))(*keys), (ctypes.c_void_p * len(values))(*values),
            (ctypes.c_long * b)(*(p.max_len for p in fused)), h0.data_ptr(), out.data_ptr(),
            torch.get_num_threads())
        if err:
            raise ValueError(f"quant_model_forward: rows {counts} from positions "
                             f"{[start for _, _, start in rows]}")
        for p, (_, tokens, start) in zip(fused, rows, strict=True):
            for cache in p.caches:
                cache.length = start + len(tokens)
            p.steps += 1
        return list(out.split(counts))


def fused_forward(layers: Sequence[QuantLayer], caches: Sequence[LayerKV],
                  embed: Callable[[torch.Tensor], torch.Tensor], cos: torch.Tensor,
                  sin_signed: torch.Tensor, scale: float) -> FusedForward | None:
    """``FusedForward`` over ``caches`` where each is a contiguous ``KVCache`` attended
    row-exact (a quantized model's); ``None`` otherwise (a paged sequence's blocks, a model
    that keeps its own cache)."""
    kept = [c for c in caches if isinstance(c, KVCache) and c.row_exact]
    if len(kept) != len(caches):
        return None
    return FusedForward(layers, kept, embed, cos, sin_signed, scale)
