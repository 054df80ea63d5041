"""A draft model's GGUF blocks re-quantized to 4 bits at load (``model.quantize=q4_0|q4_1``).

A drafter's tokens are verified by the target, so its weights may be rounded further than the
file holds without changing any output of a lossless pipeline: only how often its drafts are
accepted.  A drafting step of a small model reads its matrices once a token, so fewer bytes
a weight and cheaper codes make each drafted token cheaper.  The 0.5B's file is mostly Q5_0
and Q8_0 (5.5 and 8.5 bits a weight; its rows of 896 values are no whole number of the
256-value super-blocks that Q4_K needs), which 32-value 4-bit blocks cut to 4.5 or 5 bits.

Each part is decoded to float32 as ggml decodes it, then quantized as ggml's reference
quantizers do (``gguf.quants``), blocks of 32 values ``x``:

    q4_0:  d = x[argmax |x|] / -8;  q = min(15, trunc(x / d + 8.5));        x' = d (q - 8)
    q4_1:  d = (max x - min x) / 15;  q = min(15, trunc((x - min x) / d + 0.5));  x' = d q + min x

with ``d`` (and ``min x``) stored in float16.  A part is kept as it is where its type holds
no more bits a weight than the chosen one (Q4_K and Q4_0 for ``q4_0``) or where it is a
float tensor.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from specflow.errors import ConfigError
from specflow.quant.matrix import KERNEL_TYPES, QuantMatrix, QuantPart, part_from_numpy

# model.quantize value -> the ggml type id its parts become (Q4_0, Q4_1)
REQUANTIZE_TYPES = {"q4_0": 2, "q4_1": 3}
# Which parts are converted and how (the rule above, gguf-py's quantizers): part of what a
# re-quantized model's weights fingerprint names, so that a change of the rule is a change
# of the weights.
RULE_VERSION = 1
CHUNK_ROWS = 4096  # rows decoded and quantized at a time (the float copy of one chunk)


def bits_per_weight(ggml_type: int) -> float:
    """Bits a weight of a type the kernel multiplies: block bytes * 8 / block values."""
    _, values, nbytes = KERNEL_TYPES[ggml_type]
    return nbytes * 8 / values


def check_kind(kind: str) -> int:
    """The ggml type id ``kind`` names; ``ConfigError`` naming the choices otherwise."""
    target = REQUANTIZE_TYPES.get(kind)
    if target is None:
        raise ConfigError(f"model.quantize={kind!r} cannot re-quantize GGUF blocks; use one of "
                          f"{', '.join(REQUANTIZE_TYPES)} or null")
    return target


def requantized_fingerprint(fingerprint: str, kind: str) -> str:
    """The weights fingerprint of a model whose file has ``fingerprint``, re-quantized to
    ``kind`` (16 hex digits): heads and tables made for the file's blocks do not match it."""
    check_kind(kind)
    text = f"{fingerprint};{kind};rule {RULE_VERSION}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def requantize_part(part: QuantPart, kind: str) -> QuantPart:
    """``part`` re-quantized to ``kind`` (module doc), or ``part`` itself where it is kept."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as gguf_quantize

    target = check_kind(kind)
    if not part.quantized or bits_per_weight(part.ggml_type) <= bits_per_weight(target):
        return part
    _, values_a_block, bytes_a_block = KERNEL_TYPES[target]
    blocks = np.empty((part.rows, part.cols // values_a_block * bytes_a_block), np.uint8)
    for start in range(0, part.rows, CHUNK_ROWS):
        rows = min(CHUNK_ROWS, part.rows - start)
        values = _rows(part, start, rows)  # [rows, cols] float32
        blocks[start : start + rows] = gguf_quantize(values, GGMLQuantizationType(target))
    return part_from_numpy(target, blocks, part.cols)


def _rows(part: QuantPart, start: int, rows: int) -> np.ndarray:
    """Rows ``start .. start + rows - 1`` of ``part`` decoded to float32 ``[rows, cols]``, as
    ggml decodes them."""
    return QuantMatrix((part,)).rows_of(torch.arange(start, start + rows)).numpy()
