"""The rows kernels: a few rows times a model's matrices, at memory speed.

Two kernels in one library.  The *int8* one multiplies a draft model's int8 copies; the
*float* one (``rows_linear_f32``) a float32 model's own row-major matrices, no copy made.

``kernels/rows_linear.cpp`` multiplies ``M <= 8`` float rows by an int8 matrix stored
*blocked* (``Q [N, K] -> Qb [ceil(N/8), K, 8]``, zero-padded), streaming the weights once
with the accumulators in AVX2 registers (its header has the loop and the invariants):

    y[m, n] = s_n * sum_{k=0..K-1} x[m, k] q[n, k]  (+ b_n)      left to right, in float

A row's result is the same whatever the other rows, their number or the thread split.
Measured on a 2-core AMD EPYC (Zen 4) capped at AVX2 (``scripts/profile_step.py --model
qwen2.5-coder-0.5b --context 400 --int8``, a whole step): 31 ms at 1 row and 58 ms at 6 rows
against 42 and 99 ms with ATen's ``_weight_int8pack_mm`` (bf16 activations); the kernel keeps
the activations in float32 as well.

The float kernel multiplies ``M <= 12`` float32 rows by a row-major ``W [N, K]`` (the HF
model's own tensors; a fused matrix such as q/k/v is passed as its parts, each written into
its own columns of ``y``), 8 lanes a step along ``k`` and a fixed horizontal sum:

    y[m, n] = hsum8(sum over k steps of x[m, k:k+8] * W[n, k:k+8]) (+ tail) (+ b_n)

A row's result is again the same whatever the other rows or the threads.  Measured on the
same CPU capped at AVX2, four layers of the Qwen2.5-1.5B's shapes (750 MB of fp32 weights,
ms; ``docs/performance.md``): 1 row 25.8 against oneDNN's packed 30.5, 4 rows 26.9 against
37.8, 6 rows 30.5 against 38.8; from about 9 rows the two are level, and the row
probe (``specflow.cpu.row_padding``) picks per row count.

It is C++ built once per machine by the system compiler (``c++``/``g++``, flags ``FLAGS``)
into ``<cache root>/kernels/`` (the file named by a hash of the source and flags) and loaded
with ``ctypes``.  ``kernel_status()`` says whether it is usable and, if not, why: it needs an
x86-64 CPU with AVX2 and FMA (``/proc/cpuinfo``), a compiler, a successful build, and
``SPECFLOW_ROWS_KERNEL`` not ``0``.  Where it is not, int8 copies keep ATen's layout and
kernel (``specflow.cpu.int8_weights``): one INFO line says why.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from specflow.cache_root import cache_root
from specflow.cpu import detect as cpu

log = logging.getLogger("specflow")

SOURCE = Path(__file__).with_name("kernels") / "rows_linear.cpp"
FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
ENV_SWITCH = "SPECFLOW_ROWS_KERNEL"  # "0": never use the kernel
MAX_ROWS = 8  # rows per int8 kernel call; more are multiplied 8 at a time
MAX_ROWS_F32 = 12  # rows per float kernel call; more are multiplied 12 at a time
BLOCK = 8  # outputs per block of the blocked layout


@dataclass(frozen=True)
class KernelStatus:
    """Whether the rows kernel runs here (``library`` loaded) and, if not, why."""

    library: ctypes.CDLL | None
    why: str = ""

    @property
    def available(self) -> bool:
        return self.library is not None


def _cpu_flags() -> set[str]:
    """The ``flags`` of ``/proc/cpuinfo`` (empty where there is none)."""
    return set((cpu.cpuinfo_field("flags") or "").split())


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def _build(compiler: str, out: Path) -> None:
    """Compile ``SOURCE`` into ``out`` (atomically: a finished file or none)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", tmp], check=True,
                       capture_output=True, text=True, timeout=300)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    p, n = ctypes.c_void_p, ctypes.c_long
    lib.rows_linear_i8.argtypes = [ctypes.c_int, p, n, p, p, p, p, n, ctypes.c_int]
    lib.rows_linear_i8.restype = ctypes.c_int
    lib.rows_linear_f32.argtypes = [ctypes.c_int, p, n, p, p, p, n, n, ctypes.c_int]
    lib.rows_linear_f32.restype = ctypes.c_int
    return lib


