"""Row padding of packed matmuls (``model.min_rows``): the choice rule both ways, the probe on
a packed and an unpacked model, the config's refusals, and greedy identity when padded."""

from __future__ import annotations

import pytest
import torch

from specflow.costs import RowPrices
from specflow.cpu.row_padding import (
    RowProbe,
    WholePassCheck,
    apply_min_rows,
    choose_dense_rows,
    choose_float_rows,
    choose_int8_rows,
    choose_min_rows,
    probe_min_rows,
    row_padding_info,
    row_prices,
    settle_float_rows,
)
from specflow.engine import SpeculativePipeline
from specflow.errors import ConfigError
from specflow.models.native import NativeLM, linear, pack
from specflow.models.tiny import tiny_hf_model, tiny_model_info
from specflow.scheduler import generate
from stages.acceptors.standard import StandardAcceptor
from stages.drafters.pld import PLDDrafter
from stages.verifiers.full import FullVerifier
from tests.conftest import hf_greedy

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                  reason="this torch has no oneDNN (nothing is packed)")


def test_choose_min_rows_pads_only_when_it_pays():
    assert choose_min_rows({1: 9.32, 2: 10.43, 3: 8.41, 4: 7.30, 5: 7.12, 6: 7.51}) == 5
    assert choose_min_rows({1: 1.00, 4: 0.97}) == 1  # within the 5 % margin: not worth it
    assert choose_min_rows({1: 1.00, 2: 1.20, 4: 1.10}) == 1  # one row is fastest
    assert choose_min_rows({1: 1.00, 3: 0.90, 4: 0.90}) == 3  # a tie: the fewer rows
    with pytest.raises(ValueError, match="1 row"):
        choose_min_rows({2: 1.0, 4: 0.5})


@needs_onednn
def test_padded_linear_keeps_every_real_row():
    torch.manual_seed(0)
    w = torch.randn(48, 32)
    x = torch.randn(1, 32)
    packed = pack(w)
    one = linear(x, packed, None)
    padded = linear(x, packed, None, min_rows=5)
    assert padded.shape == (1, 48)
    assert torch.allclose(padded, one, atol=1e-5)
    assert torch.allclose(linear(x, w, None, min_rows=5), x @ w.T, atol=1e-5)  # unpacked: as is


@needs_onednn
def test_probe_times_every_row_count_of_a_packed_model_and_none_of_an_unpacked_one():
    hf = tiny_hf_model("llama", num_layers=2)
    packed = NativeLM.from_hf(hf, tiny_model_info(hf, "tiny-probe"))
    probe = probe_min_rows(packed, candidates=(1, 2, 4), layers=2, repeats=2, priced=(8, 16))
    assert sorted(probe.seconds) == [1, 2, 4] and all(s > 0 for s in probe.seconds.values())
    assert probe.chosen == choose_min_rows(probe.seconds)
    # the float rows kernel where it runs: the counts one call takes (16 > 12 is not)
    assert sorted(probe.float_rows) == ([1, 2, 4, 8] if packed.float_rows_layers else [])
    unpacked = NativeLM.from_hf(hf, tiny_model_info(hf, "tiny-probe"), packed=False)
    assert probe_min_rows(unpacked) == RowProbe({}, 1)


def test_apply_min_rows_sets_probes_once_and_refuses_bad_values(monkeypatch):
    hf = tiny_hf_model("llama", num_layers=2)
    lm = NativeLM.from_hf(hf, tiny_model_info(hf, "tiny-apply"), packed=False)
    apply_min_rows(lm, 4)
    assert lm.min_rows == 4
    calls = []

    def fake_probe(model):
        calls.append(model)
        return RowProbe({1: 1.0, 3: 0.5}, 3)

    monkeypatch.setattr("specflow.cpu.row_padding.probe_min_rows", fake_probe)
    apply_min_rows(lm, None)
    apply_min_rows(lm, None)
    assert lm.min_rows == 3 and calls == [lm]  # probed once, then remembered
    assert row_padding_info(lm) == {"min_rows": 3, "probe_ms": {"1": 1000.0, "3": 500.0},
                                    "dense_ms": None, "dense_rows": [], "int8_ms": None,
                                    "int8_rows": [], "int8_kernel": None,
                                    "float_ms": None, "float_rows": [], "float_check": None}
    assert row_padding_info(hf) == {"min_rows": 1}
    for bad in (0, -2, "four"):
        with pytest.raises(ConfigError, match="min_rows"):
            apply_min_rows(lm, bad)
    with pytest.raises(ConfigError, match="another backend"):
        apply_min_rows(hf, 4)
    apply_min_rows(hf, 1)  # nothing to pad on another backend: accepted


