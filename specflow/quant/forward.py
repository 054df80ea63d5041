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
asks it): a full forward of one sequence of ``1 .. SDPA_ROWS - 1`` chain rows (a decoding
step, a chain's verification, a drafter's step and its catch-up) runs here; anything else (a
batch of sequences, a token tree, a prefill block that the layer loop attends with SDPA)
returns ``None`` and runs in the layer loop.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence

import torch

from specflow.errors import PromptTooLongError
from specflow.kv.contiguous import SDPA_ROWS, KVCache
from specflow.quant.layer import QuantLayer
from specflow.quant.matrix import quant_library


class _ForwardDesc(ctypes.Structure):
    _fields_ = [("layers", ctypes.c_int), ("layer", ctypes.POINTER(ctypes.c_void_p)),
                ("keys", ctypes.POINTER(ctypes.c_void_p)),
                ("values", ctypes.POINTER(ctypes.c_void_p)), ("max_len", ctypes.c_long),
                ("cos", ctypes.c_void_p), ("sin_signed", ctypes.c_void_p),
                ("table_rows", ctypes.c_long), ("scale", ctypes.c_float)]


class FusedForward:
    """Full forwards of one sequence of a quantized model over its ``caches`` (one contiguous
    ``KVCache`` a layer) in one kernel call (module doc).

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
        self.steps = 0  # full forwards run here
        self._keep = (cos, sin_signed, list(layers))
        self._layer_ptrs = (ctypes.c_void_p * n)(*(layer.address for layer in layers))
        self._key_ptrs = (ctypes.c_void_p * n)(*(c.k.data_ptr() for c in self.caches))
        self._value_ptrs = (ctypes.c_void_p * n)(*(c.v.data_ptr() for c in self.caches))
        self.max_len = self.caches[0].max_len
        self.table_rows = cos.shape[0]
        self._desc = _ForwardDesc(
            layers=n, layer=ctypes.cast(self._layer_ptrs, ctypes.POINTER(ctypes.c_void_p)),
            keys=ctypes.cast(self._key_ptrs, ctypes.POINTER(ctypes.c_void_p)),
            values=ctypes.cast(self._value_ptrs, ctypes.POINTER(ctypes.c_void_p)),
            max_len=self.max_len, cos=cos.data_ptr(), sin_signed=sin_signed.data_ptr(),
            table_rows=self.table_rows, scale=scale)
        self._address = ctypes.addressof(self._desc)

    def hidden(self, tokens: list[int], start: int) -> torch.Tensor | None:
        """``h_N [T, H]`` after a full forward of the sequence's ``T`` ``tokens`` from position
        ``start`` (every layer's cache then holds ``start + T`` positions); ``None`` (nothing
        ran) for a token tree or ``T >= SDPA_ROWS``."""
        t = len(tokens)
        if not 0 < t < SDPA_ROWS or any(c.tree is not None for c in self.caches):
            return None
        end = start + t
        if end > self.max_len:
            raise PromptTooLongError(f"position {end} is beyond this KV cache's "
                                     f"{self.max_len} positions")
        if end > self.table_rows:
            raise PromptTooLongError(f"position {end - 1} is beyond the model's "
                                     f"{self.table_rows} RoPE positions")
        h0 = self.embed(torch.tensor(tokens, dtype=torch.long)).to(torch.float32).contiguous()
        out = torch.empty_like(h0)  # [T, H]
        if quant_library().quant_model_forward(self._address, t, start, h0.data_ptr(),
                                               out.data_ptr(), torch.get_num_threads()):
            raise ValueError(f"quant_model_forward: {t} rows from position {start}")
        for cache in self.caches:
            cache.length = end
        self.steps += 1
        return out
