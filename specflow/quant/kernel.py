"""The quantized rows kernel: a few rows times a GGUF-quantized matrix, weights read once.

``kernels/quant_rows.cpp`` (its header has the math and the invariants) multiplies ``M``
float32 rows by a matrix kept in ggml's own blocks (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K):
the activations are quantized to 8 bits per block, every block type is repacked once at
load into tiles of 16 weight rows (vector lanes are weight rows), each weight block is
decoded once per group of rows and multiplied in with integer dot products (one integer sum
a 32-block, a few per K-quant super-block, then their float steps), and a row's
result is the same bits whatever the other rows, their number or the threads -- so decoding
one row and verifying ``k+1`` rows agree exactly, which lossless speculation needs.

The same library holds the quantized layers' other kernels, built from the same flags:
the row-exact attention (``kernels/attend_rows.cpp``, ``specflow.quant.attention``), a
layer's work around its attention (``kernels/layer_rows.cpp``, ``specflow.quant.layer``) and
a full forward of all layers (``specflow.kv.fused``).

Three builds of the sources, chosen by probing the CPU:

- ``avx512`` (AVX2's flags and ``-mavx512f -mavx512bw -mavx512vl -mavx512vnni``) where
  ``/proc/cpuinfo`` also lists those (VNNI: 4 values of 16 weight rows in one product);
- ``avx2`` (``-mavx2 -mfma -mf16c``) where it lists AVX2, FMA and F16C;
- ``portable`` (no ISA flags) everywhere else.

All compute the same integer lanes and the same float sequence: the same bits (a test
checks each build this CPU runs against the portable one).  Built once per machine by the
system C++ compiler into ``<cache root>/kernels/`` (the file named by a hash of the source
and flags), loaded with ``ctypes``.
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

KERNELS = Path(__file__).with_name("kernels")
# compiled together into one library: the products, the row-exact attention, and a layer's
# work around its attention; the header they share counts in the library's hash
SOURCES = (KERNELS / "quant_rows.cpp", KERNELS / "attend_rows.cpp", KERNELS / "layer_rows.cpp")
HEADERS = (KERNELS / "vec_math.h",)
COMMON_FLAGS = ("-O3", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
AVX2_FLAGS = ("-mavx2", "-mfma", "-mf16c")
BUILD_FLAGS = {
    "avx512": (*AVX2_FLAGS, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"),
    "avx2": AVX2_FLAGS,
    "portable": (),
}
BUILD_ISA = {"portable": 0, "avx2": 1, "avx512": 2}  # what quant_rows_isa() returns
AVX2_CPU = {"avx2", "fma", "f16c"}
AVX512_CPU = AVX2_CPU | {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}
ENV_SWITCH = "SPECFLOW_QUANT_KERNEL"  # "0": none (GGUF weights refused); a build's name: it


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


def runnable_builds() -> tuple[str, ...]:
    """The builds this CPU can run, fastest first (``portable`` always last)."""
    flags = set((cpuinfo_field("flags") or "").split())
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return ("portable",)
    vector = [b for b, need in (("avx512", AVX512_CPU), ("avx2", AVX2_CPU)) if need <= flags]
    return (*vector, "portable")


def cpu_build() -> str:
    """The build this CPU runs: ``avx512`` on an x86-64 CPU with AVX2, FMA, F16C and
    AVX-512 F/BW/VL/VNNI, ``avx2`` with AVX2, FMA and F16C, else ``portable``."""
    return runnable_builds()[0]


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    try:
        _declare(lib)
    except AttributeError as err:  # a library built from other sources lacks a function
        raise OSError(f"{path}: {err}") from err
    return lib


def _declare(lib: ctypes.CDLL) -> None:
    """The argument and result types of the library's functions."""
    p, n, i = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
    lib.quant_rows_linear.argtypes = [i, i, p, n, p, n, p, n, i]
    lib.quant_rows_linear.restype = i
    lib.quant_rows_linear_parts.argtypes = [i, p, p, p, i, p, n, p, n, i]
    lib.quant_rows_linear_parts.restype = i
    lib.quant_dequantize_rows.argtypes = [i, p, n, p, n, p]
    lib.quant_dequantize_rows.restype = i
    lib.quant_row_bytes.argtypes = [i, n]
    lib.quant_row_bytes.restype = n
    lib.quant_tile_bytes.argtypes = [i, n]
    lib.quant_tile_bytes.restype = n
    lib.quant_repack.argtypes = [i, p, n, n, p, i]
    lib.quant_repack.restype = i
    lib.quant_attend_rows.argtypes = [i, i, i, i, p, n, p, p, n, p, p, p, ctypes.c_float, p, i]
    lib.quant_attend_rows.restype = i
    lib.quant_layer_before_attention.argtypes = [p, i, p, p, p, p, p, i]
    lib.quant_layer_before_attention.restype = i
    lib.quant_layer_after_attention.argtypes = [p, i, p, p, p, i]
    lib.quant_layer_after_attention.restype = i
    lib.quant_model_forward.argtypes = [p, i, p, p, p, p, p, p, p, p, p, p, p, i]
    lib.quant_model_forward.restype = i
    lib.quant_rows_isa.argtypes = []
    lib.quant_rows_isa.restype = i


def build_library(build: str) -> Path:
    """Compile (once per machine) the ``build`` variant; its path.  Raises
    ``RuntimeError`` with the compiler's message on failure."""
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C++ compiler (c++, g++ or clang++; or $CXX) on PATH")
    flags = (*COMMON_FLAGS, *BUILD_FLAGS[build])
    text = b"".join(source.read_bytes() for source in (*SOURCES, *HEADERS))
    digest = hashlib.sha256(text + " ".join(flags).encode()).hexdigest()[:16]
    out = cache_root() / "kernels" / f"quant_rows-{build}-{digest}.so"
    if out.exists():
        return out
    log.info("building the quantized rows kernel (%s) with %s into %s", build, compiler, out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *flags, *map(str, SOURCES), "-o", tmp],
                              capture_output=True, text=True, timeout=300)
        if done.returncode:
            names = " + ".join(source.name for source in SOURCES)
            raise RuntimeError(f"building {names} failed: {done.stderr.strip()[:300]}")
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


def load_library(path: Path, name: str) -> QuantKernel:
    """A library built elsewhere (other sources, the same flags), loaded under ``name``: to
    compare two versions of the kernel on one model (``scripts/profile_step.py
    --kernels``).  ``OSError`` where it does not load."""
    return QuantKernel(_load(path), name)


@functools.cache
def _builds_here() -> tuple[str, ...]:
    """``runnable_builds()`` read once per process: ``kernel_status`` runs on every product,
    and ``/proc/cpuinfo`` takes tens of microseconds to read."""
    return runnable_builds()


def kernel_status() -> QuantKernel:
    """The build this CPU runs, loaded; or why none runs.  ``SPECFLOW_QUANT_KERNEL`` unset
    (or ``1``): ``cpu_build()``; ``0``: none; a build's name (``avx2``, ``portable``): that
    build, where this CPU runs it (to compare builds on one machine)."""
    wanted = os.environ.get(ENV_SWITCH, "1")
    if wanted == "0":
        return QuantKernel(None, "", f"{ENV_SWITCH}=0")
    builds = _builds_here()
    if wanted == "1":
        return load_build(builds[0])
    if wanted not in builds:
        return QuantKernel(None, wanted, f"{ENV_SWITCH}={wanted}: this CPU runs "
                           f"{', '.join(builds)} (or 1 for the fastest, 0 for none)")
    return load_build(wanted)
