"""The rows kernels (``specflow.cpu.rows_kernel``).  Int8: its blocked layout, exact sums,
rows that do not depend on each other, why it is refused, and both branches of the int8
copies (the kernel's blocked layout where it runs, ATen's elsewhere) drafting HF's greedy
tokens.  Float: exact sums into each part's columns, rows independent of each other and of
the threads, the model's own matrices shared (no copy), none where the kernel does not run,
and decoding on it equal to HF's greedy tokens."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from specflow.cpu import rows_kernel
from specflow.cpu.float_rows import StackedRows
from specflow.cpu.int8_weights import int8_linear, quantize_int8
from specflow.cpu.row_padding import run_row_padding
from specflow.cpu.rows_kernel import (
    KernelStatus,
    block_int8,
    kernel_status,
    rows_linear_f32,
    rows_linear_i8,
)
from specflow.engine import SpeculativePipeline
from specflow.models.native import NativeLM, packing_available
from stages.acceptors.standard import StandardAcceptor
from stages.drafters.fallback import FallbackDrafter
from stages.drafters.model import ModelDrafter
from stages.drafters.pld import PLDDrafter
from stages.verifiers.full import FullVerifier
from tests.conftest import hf_greedy, make_pair
from tests.test_one_engine import MAX_NEW, PROMPTS, decode

needs_onednn = pytest.mark.skipif(
    not packing_available(torch.device("cpu"), torch.float32),
    reason="oneDNN does not pack fp32 weights here")
needs_kernel = pytest.mark.skipif(
    not kernel_status().available,
    reason=f"the rows kernel does not run here: {kernel_status().why}")


@pytest.fixture
def fresh_status():
    """``kernel_status`` probed again inside the test and again after it."""
    kernel_status.cache_clear()
    yield
    kernel_status.cache_clear()


def test_block_int8_puts_eight_outputs_of_one_input_index_side_by_side():
    q = torch.arange(30, dtype=torch.int8).view(10, 3)  # [N=10, K=3]: q[n, k] = 3n + k
    qb = block_int8(q)
    assert qb.shape == (2, 3, 8) and qb.is_contiguous()
    assert qb[0, 1].tolist() == [1, 4, 7, 10, 13, 16, 19, 22]  # q[0..7, 1]
    assert qb[1, 2].tolist() == [26, 29, 0, 0, 0, 0, 0, 0]  # q[8..9, 2], then padding


@needs_kernel
def test_the_kernel_sums_small_integers_exactly():
    """Integers keep every partial sum exact in float: y = x q^T * s + b to the bit, for
    1..8 rows in one call and 11 rows in two; 37 outputs (ragged last tile and block)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-127, 128, (37, 19), generator=g, dtype=torch.int8)  # [N, K]
    x = torch.randint(-9, 10, (11, 19), generator=g).float()  # [T, K]
    scale = torch.tensor([0.5, 2.0, 0.25, 1.0] * 9 + [4.0])  # powers of two: exact products
    bias = torch.arange(37, dtype=torch.float32)
    expect = (x.double() @ q.double().T * scale.double() + bias.double()).float()  # exact
    qb = block_int8(q)
    for rows in (1, 2, 3, 4, 5, 6, 7, 8, 11):
        assert torch.equal(rows_linear_i8(x[:rows], qb, scale, bias, 37), expect[:rows])
    assert torch.equal(rows_linear_i8(x[:2], qb, scale, None, 37), expect[:2] - bias)


