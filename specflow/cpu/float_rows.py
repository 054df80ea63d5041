"""A float32 model's own matrices for the float rows kernel: no copy, no new layout.

A packed fp32 model (``specflow.models.native``) multiplies oneDNN-packed copies of its
matrices; the HF model keeps its own row-major tensors beside them.  The float rows kernel
(``specflow.cpu.rows_kernel.rows_linear_f32``) multiplies a few rows by those very
tensors, faster than oneDNN's packed kernels at 1 to about 6 rows on the CPUs measured
(``docs/performance.md``), so a model's decoding steps and short verification passes run on
them at the row counts where the row probe finds them faster (``row_padding``), and every
other pass (a prefill, a long tree) on the packed copies.  A fused matrix (q/k/v, gate/up)
is its parts stacked along the outputs, each part written into its own columns:

    W = [W_1; W_2; ...]  [sum n_i, K]      y[:, c_i : c_i + n_i] = x @ W_i.T + b[c_i : ...]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specflow.cpu import rows_kernel


@dataclass(frozen=True)
class StackedRows:
    """An ``[out, in]`` float32 matrix as row-major parts stacked along ``out``.

    Attributes:
        parts: ``[n_i, in]`` contiguous float32 tensors (the HF model's own weights: shared,
            never copied), at least one, all of one ``in``.
    """

    parts: tuple[torch.Tensor, ...]

    def __post_init__(self) -> None:
        if not stackable(*self.parts):
            raise ValueError(f"StackedRows parts must be contiguous float32 CPU [n, in] "
                             f"matrices of one width, at least one, got "
                             f"{[(tuple(w.shape), w.dtype, str(w.device)) for w in self.parts]}")

    @property
    def shape(self) -> torch.Size:
        """``[out, in]``, as the matrix it stands for."""
        return torch.Size((sum(w.shape[0] for w in self.parts), self.parts[0].shape[1]))

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    def dense(self) -> torch.Tensor:
        """The stacked matrix as one ``[out, in]`` tensor (a copy)."""
        return torch.cat(self.parts)


def stackable(*weights: torch.Tensor) -> bool:
    """Whether ``weights`` can be a ``StackedRows`` as they are (no copy): 2-D, contiguous,
    float32, on the CPU, one input width."""
    return bool(weights) and all(
        w.dim() == 2 and w.dtype == torch.float32 and w.is_contiguous()
        and w.device.type == "cpu" and w.shape[1] == weights[0].shape[1] for w in weights)


def stacked_linear(x: torch.Tensor, weight: StackedRows, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [T, in] -> x @ W.T + bias`` ``[T, out]`` in ``x``'s dtype, by the float rows kernel."""
    b = None if bias is None else bias.to(torch.float32).contiguous()
    return rows_kernel.rows_linear_f32(x, weight.parts, b).to(x.dtype)
