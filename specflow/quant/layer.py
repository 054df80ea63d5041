"""A quantized decoder layer's work around its attention, in two kernel calls.

``kernels/layer_rows.cpp`` (its header has the math) runs what a Llama/Qwen2 layer of
``specflow.models.native`` does before attending (RMS norm, the q/k/v product and bias,
RoPE) and after (the output product, the residual, RMS norm, the gate/up product, SiLU, the
down product, the residual) for ``T`` rows of a model whose matrices are all GGUF blocks:
about 15 torch operators a layer become two calls, and a row's bits do not depend on the
rows beside it.  The attention between them stays the backend's (``specflow.kv``).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from specflow.quant.matrix import QuantMatrix, quant_library

MAX_PARTS = 4  # parts a matrix may have (a fused q/k/v has 3)


class _MatrixDesc(ctypes.Structure):
    _fields_ = [("parts", ctypes.c_int), ("type", ctypes.c_int * MAX_PARTS),
                ("blocks", ctypes.c_void_p * MAX_PARTS), ("rows", ctypes.c_long * MAX_PARTS),
                ("cols", ctypes.c_long), ("bias", ctypes.c_void_p)]


class _LayerDesc(ctypes.Structure):
    _fields_ = [("hidden", ctypes.c_long), ("heads", ctypes.c_long),
                ("kv_heads", ctypes.c_long), ("head_dim", ctypes.c_long),
                ("inner", ctypes.c_long), ("eps", ctypes.c_float),
                ("ln1", ctypes.c_void_p), ("ln2", ctypes.c_void_p),
                ("wqkv", _MatrixDesc), ("wo", _MatrixDesc), ("w_gate_up", _MatrixDesc),
                ("w_down", _MatrixDesc)]


@dataclass(frozen=True)
class LayerShape:
    """A layer's sizes: ``hidden`` H, ``heads`` NH, ``kv_heads`` KH, ``head_dim`` D, the MLP's
    ``inner`` I, and the RMS norms' ``eps``."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inner: int
    eps: float


def runs_quantized(*matrices: object) -> bool:
    """Whether every matrix is GGUF blocks the kernel multiplies, in at most ``MAX_PARTS``
    parts (a float part, F32 or F16, is multiplied by torch: not this path)."""
    return all(isinstance(m, QuantMatrix) and len(m.parts) <= MAX_PARTS
               and all(p.quantized for p in m.parts) for m in matrices)


def _float_vector(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().to(torch.float32).contiguous()


class QuantLayer:
    """One layer's weights as the kernel takes them (``runs_quantized`` of its four
    matrices first); the tensors it points at are kept alive here."""

    def __init__(self, shape: LayerShape, ln1: torch.Tensor, ln2: torch.Tensor,
                 matrices: dict[str, tuple[QuantMatrix, torch.Tensor | None]]) -> None:
        self.shape = shape
        self._keep: list[torch.Tensor] = []
        desc = _LayerDesc(hidden=shape.hidden, heads=shape.heads, kv_heads=shape.kv_heads,
                          head_dim=shape.head_dim, inner=shape.inner, eps=shape.eps,
                          ln1=self._pointer(_float_vector(ln1)),
                          ln2=self._pointer(_float_vector(ln2)))
        for name in ("wqkv", "wo", "w_gate_up", "w_down"):
            matrix, bias = matrices[name]
            m = getattr(desc, name)
            m.parts = len(matrix.parts)
            for i, part in enumerate(matrix.parts):
                m.type[i] = part.ggml_type
                m.blocks[i] = self._pointer(part.blocks)
                m.rows[i] = part.rows
            m.cols = matrix.shape[1]
            m.bias = self._pointer(_float_vector(bias))
        self._desc = desc
        self._address = ctypes.addressof(desc)

    @property
    def address(self) -> int:
        """The address of the kernel's layer description (valid while this object lives)."""
        return self._address

    def _pointer(self, t: torch.Tensor | None) -> int | None:
        if t is None:
            return None
        self._keep.append(t)
        return t.data_ptr()

    def before_attention(self, hidden: torch.Tensor, cos: torch.Tensor,
                         sin_signed: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``hidden [T, H]`` -> ``qkv [T, (NH + 2 KH) D]``: q and k rotated at ``positions
        [T]`` (int64, rows of the ``cos, sin_signed [P, D]`` tables), v as projected."""
        s = self.shape
        t = hidden.shape[0]
        hidden = hidden.contiguous()
        qkv = torch.empty(t, (s.heads + 2 * s.kv_heads) * s.head_dim, dtype=torch.float32)
        if quant_library().quant_layer_before_attention(
                self._address, t, hidden.data_ptr(), cos.data_ptr(), sin_signed.data_ptr(),
                positions.data_ptr(), qkv.data_ptr(), torch.get_num_threads()):
            raise ValueError(f"quant_layer_before_attention: hidden {tuple(hidden.shape)}")
        return qkv

    def after_attention(self, hidden: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """``hidden [T, H]`` and its rows' attention ``[T, NH D]`` -> the layer's output
        ``[T, H]``."""
        hidden = hidden.contiguous()
        attended = attended.contiguous()
        out = torch.empty_like(hidden)  # [T, H]
        if quant_library().quant_layer_after_attention(
                self._address, hidden.shape[0], hidden.data_ptr(), attended.data_ptr(),
                out.data_ptr(), torch.get_num_threads()):
            raise ValueError(f"quant_layer_after_attention: hidden {tuple(hidden.shape)}, "
                             f"attention {tuple(attended.shape)}")
        return out