@needs_kernel
def test_a_rows_result_does_not_depend_on_the_other_rows_or_the_threads():
    """Random floats (rounding everywhere): each row's output is bit-identical alone, among
    5 or 11 rows, and with 1 or 2 threads; within float rounding of the float64 product."""
    g = torch.Generator().manual_seed(1)
    q = torch.randint(-127, 128, (300, 700), generator=g, dtype=torch.int8)
    x = torch.randn(11, 700, generator=g)
    scale = torch.rand(300, generator=g) * 0.01 + 1e-3
    qb = block_int8(q)
    together = rows_linear_i8(x, qb, scale, None, 300)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = rows_linear_i8(x[:5], qb, scale, None, 300)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one_thread, together[:5])
    for r in (0, 4, 10):
        assert torch.equal(rows_linear_i8(x[r : r + 1], qb, scale, None, 300), together[r : r + 1])
    ref = (x.double() @ q.double().T * scale.double()).float()
    torch.testing.assert_close(together, ref, rtol=1e-4, atol=1e-4)  # K = 700 float adds


@needs_kernel
def test_blocked_int8_copies_hold_the_same_values_and_multiply_with_float_inputs():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(24, 16, generator=g) * 0.1  # [out, in]
    x = torch.randn(3, 16, generator=g)
    b = torch.randn(24, generator=g)
    aten, blocked = quantize_int8(w), quantize_int8(w, blocked=True)
    assert blocked.blocked and blocked.q.shape == (3, 16, 8) and blocked.shape == (24, 16)
    assert blocked.scale.dtype == torch.float32
    assert torch.equal(blocked.dequantized(), aten.dequantized())
    y = int8_linear(x, blocked, b)
    torch.testing.assert_close(y, x @ aten.dequantized().T + b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y, int8_linear(x, aten, b), atol=0.02, rtol=0.02)  # bf16 inputs


