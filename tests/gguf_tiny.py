"""Tiny GGUF files written in the tests: a tiny HF model's weights quantized to ggml blocks.

``quantize(w, type)`` packs a float ``[n, k]`` matrix into ggml's blocks: Q4_0, Q4_1, Q5_0 and
Q8_0 by gguf-py's own quantizers, Q4_K and Q6_K by the simple round-to-nearest packers here
(valid blocks in ggml's layout; gguf-py only decodes those two, which the tests use to check
the packing).  ``write_gguf(hf, path, types)`` writes a Llama/Qwen2 model as llama.cpp's
converter names and orders it (q/k rows of a Llama permuted).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter, quants

F16 = np.float16


def _pack_q6_k(w: np.ndarray) -> np.ndarray:
    """``w [n, k]`` (k a multiple of 256) -> Q6_K blocks ``uint8 [n, k/256*210]``."""
    n, k = w.shape
    sb = w.reshape(-1, 16, 16).astype(np.float32)  # [B, 16 groups, 16]
    scale = np.abs(sb).max(axis=2) / 31.0  # [B, 16]
    d = (scale.max(axis=1) / 127.0).astype(F16).astype(np.float32)  # [B]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d[:, None] > 0, np.rint(scale / d[:, None]), 0).clip(-128, 127)
        step = d[:, None] * sc  # [B, 16]
        q = np.where(step[..., None] > 0, np.rint(sb / step[..., None]), 0)
    q = (q.clip(-32, 31) + 32).astype(np.uint8).reshape(-1, 256)  # [B, 256] codes 0..63
    ql = np.zeros((q.shape[0], 128), np.uint8)
    qh = np.zeros((q.shape[0], 64), np.uint8)
    for h in range(2):
        c = q[:, 128 * h : 128 * h + 128]
        lo = c & 0xF
        hi = c >> 4
        ql[:, 64 * h : 64 * h + 32] = lo[:, 0:32] | (lo[:, 64:96] << 4)
        ql[:, 64 * h + 32 : 64 * h + 64] = lo[:, 32:64] | (lo[:, 96:128] << 4)
        qh[:, 32 * h : 32 * h + 32] = (hi[:, 0:32] | (hi[:, 32:64] << 2) | (hi[:, 64:96] << 4)
                                       | (hi[:, 96:128] << 6))
    blocks = np.concatenate([ql, qh, sc.astype(np.int8).view(np.uint8),
                             d.astype(F16).reshape(-1, 1).view(np.uint8)], axis=1)
    return blocks.reshape(n, -1)


def _pack_q4_k(w: np.ndarray) -> np.ndarray:
    """``w [n, k]`` (k a multiple of 256) -> Q4_K blocks ``uint8 [n, k/256*144]``."""
    n, k = w.shape
    g = w.reshape(-1, 8, 32).astype(np.float32)  # [B, 8 groups, 32]
    lo = np.minimum(g.min(axis=2), 0.0)  # [B, 8]
    scale = (g.max(axis=2) - lo) / 15.0
    d = (scale.max(axis=1) / 63.0).astype(F16).astype(np.float32)  # [B]
    dmin = ((-lo).max(axis=1) / 63.0).astype(F16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d[:, None] > 0, np.rint(scale / d[:, None]), 0).clip(0, 63)
        m = np.where(dmin[:, None] > 0, np.rint(-lo / dmin[:, None]), 0).clip(0, 63)
        step = (d[:, None] * sc)[..., None]
        q = np.where(step > 0, np.rint((g + (dmin[:, None] * m)[..., None]) / step), 0)
    q = q.clip(0, 15).astype(np.uint8).reshape(-1, 256)
    sc, m = sc.astype(np.uint8), m.astype(np.uint8)
    scales = np.zeros((q.shape[0], 12), np.uint8)
    scales[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    scales[:, 4:8] = (m[:, 0:4] & 63) | ((m[:, 4:8] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:8] & 0xF) | ((m[:, 4:8] & 0xF) << 4)
    qs = np.zeros((q.shape[0], 128), np.uint8)
    for j in range(4):
        low, high = q[:, 64 * j : 64 * j + 32], q[:, 64 * j + 32 : 64 * j + 64]
        qs[:, 32 * j : 32 * j + 32] = low | (high << 4)
    blocks = np.concatenate([d.astype(F16).reshape(-1, 1).view(np.uint8),
                             dmin.astype(F16).reshape(-1, 1).view(np.uint8), scales, qs], axis=1)
    return blocks.reshape(n, -1)


def quantize(w: np.ndarray, ggml_type: T) -> np.ndarray:
    """``w [n, k]`` float -> ggml blocks ``uint8 [n, row_bytes]`` of ``ggml_type``."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    if ggml_type == T.Q6_K:
        return _pack_q6_k(w)
    if ggml_type == T.Q4_K:
        return _pack_q4_k(w)
    return quants.quantize(w, ggml_type)


