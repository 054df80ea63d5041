"""The quantized rows kernel: a few rows times a GGUF-quantized matrix, weights read once.

``kernels/quant_rows.cpp`` (its header has the math and the invariants) multiplies ``M``
float32 rows by a matrix kept in ggml's own blocks (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K):
the activations are quantized to 8 bits per block, each weight block is decoded once per
call and multiplied into every row with integer dot products, and a row's result is the
same bits whatever the other rows, their number or the threads -- so decoding one row and
verifying ``k+1`` rows agree exactly, which lossless speculation needs.

Two builds of the one source, chosen by probing the CPU:

- ``avx2`` (``-mavx2 -mfma -mf16c``) where ``/proc/cpuinfo`` lists AVX2, FMA and F16C;
- ``portable`` (no ISA flags) everywhere else.

Both compute the same integer lanes and the same float sequence: the same bits (a test
checks it).  Built once per machine by the system C++ compiler into ``<cache
root>/kernels/`` (the file named by a hash of the source and flags), loaded with ``ctypes``.
``kernel_status()`` says which build runs, or why none does (no compiler, a failed build,
``SPECFLOW_QUANT_KERNEL=0``).
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

from specflow.cache_root import cache_root
from specflow.cpu.detect import cpuinfo_field

log = logging.getLogger("specflow")

SOURCE = Path(__file__).with_name("kernels") / "quant_rows.cpp"
COMMON_FLAGS = ("-O3", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
BUILD_FLAGS = {"avx2": ("-mavx2", "-mfma", "-mf16c"), "portable": ()}
ENV_SWITCH = "SPECFLOW_QUANT_KERNEL"  # "0": no quantized kernel (GGUF weights refused)


@dataclass(frozen=True)
class QuantKernel:
    """A loaded build of the kernel (``library``) and which (``build``), or why none."""

    library: ctypes.CDLL | None
    build: str = ""
    why: str = ""

    @property
    def available(self) -> bool:
        return self.library is not None


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def cpu_build() -> str:
    """The build this CPU runs: ``avx2`` on an x86-64 CPU with AVX2, FMA and F16C, else
    ``portable``."""
    flags = set((cpuinfo_field("flags") or "").split())
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    return "avx2" if x86 and {"avx2", "fma", "f16c"} <= flags else "portable"


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    p, n, i = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
    lib.quant_rows_linear.argtypes = [i, i, p, n, p, n, p, n, i]
    lib.quant_rows_linear.restype = i
    lib.quant_dequantize_rows.argtypes = [i, p, n, p, n, p]
    lib.quant_dequantize_rows.restype = i
    lib.quant_row_bytes.argtypes = [i, n]
    lib.quant_row_bytes.restype = n
    lib.quant_rows_avx2.argtypes = []
    lib.quant_rows_avx2.restype = i
    return lib


def build_library(build: str) -> Path:
    """Compile (once per machine) the ``build`` variant; its path.  Raises
    ``RuntimeError`` with the compiler's message on failure."""
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C++ compiler (c++, g++ or clang++; or $CXX) on PATH")
    flags = (*COMMON_FLAGS, *BUILD_FLAGS[build])
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(flags).encode()).hexdigest()[:16]
    out = cache_root() / "kernels" / f"quant_rows-{build}-{digest}.so"
    if out.exists():
        return out
    log.info("building the quantized rows kernel (%s) with %s into %s", build, compiler, out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *flags, str(SOURCE), "-o", tmp], capture_output=True,
                              text=True, timeout=300)
        if done.returncode:
            raise RuntimeError(f"building {SOURCE.name} failed: {done.stderr.strip()[:300]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


@functools.cache
def load_build(build: str) -> QuantKernel:
    """The ``build`` variant loaded (built first if needed), or why it cannot be."""
    try:
        return QuantKernel(_load(build_library(build)), build)
    except (RuntimeError, OSError, subprocess.SubprocessError) as err:
        return QuantKernel(None, build, str(err))


def kernel_status() -> QuantKernel:
    """The build this CPU runs (``cpu_build``), loaded; or why none runs."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return QuantKernel(None, "", f"{ENV_SWITCH}=0")
    return load_build(cpu_build())
