"""The GGUF file's pages given back once its K-quants are repacked.

``release_pages`` drops a memory-mapped array's pages from this process (``MADV_DONTNEED``):
a K-quant's file bytes, once repacked into the kernel's tiles, would otherwise stay counted
in its resident memory.  The file stays mapped (a later read maps the pages again); where
``madvise`` is missing (not Linux) nothing happens.  The tiles take ordinary pages:
transparent huge pages gave no faster pass on a 2-vCPU EPYC (Zen 4).
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import platform

import numpy as np

MADV_DONTNEED = 4


@functools.cache
def _libc() -> ctypes.CDLL | None:
    if platform.system() != "Linux":
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def release_pages(data: np.ndarray) -> None:
    """Drop the whole pages of a memory-mapped array from this process (module doc)."""
    libc = _libc()
    if libc is None or data.nbytes == 0:
        return
    page = mmap.PAGESIZE
    start = -(-data.ctypes.data // page) * page
    end = (data.ctypes.data + data.nbytes) // page * page
    if end > start:
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_DONTNEED)
