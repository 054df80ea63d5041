"""Weight-only int8 copies of a model's matrices (``model.quantize=int8``): cheaper drafting.

A decoding step of a small model on a CPU streams every weight once per token, so its time is
the weights' bytes over the memory bandwidth.  Int8 weights are a quarter of fp32's bytes and
half of bf16's; ATen's ``_weight_int8pack_mm`` multiplies them with bfloat16 activations,
vectorised on AVX2 as on AVX-512.  Per output channel ``o`` (symmetric, no zero point):

    s_o = max_i |W_oi| / 127        q_oi = round(W_oi / s_o)  in [-127, 127]
    y_o = s_o * sum_i q_oi * bf16(x_i)   (+ bias, in the model's dtype)

so ``|W_oi - s_o q_oi| <= s_o / 2``.  The outputs differ from the full-precision model's in
the last bits and, rarely, in an argmax: an int8 model is a *draft* model (its tokens are
verified by the target, whose outputs stay exact); the target itself is refused
(``specflow.app``).  Several rows cost more than one (the kernel is a matrix-vector one), so
the model uses the copies only at the row counts where the row probe finds them faster
(``specflow.cpu.row_padding``); a prefill keeps the model's own weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specflow.cpu import rows_kernel

QUANTIZE_CHOICES = ("int8",)
PREFIX_ALIGN = rows_kernel.BLOCK  # a prefix view (``Int8Matrix.prefix``): whole blocks of rows


@dataclass(frozen=True)
class Int8Matrix:
    """An ``[out, in]`` matrix as int8 values and one scale per output row (module doc).

    Attributes:
        q: ``|q| <= 127`` int8: ``[out, in]`` for ATen's kernel, or blocked for the rows
            kernel, ``[ceil(out/8), in, 8]`` (``rows_kernel.block_int8``).
        scale: ``[out]``, > 0 and a bfloat16 value: bfloat16 for ATen's kernel (its activation
            dtype), float32 for the rows kernel.
        dtype: the dtype the model computes in: inputs arrive and outputs leave in it.
        blocked: which layout and kernel (above).
    """

    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype
    blocked: bool = False

    @property
    def shape(self) -> torch.Size:
        """``[out, in]``, as the matrix it stands for."""
        return torch.Size((self.scale.shape[0], self.q.shape[1]))

    def dequantized(self) -> torch.Tensor:
        """``s_o * q_oi`` as a float32 ``[out, in]`` matrix (what the kernel multiplies)."""
        q = self.q
        if self.blocked:  # [B, in, 8] -> [B * 8, in], the padding rows dropped
            q = q.permute(0, 2, 1).reshape(-1, q.shape[1])[: self.scale.shape[0]]
        return q.float() * self.scale.float()[:, None]

    def prefix(self, rows: int) -> Int8Matrix:
        """Its first ``rows`` output rows, a view (no copy) in the same layout: ``rows`` a
        multiple of ``PREFIX_ALIGN`` (a blocked copy holds 8 outputs a block), at most
        ``out``.  Row ``o`` of the product is the same bits as the whole matrix's row ``o``
        (each output is its own sum)."""
        out = self.scale.shape[0]
        if rows % PREFIX_ALIGN or not 0 < rows <= out:
            raise ValueError(f"an int8 prefix needs a multiple of {PREFIX_ALIGN} rows in "
                             f"1..{out}, got {rows}")
        q = self.q[: rows // rows_kernel.BLOCK] if self.blocked else self.q[:rows]
        return Int8Matrix(q, self.scale[:rows], self.dtype, self.blocked)


def quantize_int8(weight: torch.Tensor, blocked: bool = False) -> Int8Matrix:
    """``weight [out, in]`` (any float dtype, dense) -> its per-row symmetric int8 copy, in
    ATen's layout or (``blocked``) the rows kernel's."""
    w = weight.detach().float()  # [out, in]
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=torch.finfo(torch.float32).tiny)  # [out]
    scale = scale.to(torch.bfloat16)  # the kernel's dtype; quantize against the rounded one
    q = torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)  # [out, in]
    if blocked:
        return Int8Matrix(rows_kernel.block_int8(q), scale.float().contiguous(), weight.dtype,
                          blocked=True)
    return Int8Matrix(q.contiguous(), scale.contiguous(), weight.dtype)


def int8_linear(x: torch.Tensor, weight: Int8Matrix, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [N, in] -> x @ (s * q).T + bias`` ``[N, out]`` in ``x``'s dtype, the product taken
    with bfloat16 activations by ATen's kernel, float32 ones by the rows kernel (module doc)."""
    if weight.blocked:
        b = None if bias is None else bias.float().contiguous()
        y = rows_kernel.rows_linear_i8(x, weight.q, weight.scale, b, weight.shape[0])
        return y.to(x.dtype)  # [N, out]
    y = torch._weight_int8pack_mm(x.to(torch.bfloat16).contiguous(), weight.q, weight.scale)
    y = y.to(x.dtype)  # [N, out]
    return y if bias is None else y + bias