def test_the_kernel_is_refused_with_the_reason(monkeypatch, fresh_status):
    monkeypatch.setenv(rows_kernel.ENV_SWITCH, "0")
    assert kernel_status() == KernelStatus(None, "SPECFLOW_ROWS_KERNEL=0")
    monkeypatch.delenv(rows_kernel.ENV_SWITCH)
    monkeypatch.setattr(rows_kernel.platform, "machine", lambda: "aarch64")
    kernel_status.cache_clear()
    assert kernel_status().why == "the CPU is aarch64, not x86-64"
    monkeypatch.setattr(rows_kernel.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(rows_kernel, "_cpu_flags", lambda: {"avx2"})
    kernel_status.cache_clear()
    assert kernel_status().why == "the CPU lacks AVX2 or FMA"
    monkeypatch.setattr(rows_kernel, "_cpu_flags", lambda: {"avx2", "fma"})
    monkeypatch.setattr(rows_kernel, "_compiler", lambda: None)
    kernel_status.cache_clear()
    assert not kernel_status().available
    assert kernel_status().why.startswith("no C++ compiler")
    with pytest.raises(RuntimeError, match="the int8 rows kernel is not available: no C"):
        rows_linear_i8(torch.ones(1, 2), torch.zeros(1, 2, 8, dtype=torch.int8),
                       torch.ones(8), None, 8)


@needs_kernel
def test_a_failed_build_is_reported_not_raised(monkeypatch, tmp_path, fresh_status):
    monkeypatch.setenv("SPECFLOW_CACHE", str(tmp_path))
    monkeypatch.setattr(rows_kernel, "FLAGS", ("-no-such-flag",))
    status = kernel_status()
    assert not status.available and status.why.startswith("building rows_linear.cpp failed")
    assert not list((tmp_path / "kernels").glob("*.so"))  # no half-written library


@pytest.fixture(scope="module")
def target():
    return make_pair("llama", seed=0, num_layers=4, packed=True)  # the float kernel's case


@pytest.mark.parametrize("kernel", ["rows", "aten"])
def test_both_int8_branches_draft_hf_greedy_tokens(kernel, target, monkeypatch):
    """The target's own weights as an int8 draft model, its copies in the kernel's blocked
    layout (where the kernel runs) or ATen's (where it does not): batch 3, paged, HF's
    greedy tokens, most drafts accepted."""
    if kernel == "rows" and not kernel_status().available:
        pytest.skip(f"the rows kernel does not run here: {kernel_status().why}")
    if kernel == "aten":
        monkeypatch.setattr(rows_kernel, "kernel_status", lambda: KernelStatus(None, "off"))
    hf, lm = target
    draft = NativeLM.from_hf(hf, lm.info)
    draft.make_int8_copies()
    assert draft.int8_head.blocked == (kernel == "rows")
    assert all(w.w_down.blocked == (kernel == "rows") for w in draft.int8_layers)
    draft.set_int8_rows(frozenset(range(1, 257)))
    pipe = SpeculativePipeline(FullVerifier(lm), StandardAcceptor(),
                               drafter=FallbackDrafter(PLDDrafter(k=4, min_ngram=2),
                                                       ModelDrafter(draft, k=4)))
    gens, _ = decode(pipe, 3, "paged", PROMPTS, MAX_NEW)
    assert [g.tokens for g in gens] == [hf_greedy(hf, p, MAX_NEW) for p in PROMPTS]
    drafted = sum(g.stats.drafted for g in gens)
    accepted = sum(g.stats.accepted for g in gens)
    assert 0 < accepted and accepted > drafted // 2


def test_a_runs_summary_records_every_model_and_its_int8_kernel(target, monkeypatch):
    """``RunMeta.row_padding``: the target and the draft model by name, the draft's int8
    kernel named (``rows`` where the kernel runs, ``aten`` where it does not)."""
    hf, lm = target
    info = replace(lm.info, name="tiny-draft")
    rows = NativeLM.from_hf(hf, info)
    monkeypatch.setattr(rows_kernel, "kernel_status", lambda: KernelStatus(None, "off"))
    rows.make_int8_copies()
    rows.set_int8_rows(frozenset({1}))
    meta = run_row_padding([lm, rows, lm])
    assert list(meta) == [lm.info.name, "tiny-draft"]
    assert meta[lm.info.name]["int8_kernel"] is None and meta[lm.info.name]["int8_rows"] == []
    assert meta["tiny-draft"]["int8_kernel"] == "aten" and meta["tiny-draft"]["int8_rows"] == [1]


def test_int8_copies_take_atens_layout_when_asked(target):
    hf, lm = target
    draft = NativeLM.from_hf(hf, lm.info)
    draft.make_int8_copies(blocked=False)
    assert not draft.int8_head.blocked and draft.int8_head.q.shape == draft.lm_head.shape
    assert not any(w.wqkv.blocked for w in draft.int8_layers)


# ----------------------------------------------------------------------- the float kernel


@needs_kernel
def test_the_float_kernel_sums_small_integers_exactly_into_each_parts_columns():
    """Integers keep every partial sum exact: y = x W^T + b to the bit for 1..12 rows in one
    call and 13 and 25 in several; W as three parts (31 + 5 + 8 outputs: ragged tiles and
    threads) of K = 19 (two 8-lane steps and a tail of 3)."""
    g = torch.Generator().manual_seed(0)
    parts = tuple(torch.randint(-50, 51, (n, 19), generator=g).float() for n in (31, 5, 8))
    x = torch.randint(-9, 10, (25, 19), generator=g).float()  # [T, K]
    bias = torch.arange(44, dtype=torch.float32)
    w = torch.cat(parts)  # [44, 19]
    expect = (x.double() @ w.double().T + bias.double()).float()  # exact
    for rows in (*range(1, 14), 25):
        assert torch.equal(rows_linear_f32(x[:rows], parts, bias), expect[:rows])
    assert torch.equal(rows_linear_f32(x[:2], parts, None), expect[:2] - bias)
    assert torch.equal(rows_linear_f32(x[:3].double(), parts[:1], None),
                       (expect[:3] - bias)[:, :31])  # any float input dtype


@needs_kernel
def test_a_float_kernel_rows_result_does_not_depend_on_the_other_rows_or_the_threads():
    """Random floats: each row's output is bit-identical alone, among 6 or 12 rows, and with
    1 or 2 threads; within float rounding of the float64 product; the parts checked."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(300, 700, generator=g)
    x = torch.randn(12, 700, generator=g)
    together = rows_linear_f32(x, (w,), None)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = rows_linear_f32(x[:6], (w,), None)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one_thread, together[:6])
    for r in (0, 5, 11):
        assert torch.equal(rows_linear_f32(x[r : r + 1], (w,), None), together[r : r + 1])
    torch.testing.assert_close(together, (x.double() @ w.double().T).float(),
                               rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="contiguous float32"):
        rows_linear_f32(x, (w.t(),), None)
    with pytest.raises(ValueError, match="StackedRows parts"):
        StackedRows((w.double(),))


@needs_kernel
@needs_onednn
def test_a_packed_fp32_model_keeps_its_own_matrices_for_the_float_kernel(target):
    """No copy: the float layers' parts are the HF model's own tensors; a model not packed
    has none, and asking for them is refused."""
    hf, lm = target
    packed = NativeLM.from_hf(hf, lm.info)
    assert packed.packed and len(packed.float_rows_layers) == 4
    att = hf.model.layers[0].self_attn
    parts = packed.float_rows_layers[0].wqkv.parts
    assert [p.data_ptr() for p in parts] == [att.q_proj.weight.data_ptr(),
                                             att.k_proj.weight.data_ptr(),
                                             att.v_proj.weight.data_ptr()]
    assert packed.float_rows_head.parts[0].data_ptr() == packed.lm_head.data_ptr()
    other_hf, other = make_pair("llama", seed=1, num_layers=2)  # its weights re-laid below
    unpacked = NativeLM.from_hf(other_hf, other.info, packed=False)
    assert unpacked.float_rows_layers == [] and unpacked.float_rows_head is None
    with pytest.raises(ValueError, match="float rows \\[1\\] without"):
        unpacked.set_float_rows(frozenset({1}))


@needs_onednn
def test_no_float_layers_where_the_kernel_does_not_run(target, monkeypatch, caplog):
    """The other branch: oneDNN at every count, one log line saying why."""
    hf, lm = target
    monkeypatch.setattr(rows_kernel, "kernel_status", lambda: KernelStatus(None, "off"))
    with caplog.at_level("INFO", logger="specflow"):
        model = NativeLM.from_hf(hf, lm.info)
    assert model.packed and model.float_rows_layers == [] and model.float_rows_head is None
    assert "packed matmuls at every row count (the float rows kernel: off)" in caplog.text


@needs_kernel
@needs_onednn
@pytest.mark.parametrize("float_rows", [frozenset(range(1, 13)), frozenset({1, 3, 5})])
def test_decoding_on_the_float_kernel_equals_hf_greedy(float_rows, target):
    """Plain steps and prompt-lookup verifications, batch 1 contiguous and batch 3 paged, on
    the float rows kernel at every count it takes (the rest packed), or at a few: HF's greedy
    tokens, the kernel run at those counts only (the run's summary records them)."""
    hf, lm = target
    own = NativeLM.from_hf(hf, replace(lm.info, name="tiny-float-rows"))
    own.set_float_rows(float_rows)
    calls = []
    real = rows_kernel.rows_linear_f32

    def counted(x, parts, bias):
        calls.append(x.shape[0])
        return real(x, parts, bias)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rows_kernel, "rows_linear_f32", counted)
        for drafter in (None, PLDDrafter(k=3, min_ngram=2)):
            pipe = SpeculativePipeline(FullVerifier(own), StandardAcceptor(), drafter=drafter)
            for batch, kv in ((1, "contiguous"), (3, "paged")):
                gens, _ = decode(pipe, batch, kv, PROMPTS, MAX_NEW)
                assert [g.tokens for g in gens] == [hf_greedy(hf, p, MAX_NEW) for p in PROMPTS]
    assert calls and set(calls) <= float_rows
    assert {1, 3} <= set(calls)  # decoding steps of one sequence and of three
    assert run_row_padding([own])["tiny-float-rows"]["float_rows"] == sorted(float_rows)
