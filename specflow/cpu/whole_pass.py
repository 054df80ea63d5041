"""Whole passes of a loaded model timed on its own session: the check that keeps the float
rows kernel only where a whole pass runs faster with it.

The row probe (``specflow.cpu.row_padding``) chooses a kernel per row count from the
matrices' times alone.  At AVX-512 on a 2-vCPU AMD EPYC those put the float rows kernel level
with oneDNN at one row while a whole decoding pass of the Qwen2.5-1.5B ran 22 % slower with it
(docs/performance.md, "A whole pass decides").  A pass needs keys and values, which
``models/`` does not touch, so the check runs here, once the stages have loaded and probed
their models: ``specflow.app`` calls ``check_float_rows`` before a CPU run, and the
benchmarks after they choose the kernels.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable

import torch

from specflow.cpu.row_padding import WholePassCheck, settle_float_rows
from specflow.kv.session import ModelSession
from specflow.models.native import NativeLM

CONTEXT = 32  # positions cached before the timed passes
REPEATS = 4  # timed passes of each setting, after one untimed pair


@torch.inference_mode()
def time_whole_passes(lm: NativeLM, float_rows: frozenset[int], rows: int, min_rows: int,
                      repeats: int = REPEATS) -> WholePassCheck:
    """Time whole passes of ``rows`` rows of ``lm`` (its layers and LM head) after
    ``CONTEXT`` cached positions, alternately with the float rows kernel at ``float_rows``
    and without it (the packed matrices padded to ``min_rows``, dense copies where they
    run; no int8 copies): ``repeats`` of each after one untimed pair, medians.  The model's
    kernel choices and padding are as before afterwards."""
    saved = lm.float_rows, lm.int8_rows, lm.min_rows
    vocab = lm.info.vocab_size
    tokens = [(7 + 31 * i) % vocab for i in range(CONTEXT + rows)]
    layers = lm.info.num_layers
    start = CONTEXT - 1  # the first timed position
    session = ModelSession(lm, CONTEXT + rows)
    session.set_tokens(tokens[:start])
    session.hidden(layers, start)  # positions [0, start) cached
    timed: dict[bool, list[float]] = {True: [], False: []}
    try:
        lm.set_int8_rows(frozenset())
        lm.min_rows = min_rows
        for it in range(repeats + 1):
            for with_kernel in ((True, False) if it % 2 == 0 else (False, True)):
                lm.set_float_rows(float_rows if with_kernel else frozenset())
                session.set_tokens(tokens[: start + rows])
                t0 = time.perf_counter()
                session.logits(layers, start, start + rows)  # one pass of `rows` rows
                if it > 0:
                    timed[with_kernel].append(time.perf_counter() - t0)
                session.set_tokens(tokens[:start])  # back: the cache keeps [0, start)
    finally:
        lm.set_float_rows(saved[0])
        lm.set_int8_rows(saved[1])
        lm.min_rows = saved[2]
    return WholePassCheck(rows, statistics.median(timed[True]), statistics.median(timed[False]))


def check_float_rows(models: Iterable[object]) -> None:
    """For each native model of ``models`` that runs some row counts on the float rows
    kernel and has not been checked: time a whole pass at the fewest of them with and
    without it (``time_whole_passes``) and keep the kernel only where the pass is faster
    with it (``settle_float_rows``).  Other models are left alone."""
    for lm in models:  # a model named twice is checked once: the check is kept on it
        if not isinstance(lm, NativeLM) or not lm.float_rows or lm.whole_pass_check is not None:
            continue
        check = time_whole_passes(lm, lm.float_rows, min(lm.float_rows), lm.min_rows)
        settle_float_rows(lm, check)
