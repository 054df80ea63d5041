"""A ``NativeLM`` over a GGUF file's quantized weights as published (``model.weights=gguf``).

Every matrix stays in the file's own blocks (Q4_K, Q6_K, Q5_0, Q8_0, Q4_1, ...) and is
multiplied by the quantized rows kernel (``specflow.quant``): repacked once into the kernel's
tiles of 16 rows (the same bytes, or 2.8% more for Q4_K; the file's pages are then
released); norms and biases are the file's float32 vectors; the embedding decodes the rows
it looks up.  No float copy of a matrix is made, so the model takes about the file's size in
memory (q/k of a Llama file are re-ordered, below, which copies those two).

GGUF names -> the layer's parts (Llama and Qwen2 files, as llama.cpp's converter writes them):

    token_embd          embedding (and the LM head when there is no ``output``)
    output_norm, output final norm, LM head
    blk.N.attn_norm     ln1              blk.N.ffn_norm       ln2
    blk.N.attn_{q,k,v}  wqkv (+ biases)  blk.N.attn_output    wo
    blk.N.ffn_{gate,up} w_gate_up        blk.N.ffn_down       w_down

llama.cpp's converter permutes the rows of a Llama model's q and k (for its own RoPE layout):
``rows (h, s, i) -> (h, i, s)`` with ``s`` the half of the head and ``i < D/2``.  The rows are
put back in Hugging Face's order here (whole rows move; a row's blocks are untouched), so
the model computes what the Hugging Face model of the same weights computes.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specflow.errors import ConfigError
from specflow.kv.base import ModelInfo
from specflow.models.native import NativeLM, _Layer, _rope_params, supports
from specflow.quant.matrix import QuantMatrix, QuantPart, check_part, part_from_numpy
from specflow.quant.memory import release_pages
from specflow.quant.requantize import requantize_part

log = logging.getLogger("specflow")


class GGUFTensors:
    """The tensors of a GGUF file by name (memory-mapped by ``gguf.GGUFReader``)."""

    def __init__(self, path: str | Path) -> None:
        import gguf

        self.path = Path(path)
        self.reader = gguf.GGUFReader(str(self.path))
        self.tensors = {t.name: t for t in self.reader.tensors}

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def part(self, name: str, row_order: np.ndarray | None = None) -> QuantPart:
        """A 2-D tensor as a ``QuantPart`` (rows re-ordered by ``row_order`` if given)."""
        t = self._get(name)
        cols, rows = int(t.shape[0]), int(t.shape[1])
        data = np.asarray(t.data).reshape(rows, -1)
        check_part(f"{self.path.name}: {name}", int(t.tensor_type), (rows, cols),
                   data.shape[1] * data.itemsize)
        if row_order is not None:
            data = data[row_order]
        part = part_from_numpy(int(t.tensor_type), data, cols)
        if part.quantized:
            release_pages(np.asarray(t.data))
        return part

    def vector(self, name: str, row_order: np.ndarray | None = None) -> torch.Tensor:
        """A 1-D float tensor (a norm's weight, a bias) as float32."""
        t = self._get(name)
        values = np.asarray(t.data, dtype=np.float32).reshape(-1)
        if row_order is not None:
            values = values[row_order]
        return torch.from_numpy(values.copy())

    def _get(self, name: str):
        t = self.tensors.get(name)
        if t is None:
            raise ConfigError(f"{self.path}: the GGUF file has no tensor {name!r}")
        return t


def unpermute_rows(rows: int, heads: int) -> np.ndarray:
    """The row order that undoes llama.cpp's q/k permutation (module doc): Hugging Face row
    ``h*D + s*D/2 + i`` is file row ``h*D + 2i + s``."""
    d = rows // heads
    return np.arange(rows).reshape(heads, d // 2, 2).swapaxes(1, 2).reshape(-1)


def _bias(tensors: GGUFTensors, name: str, order: np.ndarray | None = None
          ) -> torch.Tensor | None:
    return tensors.vector(name, order) if name in tensors else None


def _cat_bias(parts: list[tuple[torch.Tensor | None, int]]) -> torch.Tensor | None:
    if all(b is None for b, _ in parts):
        return None
    return torch.cat([b if b is not None else torch.zeros(n) for b, n in parts])


def native_from_gguf(path: str | Path, hf_config: Any, info: ModelInfo,
                     requantize: str | None = None) -> NativeLM:
    """Build the quantized ``NativeLM`` of the GGUF file ``path`` (module doc);
    ``hf_config`` is the model's Hugging Face config (heads, RoPE, norms).  ``requantize``
    (``q4_0``, ``q4_1``; a draft model's ``model.quantize``): each matrix a pass multiplies
    whose type holds more bits a weight re-quantized to that type (``specflow.quant.requantize``;
    Q4_K and fewer-bit types are kept); the embedding too where it is the LM head (its
    lookups then read the 4-bit values), else it keeps the file's blocks (it is only looked
    up)."""
    ok, why = supports(hf_config)
    if not ok:
        raise ConfigError(f"{info.name}: model.weights=gguf runs the native backend, which does "
                          f"not support this model: {why}; use model.weights=float")
    tensors = GGUFTensors(path)
    heads, kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    llama = hf_config.model_type == "llama"
    q_order = unpermute_rows(heads * head_dim, heads) if llama else None
    k_order = unpermute_rows(kv_heads * head_dim, kv_heads) if llama else None

    def part(name: str, row_order: np.ndarray | None = None) -> QuantPart:
        got = tensors.part(name, row_order)
        return got if requantize is None else requantize_part(got, requantize)

    layers = []
    for n in range(info.num_layers):
        p = f"blk.{n}."
        q = part(p + "attn_q.weight", q_order)
        k = part(p + "attn_k.weight", k_order)
        v = part(p + "attn_v.weight")
        gate, up = part(p + "ffn_gate.weight"), part(p + "ffn_up.weight")
        layers.append(_Layer(
            ln1=tensors.vector(p + "attn_norm.weight"),
            wqkv=QuantMatrix((q, k, v)),
            bqkv=_cat_bias([(_bias(tensors, p + "attn_q.bias", q_order), q.rows),
                            (_bias(tensors, p + "attn_k.bias", k_order), k.rows),
                            (_bias(tensors, p + "attn_v.bias"), v.rows)]),
            wo=QuantMatrix((part(p + "attn_output.weight"),)),
            bo=_bias(tensors, p + "attn_output.bias"),
            ln2=tensors.vector(p + "ffn_norm.weight"),
            w_gate_up=QuantMatrix((gate, up)),
            b_gate_up=None,
            w_down=QuantMatrix((part(p + "ffn_down.weight"),)),
            b_down=None,
        ))
    if "output.weight" in tensors:
        embed = QuantMatrix((tensors.part("token_embd.weight"),))
        head = QuantMatrix((part("output.weight"),))
    else:  # tied: the LM head is the embedding
        embed = head = QuantMatrix((part("token_embd.weight"),))
    rope = _rope_params(hf_config)
    return NativeLM(
        info,
        embed_weight=embed,
        layers=layers,
        final_norm=tensors.vector("output_norm.weight"),
        lm_head=head,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_eps=hf_config.rms_norm_eps,
        rope_theta=rope["rope_theta"],
        max_positions=hf_config.max_position_embeddings,
        rope_scaling=rope if rope["rope_type"] == "llama3" else None,
    )


def loaded_bytes(lm: NativeLM) -> int:
    """Bytes of a quantized model's weights as loaded: every matrix's blocks (the embedding
    once when the LM head is the same matrix) and the float vectors."""
    seen: dict[int, int] = {}
    for layer in lm.layers:
        for name in ("wqkv", "wo", "w_gate_up", "w_down"):
            matrix = getattr(layer, name)
            seen[id(matrix)] = matrix.nbytes
        for name in ("ln1", "ln2", "bqkv", "bo"):
            vector = getattr(layer, name)
            if vector is not None:
                seen[id(vector)] = vector.numel() * 4
    for matrix in (lm.embed_weight, lm.lm_head):
        seen[id(matrix)] = matrix.nbytes
    return sum(seen.values())


def gguf_fingerprint(path: str | Path) -> str:
    """A cheap stable hash of a GGUF file's weights: its tensors' names, types and shapes and
    the first and last 4 KiB of each of the embedding, the LM head and the last layer
    (first 16 hex digits).  Differs from the float32 model's fingerprint: heads trained on
    one are checked against the weights they were trained on."""
    tensors = GGUFTensors(path)
    digest = hashlib.sha256(b"gguf;")
    last = max(int(n.split(".")[1]) for n in tensors.tensors if n.startswith("blk."))
    for name, t in sorted(tensors.tensors.items()):
        digest.update(f"{name}:{int(t.tensor_type)}:{tuple(int(s) for s in t.shape)};".encode())
        if name in ("token_embd.weight", "output.weight") or name.startswith(f"blk.{last}."):
            raw = np.asarray(t.data).reshape(-1).view(np.uint8)
            digest.update(raw[:4096].tobytes() + raw[-4096:].tobytes())
    return digest.hexdigest()[:16]
