"""Matrices kept in GGUF's quantized blocks, as a ``NativeLM`` layer multiplies them.

A ``QuantMatrix`` stands for ``W [N, K]`` stacked from parts (a fused q/k/v or gate/up is its
parts, each in its own block type: a Q4_K_M file mixes Q4_K and Q6_K within one layer).  Each
``QuantPart`` holds its rows' blocks, repacked once into tiles of 16 rows (``uint8 [ceil(n /
16), tile_bytes]``: the same bytes, laid out for the kernel's products), or, for a float
tensor (F32/F16/BF16), a float32 ``[n, K]`` multiplied by ``F.linear``.

``quant_linear(x, W, b)`` is ``x @ W.T + b`` with every quantized part multiplied by the
quantized rows kernel (``specflow.quant.kernel``): activations quantized to 8 bits per block
and integer dot products, the same bits for a row whatever the rows beside it.
"""

from __future__ import annotations

import ctypes
import warnings
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from specflow.errors import ConfigError
from specflow.quant.kernel import kernel_status

# ggml type id -> (name, values a block, bytes a block) for the types the kernel multiplies
KERNEL_TYPES = {2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
                8: ("Q8_0", 32, 34), 12: ("Q4_K", 256, 144), 14: ("Q6_K", 256, 210)}
TILE_ROWS = 16  # rows a tile of a quantized part holds (quant_repack)
FLOAT_TYPES = {0: "F32", 1: "F16", 30: "BF16"}
CALL_PARTS = 8  # parts quant_rows_linear_parts multiplies in one call


def type_name(ggml_type: int) -> str:
    """``Q4_K`` for 12, and so on; ``type <id>`` for one this module does not know."""
    known = KERNEL_TYPES.get(ggml_type)
    if known:
        return known[0]
    if ggml_type in FLOAT_TYPES:
        return FLOAT_TYPES[ggml_type]
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"type {ggml_type}"


