"""An attention adapter at an early exit (Kangaroo-style): an exit head with a KV cache.

A position-wise exit head (``specflow.models.exit_heads.ExitHead``) maps ``h_L`` of one
position to the LM head's input.  An adapter reads every position so far through ONE decoder
layer of the target's shape (attention with RoPE and GQA over its own KV cache, SwiGLU MLP):

    a_p  = DecoderLayer(h_L[0], .., h_L[p])_p            [H]   causal, its own keys/values
    q(t_{p+1}) = softmax( W · RMSNorm_g(a_p) )           W: the target's frozen LM head

``g`` is trained (initialised to the target's final-norm weight); the layer is initialised
from the target's own layer ``L`` (0-based: the first layer the exit skips), so an untrained
adapter computes exactly the target's exit ``L + 1`` with its final norm, and training moves
it from there.  Draft cost per token: ``L + 1`` layers plus the LM head (one layer more than a
position-wise head at exit ``L``).

Inference never runs this module's layer: ``attach_heads`` hands ``native_layer()`` (the
weights as a ``NativeLM`` layer, packed where the model is) to the model, whose sessions run
it through ``NativeLM``'s one decoder-layer function, feeding it ``h_L`` of every position
before layer ``L`` consumes it (``specflow.kv.session``).  ``forward`` is the position-wise
part (``RMSNorm_g``), what ``NativeLM.head`` applies to the adapter's outputs.

Files: the exit-heads file (``save_heads`` / ``load_heads``), ``head_type = "adapter"``, the
layer's shape in the per-exit config: one format for every exit head.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specflow.errors import ConfigError
from specflow.models.decoder_params import copy_from_native, rope_tables, to_native
from specflow.models.native import NativeLM, _Layer, dense


class AdapterHead(nn.Module):
    """The adapter at one exit (module doc): a trainable decoder layer plus ``RMSNorm_g``.

    Args: the layer's shape (the target's): ``hidden_size``, ``num_heads``,
    ``num_kv_heads``, ``head_dim``, ``intermediate_size``, ``eps``, ``qkv_bias``,
    ``rope_theta``; ``head_type`` is always ``"adapter"`` (the exit-heads file's config key).
    """

    head_type = "adapter"

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 intermediate_size: int, eps: float = 1e-6, qkv_bias: bool = False,
                 rope_theta: float = 10000.0, head_type: str = "adapter") -> None:
        super().__init__()
        if head_type != "adapter":
            raise ConfigError(f"AdapterHead got head_type={head_type!r}")
        if num_heads % num_kv_heads:
            raise ConfigError(f"{num_heads} attention heads are not a multiple of "
                              f"{num_kv_heads} KV heads")
        self.hidden_size = hidden_size
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.intermediate_size = intermediate_size
        self.eps = float(eps)
        self.qkv_bias = bool(qkv_bias)
        self.rope_theta = float(rope_theta)
        h, nh, kh, d, i = hidden_size, num_heads, num_kv_heads, head_dim, intermediate_size
        self.ln1 = nn.Parameter(torch.ones(h))
        self.q = nn.Linear(h, nh * d, bias=qkv_bias)
        self.k = nn.Linear(h, kh * d, bias=qkv_bias)
        self.v = nn.Linear(h, kh * d, bias=qkv_bias)
        self.o = nn.Linear(nh * d, h, bias=False)
        self.ln2 = nn.Parameter(torch.ones(h))
        self.gate = nn.Linear(h, i, bias=False)
        self.up = nn.Linear(h, i, bias=False)
        self.down = nn.Linear(i, h, bias=False)
        self.out_norm = nn.Parameter(torch.ones(h))  # g

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_target(cls, lm: NativeLM, exit_layer: int) -> AdapterHead:
        """An adapter at ``exit_layer`` of ``lm`` (1 <= L < N), its layer a copy of ``lm``'s
        layer ``L`` and ``g`` its final norm: untrained, it computes ``lm``'s exit ``L + 1``."""
        depth = lm.info.num_layers
        if not 1 <= exit_layer < depth:
            raise ConfigError(f"an adapter needs an early exit in 1..{depth - 1}, got "
                              f"{exit_layer} ({lm.info.name} has {depth} layers)")
        src = lm.layers[exit_layer]
        nh, kh, d = lm.num_heads, lm.num_kv_heads, lm.head_dim
        w_gate_up = dense(src.w_gate_up).float()
        if src.bo is not None or src.b_gate_up is not None or src.b_down is not None:
            raise ConfigError(f"{lm.info.name}: adapters support q/k/v biases only")
        head = cls(lm.hidden_size, nh, kh, d, w_gate_up.shape[0] // 2, float(lm.eps),
                   src.bqkv is not None, float(lm.rope_theta))
        copy_from_native(head, src, nh, kh, d)
        with torch.no_grad():
            head.out_norm.copy_(lm.final_norm.float())
        return head

    def config(self) -> dict[str, Any]:
        """The constructor arguments (minus weights): the exit-heads file's per-exit config."""
        return {
            "head_type": "adapter", "hidden_size": self.hidden_size,
            "num_heads": self.num_heads, "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "intermediate_size": self.intermediate_size,
            "eps": self.eps, "qkv_bias": self.qkv_bias, "rope_theta": self.rope_theta,
        }

    # ------------------------------------------------------------------ the two parts
    def forward(self, adapted: torch.Tensor) -> torch.Tensor:
        """``a [..., H] -> RMSNorm_g(a)``: the LM head's input (the position-wise part)."""
        return F.rms_norm(adapted, (self.hidden_size,), self.out_norm, self.eps)

    def sequence(self, hidden: torch.Tensor, key_valid: torch.Tensor) -> torch.Tensor:
        """The layer over whole sequences (training path, float32): ``h_L [B, T, H]`` and
        ``key_valid [B, T]`` (False: padding) -> ``a [B, T, H]``; row ``p`` attends to rows
        ``<= p`` (RoPE position = row index: sequences start at position 0)."""
        b, t, h = hidden.shape
        nh, kh, d = self.num_heads, self.num_kv_heads, self.head_dim
        cos, sin = rope_tables(t, d, self.rope_theta, hidden.device)  # [T, D]
        cos, sin = cos[None, :, None], sin[None, :, None]
        x = F.rms_norm(hidden, (h,), self.ln1, self.eps)
        q = self.q(x).view(b, t, nh, d)
        k = self.k(x).view(b, t, kh, d)
        q = q * cos + q.roll(d // 2, -1) * sin
        k = k * cos + k.roll(d // 2, -1) * sin
        v = self.v(x).view(b, t, kh, d)
        pos = torch.arange(t, device=hidden.device)
        mask = (pos[None, :] <= pos[:, None])[None, None] & key_valid[:, None, None, :]
        att = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
            scale=d**-0.5, enable_gqa=nh != kh,
        )  # [B, NH, T, D]
        hidden = hidden + self.o(att.transpose(1, 2).reshape(b, t, nh * d))
        x = F.rms_norm(hidden, (h,), self.ln2, self.eps)
        return hidden + self.down(F.silu(self.gate(x)) * self.up(x))  # [B, T, H]

    # ------------------------------------------------------------------ inference
    def native_layer(self, device: torch.device, dtype: torch.dtype, packed: bool) -> _Layer:
        """The layer's weights as a ``NativeLM`` layer on ``device`` / ``dtype`` (packed when
        asked and oneDNN can)."""
        return to_native(self, device, dtype, packed)
