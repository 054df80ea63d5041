"""The whole-pass check of the float rows kernel (specflow/cpu/whole_pass.py)."""

from __future__ import annotations

import pytest
import torch

from specflow.cpu.row_padding import WholePassCheck
from specflow.cpu.whole_pass import check_float_rows, time_whole_passes
from specflow.models.native import NativeLM
from specflow.models.tiny import tiny_hf_model, tiny_model_info

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                  reason="this torch has no oneDNN (nothing is packed)")


def float_model(name: str, seed: int) -> NativeLM:
    hf = tiny_hf_model("llama", num_layers=2, seed=seed)
    lm = NativeLM.from_hf(hf, tiny_model_info(hf, name))
    if not lm.float_rows_layers:
        pytest.skip("the float rows kernel does not run here")
    return lm


@needs_onednn
def test_time_whole_passes_times_both_and_leaves_the_model_as_it_was():
    lm = float_model("tiny-whole-pass", 5)
    lm.make_int8_copies()
    lm.set_int8_rows(frozenset({1}))
    lm.set_float_rows(frozenset({3}))
    lm.min_rows = 2
    check = time_whole_passes(lm, frozenset({2, 3}), 2, min_rows=4, repeats=2)
    assert check.rows == 2 and check.with_s > 0 and check.without_s > 0
    assert (lm.int8_rows, lm.float_rows, lm.min_rows) == (frozenset({1}), frozenset({3}), 2)


@needs_onednn
def test_check_float_rows_checks_each_model_on_the_kernel_once(monkeypatch):
    """Only native models running some count on the kernel are timed, at their fewest such
    count and their own padding, once however often they are named; the verdict is
    applied (here: slower with the kernel, so dropped)."""
    lm = float_model("tiny-whole-pass-once", 6)
    lm.set_float_rows(frozenset({2, 4}))
    lm.min_rows = 3
    idle = float_model("tiny-whole-pass-idle", 7)  # no count on the kernel
    timed = []

    def fake(model, float_rows, rows, min_rows):
        timed.append((model.info.name, float_rows, rows, min_rows))
        return WholePassCheck(rows, 0.2, 0.1)

    monkeypatch.setattr("specflow.cpu.whole_pass.time_whole_passes", fake)
    check_float_rows([lm, idle, lm, "not a model"])
    assert timed == [("tiny-whole-pass-once", frozenset({2, 4}), 2, 3)]
    assert lm.float_rows == frozenset() and lm.whole_pass_check == WholePassCheck(2, 0.2, 0.1)
    lm.set_float_rows(frozenset({2}))
    check_float_rows([lm])  # checked already: not timed again
    assert len(timed) == 1 and lm.float_rows == frozenset({2})
