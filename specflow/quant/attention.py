"""Row-exact attention over a contiguous KV cache: how a quantized model attends.

``kernels/attend_rows.cpp`` (its header has the math) attends every query row of a block
exactly as a one-row decoding step at that row's position attends it, whatever the rows
beside it: a quantized model's 8-bit activations can turn a last-bit difference into another
token, so a verified row must get a decoding step's bits (``specflow.kv.base.KVSpec``'s
``row_exact``).  One call attends all rows and heads of one sequence's block: row ``i`` sees
the keys ``0 .. prefix[i] - 1`` and then, in a token tree, the positions its ancestors and
itself hold (``extra``).
"""

from __future__ import annotations

import torch

from specflow.quant.matrix import quant_library


def attend_rows(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                prefix: torch.Tensor, extra: tuple[torch.Tensor, torch.Tensor] | None,
                scale: float) -> torch.Tensor:
    """``q [T, NH, D]`` (rows at any stride, heads contiguous) over the cache's ``keys,
    values [KH, L, D]`` -> ``[T, NH, D]`` float32.

    ``prefix [T]`` int64: row ``i`` sees keys ``[0, prefix[i])``; ``extra``: ``(offsets
    [T + 1], columns)`` int64, row ``i`` also sees ``columns[offsets[i]:offsets[i + 1]]`` in
    that order (a tree's ancestors and node), or ``None`` (a chain).
    """
    t, nh, d = q.shape
    kh = keys.shape[0]
    if q.dtype != torch.float32 or q.stride(2) != 1 or q.stride(1) != d:
        raise ValueError(f"attend_rows: q {tuple(q.shape)} {q.dtype} strides {q.stride()} "
                         "needs float32 with contiguous heads")
    if keys.stride() != values.stride() or keys.stride(1) != d or keys.stride(2) != 1:
        raise ValueError(f"attend_rows: caches of strides {keys.stride()}, {values.stride()}")
    out = torch.empty(t, nh, d, dtype=torch.float32)  # [T, NH, D]
    offsets, columns = (None, None) if extra is None else extra
    err = quant_library().quant_attend_rows(
        t, nh, kh, d, q.data_ptr(), q.stride(0), keys.data_ptr(), values.data_ptr(),
        keys.stride(0), prefix.data_ptr(),
        None if offsets is None else offsets.data_ptr(),
        None if columns is None else columns.data_ptr(),
        scale, out.data_ptr(), torch.get_num_threads())
    if err:
        raise ValueError(f"attend_rows: {nh} heads of {d} over {kh} KV heads (head size a "
                         "multiple of 8, heads a multiple of KV heads, at most 64 a KV head)")
    return out