@dataclass(frozen=True)
class QuantPart:
    """``rows`` rows of one GGUF tensor standing for ``[rows, cols]`` values: ``blocks`` of
    ``ggml_type`` as ``uint8 [ceil(rows / 16), tile_bytes]`` tiles, or (a float type) a
    float32 ``[rows, cols]``."""

    ggml_type: int
    blocks: torch.Tensor
    cols: int
    rows: int

    @property
    def quantized(self) -> bool:
        return self.ggml_type in KERNEL_TYPES

    @property
    def nbytes(self) -> int:
        return self.blocks.numel() * self.blocks.element_size()

    def prefix(self, rows: int) -> QuantPart:
        """Its first ``rows`` rows (a view; a quantized part's last tile partly used): each output
        row is its own sum."""
        kept = -(-rows // TILE_ROWS) if self.quantized else rows
        return QuantPart(self.ggml_type, self.blocks[:kept], self.cols, rows)


def check_part(name: str, ggml_type: int, shape: tuple[int, int], row_bytes: int) -> None:
    """Refuse a tensor the kernel cannot multiply, naming it and the fix."""
    if ggml_type in FLOAT_TYPES:
        return
    if ggml_type not in KERNEL_TYPES:
        raise ConfigError(
            f"{name}: GGUF type {type_name(ggml_type)} is not one the quantized kernel "
            f"multiplies ({', '.join(v[0] for v in KERNEL_TYPES.values())}); load the model "
            "with model.weights=float (dequantized float32) instead")
    _, block, nbytes = KERNEL_TYPES[ggml_type]
    n, k = shape
    if k % block or row_bytes != k // block * nbytes:
        raise ConfigError(f"{name}: {type_name(ggml_type)} rows of {k} values need a multiple "
                          f"of {block} and {k // block * nbytes} bytes, got {row_bytes}")


@dataclass(frozen=True)
class QuantMatrix:
    """``W [N, K]``: its parts stacked along ``N`` (module doc)."""

    parts: tuple[QuantPart, ...]

    @property
    def shape(self) -> torch.Size:
        return torch.Size((sum(p.rows for p in self.parts), self.parts[0].cols))

    @property
    def dtype(self) -> torch.dtype:
        """What it computes in: float32 inputs and outputs."""
        return torch.float32

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def prefix(self, rows: int) -> QuantMatrix:
        """Its first ``rows`` output rows (views): the LM head over a vocabulary prefix."""
        kept, left = [], rows
        for part in self.parts:
            if left <= 0:
                break
            kept.append(part.prefix(min(left, part.rows)))
            left -= part.rows
        return QuantMatrix(tuple(kept))

    def rows_of(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids [T]`` -> the float32 rows ``W[ids] [T, K]`` (an embedding lookup), decoded as
        ggml decodes them.  A one-part matrix only."""
        (part,) = self.parts
        ids = ids.to(torch.int64).contiguous()
        if not part.quantized:
            return F.embedding(ids, part.blocks)
        out = torch.empty(ids.shape[0], part.cols, dtype=torch.float32)  # [T, K]
        err = quant_library().quant_dequantize_rows(
            part.ggml_type, part.blocks.data_ptr(), part.cols, ids.data_ptr(), ids.shape[0],
            out.data_ptr())
        if err:
            raise ValueError(f"quant_dequantize_rows: {type_name(part.ggml_type)} {part.cols}")
        return out


def quant_library():
    """The loaded kernel library (``specflow.quant.kernel``); ``ConfigError`` naming the
    fix where none runs."""
    status = kernel_status()
    if status.library is None:
        raise ConfigError(f"GGUF-quantized weights need the quantized rows kernel: {status.why}; "
                          "load the model with model.weights=float instead")
    return status.library


def quant_linear(x: torch.Tensor, w: QuantMatrix, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [T, K]`` -> ``x @ W.T + bias`` ``[T, N]`` float32 (module doc)."""
    x = x.to(torch.float32).contiguous()  # [T, K]
    rows, k = x.shape
    n_total = w.shape[0]
    y = torch.empty(rows, n_total, dtype=torch.float32)  # [T, N]
    threads = torch.get_num_threads()
    if len(w.parts) <= CALL_PARTS and all(part.quantized for part in w.parts):
        # one call: x quantized once per block size, one region of threads for all parts
        count = len(w.parts)
        types = (ctypes.c_int * count)(*(part.ggml_type for part in w.parts))
        blocks = (ctypes.c_void_p * count)(*(part.blocks.data_ptr() for part in w.parts))
        part_rows = (ctypes.c_long * count)(*(part.rows for part in w.parts))
        err = quant_library().quant_rows_linear_parts(count, types, blocks, part_rows, rows,
                                                      x.data_ptr(), k, y.data_ptr(), n_total,
                                                      threads)
        if err:
            shapes = ", ".join(f"{type_name(p.ggml_type)} [{p.rows}, {p.cols}]" for p in w.parts)
            raise ValueError(f"quant_rows_linear_parts: x {tuple(x.shape)} against {shapes}")
    else:  # part by part: a float part (or more parts than one call takes) among them
        col = 0
        for part in w.parts:
            if part.quantized:
                err = quant_library().quant_rows_linear(part.ggml_type, rows, x.data_ptr(), k,
                                                        part.blocks.data_ptr(), part.rows,
                                                        y.data_ptr() + col * 4, n_total, threads)
                if err:
                    raise ValueError(f"quant_rows_linear: x {tuple(x.shape)} against "
                                     f"{type_name(part.ggml_type)} [{part.rows}, {part.cols}]")
            else:
                y[:, col : col + part.rows] = F.linear(x, part.blocks)
            col += part.rows
    if bias is not None:
        y += bias
    return y


def dequantize(part: QuantPart) -> torch.Tensor:
    """A part's values as float32 ``[n, cols]`` (tests, and the fp32 oracle of one matrix)."""
    if not part.quantized:
        return part.blocks.float()
    ids = torch.arange(part.rows)
    return QuantMatrix((part,)).rows_of(ids)


def part_from_numpy(ggml_type: int, data: np.ndarray, cols: int) -> QuantPart:
    """A part over a GGUF tensor's data as the reader gives it (``uint8 [n, row_bytes]`` for a
    quantized type, repacked into tiles);
    a float type becomes float32 ``[n, cols]``."""
    if ggml_type in FLOAT_TYPES:
        values = torch.from_numpy(np.asarray(data)).reshape(-1, cols)
        return QuantPart(ggml_type, values.to(torch.float32).contiguous(), cols, values.shape[0])
    with warnings.catch_warnings():  # a read-only memory map: the kernel only reads it
        warnings.simplefilter("ignore", UserWarning)
        blocks = torch.from_numpy(np.ascontiguousarray(data)).view(torch.uint8)
    rows = data.shape[0]
    blocks = blocks.reshape(rows, -1)
    lib = quant_library()
    tile_bytes = lib.quant_tile_bytes(ggml_type, cols)
    tiles = torch.empty(-(-rows // TILE_ROWS), tile_bytes, dtype=torch.uint8)
    if lib.quant_repack(ggml_type, blocks.data_ptr(), rows, cols, tiles.data_ptr(),
                        torch.get_num_threads()):
        raise ValueError(f"quant_repack: {type_name(ggml_type)} [{rows}, {cols}]")
    return QuantPart(ggml_type, tiles, cols, rows)