@needs_onednn
@pytest.mark.parametrize("min_rows", [1, 5])
def test_padded_decoding_equals_hf_greedy(min_rows):
    """Plain decoding (1-row steps) and prompt lookup (short verification passes), padded to
    5 rows or not: HF generate's greedy tokens."""
    hf = tiny_hf_model("llama", num_layers=3, seed=4)
    lm = NativeLM.from_hf(hf, tiny_model_info(hf, f"tiny-rows-{min_rows}"))
    assert lm.packed
    apply_min_rows(lm, min_rows)
    prompts = [[1, 5, 9, 17, 33, 5, 9], [3, 4, 5, 6, 3, 4, 5], [2]]
    for drafter in (None, PLDDrafter(k=3)):
        pipe = SpeculativePipeline(FullVerifier(lm), StandardAcceptor(), drafter=drafter)
        for p in prompts:
            assert generate(pipe, p, 20).tokens == hf_greedy(hf, p, 20)


def test_row_prices_are_the_probes_seconds_against_a_step_padding_included():
    """price(n) = S(max(n, m)) / S(max(1, m)): measured counts exactly, linear between two,
    the line through the two largest beyond them; a step (1 row) is 1."""
    seconds = {1: 10.0, 2: 11.0, 4: 12.0, 8: 16.0, 12: 22.0}
    prices = RowPrices(seconds, min_rows=1)
    assert [prices(n) for n in (1, 2, 3, 4, 8, 12)] == [1.0, 1.1, 1.15, 1.2, 1.6, 2.2]
    assert prices(6) == pytest.approx(1.4) and prices(16) == pytest.approx(2.8)
    padded = RowPrices(seconds, min_rows=4)  # every pass of <= 4 rows runs 4: a step
    assert [padded(n) for n in (1, 3, 4)] == [1.0, 1.0, 1.0]
    assert padded(8) == pytest.approx(16 / 12)
    with pytest.raises(ValueError, match="1 row"):
        RowPrices({2: 1.0, 4: 2.0}, 1)


def test_row_prices_come_only_from_a_probe_this_process_ran():
    hf = tiny_hf_model("llama", num_layers=2)
    lm = NativeLM.from_hf(hf, tiny_model_info(hf, "tiny-prices"))
    assert row_prices(lm) is None and lm.row_probe is None  # min_rows given: not probed
    assert row_prices(hf) is None  # another backend
    lm.row_probe = RowProbe({1: 2.0, 2: 2.0, 3: 3.0}, 1, priced={8: 8.0})
    lm.min_rows = 2
    prices = row_prices(lm)
    assert prices == RowPrices({1: 2.0, 2: 2.0, 3: 3.0, 8: 8.0}, 2)
    assert prices(1) == 1.0 and prices(3) == 1.5 and prices(8) == 4.0
    assert row_padding_info(lm)["probe_ms"] == {"1": 2000.0, "2": 2000.0, "3": 3000.0,
                                                "8": 8000.0}


@needs_onednn
def test_the_probe_times_priced_row_counts_without_choosing_them():
    hf = tiny_hf_model("llama", num_layers=2)
    packed = NativeLM.from_hf(hf, tiny_model_info(hf, "tiny-priced"))
    probe = probe_min_rows(packed, candidates=(1, 2), layers=1, repeats=1, priced=(2, 8))
    assert sorted(probe.seconds) == [1, 2] and sorted(probe.priced) == [8]
    assert probe.chosen in (1, 2)


def test_row_prices_never_fall_with_more_rows_nor_below_a_step():
    """Noise or a kernel running 3 rows faster than 2 never prices a longer pass below a
    shorter one (the running maximum), the line beyond the largest count never falls, and a
    padding that was not timed is priced on the interpolated line."""
    seconds = {1: 10.0, 2: 12.0, 3: 11.0, 6: 9.0, 8: 13.0, 12: 12.0}
    prices = RowPrices(seconds, min_rows=1)
    assert [prices(n) for n in (1, 2, 3, 6, 8, 12, 16, 40)] == [1.0, 1.2, 1.2, 1.2, 1.3, 1.3,
                                                                1.3, 1.3]
    padded = RowPrices(seconds, min_rows=6)  # the fastest count: a step runs 6 rows
    assert padded(1) == padded(6) == 1.0
    assert padded(7) == pytest.approx(11 / 9) and padded(8) == pytest.approx(13 / 9)
    untimed = RowPrices(seconds, min_rows=20)  # beyond the counts: flat from 12 on
    assert untimed(1) == untimed(30) == 1.0
    for bad in ({1: 0.0, 2: 1.0}, {1: -1.0, 2: 1.0}):
        with pytest.raises(ValueError, match="seconds > 0"):
            RowPrices(bad, 1)
    with pytest.raises(ValueError, match="min_rows >= 1"):
        RowPrices({1: 1.0, 2: 1.0}, 0)


