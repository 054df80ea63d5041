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
no more bits a weight than the chosen one (Q4_K and Q4_0 for ``q4_0``), where it is a float
tensor, or where its rows are no whole number of 32-value blocks.
"""

from __future__ import annotations

import numpy as np
import torch

from specflow.quant.matrix import QuantMatrix, QuantPart, part_from_numpy

# model.quantize value -> the ggml type id its parts become (Q4_0, Q4_1)
REQUANTIZE_TYPES = {"q4_0": 2, "q4_1": 3}
# bits a weight of each type the kernel multiplies (block bytes * 8 / block values)
BITS_PER_WEIGHT = {2: 4.5, 3: 5.0, 6: 5.5, 8: 8.5, 12: 4.5, 14: 6.5625}
CHUNK_ROWS = 4096  # rows decoded and quantized at a time (the float copy of one chunk)


def requantize_part(part: QuantPart, kind: str) -> QuantPart:
    """``part`` re-quantized to ``kind`` (module doc), or ``part`` itself where it is kept."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as gguf_quantize

    target = REQUANTIZE_TYPES[kind]
    if (not part.quantized or part.cols % 32
            or BITS_PER_WEIGHT[part.ggml_type] <= BITS_PER_WEIGHT[target]):
        return part
    chunks = []
    for start in range(0, part.rows, CHUNK_ROWS):
        rows = min(CHUNK_ROWS, part.rows - start)
        values = _rows(part, start, rows)  # [rows, cols] float32
        chunks.append(gguf_quantize(values, GGMLQuantizationType(target)))  # uint8 [rows, bytes]
    return part_from_numpy(target, np.concatenate(chunks), part.cols)


def _rows(part: QuantPart, start: int, rows: int) -> np.ndarray:
    """Rows ``start .. start + rows - 1`` of ``part`` decoded to float32 ``[rows, cols]``, as
    ggml decodes them."""
    return QuantMatrix((part,)).rows_of(torch.arange(start, start + rows)).numpy()