def dequantize(blocks: np.ndarray, ggml_type: T) -> np.ndarray:
    """gguf-py's own decoding of ``blocks [n, row_bytes]`` -> float32 ``[n, k]``."""
    return quants.dequantize(blocks, ggml_type).reshape(blocks.shape[0], -1)


def llama_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order: rows ``(h, s, i) -> (h, i, s)``."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def write_gguf(hf, path: str | Path, types: dict[str, T] | T) -> Path:
    """Write ``hf`` (a tiny Llama/Qwen2) as a GGUF file of quantized matrices: ``types``
    one type for every matrix, or a type per GGUF tensor suffix (``attn_q``, ``ffn_down``,
    ``token_embd``, ``output``, ...; missing: Q8_0).  Norms and biases stay float32."""
    cfg = hf.config
    arch = cfg.model_type
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)

    def kind(suffix: str) -> T:
        return types if isinstance(types, T) else types.get(suffix, T.Q8_0)

    def matrix(name: str, suffix: str, weight: torch.Tensor, heads: int | None = None) -> None:
        w = weight.detach().float().numpy()
        if heads is not None and arch == "llama":
            w = llama_permute(w, heads)
        t = kind(suffix)
        writer.add_tensor(name, quantize(w, t), raw_dtype=t)

    def vector(name: str, value: torch.Tensor, heads: int | None = None) -> None:
        v = value.detach().float().numpy()
        if heads is not None and arch == "llama":
            v = llama_permute(v, heads)
        writer.add_tensor(name, np.ascontiguousarray(v, dtype=np.float32))

    base = hf.model
    matrix("token_embd.weight", "token_embd", base.embed_tokens.weight)
    if hf.lm_head.weight is not base.embed_tokens.weight:
        matrix("output.weight", "output", hf.lm_head.weight)
    vector("output_norm.weight", base.norm.weight)
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    for n, blk in enumerate(base.layers):
        p = f"blk.{n}."
        att, mlp = blk.self_attn, blk.mlp
        vector(p + "attn_norm.weight", blk.input_layernorm.weight)
        vector(p + "ffn_norm.weight", blk.post_attention_layernorm.weight)
        matrix(p + "attn_q.weight", "attn_q", att.q_proj.weight, heads)
        matrix(p + "attn_k.weight", "attn_k", att.k_proj.weight, kv_heads)
        matrix(p + "attn_v.weight", "attn_v", att.v_proj.weight)
        matrix(p + "attn_output.weight", "attn_output", att.o_proj.weight)
        for proj, heads_of in (("q", heads), ("k", kv_heads), ("v", None)):
            bias = getattr(att, f"{proj}_proj").bias
            if bias is not None:
                vector(p + f"attn_{proj}.bias", bias, heads_of)
        matrix(p + "ffn_gate.weight", "ffn_gate", mlp.gate_proj.weight)
        matrix(p + "ffn_up.weight", "ffn_up", mlp.up_proj.weight)
        matrix(p + "ffn_down.weight", "ffn_down", mlp.down_proj.weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)
