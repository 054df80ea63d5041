"""A trainable decoder layer's weights to and from ``NativeLM``'s layer format.

The feature head and the attention adapter each train one decoder layer of the target's
shape, held as ``nn.Module`` attributes ``ln1, q, k, v, o, ln2, gate, up, down`` (float32,
``q/k/v`` with biases where the target has them).  ``copy_from_native`` initialises them
from a target layer; ``to_native`` gives them back as a ``_Layer`` the model's one
decoder-layer function runs (fused q/k/v and gate/up, packed where oneDNN can).
"""

from __future__ import annotations

import torch
from torch import nn

from specflow.models.native import _Layer, dense, pack, packing_available, rope_inv_freq


def copy_from_native(module: nn.Module, src: _Layer, num_heads: int, num_kv_heads: int,
                     head_dim: int) -> None:
    """Set ``module``'s layer parameters to the target layer ``src``'s weights."""
    nh, kh, d = num_heads, num_kv_heads, head_dim
    with torch.no_grad():
        q, k, v = dense(src.wqkv).float().split([nh * d, kh * d, kh * d])
        module.q.weight.copy_(q)
        module.k.weight.copy_(k)
        module.v.weight.copy_(v)
        if src.bqkv is not None:
            bq, bk, bv = src.bqkv.float().split([nh * d, kh * d, kh * d])
            module.q.bias.copy_(bq)
            module.k.bias.copy_(bk)
            module.v.bias.copy_(bv)
        module.o.weight.copy_(dense(src.wo).float())
        gate, up = dense(src.w_gate_up).float().chunk(2)
        module.gate.weight.copy_(gate)
        module.up.weight.copy_(up)
        module.down.weight.copy_(dense(src.w_down).float())
        module.ln1.copy_(src.ln1.float())
        module.ln2.copy_(src.ln2.float())


def place_matrix(t: torch.Tensor, device: torch.device, dtype: torch.dtype,
                 packed: bool) -> torch.Tensor:
    """A weight matrix for inference: detached, on ``device`` / ``dtype``, contiguous, and
    oneDNN-packed when ``packed`` (the caller checked ``packing_available``)."""
    t = t.detach().to(device=device, dtype=dtype).contiguous()
    return pack(t) if packed else t


def place_vector(t: torch.Tensor | None, device: torch.device, dtype: torch.dtype
                 ) -> torch.Tensor | None:
    """A bias or norm weight for inference (``None`` stays ``None``)."""
    return None if t is None else t.detach().to(device=device, dtype=dtype)


def to_native(module: nn.Module, device: torch.device, dtype: torch.dtype,
              packed: bool) -> _Layer:
    """``module``'s layer parameters as a ``_Layer`` on ``device`` / ``dtype`` (matrices
    packed when ``packed`` and oneDNN can)."""
    packed = packed and packing_available(device, dtype)

    def w(t: torch.Tensor) -> torch.Tensor:
        return place_matrix(t, device, dtype, packed)

    def b(t: torch.Tensor | None) -> torch.Tensor | None:
        return place_vector(t, device, dtype)

    with torch.no_grad():
        bqkv = None
        if module.q.bias is not None:
            bqkv = b(torch.cat([module.q.bias, module.k.bias, module.v.bias]))
        return _Layer(
            ln1=b(module.ln1), wqkv=w(torch.cat([module.q.weight, module.k.weight,
                                                 module.v.weight])),
            bqkv=bqkv, wo=w(module.o.weight), bo=None, ln2=b(module.ln2),
            w_gate_up=w(torch.cat([module.gate.weight, module.up.weight])), b_gate_up=None,
            w_down=w(module.down.weight), b_down=None,
        )


def rope_tables(length: int, head_dim: int, theta: float, device: torch.device,
                scaling: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin_signed [T, D]`` (float32) exactly as ``NativeLM`` builds them:
    ``rope(x) = x * cos + roll(x, D/2) * sin_signed`` (``scaling``: ``rope_inv_freq``'s)."""
    inv = rope_inv_freq(head_dim, theta, scaling).to(device)
    ang = torch.arange(length, device=device).float()[:, None] * inv
    emb = torch.cat([ang, ang], dim=-1)
    sign = torch.cat([-torch.ones(head_dim // 2), torch.ones(head_dim // 2)]).to(device)
    return emb.cos(), emb.sin() * sign