@functools.cache
def kernel_status() -> KernelStatus:
    """Probe, build (once per machine) and load the kernel; once per process
    (``kernel_status.cache_clear()`` probes again)."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return KernelStatus(None, f"{ENV_SWITCH}=0")
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return KernelStatus(None, f"the CPU is {platform.machine()}, not x86-64")
    flags = _cpu_flags()
    if not cpu.probe_cpu().avx2 or "fma" not in flags:
        return KernelStatus(None, "the CPU lacks AVX2 or FMA")
    compiler = _compiler()
    if compiler is None:
        return KernelStatus(None, "no C++ compiler (c++, g++ or clang++; or $CXX) on PATH")
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode()).hexdigest()[:16]
    path = cache_root() / "kernels" / f"rows_linear-{digest}.so"
    try:
        if not path.exists():
            log.info("building the rows kernels with %s into %s", compiler, path)
            _build(compiler, path)
        return KernelStatus(_load(path))
    except subprocess.CalledProcessError as err:  # the compiler's own message
        return KernelStatus(None, f"building {SOURCE.name} failed: {err.stderr.strip()[:300]}")
    except (OSError, subprocess.SubprocessError) as err:
        return KernelStatus(None, f"building {SOURCE.name} failed: {err}")


def block_int8(q: torch.Tensor) -> torch.Tensor:
    """``q [N, K]`` int8 -> ``[ceil(N/8), K, 8]``: block ``b`` holds outputs ``8b .. 8b+7``
    (zero rows padding the last), ``[b, k, j] = q[8b + j, k]``."""
    n, k = q.shape
    blocks = -(-n // BLOCK)
    padded = F.pad(q, (0, 0, 0, blocks * BLOCK - n))  # [blocks * 8, K]
    return padded.view(blocks, BLOCK, k).permute(0, 2, 1).contiguous()


def rows_linear_i8(x: torch.Tensor, qb: torch.Tensor, scale: torch.Tensor,
                   bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """``x [T, K]`` (any float dtype) -> ``x @ (s * q).T + bias`` ``[T, N]`` float32, ``qb``
    from ``block_int8``, ``scale [N]`` and ``bias [N]`` float32; 8 rows a kernel call."""
    lib = kernel_status().library
    if lib is None:
        raise RuntimeError(f"the int8 rows kernel is not available: {kernel_status().why}")
    rows, k = x.shape
    y = torch.empty(rows, out_features, dtype=torch.float32)  # [T, N]
    threads = torch.get_num_threads()
    bias_ptr = 0 if bias is None else bias.data_ptr()
    for start in range(0, rows, MAX_ROWS):
        part = x[start : start + MAX_ROWS]
        xt = part.t().to(torch.float32).contiguous()  # [K, M]
        out = y[start : start + MAX_ROWS]  # [M, N], contiguous rows of y
        err = lib.rows_linear_i8(part.shape[0], xt.data_ptr(), k, qb.data_ptr(),
                                 scale.data_ptr(), bias_ptr, out.data_ptr(), out_features,
                                 threads)
        if err:
            raise ValueError(f"rows_linear_i8: bad shape x {tuple(x.shape)}, N {out_features}")
    return y


def rows_linear_f32(x: torch.Tensor, parts: tuple[torch.Tensor, ...],
                    bias: torch.Tensor | None) -> torch.Tensor:
    """``x [T, K]`` (any float dtype) -> ``x @ W.T + bias`` ``[T, N]`` float32, where ``W`` is
    the parts ``[n_i, K]`` (contiguous float32, row-major) stacked along ``N = sum n_i`` and
    ``bias [N]`` float32; 12 rows a kernel call, one call per part."""
    lib = kernel_status().library
    if lib is None:
        raise RuntimeError(f"the float rows kernel is not available: {kernel_status().why}")
    rows, k = x.shape
    n_total = sum(w.shape[0] for w in parts)
    if any(w.dtype != torch.float32 or not w.is_contiguous() or w.shape[1] != k for w in parts):
        raise ValueError(f"rows_linear_f32 needs contiguous float32 [n, {k}] parts, got "
                         f"{[(tuple(w.shape), w.dtype) for w in parts]}")
    y = torch.empty(rows, n_total, dtype=torch.float32)  # [T, N]
    threads = torch.get_num_threads()
    f32 = 4  # bytes a float
    for start in range(0, rows, MAX_ROWS_F32):
        block = x[start : start + MAX_ROWS_F32].to(torch.float32).contiguous()  # [M, K]
        out = y.data_ptr() + start * n_total * f32  # y[start, 0]
        col = 0
        for w in parts:
            b = 0 if bias is None else bias.data_ptr() + col * f32
            err = lib.rows_linear_f32(block.shape[0], block.data_ptr(), k, w.data_ptr(), b,
                                      out + col * f32, n_total, w.shape[0], threads)
            if err:
                raise ValueError(f"rows_linear_f32: bad shape x {tuple(x.shape)}, "
                                 f"part {tuple(w.shape)}")
            col += w.shape[0]
    return y
