"""Row padding of packed matmuls (``model.min_rows``): run a 1-row pass on a few rows.

A decoding step multiplies every weight matrix by one row; a verification pass by k + 1.
On some CPUs oneDNN's packed fp32 kernels stream the weights markedly slower for one or two
rows than for four or five: on the 2-vCPU AVX-512 `AMD EPYC` of ``docs/benchmarks.md``
§16.3, a Qwen2.5-1.5B layer's four matmuls took 9.3 ms at 1 row, 10.4 at 2 and 7.1 at 5 (the
weights read from memory, as in a forward pass).  There a plain step is faster padded to 5
rows than run on 1.  Elsewhere (another ISA, another oneDNN) it may not be, so the row count
is never assumed: ``model.min_rows`` gives it, or ``null`` probes it once per model and
process on the model's own packed matrices (``probe_min_rows``), and keeps 1 unless a row
count is faster by more than ``MARGIN``.

Padding appends zero rows to the input of each packed multiply and drops their outputs
(``specflow.models.native.linear``).  Every output row depends only on its own input row;
a kernel chosen for another row count may round differently in the last bits, as a
verification pass of k + 1 rows already does against a decoding step.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from specflow.errors import ConfigError
from specflow.models.native import NativeLM, linear

log = logging.getLogger(__name__)

MARGIN = 0.05  # a padded row count must be this much faster than 1 row to be chosen
CANDIDATES = (1, 2, 3, 4, 5, 6)


@dataclass(frozen=True)
class RowProbe:
    """What ``probe_min_rows`` measured: median seconds of the probed matmuls per row count,
    and the row count chosen (``choose_min_rows``)."""

    seconds: dict[int, float]
    chosen: int


def choose_min_rows(seconds: Mapping[int, float], margin: float = MARGIN) -> int:
    """The row count whose pass is fastest, if it beats 1 row by more than ``margin``
    (relative); else 1 (no padding)."""
    if 1 not in seconds:
        raise ValueError("the probe must time 1 row (the unpadded pass)")
    best = min(seconds, key=lambda r: (seconds[r], r))
    return best if seconds[best] < (1.0 - margin) * seconds[1] else 1


@torch.inference_mode()
def time_rows(layers: Sequence[Sequence[torch.Tensor]], candidates: Sequence[int] = CANDIDATES,
              repeats: int = 5) -> dict[int, float]:
    """Median seconds of one pass over ``layers`` (each a list of packed ``[out, in]``
    matrices, each multiplied by ``rows`` rows of its own input width) per row count; row
    counts interleaved in alternating order, a first untimed round warming up."""
    if not layers or not layers[0]:
        raise ValueError("time_rows needs at least one layer of matrices")
    dtype = layers[0][0].dtype
    seconds: dict[int, list[float]] = {r: [] for r in candidates}
    order = list(candidates)
    for it in range(repeats + 1):
        for rows in (order if it % 2 == 0 else order[::-1]):
            inputs = {w.shape[1]: torch.zeros(rows, w.shape[1], dtype=dtype)
                      for layer in layers for w in layer}
            t0 = time.perf_counter()
            for layer in layers:
                for w in layer:
                    linear(inputs[w.shape[1]], w, None)
            if it > 0:
                seconds[rows].append(time.perf_counter() - t0)
    return {r: statistics.median(ts) for r, ts in seconds.items()}


def probe_min_rows(lm: NativeLM, candidates: Sequence[int] = CANDIDATES, layers: int = 4,
                   repeats: int = 5) -> RowProbe:
    """Time ``lm``'s own packed matmuls (the four matrices of its first ``layers`` layers:
    ``time_rows``) for each row count and choose (``choose_min_rows``); an unpacked model is
    never padded (``chosen`` 1, nothing timed)."""
    if not lm.packed:
        return RowProbe({}, 1)
    used = [[w.wqkv, w.wo, w.w_gate_up, w.w_down] for w in lm.layers[: max(1, layers)]]
    seconds = time_rows(used, candidates, repeats)
    return RowProbe(seconds, choose_min_rows(seconds))


def apply_min_rows(lm: object, setting: int | None) -> None:
    """Set a native model's row padding from ``model.min_rows``: an int >= 1 as given,
    ``None`` the probed row count (probed once per model and process, logged).  Other
    backends have no packed matmuls: only 1 or ``None`` is accepted for them."""
    if setting is not None and (not isinstance(setting, int) or setting < 1):
        raise ConfigError(
            f"model.min_rows must be an integer >= 1 or null (probe), got {setting!r}"
        )
    if not isinstance(lm, NativeLM):
        if setting not in (None, 1):
            raise ConfigError(
                f"model.min_rows={setting} pads the native backend's packed matmuls; this "
                f"model runs on another backend: set model.min_rows=1 or model.backend=native"
            )
        return
    if setting is not None:
        lm.min_rows = setting
        return
    lm.min_rows = row_probe(lm).chosen


def row_probe(lm: NativeLM) -> RowProbe:
    """``lm``'s row probe (``probe_min_rows``), run once per model and process (kept in
    ``lm.row_probe``, logged); its row padding is left as it is."""
    probe = lm.row_probe
    if not isinstance(probe, RowProbe):
        probe = lm.row_probe = probe_min_rows(lm)
        log.info("%s: packed matmul ms by rows %s (fastest beyond the margin: %d)",
                 lm.info.name, {r: round(s * 1e3, 2) for r, s in probe.seconds.items()},
                 probe.chosen)
    return probe


def row_padding_info(lm: object) -> dict[str, object]:
    """What a run's summary records of a model's row padding (``RunMeta.row_padding``):
    ``min_rows`` and, when it was probed, the probe's milliseconds by row count."""
    if not isinstance(lm, NativeLM):
        return {"min_rows": 1}
    probe = lm.row_probe
    probed = ({str(r): round(t * 1e3, 3) for r, t in probe.seconds.items()}
              if isinstance(probe, RowProbe) else None)
    return {"min_rows": lm.min_rows, "probe_ms": probed}

