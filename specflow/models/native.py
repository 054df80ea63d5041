"""A native ``LayeredLM`` for the Llama/Qwen2 family, fast at batch 1 on CPU.

Covers ``LlamaForCausalLM`` (SmolLM2, TinyLlama, Llama 2/3, and Llama 3.1/3.2 with their
``llama3`` RoPE scaling: ``rope_inv_freq``) and ``Qwen2ForCausalLM`` (Qwen2/2.5: q/k/v biases,
often tied embeddings) with full attention in every layer; ``supports(config)`` says why
anything else is refused.

The weights are the HF model's own tensors (shared, same dtype); only the fused q/k/v and
gate/up matrices are new (one matmul instead of three/two per layer, measured faster at
batch 1).  On a CPU whose oneDNN runs the model's dtype (fp32 anywhere; bf16 only with AVX-512
or avx_ne_convert: ``specflow.cpu.probe_cpu``), the matrices are instead *packed*: copied once
into oneDNN's blocked layout and multiplied by ``mkldnn._linear_pointwise``.  Measured on the
2-core AVX2 box (Qwen2.5-1.5B shapes, 28 layers streamed, ms per matmul): the gate/up matrix
at 1 row 4.99 -> 3.82, at 5 rows 9.22 -> 3.34; the LM head at 5 rows 87 -> 35.  MKL's
small-M sgemm is far from the memory bound there, so verifying k+1 tokens cost 1.6-2x a
decoding step; packed it costs about one step (bf16 packed: 2.3 ms at 1 and at 4 rows).
The HF model keeps its own untouched tensors (the packed copy is extra memory: about the
size of the layers plus the LM head).

Per layer and block of ``T`` positions ``[s, s+T)``:

    x = h + o_proj(attn(rope(q), rope(k), v))      keys/values of [0, s+T) from the cache
    h' = x + down(silu(gate(rms(x))) * up(rms(x)))

Attention is causal *lower-right aligned*: query ``s+i`` sees keys ``<= s+i``.

A model whose matrices are all GGUF blocks (``specflow.models.gguf_native``) runs the same
layer through ``specflow.quant.layer``: everything before the attention (norm, q/k/v, bias,
RoPE) in one kernel call, everything after it (o_proj, residual, norm, gate/up, SiLU, down,
residual) in another, each row's bits independent of the rows beside it; its cache attends
with the row-exact kernel (``specflow.quant.attention``).
"""

from __future__ import annotations

import copy
import logging
import math
from dataclasses import dataclass, fields, replace

import torch
import torch.nn.functional as F
from torch import nn

from specflow.cpu import detect as cpu
from specflow.cpu import rows_kernel
from specflow.cpu.float_rows import StackedRows, stackable, stacked_linear
from specflow.cpu.int8_weights import Int8Matrix, int8_linear, quantize_int8
from specflow.errors import ConfigError, PromptTooLongError
from specflow.kv.base import AttendedKV, FusedLayers, KVSpec, LayerBatch, ModelInfo
from specflow.quant.layer import LayerShape, QuantLayer, runs_quantized
from specflow.quant.matrix import QuantMatrix, quant_linear

log = logging.getLogger("specflow")

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")


LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor",
                    "original_max_position_embeddings")


def _rope_params(cfg) -> dict:
    """``{"rope_type": ..., "rope_theta": ..., <the type's parameters>}`` from a transformers
    v5 (``rope_parameters``) or v4-style (``rope_scaling``, ``rope_theta``) config."""
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    scaling = getattr(cfg, "rope_scaling", None)
    if scaling:
        for key, value in scaling.items():
            params.setdefault(key, value)
        if "rope_type" not in params and "type" in scaling:
            params["rope_type"] = scaling["type"]
    params.setdefault("rope_type", "default")
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(cfg, "rope_theta", 10000.0)
    return params


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """RoPE's inverse frequencies ``[D/2]`` (float32): ``theta^(-2i/D)``, and with
    ``scaling`` of type ``llama3`` (Llama 3.1/3.2) rescaled by wavelength ``l = 2 pi / f``
    against the original context ``C`` (factors ``s``, ``a = low_freq_factor``,
    ``b = high_freq_factor``):

        l > C / a          f / s                               (long waves: slowed)
        l < C / b          f                                   (short waves: kept)
        otherwise          (1 - m) f / s + m f,   m = (C / l - a) / (b - a)   (blended)
    """
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling or scaling.get("rope_type", "default") == "default":
        return inv
    if scaling["rope_type"] != "llama3":
        raise ConfigError(f"rope_type {scaling['rope_type']!r} is not supported (default, llama3)")
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    context = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > context / low, inv / factor, inv)
    mix = (context / wavelen - low) / (high - low)
    blended = (1 - mix) * scaled / factor + mix * scaled
    medium = (wavelen >= context / high) & (wavelen <= context / low)
    return torch.where(medium, blended, scaled)


