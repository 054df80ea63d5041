"""Row padding of packed matmuls (``model.min_rows``): run a 1-row pass on a few rows.

A decoding step multiplies every weight matrix by one row; a verification pass by k + 1.
On some CPUs oneDNN's packed fp32 kernels stream the weights markedly slower for one or two
rows than for four or five: on the 2-vCPU KVM `AMD EPYC` (torch ISA AVX512) of
``docs/performance.md`` ("How a round's cost is made") the probe pads the Qwen2.5-1.5B's
steps to 5 rows, which ran faster than one.  Elsewhere (another ISA, another oneDNN) it
may not be, so the row count is never assumed: ``model.min_rows`` gives it, or ``null``
probes it once per model and process on the model's own packed matrices
(``probe_min_rows``), and keeps 1 unless a row count is faster by more than ``MARGIN``.

The same probe prices a verification pass (``RowPrices``, ``specflow.costs``): it also times
``PRICED`` row counts (never chosen as padding), so a draft-length policy knows what k + 1
verify rows cost against a one-token step without fitting that from noisy round times.

It also times the same matrices unpacked (ordinary ``F.linear``) at every count: on some
CPUs the dense kernel beats the packed one at a few row counts (an Intel CPU ran the 0.5B's
1-row step dense in 82 ms against 112 packed).  Where dense is faster by more than
``MARGIN`` than packed at that count (padded as chosen), the model multiplies those row
counts with dense copies of its matrices (``use_dense_rows``: logged; the copies cost the
layers' memory once more, so they are made only where a count wins).

A model with int8 copies of its weights (``model.quantize=int8``,
``specflow.cpu.int8_weights``) has them timed too, at every count: its passes of the counts
where they beat the model's own matrices (packed as padded, or dense where dense runs) by more
than ``MARGIN`` multiply the int8 copies (``use_int8_rows``, logged) -- a small model's
drafting steps, measured 1.8x faster at one row on an AVX2-capped AMD EPYC, not its prefill.

A packed fp32 model whose CPU runs the float rows kernel (``specflow.cpu.float_rows``:
its own row-major HF matrices, no copy) has that kernel timed too, at the counts one call
takes (1 to ``rows_kernel.MAX_ROWS_F32``): its passes of the counts where it beats the packed
(or dense) ones by more than ``MARGIN`` run on it (``use_float_rows``, logged).  Measured on
an AMD EPYC capped at AVX2: decoding steps and verification passes of up to about 6 rows.
Which kernel runs a count, first match: int8 copies, the float rows kernel, dense copies,
the packed matrices (padded to ``min_rows``).

The matrices' times do not always rank whole passes the same way: on the 2-vCPU `AMD EPYC`
at AVX-512 the float rows kernel's 1-row matmuls timed level with oneDNN's padded ones (the
28 layers: 175 against 172 ms) while a whole 1-row decoding pass of the Qwen2.5-1.5B took
233 ms with the kernel against 191 without; capped at AVX2 the same check ran 216 against
298.  So where the probe chooses the float rows kernel, a whole pass at the fewest rows it
chose is timed with and without it, a few interleaved passes after a 32-token prefill, and
the kernel is kept only where that pass is faster with it (``WholePassCheck``,
``settle_float_rows``; logged and in the run's summary).  A pass needs keys and values,
which ``models/`` does not touch, so ``specflow.cpu.whole_pass`` times it once the models are
loaded (``specflow.app`` and the benchmarks call ``check_float_rows``).

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
from dataclasses import dataclass, field

import torch

from specflow.costs import RowPrices
from specflow.cpu.rows_kernel import MAX_ROWS_F32
from specflow.errors import ConfigError
from specflow.kv.base import LayeredLM
from specflow.models.native import MATRICES, NativeLM, dense, linear

log = logging.getLogger(__name__)

MARGIN = 0.05  # a padded row count must be this much faster than 1 row to be chosen
CANDIDATES = (1, 2, 3, 4, 5, 6)
# timed for RowPrices and the kernels' choice only (never padding): verify passes of longer
# drafts and trees, and batches; every count a float rows kernel call takes, as a count
# never timed never runs on it
PRICED = (7, 8, 9, 10, 11, 12, 16)


@dataclass(frozen=True)
class RowProbe:
    """What ``probe_min_rows`` measured: median seconds of the probed matmuls per candidate
    row count, the row count chosen (``choose_min_rows``), the seconds of the larger row
    counts timed for pricing only (``priced``), and the same matrices' seconds unpacked at
    every count (``dense``; empty where not timed), as int8 copies (``int8``; empty where
    the model has none) and by the float rows kernel (``float_rows``; counts up to one
    kernel call, empty where it does not run).  An unpacked model with int8 copies has its
    dense seconds in ``seconds`` (``chosen`` 1: only packed matmuls are padded)."""

    seconds: dict[int, float]
    chosen: int
    priced: dict[int, float] = field(default_factory=dict)
    dense: dict[int, float] = field(default_factory=dict)
    int8: dict[int, float] = field(default_factory=dict)
    float_rows: dict[int, float] = field(default_factory=dict)

    def packed_at(self, rows: int, min_rows: int) -> float | None:
        """Seconds of a packed pass of ``rows`` rows padded to ``min_rows`` (``None``: the
        padded count was not timed)."""
        return {**self.seconds, **self.priced}.get(max(rows, min_rows))


def choose_dense_rows(probe: RowProbe, min_rows: int, margin: float = MARGIN) -> frozenset[int]:
    """The row counts whose dense pass beats the packed one (padded to ``min_rows``) by more
    than ``margin`` (relative)."""
    out = set()
    for rows, dense_s in probe.dense.items():
        packed_s = probe.packed_at(rows, min_rows)
        if packed_s is not None and dense_s < (1.0 - margin) * packed_s:
            out.add(rows)
    return frozenset(out)


def _own_seconds(probe: RowProbe, rows: int, min_rows: int, dense_rows: frozenset[int],
                 float_rows: frozenset[int] = frozenset()) -> float | None:
    """Seconds of what the model's own weights run at ``rows``: the float rows kernel at
    ``float_rows``, dense at ``dense_rows``, else packed padded to ``min_rows``."""
    if rows in float_rows:
        return probe.float_rows.get(rows)
    if rows in dense_rows:
        return probe.dense.get(rows)
    return probe.packed_at(rows, min_rows)


def choose_float_rows(probe: RowProbe, min_rows: int, dense_rows: frozenset[int],
                      margin: float = MARGIN) -> frozenset[int]:
    """The row counts whose pass by the float rows kernel beats what the model runs there
    otherwise (dense at ``dense_rows``, else packed padded to ``min_rows``) by more than
    ``margin``."""
    out = set()
    for rows, float_s in probe.float_rows.items():
        own_s = _own_seconds(probe, rows, min_rows, dense_rows)
        if own_s is not None and float_s < (1.0 - margin) * own_s:
            out.add(rows)
    return frozenset(out)


def choose_int8_rows(probe: RowProbe, min_rows: int, dense_rows: frozenset[int],
                     margin: float = MARGIN,
                     float_rows: frozenset[int] = frozenset()) -> frozenset[int]:
    """The row counts whose int8 pass beats what the model runs there otherwise (the float
    rows kernel at ``float_rows``, its dense matrices at ``dense_rows``, else its own padded
    to ``min_rows``) by more than ``margin``."""
    out = set()
    for rows, int8_s in probe.int8.items():
        own_s = _own_seconds(probe, rows, min_rows, dense_rows, float_rows)
        if own_s is not None and int8_s < (1.0 - margin) * own_s:
            out.add(rows)
    return frozenset(out)


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
                   repeats: int = 5, priced: Sequence[int] = PRICED) -> RowProbe:
    """Time ``lm``'s own packed matmuls (the four matrices of its first ``layers`` layers:
    ``time_rows``) for each candidate row count and choose (``choose_min_rows``), and for
    each ``priced`` row count (``RowPrices``, never chosen), the int8 copies' where the
    model has them and the float rows kernel's on the model's own matrices where it has
    them (``NativeLM.float_rows_layers``: counts up to ``MAX_ROWS_F32``); an unpacked model
    is never padded (``chosen`` 1; nothing timed unless it has int8 copies, whose rivals are
    then its dense matrices).  A GGUF-quantized model (``NativeLM.quantized``) is timed on
    its one kernel at every count, for the prices only (``chosen`` 1)."""
    n = max(1, layers)
    used = [[getattr(w, m) for m in MATRICES] for w in lm.layers[:n]]
    int8 = [[getattr(w, m) for m in MATRICES] for w in lm.int8_layers[:n]]
    stacked = [[getattr(w, m) for m in MATRICES] for w in lm.float_rows_layers[:n]]
    counts = [*candidates, *(r for r in priced if r not in candidates)]
    if lm.quantized:  # GGUF blocks: one kernel at every count, never padded; priced
        timed = time_rows(used, counts, repeats)
        return RowProbe({r: timed[r] for r in candidates}, 1,
                        {r: t for r, t in timed.items() if r not in candidates})
    if not lm.packed and not int8:
        return RowProbe({}, 1)
    timed = time_rows(used, counts, repeats)  # the own matrices: packed, or dense
    seconds = {r: timed[r] for r in candidates}
    # the same layers dense (as many weights streamed: fewer would sit in the cache and
    # look faster than they run), fewer repeats: enough to see a kernel that wins clearly
    dense_timed = (time_rows([[dense(w) for w in layer] for layer in used], counts,
                             max(1, repeats // 2)) if lm.packed else {})
    float_counts = [r for r in counts if r <= MAX_ROWS_F32]
    return RowProbe(seconds, choose_min_rows(seconds) if lm.packed else 1,
                    {r: t for r, t in timed.items() if r not in candidates}, dense_timed,
                    time_rows(int8, counts, repeats) if int8 else {},
                    time_rows(stacked, float_counts, repeats) if stacked else {})


def use_dense_rows(lm: NativeLM, rows: frozenset[int]) -> None:
    """Multiply ``rows``-row passes of ``lm`` with dense copies of its packed matrices (made
    once, only when ``rows`` is not empty), every other count packed; logged."""
    lm.set_dense_rows(rows)
    if rows:
        log.info("%s: dense matmuls at %s rows (faster than packed there by the row probe)",
                 lm.info.name, sorted(rows))


def use_float_rows(lm: NativeLM, rows: frozenset[int]) -> None:
    """Multiply ``rows``-row passes of ``lm`` with the float rows kernel; logged."""
    lm.set_float_rows(rows)
    if rows:
        log.info("%s: float rows kernel at %s rows (faster than oneDNN there by the row probe)",
                 lm.info.name, sorted(rows))


@dataclass(frozen=True)
class WholePassCheck:
    """Median seconds of a whole pass of ``rows`` rows (the model's layers and LM head, as a
    decoding step or a verification runs them) with the float rows kernel at the row counts
    the matmul probe chose for it (``with_s``) and with what runs there otherwise
    (``without_s``), timed by ``specflow.cpu.whole_pass``.  The kernel is kept only where the
    pass is faster with it (``keeps``)."""

    rows: int
    with_s: float
    without_s: float

    @property
    def keeps(self) -> bool:
        return self.with_s < self.without_s


def settle_float_rows(lm: NativeLM, check: WholePassCheck) -> None:
    """Keep ``lm``'s float rows kernel if ``check`` says a whole pass is faster with it, else
    choose its kernels again without it (``choose_row_kernels`` keeps the verdict: the int8
    copies' counts are then chosen against what runs there instead); ``check`` is kept in
    ``lm.whole_pass_check`` (the run's summary) and logged."""
    lm.whole_pass_check = check
    chosen = sorted(lm.float_rows)
    log.info("%s: a whole %d-row pass took %.2f ms with the float rows kernel and %.2f ms "
             "without: %s", lm.info.name, check.rows, check.with_s * 1e3,
             check.without_s * 1e3,
             f"the kernel runs at {chosen} rows" if check.keeps
             else f"the kernel is not used (the matmul probe had chosen it at {chosen} rows)")
    if check.keeps:
        return
    probe = lm.row_probe
    if isinstance(probe, RowProbe):
        choose_row_kernels(lm, probe, lm.min_rows)
    else:  # counts set by hand, no probe to choose from
        lm.set_float_rows(frozenset())


def choose_row_kernels(lm: NativeLM, probe: RowProbe, min_rows: int) -> None:
    """Give ``lm`` the kernels the probe found fastest per row count at row padding
    ``min_rows``: dense copies, then the float rows kernel, then int8 copies (each against
    what runs there after the ones before it); logged.  The float rows kernel is then
    checked on a whole pass (``specflow.cpu.whole_pass.check_float_rows``, once the model can
    run one: ``settle_float_rows``); a model whose check dropped it (a process that builds
    several pipelines on one model) does not get it back."""
    use_dense_rows(lm, choose_dense_rows(probe, min_rows))
    if lm.float_rows_layers:
        chosen = choose_float_rows(probe, min_rows, lm.dense_rows)
        check = lm.whole_pass_check
        if isinstance(check, WholePassCheck) and not check.keeps:
            chosen = frozenset()
        use_float_rows(lm, chosen)
    if lm.int8_layers:
        use_int8_rows(lm, choose_int8_rows(probe, min_rows, lm.dense_rows,
                                           float_rows=lm.float_rows))


def use_int8_rows(lm: NativeLM, rows: frozenset[int]) -> None:
    """Multiply ``rows``-row passes of ``lm`` with its int8 copies; logged."""
    lm.set_int8_rows(rows)
    log.info("%s: int8 matmuls at %s rows (model.quantize=int8; faster there by the row probe)",
             lm.info.name, sorted(rows) or "no row count")


def apply_min_rows(lm: object, setting: int | None) -> None:
    """Set a native model's row padding from ``model.min_rows``: an int >= 1 as given,
    ``None`` the probed row count (probed once per model and process, logged), and with it
    the row counts that run dense or int8 copies.  A model with int8 copies and a given
    ``min_rows`` (no probe) runs its one-row passes on them.  Other backends have no packed
    matmuls: only 1 or ``None`` is accepted for them."""
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
        if lm.int8_layers:
            use_int8_rows(lm, frozenset({1}))
        return
    probe = row_probe(lm)
    lm.min_rows = probe.chosen
    choose_row_kernels(lm, probe, lm.min_rows)


def row_probe(lm: NativeLM) -> RowProbe:
    """``lm``'s row probe (``probe_min_rows``), run once per model and process (kept in
    ``lm.row_probe``, logged); its row padding is left as it is."""
    probe = lm.row_probe
    if not isinstance(probe, RowProbe):
        probe = lm.row_probe = probe_min_rows(lm)
        log.info("%s: packed matmul ms by rows %s (fastest beyond the margin: %d); dense %s%s%s",
                 lm.info.name, {r: round(s * 1e3, 2)
                                 for r, s in {**probe.seconds, **probe.priced}.items()},
                 probe.chosen, {r: round(s * 1e3, 2) for r, s in probe.dense.items()},
                 f"; int8 {({r: round(s * 1e3, 2) for r, s in probe.int8.items()})}"
                 if probe.int8 else "",
                 f"; float rows kernel "
                 f"{({r: round(s * 1e3, 2) for r, s in probe.float_rows.items()})}"
                 if probe.float_rows else "")
    return probe


def row_prices(lm: object) -> RowPrices | None:
    """The price of a verification pass of ``lm`` by row count (``RowPrices``), from the row
    probe this process ran on that very model (``model.min_rows=null``, the default, or a
    stage that needed the probe; a copy moved to another device or dtype has none);
    ``None`` where nothing was timed: ``model.min_rows`` given and never
    probed, another backend, weights that are not packed (a GPU's, an unpacked CPU
    model's).  A policy then measures the price itself."""
    if not isinstance(lm, NativeLM) or not isinstance(lm.row_probe, RowProbe):
        return None
    probe = lm.row_probe
    timed = {**probe.seconds, **probe.priced}
    if len(timed) < 2 or 1 not in timed:
        return None
    if not lm.dense_rows and not lm.int8_rows and not lm.float_rows:
        return RowPrices(timed, lm.min_rows)
    # Some counts run dense, int8 or the float rows kernel: a count's seconds are what the
    # model runs there (int8, float rows, dense, or packed padded to min_rows), so the
    # prices need no padding of their own.
    effective = {r: probe.int8[r] if r in lm.int8_rows and r in probe.int8
                 else probe.float_rows[r] if r in lm.float_rows and r in probe.float_rows
                 else probe.dense[r] if r in lm.dense_rows and r in probe.dense
                 else timed.get(max(r, lm.min_rows), t) for r, t in timed.items()}
    return RowPrices(effective, 1)


def row_padding_info(lm: object) -> dict[str, object]:
    """What a run's summary records of a model's row padding (``RunMeta.row_padding``):
    ``min_rows`` and, when it was probed, the probe's milliseconds by row count; with int8
    copies (``model.quantize=int8``) the kernel that multiplies them, ``int8_kernel``:
    ``rows`` (``specflow.cpu.rows_kernel``) or ``aten`` (``None`` without copies); the
    float rows kernel's milliseconds and row counts (``float_ms``, ``float_rows``) and the
    whole-pass check that kept or dropped it (``float_check``: ``WholePassCheck`` in ms;
    ``None`` where none ran)."""
    if not isinstance(lm, NativeLM):
        return {"min_rows": 1}
    probe = lm.row_probe
    probed = ({str(r): round(t * 1e3, 3)
               for r, t in sorted({**probe.seconds, **probe.priced}.items())}
              if isinstance(probe, RowProbe) else None)
    dense_ms = ({str(r): round(t * 1e3, 3) for r, t in sorted(probe.dense.items())}
                if isinstance(probe, RowProbe) and probe.dense else None)
    int8_ms = ({str(r): round(t * 1e3, 3) for r, t in sorted(probe.int8.items())}
               if isinstance(probe, RowProbe) and probe.int8 else None)
    float_ms = ({str(r): round(t * 1e3, 3) for r, t in sorted(probe.float_rows.items())}
                if isinstance(probe, RowProbe) and probe.float_rows else None)
    check = lm.whole_pass_check
    float_check = ({"rows": check.rows, "with_ms": round(check.with_s * 1e3, 3),
                    "without_ms": round(check.without_s * 1e3, 3)}
                   if isinstance(check, WholePassCheck) else None)
    kernel = None if lm.int8_head is None else "rows" if lm.int8_head.blocked else "aten"
    return {"min_rows": lm.min_rows, "probe_ms": probed, "dense_ms": dense_ms,
            "dense_rows": sorted(lm.dense_rows), "int8_ms": int8_ms,
            "int8_rows": sorted(lm.int8_rows), "int8_kernel": kernel, "float_ms": float_ms,
            "float_rows": sorted(lm.float_rows), "float_check": float_check}


def run_row_padding(lms: Sequence[LayeredLM]) -> dict[str, dict[str, object]]:
    """``RunMeta.row_padding``: ``row_padding_info`` of every model a run runs (the target
    first, then its drafters' models), by model name; a model named twice is recorded once."""
    return {lm.info.name: row_padding_info(lm) for lm in lms}