def test_dense_rows_are_chosen_where_dense_beats_packed_as_padded():
    """Dense beats packed at 1 row by more than the margin (0.8 against 1.0), not at 2
    (0.97 against 1.0) nor at 8 (packed 1.1); with padding to 4 rows the 1-row step is
    packed at 4 rows (0.7): dense loses there."""
    probe = RowProbe({1: 1.0, 2: 1.0, 4: 0.7}, 4, priced={8: 1.1},
                     dense={1: 0.8, 2: 0.97, 4: 0.9, 8: 1.2})
    assert choose_dense_rows(probe, min_rows=1) == frozenset({1})
    assert choose_dense_rows(probe, min_rows=4) == frozenset()
    assert choose_dense_rows(RowProbe({1: 1.0}, 1), min_rows=1) == frozenset()


@needs_onednn
@pytest.mark.parametrize("dense_rows", [frozenset(), frozenset({1, 2, 3, 4})])
def test_decoding_equals_hf_greedy_with_dense_or_packed_row_counts(dense_rows):
    """Both branches of the kernel choice: 1-4 row passes dense (plain steps, short
    verifications) and the rest packed, or every pass packed: HF's greedy tokens; the dense
    copies exist only while a count uses them."""
    hf = tiny_hf_model("llama", num_layers=3, seed=4)
    lm = NativeLM.from_hf(hf, tiny_model_info(hf, f"tiny-dense-{len(dense_rows)}"))
    assert lm.packed
    lm.set_dense_rows(dense_rows)
    assert lm.dense_rows == dense_rows
    assert len(lm.dense_layers) == (3 if dense_rows else 0)
    assert all(not w.wqkv.is_mkldnn for w in lm.dense_layers)
    prompts = [[1, 5, 9, 17, 33, 5, 9], [3, 4, 5, 6, 3, 4, 5], [2]]
    for drafter in (None, PLDDrafter(k=3)):
        pipe = SpeculativePipeline(FullVerifier(lm), StandardAcceptor(), drafter=drafter)
        for p in prompts:
            assert generate(pipe, p, 20).tokens == hf_greedy(hf, p, 20)
    lm.set_dense_rows(frozenset())
    assert lm.dense_layers == [] and lm.dense_rows == frozenset()
    unpacked = NativeLM.from_hf(hf, tiny_model_info(hf, "tiny-dense-unpacked"), packed=False)
    unpacked.set_dense_rows(frozenset({1}))
    assert unpacked.dense_rows == frozenset() and unpacked.dense_layers == []


def test_row_prices_follow_the_kernel_each_count_runs():
    """With 1 row dense (0.8) and padding to 2: a step costs 0.8, 2 rows packed 1.0, 3 rows
    packed 1.2: prices 1, 1.25, 1.5."""
    hf = tiny_hf_model("llama", num_layers=2)
    lm = NativeLM.from_hf(hf, tiny_model_info(hf, "tiny-dense-prices"))
    lm.row_probe = RowProbe({1: 1.0, 2: 1.0, 3: 1.2}, 2, dense={1: 0.8, 2: 1.1, 3: 1.3})
    lm.min_rows = 2
    lm.dense_rows = frozenset({1})
    prices = row_prices(lm)
    assert prices is not None
    assert [prices(n) for n in (1, 2, 3)] == pytest.approx([1.0, 1.25, 1.5])
    lm.dense_rows = frozenset()


def test_the_float_kernel_is_chosen_where_it_beats_what_runs_there_and_int8_against_it():
    """Float rows against packed-as-padded (or dense): chosen at 1 (0.6 < 0.95 * 1.0) and 2,
    not at 4 (0.97 against 1.0: within the margin) nor at 6 (slower); then int8 is chosen
    only where it beats the float kernel there (1: 0.5 < 0.57; 2: 0.6 > 0.95 * 0.62)."""
    probe = RowProbe({1: 1.0, 2: 1.0, 4: 1.0, 6: 1.1}, 1, float_rows={1: 0.6, 2: 0.62, 4: 0.97,
                                                                       6: 1.3},
                     int8={1: 0.5, 2: 0.6, 4: 0.8})
    floats = choose_float_rows(probe, min_rows=1, dense_rows=frozenset())
    assert floats == frozenset({1, 2})
    assert choose_int8_rows(probe, 1, frozenset(), float_rows=floats) == frozenset({1, 4})
    assert choose_int8_rows(probe, 1, frozenset()) == frozenset({1, 2, 4})  # against packed
    padded = RowProbe({1: 1.0, 2: 1.0, 4: 0.55}, 4, float_rows={1: 0.6, 2: 0.5})
    assert choose_float_rows(padded, min_rows=4, dense_rows=frozenset()) == frozenset({2})