def supports(hf_config) -> tuple[bool, str]:
    """Whether ``NativeLM`` computes exactly what HF computes for this config, and if not why."""
    mt = getattr(hf_config, "model_type", None)
    if mt not in SUPPORTED_MODEL_TYPES:
        return False, f"model_type {mt!r} is not one of {SUPPORTED_MODEL_TYPES}"
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        return False, f"hidden_act {act!r} is not 'silu'"
    rope = _rope_params(hf_config)
    if rope["rope_type"] not in (None, "default", "llama3"):
        return False, (f"rope_type {rope['rope_type']!r} is not supported (only default and "
                       "llama3 RoPE)")
    if rope["rope_type"] == "llama3":
        missing = [k for k in LLAMA3_ROPE_KEYS if k not in rope]
        if missing:
            return False, f"llama3 RoPE without {missing}"
        if float(rope.get("attention_factor") or 1.0) != 1.0:
            return False, "llama3 RoPE with an attention_factor other than 1"
    if isinstance(rope.get("partial_rotary_factor"), float) and rope["partial_rotary_factor"] != 1:
        return False, "partial rotary embeddings are not supported"
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None:
        other = sorted({t for t in layer_types if t != "full_attention"})
        if other:
            return False, f"layer types {other} are not supported (only full attention)"
    elif getattr(hf_config, "use_sliding_window", False):
        return False, "sliding-window attention is not supported"
    heads, kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads
    if heads % kv_heads:
        return False, f"{heads} attention heads are not a multiple of {kv_heads} KV heads"
    return True, ""


# a dense or packed tensor, an int8 copy, a float32 model's own parts (float rows kernel), or
# GGUF blocks as published (the quantized rows kernel: specflow.quant)
Matrix = torch.Tensor | Int8Matrix | StackedRows | QuantMatrix
MATRICES = ("wqkv", "wo", "w_gate_up", "w_down")  # the _Layer fields that are matrices


@dataclass
class _Layer:
    """One decoder layer's weights (views of the HF tensors, except the fused matrices)."""

    ln1: torch.Tensor  # [H]
    wqkv: Matrix  # [(NH + 2*KH) * D, H]
    bqkv: torch.Tensor | None  # [(NH + 2*KH) * D]
    wo: Matrix  # [H, NH * D]
    bo: torch.Tensor | None  # [H]
    ln2: torch.Tensor  # [H]
    w_gate_up: Matrix  # [2 * I, H]
    b_gate_up: torch.Tensor | None  # [2 * I]
    w_down: Matrix  # [H, I]
    b_down: torch.Tensor | None  # [H]


def packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN can pack and multiply ``dtype`` weights on ``device``: a CPU whose
    probe (``specflow.cpu.probe_cpu``) says so -- float32 wherever oneDNN is usable,
    bfloat16 only where oneDNN runs bf16 (AVX-512 or avx_ne_convert; not on AVX2-only)."""
    return device.type == "cpu" and cpu.probe_cpu().can_pack(dtype)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``[out, in]`` -> the same matrix as an opaque oneDNN-blocked tensor for ``linear``."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)


def dense(weight: torch.Tensor) -> torch.Tensor:
    """A packed weight back as an ordinary ``[out, in]`` tensor (others unchanged)."""
    return weight.to_dense() if weight.is_mkldnn else weight


def linear(x: torch.Tensor, weight: Matrix, bias: torch.Tensor | None,
           min_rows: int = 1) -> torch.Tensor:
    """``x [N, in] @ weight.T + bias`` -> ``[N, out]``, with oneDNN when ``weight`` is packed,
    with the int8 kernel when it is an ``Int8Matrix`` (``specflow.cpu.int8_weights``), with
    the float rows kernel when it is a ``StackedRows`` (``specflow.cpu.float_rows``), with the
    quantized rows kernel when it is a ``QuantMatrix`` (``specflow.quant.matrix``).

    ``min_rows``: a packed multiply of fewer rows runs on ``min_rows`` rows (zero rows
    appended, their outputs dropped).  Each output row depends only on its own input row, so
    the real rows are unchanged up to the kernel's float rounding; it pays where oneDNN's
    kernels stream the weights faster at a few rows than at one
    (``specflow.cpu.row_padding``).
    """
    if isinstance(weight, QuantMatrix):
        return quant_linear(x, weight, bias)
    if isinstance(weight, Int8Matrix):
        return int8_linear(x, weight, bias)
    if isinstance(weight, StackedRows):
        return stacked_linear(x, weight, bias)
    if weight.is_mkldnn:
        n = x.shape[0]
        if n < min_rows:
            x = F.pad(x, (0, 0, 0, min_rows - n))  # [min_rows, in]
            return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")[:n]
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def _bias(module: nn.Linear) -> torch.Tensor | None:
    return None if module.bias is None else module.bias.detach()


def _cat_bias(*linears: nn.Linear) -> torch.Tensor | None:
    """The concatenated biases, zeros standing in for a missing one; None if all are missing."""
    if all(lin.bias is None for lin in linears):
        return None
    parts = [
        _bias(lin) if lin.bias is not None else lin.weight.new_zeros(lin.weight.shape[0])
        for lin in linears
    ]
    return torch.cat(parts).detach()


def _adopt(*modules: nn.Module) -> torch.Tensor:
    """Re-lay the modules' ``[out_i, in]`` weights as one row-major ``[in, sum(out_i)]`` matrix.

    Each module's ``weight`` is re-pointed at its column block of that matrix (a transposed
    view), so the HF model and ``NativeLM`` share one copy and compute exactly as before.
    Returns the ``[sum(out_i), in]`` transposed view, ready for ``F.linear``: with MKL this
    layout is 1.5-2x faster than row-major ``[out, in]`` for blocks of 4-8 rows.
    """
    wt = torch.cat([m.weight.detach().t() for m in modules], dim=1).contiguous()  # [in, out]
    col = 0
    for m in modules:
        n = m.weight.shape[0]
        m.weight.data = wt[:, col : col + n].t()  # [n, in] view
        col += n
    return wt.t()  # [out, in] view


class NativeLM:
    """Llama/Qwen2 as a ``LayeredLM`` (see module doc).

    Attributes:
        info: the model's ``ModelInfo``.
        exit_heads: exit layer ``L`` -> module applied to ``h_L`` instead of the final norm
            before the shared LM head (``lm_head(exit_heads[L](h))``).  Empty by default.

    ``embed``/``run_layer`` run under ``torch.inference_mode`` (measured ~15% faster than
    ``no_grad`` on tiny models): hidden states are inference tensors, so they cannot be edited
    in place or saved for autograd (train exit heads on ``.clone()``-d copies).  ``head``
    runs under ``no_grad`` and returns ordinary tensors.
    """

    def __init__(
        self,
        info: ModelInfo,
        *,
        embed_weight: torch.Tensor,
        layers: list[_Layer],
        final_norm: torch.Tensor,
        lm_head: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rms_eps: float,
        rope_theta: float,
        max_positions: int,
        head_weight: torch.Tensor | None = None,
        rope_scaling: dict | None = None,
    ) -> None:
        if len(layers) != info.num_layers:
            raise ConfigError(f"{info.name}: {len(layers)} layers but info says {info.num_layers}")
        self.info = info
        self.embed_weight = embed_weight  # [V, H]
        self.layers = layers
        self.final_norm = final_norm  # [H]
        self.lm_head = lm_head  # [V, H], dense (vocabulary subsets, exit-head training)
        # What ``head`` multiplies: ``lm_head`` itself, or its packed copy.
        self.head_weight = lm_head if head_weight is None else head_weight  # [V, H]
        first = layers[0].wqkv if layers else None
        self.packed = isinstance(first, torch.Tensor) and first.is_mkldnn
        # GGUF blocks as published (``specflow.models.gguf_native``): one kernel at every row
        # count, so none of the row-count choices below applies.
        self.quantized = isinstance(first, QuantMatrix)
        # id(layer weights) -> (those weights, their QuantLayer or None): the layer kernel of
        # a quantized model's layers and adapters, made on first use (``_quant_layer``).
        self._quant_layers: dict[int, tuple[_Layer, QuantLayer | None]] = {}
        # Packed multiplies of fewer rows run on this many (``linear``; model.min_rows,
        # ``specflow.cpu.row_padding``): 1 = as given.
        self.min_rows = 1
        self.row_probe: object | None = None  # row_padding.RowProbe, once probed
        # row_padding.WholePassCheck: the whole-pass timing that kept or dropped the float
        # rows kernel, once run
        self.whole_pass_check: object | None = None
        # Row counts whose passes multiply dense copies of the packed matrices
        # (``set_dense_rows``; ``row_padding.use_dense_rows``), and those copies.
        self.dense_rows: frozenset[int] = frozenset()
        self.dense_layers: list[_Layer] = []
        # Int8 copies of the matrices and the LM head (``make_int8_copies``, model.quantize)
        # and the row counts whose passes multiply them (``set_int8_rows``).
        self.int8_layers: list[_Layer] = []
        self.int8_head: Int8Matrix | None = None
        self.int8_rows: frozenset[int] = frozenset()
        # A packed fp32 model's own (HF) row-major matrices as the float rows kernel takes
        # them (``float_rows_layers``, ``float_rows_head``: shared, no copy; empty where the
        # kernel or the model cannot) and the row counts whose passes multiply them
        # (``set_float_rows``; ``row_padding.use_float_rows``).
        self.float_rows_layers: list[_Layer] = []
        self.float_rows_head: StackedRows | None = None
        self.float_rows: frozenset[int] = frozenset()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.eps = rms_eps
        self.rope_theta = rope_theta
        # None: default RoPE; else its parameters (llama3: ``rope_inv_freq``).  Heads with a
        # RoPE of their own reuse the target's tables only where this is None.
        self.rope_scaling = rope_scaling
        self.scale = head_dim**-0.5
        self.hidden_size = embed_weight.shape[1]
        self.dtype = embed_weight.dtype
        self.device = embed_weight.device
        self.exit_heads: dict[int, nn.Module] = {}
        self.exit_heads_path: str | None = None  # the file the attached heads came from
        # Exit L -> the decoder layer of the attention adapter there (its sessions feed it
        # h_L of every position: ``exit_adapter``); its position-wise part is exit_heads[L].
        self.exit_adapters: dict[int, _Layer] = {}
        self._placed: dict[tuple[str, torch.dtype], NativeLM] = {}  # see ``to``
        # RoPE tables exactly as HF's rope: fp32 angles, cast to the model dtype.
        inv_freq = rope_inv_freq(head_dim, rope_theta, rope_scaling).to(self.device)
        angles = torch.arange(max_positions, device=self.device).float()[:, None] * inv_freq
        emb = torch.cat([angles, angles], dim=-1)  # [P, D]
        half = head_dim // 2
        sign = torch.cat([-torch.ones(half), torch.ones(half)]).to(self.device)
        self.cos = emb.cos().to(self.dtype)  # [P, D]
        # rotate_half(x) * sin == roll(x, D/2) * (sign * sin): fold the sign into the table.
        self.sin_signed = (emb.sin().to(self.dtype) * sign.to(self.dtype)).contiguous()  # [P, D]

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_hf(cls, hf_model: nn.Module, info: ModelInfo, packed: bool | None = None) -> NativeLM:
        """Wrap an in-memory HF Llama/Qwen2 causal LM.

        ``packed``: multiply with oneDNN-packed copies of the matrices (module doc); ``None``
        packs when ``packing_available`` for the model's device and dtype.  Unpacked, the
        weights are the HF tensors themselves, re-laid in place (``_adopt``).
        """
        cfg = hf_model.config
        ok, why = supports(cfg)
        if not ok:
            raise ConfigError(f"{info.name}: NativeLM does not support this model: {why}")
        base = hf_model.model
        embed_w = base.embed_tokens.weight
        device, dtype = embed_w.device, embed_w.dtype
        if packed is None:
            packed = packing_available(device, dtype)
            if not packed and device.type == "cpu":
                log.info("%s: unpacked weights (%s)", info.name,
                         cpu.probe_cpu().why_not_pack(dtype))
        elif packed and not packing_available(device, dtype):
            why = (cpu.probe_cpu().why_not_pack(dtype) if device.type == "cpu"
                   else f"the weights are on {device.type}, not a CPU")
            raise ConfigError(
                f"{info.name}: packed_weights=true with {str(dtype).removeprefix('torch.')}: "
                f"{why}; set packed_weights=null or false"
            )

        def fused(*modules: nn.Module) -> torch.Tensor:  # [sum(out_i), in]
            if packed:
                return pack(torch.cat([m.weight.detach() for m in modules]))
            return _adopt(*modules)

        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        layers = []
        with torch.no_grad():
            for blk in base.layers:
                att, mlp = blk.self_attn, blk.mlp
                layers.append(
                    _Layer(
                        ln1=blk.input_layernorm.weight.detach(),
                        wqkv=fused(att.q_proj, att.k_proj, att.v_proj),
                        bqkv=_cat_bias(att.q_proj, att.k_proj, att.v_proj),
                        wo=fused(att.o_proj),
                        bo=_bias(att.o_proj),
                        ln2=blk.post_attention_layernorm.weight.detach(),
                        w_gate_up=fused(mlp.gate_proj, mlp.up_proj),
                        b_gate_up=_cat_bias(mlp.gate_proj, mlp.up_proj),
                        w_down=fused(mlp.down_proj),
                        b_down=_bias(mlp.down_proj),
                    )
                )
            tied = hf_model.lm_head.weight is embed_w
            if packed:
                embed = embed_w.detach()  # [V, H]
                lm_head = embed if tied else hf_model.lm_head.weight.detach()
                head_weight = pack(lm_head)
            else:
                embed = _adopt(base.embed_tokens)  # [V, H]
                lm_head = embed_w.detach() if tied else _adopt(hf_model.lm_head)
                head_weight = None
        lm = cls(
            info,
            embed_weight=embed,
            layers=layers,
            final_norm=base.norm.weight.detach(),
            lm_head=lm_head,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=head_dim,
            rms_eps=cfg.rms_norm_eps,
            rope_theta=_rope_params(cfg)["rope_theta"],
            max_positions=cfg.max_position_embeddings,
            head_weight=head_weight,
            rope_scaling=rope if (rope := _rope_params(cfg))["rope_type"] == "llama3" else None,
        )
        if packed:
            lm._adopt_float_rows(hf_model)
        return lm

    def _adopt_float_rows(self, hf_model: nn.Module) -> None:
        """Keep the HF model's own row-major fp32 matrices for the float rows kernel
        (``float_rows_layers``, ``float_rows_head``; views, no copy) where the kernel runs on
        this CPU and every matrix is a contiguous float32 CPU tensor; else leave them empty."""
        if self.dtype != torch.float32:
            return
        status = rows_kernel.kernel_status()
        if not status.available:
            log.info("%s: oneDNN's packed matmuls at every row count (the float rows kernel: "
                     "%s)", self.info.name, status.why)
            return
        base = hf_model.model

        def stacked(*modules: nn.Module) -> StackedRows | None:
            parts = tuple(m.weight.detach() for m in modules)
            return StackedRows(parts) if stackable(*parts) else None

        layers = []
        for blk, own in zip(base.layers, self.layers, strict=True):
            att, mlp = blk.self_attn, blk.mlp
            matrices = {"wqkv": stacked(att.q_proj, att.k_proj, att.v_proj),
                        "wo": stacked(att.o_proj),
                        "w_gate_up": stacked(mlp.gate_proj, mlp.up_proj),
                        "w_down": stacked(mlp.down_proj)}
            if any(m is None for m in matrices.values()):
                return
            layers.append(replace(own, **matrices))
        if not stackable(self.lm_head):
            return
        self.float_rows_layers = layers
        self.float_rows_head = StackedRows((self.lm_head,))

    def set_float_rows(self, rows: frozenset[int]) -> None:
        """Run passes of ``rows`` rows on the float rows kernel (``float_rows_layers``);
        ``int8_rows`` take precedence, these over ``dense_rows``."""
        if rows and not self.float_rows_layers:
            raise ValueError(f"{self.info.name}: float rows {sorted(rows)} without the model's "
                             f"own fp32 matrices (a packed fp32 model where the kernel runs)")
        self.float_rows = frozenset(rows)

    # ------------------------------------------------------------------ LayeredLM
    @property
    def kv(self) -> KVSpec:
        """Keys/values per layer: ``num_kv_heads x head_dim`` in this model's dtype/device."""
        return KVSpec(self.info.num_layers, self.num_kv_heads, self.head_dim, self.dtype,
                      self.device, row_exact=self.quantized)

    def set_exit_heads(self, heads: dict[int, nn.Module], path: str | None = None,
                       adapters: dict[int, _Layer] | None = None) -> None:
        """Replace the exit heads (already on this model's device/dtype) and the layers of
        the attention adapters among them (``adapters``: exit -> layer, each exit also in
        ``heads``); copies of this model on other devices are dropped, so the next ``to``
        carries the new heads."""
        adapters = dict(adapters or {})
        stray = sorted(set(adapters) - set(heads))
        if stray:
            raise ConfigError(f"adapter layers at exits {stray} have no exit head")
        self.exit_heads = heads
        self.exit_heads_path = path
        self.exit_adapters = adapters
        self._placed.clear()

    def fused_layers(self) -> FusedLayers | None:
        """Its layers for a full forward of a few rows in one kernel call (``LayeredLM``
        doc; ``specflow.kv.fused``): a GGUF-quantized model whose every layer runs the layer
        kernel; ``None`` otherwise.  Such a model keeps no int8, float-rows or dense copies
        (its settings refuse them), so every pass runs these layers."""
        if not self.quantized or self.int8_rows or self.float_rows or self.dense_rows:
            return None
        kernels = [self._quant_layer(w) for w in self.layers]
        if any(k is None for k in kernels):
            return None
        return FusedLayers(tuple(k.address for k in kernels if k is not None), self.embed,
                           self.cos, self.sin_signed, self.scale, kernels)

    def exit_adapter(self, exit_layer: int) -> LayerAdapter | None:
        """The attention adapter at ``exit_layer``, or ``None`` (``LayeredLM`` doc)."""
        layer = self.exit_adapters.get(exit_layer)
        return None if layer is None else LayerAdapter(self, layer)

    def to(self, device: torch.device | str, dtype: torch.dtype) -> NativeLM:
        """This model's weights on ``device`` / ``dtype`` (``self`` when nothing changes;
        one copy per placement, memoised)."""
        device = torch.device(device)
        if device.type == self.device.type and dtype == self.dtype:
            return self
        if self.quantized:
            raise ConfigError(f"{self.info.name}: GGUF-quantized weights run on the CPU in "
                              f"float32 only, not {device.type}/{dtype}; use model.weights=float")
        key = (str(device), dtype)
        moved = self._placed.get(key)
        if moved is not None:
            return moved

        repack = self.packed and packing_available(device, dtype)

        def mv(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else dense(t).to(device=device, dtype=dtype).contiguous()

        def mv_matrix(t: torch.Tensor | None) -> torch.Tensor | None:
            moved = mv(t)
            return pack(moved) if repack and moved is not None and moved.dim() == 2 else moved

        with torch.no_grad():
            layers = [
                _Layer(**{f.name: mv_matrix(getattr(w, f.name)) for f in fields(_Layer)})
                for w in self.layers
            ]
            lm_head = mv(self.lm_head)
            moved = NativeLM(
                self.info,
                embed_weight=mv(self.embed_weight),
                layers=layers,
                final_norm=mv(self.final_norm),
                lm_head=lm_head,
                num_heads=self.num_heads,
                num_kv_heads=self.num_kv_heads,
                head_dim=self.head_dim,
                rms_eps=self.eps,
                rope_theta=10000.0,  # the tables are moved below, not recomputed
                max_positions=1,
                head_weight=pack(lm_head) if repack else None,
            )
            moved.rope_theta = self.rope_theta
            moved.rope_scaling = self.rope_scaling
            moved.min_rows = self.min_rows
            moved.cos = self.cos.to(device=device, dtype=dtype)
            moved.sin_signed = self.sin_signed.to(device=device, dtype=dtype)
            moved.exit_heads = {
                e: copy.deepcopy(m).to(device=device, dtype=dtype)
                for e, m in self.exit_heads.items()
            }
            moved.exit_adapters = {
                e: _Layer(**{f.name: mv_matrix(getattr(w, f.name)) for f in fields(_Layer)})
                for e, w in self.exit_adapters.items()
            }
        self._placed[key] = moved
        return moved

    @torch.inference_mode()
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """``token_ids [T] -> h_0 [T, H]``."""
        if isinstance(self.embed_weight, QuantMatrix):
            return self.embed_weight.rows_of(token_ids)
        return F.embedding(token_ids.to(self.device), self.embed_weight)

    @torch.inference_mode()
    def run_layer(
        self, layer: int, hidden: torch.Tensor, batch: list[tuple[AttendedKV, int]], memo: dict
    ) -> torch.Tensor:
        """``h_layer [N, H] -> h_{layer+1} [N, H]`` for a ragged batch (``LayeredLM`` doc).

        Projections, RoPE and the MLP run on the packed rows (one matmul per weight for the
        whole batch); keys/values are written and attended by the batch's backend (its
        ``AttendedKV``s name it: contiguous, paged or static).
        """
        weights = self.layers[layer]
        if hidden.shape[0] in self.int8_rows:  # a row count the int8 copies run faster
            weights = self.int8_layers[layer]
        elif hidden.shape[0] in self.float_rows:  # the float rows kernel runs faster
            weights = self.float_rows_layers[layer]
        elif hidden.shape[0] in self.dense_rows:  # a row count dense runs faster here
            weights = self.dense_layers[layer]
        return self.forward_layer(weights, hidden, batch, memo)

    def make_int8_copies(self, blocked: bool | None = None) -> None:
        """Make int8 copies of every layer's matrices and of the LM head (once; about a
        quarter of the fp32 weights' memory), used by no pass until ``set_int8_rows``:
        blocked for the int8 rows kernel (``blocked=None``: on a CPU where it runs) or in
        ATen's layout (``False``)."""
        if self.int8_layers:
            return
        if blocked is None:
            status = rows_kernel.kernel_status()
            if not status.available:
                log.info("%s: int8 copies for ATen's kernel (the rows kernel: %s)",
                         self.info.name, status.why)
            blocked = status.available and self.device.type == "cpu"

        def quantize(weight: torch.Tensor) -> Int8Matrix:
            return quantize_int8(dense(weight), blocked)

        with torch.no_grad():
            self.int8_layers = [
                replace(w, **{name: quantize(getattr(w, name)) for name in MATRICES})
                for w in self.layers
            ]
            self.int8_head = quantize(self.lm_head)

    def set_int8_rows(self, rows: frozenset[int]) -> None:
        """Run passes of ``rows`` rows on the int8 copies (``make_int8_copies`` first); they
        take precedence over ``dense_rows``."""
        if rows and not self.int8_layers:
            raise ValueError(f"{self.info.name}: int8 rows {sorted(rows)} without int8 copies")
        self.int8_rows = frozenset(rows)

    def set_dense_rows(self, rows: frozenset[int]) -> None:
        """Run passes of ``rows`` rows on dense copies of the packed matrices (made once,
        only when ``rows`` is not empty; an unpacked model is dense already)."""
        if rows and self.packed and not self.dense_layers:
            self.dense_layers = [
                _Layer(**{f.name: dense(getattr(w, f.name)) if getattr(w, f.name) is not None
                          else None for f in fields(_Layer)})
                for w in self.layers
            ]
        self.dense_rows = frozenset(rows) if self.packed else frozenset()
        if not self.dense_rows:
            self.dense_layers = []

    @torch.inference_mode()
    def forward_layer(
        self, w: _Layer, hidden: torch.Tensor, batch: LayerBatch, memo: dict
    ) -> torch.Tensor:
        """``run_layer`` with the weights ``w`` (one of this model's layers, or an adapter's:
        the one decoder-layer function of the module doc)."""
        attention = batch[0][0].attention
        rows = attention.positions(batch, memo)  # [N] positions (a slice for one sequence)
        n = hidden.shape[0]
        nh, kh, d = self.num_heads, self.num_kv_heads, self.head_dim
        h = self.hidden_size
        kernel = self._quant_layer(w) if self.quantized else None
        if kernel is not None:  # GGUF blocks: the layer kernel around the attention
            qkv = kernel.before_attention(hidden, self.cos, self.sin_signed,
                                          self._position_ids(rows, memo))
            qk = qkv[:, : (nh + kh) * d].view(n, nh + kh, d)  # [N, NH + KH, D], rotated
            v = qkv[:, (nh + kh) * d :].view(n, kh, d)  # [N, KH, D]
            att = attention.attend(qk[:, :nh], qk[:, nh:], v, batch, self.scale, memo)
            return kernel.after_attention(hidden, att.reshape(n, nh * d))  # [N, H]

        r = self.min_rows
        x = F.rms_norm(hidden, (h,), w.ln1, self.eps)  # [N, H]
        qkv = linear(x, w.wqkv, w.bqkv, r)  # [N, (NH + 2KH) * D]
        qk = qkv[:, : (nh + kh) * d].view(n, nh + kh, d)  # [N, NH + KH, D]
        v = qkv[:, (nh + kh) * d :].view(n, kh, d)  # [N, KH, D]
        qk = rotate(qk, *self._rope_rows(rows, memo))
        att = attention.attend(qk[:, :nh], qk[:, nh:], v, batch, self.scale, memo)  # [N, NH, D]
        x = linear(att.reshape(n, nh * d), w.wo, w.bo, r)  # [N, H]
        hidden = hidden + x

        x = F.rms_norm(hidden, (h,), w.ln2, self.eps)  # [N, H]
        gate, up = linear(x, w.w_gate_up, w.b_gate_up, r).chunk(2, dim=-1)  # [N, I] each
        act = F.silu(gate).mul_(up)  # [N, I]: one new tensor, the product in place
        return hidden + linear(act, w.w_down, w.b_down, r)  # [N, H]

    def _quant_layer(self, w: _Layer) -> QuantLayer | None:
        """The layer kernel of ``w`` (``specflow.quant.layer``), made once; None where one
        of its matrices is not all GGUF blocks the kernel multiplies (then torch runs it)."""
        hit = self._quant_layers.get(id(w))
        if hit is None or hit[0] is not w:
            matrices = {"wqkv": (w.wqkv, w.bqkv), "wo": (w.wo, w.bo),
                        "w_gate_up": (w.w_gate_up, w.b_gate_up), "w_down": (w.w_down, w.b_down)}
            kernel = None
            if runs_quantized(*(m for m, _ in matrices.values())):
                shape = LayerShape(self.hidden_size, self.num_heads, self.num_kv_heads,
                                   self.head_dim, w.w_down.shape[1], self.eps)
                kernel = QuantLayer(shape, w.ln1, w.ln2, matrices)
            hit = self._quant_layers[id(w)] = (w, kernel)
        return hit[1]

    def _position_ids(self, rows: slice | torch.Tensor, memo: dict) -> torch.Tensor:
        """``rows`` (``attention.positions``) as int64 ``[N]``, each a row of the RoPE tables
        (checked: the kernel indexes them unchecked); made once per forward (``memo``)."""
        key = ("position_ids", id(rows)) if isinstance(rows, torch.Tensor) else (
            "position_ids", rows.start, rows.stop)
        hit = memo.get(key)
        if hit is None or (isinstance(rows, torch.Tensor) and hit[0] is not rows):
            ids = (torch.arange(rows.start, rows.stop, dtype=torch.long)
                   if isinstance(rows, slice) else rows.to(torch.long).contiguous())
            if ids.numel() and int(ids.max()) >= self.cos.shape[0]:
                raise PromptTooLongError(f"position {int(ids.max())} is beyond the model's "
                                         f"{self.cos.shape[0]} RoPE positions")
            hit = memo[key] = (rows, ids)
        return hit[1]

    def _rope_rows(self, rows: slice | torch.Tensor,
                   memo: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin_signed [N, 1, D]`` at the positions ``rows``: views for a slice; for a
        positions tensor (a tree, a ragged batch) gathered once per forward and shared by
        its layers through ``memo`` (the backend memoises ``rows`` itself, so one forward
        passes every layer the same tensor)."""
        if isinstance(rows, slice):
            return self.cos[rows].unsqueeze(1), self.sin_signed[rows].unsqueeze(1)
        key = ("rope", id(self.cos), id(rows))
        hit = memo.get(key)
        if hit is None or hit[0] is not rows:
            hit = memo[key] = (rows, self.cos[rows].unsqueeze(1),
                               self.sin_signed[rows].unsqueeze(1))
        return hit[1], hit[2]

    @torch.no_grad()
    def head(self, hidden: torch.Tensor, exit_layer: int) -> torch.Tensor:
        """``h_exit [T, H] -> logits [T, V]`` float32; an exit head replaces the final norm.

        Runs under ``no_grad`` (not inference mode) so callers may edit the logits in place.
        """
        x = self.head_input(hidden, exit_layer)  # [T, H]
        if x.shape[0] in self.int8_rows and self.int8_head is not None:
            return int8_linear(x, self.int8_head, None).float()  # [T, V]
        if x.shape[0] in self.float_rows and self.float_rows_head is not None:
            return stacked_linear(x, self.float_rows_head, None)  # [T, V]
        if x.shape[0] in self.dense_rows:
            return F.linear(x, self.lm_head).float()  # [T, V], the dense LM head
        return linear(x, self.head_weight, None, self.min_rows).float()  # [T, V]

    @torch.no_grad()
    def head_prefix(self, x: torch.Tensor, ids: int) -> torch.Tensor:
        """``x [T, H]`` (``head_input``'s output) ``-> logits [T, ids]`` float32 of token ids
        ``0..ids-1`` only: the first ``ids`` rows of the LM head, a view, not a copy (the
        int8 copy's when ``T`` is one of ``int8_rows``; then ``ids`` is a multiple of
        ``int8_weights.PREFIX_ALIGN``).  A drafter's vocabulary subset
        (``specflow.drafting.SubVocabHead``)."""
        if x.shape[0] in self.int8_rows and self.int8_head is not None:
            return int8_linear(x, self.int8_head.prefix(ids), None).float()  # [T, ids]
        if isinstance(self.lm_head, QuantMatrix):
            return quant_linear(x, self.lm_head.prefix(ids), None)  # [T, ids]
        return F.linear(x, self.lm_head[:ids]).float()  # [T, ids]

    def head_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids [E]`` -> the LM head's rows of those token ids, ``[E, H]`` dense (a GGUF
        head's decoded to float32 as ggml decodes them): the extra ids of a drafter's
        vocabulary subset (``specflow.drafting.SubVocabHead``)."""
        if isinstance(self.lm_head, QuantMatrix):
            return self.lm_head.rows_of(ids)  # [E, H] float32
        return self.lm_head.index_select(0, ids.to(self.lm_head.device)).contiguous()  # [E, H]

    @torch.no_grad()
    def head_input(self, hidden: torch.Tensor, exit_layer: int) -> torch.Tensor:
        """``h_exit [T, H] -> x [T, H]``, what the LM head multiplies: the exit's trained head
        when one is attached, else the final norm.  ``head(h) = x @ lm_head.T``."""
        if not 1 <= exit_layer <= self.info.num_layers:
            raise ValueError(f"exit layer must be in 1..{self.info.num_layers}, got {exit_layer}")
        exit_head = self.exit_heads.get(exit_layer)
        if exit_head is not None:
            return exit_head(hidden)  # [T, H]
        return F.rms_norm(hidden, (self.hidden_size,), self.final_norm, self.eps)  # [T, H]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """RoPE: ``x [N, H, D]`` (any row stride) ``-> x * cos + roll(x, D/2) * sin_signed``,
    a new contiguous ``[N, H, D]``; ``cos, sin_signed [N, 1, D]``.

    ``roll(x, D/2)`` is ``[x2, x1]`` for ``x = [x1, x2]``, so the second term is added per
    half (products rounded, then added: the same two roundings as the formula).  The
    formula itself on a strided slice of the fused q/k/v output ran 10-20x slower than
    this on a prefill's rows.
    """
    half = x.shape[-1] // 2
    out = x * cos  # [N, H, D]
    out[..., :half] += x[..., half:] * sin_signed[..., :half]
    out[..., half:] += x[..., :half] * sin_signed[..., half:]
    return out


@dataclass(frozen=True)
class LayerAdapter:
    """An attention adapter's layer at one exit of a ``NativeLM`` (an ``ExitAdapter``):
    one decoder layer run by the model's own layer function over its own keys/values
    (``specflow.models.adapter_head`` has the math)."""

    lm: NativeLM
    layer: _Layer

    @property
    def kv(self) -> KVSpec:
        """One layer of the model's key/value shape (a request's cache: ``KVCache(kv, n)``)."""
        return replace(self.lm.kv, num_layers=1)

    def run(self, hidden: torch.Tensor, batch: LayerBatch, memo: dict) -> torch.Tensor:
        """``h_L [N, H] -> a [N, H]`` for a ragged batch of the adapter's caches."""
        return self.lm.forward_layer(self.layer, hidden, batch, memo)