@needs_onednn
def test_apply_min_rows_runs_the_float_kernel_where_the_probe_chose_it(monkeypatch):
    """A packed fp32 model with its own matrices for the float kernel: the probe's choice is
    applied, recorded in the summary, and its verify prices are the float kernel's there."""
    hf = tiny_hf_model("llama", num_layers=2, seed=3)
    lm = NativeLM.from_hf(hf, tiny_model_info(hf, "tiny-float-apply"))
    if not lm.float_rows_layers:
        pytest.skip("the float rows kernel does not run here")
    probe = RowProbe({1: 1.0, 2: 1.0, 4: 1.2}, 1, priced={8: 1.5},
                     float_rows={1: 0.5, 2: 0.9, 4: 1.4, 8: 2.0})
    monkeypatch.setattr("specflow.cpu.row_padding.probe_min_rows", lambda model: probe)
    apply_min_rows(lm, None)
    assert lm.float_rows == frozenset({1, 2}) and lm.min_rows == 1
    settle_float_rows(lm, WholePassCheck(1, 0.004, 0.005))  # faster with the kernel: kept
    assert lm.float_rows == frozenset({1, 2})
    info = row_padding_info(lm)
    assert info["float_rows"] == [1, 2] and info["float_ms"]["1"] == 500.0
    assert info["float_check"] == {"rows": 1, "with_ms": 4.0, "without_ms": 5.0}
    prices = row_prices(lm)
    assert prices.seconds == {1: 0.5, 2: 0.9, 4: 1.2, 8: 1.5} and prices(4) == 1.2 / 0.5


def test_a_whole_pass_check_keeps_the_float_kernel_only_where_the_pass_is_faster_with_it():
    assert WholePassCheck(1, 0.190, 0.191).keeps
    assert not WholePassCheck(1, 0.191, 0.191).keeps  # level: the kernel brings nothing
    assert not WholePassCheck(1, 0.233, 0.191).keeps  # the 1.5B's step at AVX-512


@needs_onednn
def test_the_float_kernel_is_not_used_where_a_whole_pass_runs_slower_with_it(monkeypatch):
    """The matmul probe chose the float kernel at 1 and 2 rows, a whole 1-row pass ran
    slower with it: the model keeps oneDNN at every count, its prices are oneDNN's, and
    its int8 copies are chosen again against oneDNN (they had lost to the kernel at 1)."""
    hf = tiny_hf_model("llama", num_layers=2, seed=3)
    lm = NativeLM.from_hf(hf, tiny_model_info(hf, "tiny-float-dropped"))
    if not lm.float_rows_layers:
        pytest.skip("the float rows kernel does not run here")
    lm.make_int8_copies()
    probe = RowProbe({1: 1.0, 2: 1.0, 4: 1.2}, 1, priced={8: 1.5},
                     float_rows={1: 0.5, 2: 0.9, 4: 1.4, 8: 2.0},
                     int8={1: 0.7, 2: 1.2, 4: 1.5, 8: 2.0})
    monkeypatch.setattr("specflow.cpu.row_padding.probe_min_rows", lambda model: probe)
    apply_min_rows(lm, None)
    assert lm.float_rows == frozenset({1, 2}) and lm.int8_rows == frozenset()
    settle_float_rows(lm, WholePassCheck(1, 0.233, 0.191))
    assert lm.float_rows == frozenset() and lm.int8_rows == frozenset({1}) and lm.min_rows == 1
    info = row_padding_info(lm)
    assert info["float_rows"] == [] and info["float_ms"]["1"] == 500.0
    assert info["float_check"] == {"rows": 1, "with_ms": 233.0, "without_ms": 191.0}
    assert row_prices(lm).seconds == {1: 0.7, 2: 1.0, 4: 1.2, 8: 1.5}
    apply_min_rows(lm, None)  # a second pipeline on the same model: the verdict holds
    assert lm.float_rows == frozenset() and lm.int8_rows == frozenset({1})
