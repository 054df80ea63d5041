"""The quantized rows kernel (``specflow.quant``): ggml blocks decoded as ggml decodes them,
products within the 8-bit activations' error of the float product, a row's bits independent
of the rows beside it and of the threads, and the AVX-512, AVX2 and portable builds giving
the same bits."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from specflow.errors import ConfigError
from specflow.quant import kernel
from specflow.quant.matrix import (
    QuantMatrix,
    check_part,
    dequantize,
    part_from_numpy,
    quant_linear,
)
from tests.gguf_tiny import dequantize as gguf_dequantize
from tests.gguf_tiny import quantize

TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q8_0, T.Q4_K, T.Q6_K]
K = 512  # two K-quant super-blocks, sixteen 32-blocks


def weights(ggml_type: T, n: int = 24, seed: int = 0) -> tuple[QuantMatrix, np.ndarray]:
    w = np.random.default_rng(seed).standard_normal((n, K)).astype(np.float32)
    blocks = quantize(w, ggml_type)
    return QuantMatrix((part_from_numpy(int(ggml_type), blocks, K),)), blocks


def reference(x: torch.Tensor, w: np.ndarray, block: int) -> torch.Tensor:
    """``x`` quantized to 8 bits per ``block`` as the kernel does, times ``w.T`` in float64."""
    xb = x.double().reshape(x.shape[0], -1, block)
    dx = xb.abs().amax(dim=2, keepdim=True) / 127.0
    x8 = torch.where(dx > 0, torch.round(xb / dx), torch.zeros_like(xb))
    return ((x8 * dx).reshape(x.shape) @ torch.from_numpy(w).double().T).float()


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_blocks_decode_as_ggml_decodes_them(ggml_type):
    matrix, blocks = weights(ggml_type)
    assert torch.equal(dequantize(matrix.parts[0]),
                       torch.from_numpy(gguf_dequantize(blocks, ggml_type)))
    ids = torch.tensor([5, 0, 23, 5])
    assert torch.equal(matrix.rows_of(ids), dequantize(matrix.parts[0])[ids])


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_tiles_hold_the_files_bytes_sixteen_rows_side_by_side(ggml_type):
    """29 rows: two tiles of 16 rows (the last 3 zero); a 32-block tile is exactly its 16
    rows' bytes."""
    matrix, blocks = weights(ggml_type, n=29)
    (part,) = matrix.parts
    row_bytes = blocks.shape[1]
    assert part.blocks.shape[0] == 2
    if ggml_type in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q8_0):
        assert part.blocks.shape[1] == 16 * row_bytes
        assert sorted(part.blocks[0].tolist()) == sorted(blocks[:16].reshape(-1).tolist())


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_products_match_the_8_bit_activations_reference(ggml_type):
    matrix, blocks = weights(ggml_type)
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(1))
    w = gguf_dequantize(blocks, ggml_type)
    block = 256 if ggml_type in (T.Q4_K, T.Q6_K) else 32
    y = quant_linear(x, matrix, None)
    torch.testing.assert_close(y, reference(x, w, block), rtol=1e-4, atol=1e-4)
    exact = x @ torch.from_numpy(w).T  # the float product: within the 8-bit activations' error
    assert ((y - exact).norm() / exact.norm()).item() < 0.02


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it_or_the_threads(ggml_type):
    matrix, _ = weights(ggml_type, n=37)
    # 530 rows: a span of 512 (the rows whose 8-bit values, K bytes each, fit the 256 KiB a
    # product keeps in cache), then 18: a chunk of 16, then 2
    x = torch.randn(530, K, generator=torch.Generator().manual_seed(2)) * 3
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        together = quant_linear(x, matrix, None)
        torch.set_num_threads(1)
        alone = torch.cat([quant_linear(x[i : i + 1], matrix, None) for i in range(530)])
        mixed = quant_linear(torch.cat([x[7:12], x[:3]]), matrix, None)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(together, alone)
    assert torch.equal(mixed, torch.cat([alone[7:12], alone[:3]]))


def test_parts_stack_and_bias_adds():
    a, _ = weights(T.Q4_K, n=8, seed=3)
    b, _ = weights(T.Q6_K, n=5, seed=4)
    fused = QuantMatrix(a.parts + b.parts)
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(7))
    bias = torch.arange(13, dtype=torch.float32)
    y = quant_linear(x, fused, None)
    assert y.shape == (3, 13)
    assert torch.equal(y, torch.cat([quant_linear(x, a, None), quant_linear(x, b, None)], 1))
    assert torch.equal(quant_linear(x, fused, bias), y + bias)
    assert torch.equal(quant_linear(x, fused.prefix(10), None), y[:, :10])


def test_mixed_parts_in_one_call_give_each_parts_own_bits():
    """K-quant and 32-block parts in one call (activations quantized once per block size, the
    parts' outputs shared out over 2 threads) against each part alone on one thread."""
    alone = [weights(t, n=n, seed=s)[0] for t, n, s in
             ((T.Q4_K, 40, 1), (T.Q5_0, 21, 2), (T.Q6_K, 17, 3), (T.Q8_0, 9, 4))]
    fused = QuantMatrix(tuple(m.parts[0] for m in alone))
    x = torch.randn(12, K, generator=torch.Generator().manual_seed(8))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        y = quant_linear(x, fused, None)
        torch.set_num_threads(1)
        expected = torch.cat([quant_linear(x, m, None) for m in alone], 1)
    finally:
        torch.set_num_threads(threads)
    assert y.shape == (12, 87)
    assert torch.equal(y, expected)


VECTOR_BUILDS = [b for b in ("avx512", "avx2") if b in kernel.runnable_builds()]


@pytest.mark.skipif(not VECTOR_BUILDS, reason="the CPU lacks AVX2, FMA or F16C")
@pytest.mark.parametrize("build", VECTOR_BUILDS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 17, 35, 530])
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_each_vector_build_gives_the_portable_builds_bits(ggml_type, rows, build, monkeypatch):
    """Every build this CPU runs against the portable one: K-quant tiles take rows in groups
    of up to 8 (17 rows: a chunk of 16 as 8 + 8, then 1; 35: two chunks of 16, then 3, a
    thread taking all of them through a tile before the next; 530: a span of the 512 rows
    whose values (K = 512 bytes a row) fit the 256 KiB kept in cache, then one of 18; on
    AVX2 a group of 2-7 rows
    takes both halves of a tile per broadcast, a larger one a half at a time), 32-block tiles one
    integer sum a block (on AVX2 one row at a time, Q5_0 from 3 rows with a block's codes
    decoded once for all of them; on AVX-512 Q4_0, Q4_1 and Q8_0 in groups of up to 4 rows);
    29 weight rows end in a tile of 13 (both halves, the second partial).  The first row's
    activations hold exact halves (a block whose largest value is 127: x / dx ties, rounded
    to even) and a block of values near 1e-38 (1 / dx not finite: all zero), quantized by
    vector or scalar code."""
    matrix, _ = weights(ggml_type, n=29, seed=5)
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(6))
    x[0, :256] = (torch.arange(-127.0, 127.0) + 0.5).repeat(2)[:256]  # -126.5 .. 126.5
    x[0, 0] = 127.0
    x[0, 256:288] = 1e-38
    results = {}
    for name in (build, "portable"):
        loaded = kernel.load_build(name)
        assert loaded.available, loaded.why
        assert loaded.library.quant_rows_isa() == kernel.BUILD_ISA[name]
        monkeypatch.setattr("specflow.quant.matrix.kernel_status", lambda k=loaded: k)
        results[name] = (quant_linear(x, matrix, None), matrix.rows_of(torch.arange(29)))
    assert torch.equal(results[build][0], results["portable"][0])
    assert torch.equal(results[build][1], results["portable"][1])
    assert torch.equal(results[build][1], dequantize(matrix.parts[0]))


@pytest.mark.skipif(not VECTOR_BUILDS, reason="the CPU lacks AVX2, FMA or F16C")
@pytest.mark.parametrize("build", VECTOR_BUILDS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 9])
def test_q8_0_codes_at_both_ends_of_their_range_give_exact_sums(build, rows, monkeypatch):
    """Q8_0 blocks whose codes span -128 .. 127 (a file may hold -128, which ggml's quantizer
    never writes) against activations at +-127 (8-bit values at their ends): AVX2 takes |c| and
    x with c's sign (|-128| x 127 pairs still fit int16), AVX-512 takes c + 128 less 128 sum x.
    Every build gives the portable build's bits, and with d = 1 each product is the exact
    integer sum of c x8 times the block scale dx."""
    rng = np.random.default_rng(9)
    n = 20
    codes = rng.integers(-128, 128, size=(n, K), dtype=np.int64)
    codes[:, :32] = -128  # a block of -128 only
    codes[:, 32:64] = 127
    blocks = np.zeros((n, K // 32, 34), np.uint8)
    blocks[:, :, :2] = np.frombuffer(np.float16(1.0).tobytes(), np.uint8)
    blocks[:, :, 2:] = codes.astype(np.int8).reshape(n, K // 32, 32).view(np.uint8)
    matrix = QuantMatrix((part_from_numpy(int(T.Q8_0), blocks.reshape(n, -1), K),))
    x = torch.where(torch.rand(rows, K, generator=torch.Generator().manual_seed(3)) < 0.5,
                    -127.0, 127.0)  # every block's dx is 1: x8 = x
    results = {}
    for name in (build, "portable"):
        loaded = kernel.load_build(name)
        monkeypatch.setattr("specflow.quant.matrix.kernel_status", lambda k=loaded: k)
        results[name] = quant_linear(x, matrix, None)
    assert torch.equal(results[build], results["portable"])
    exact = (x.double() @ torch.from_numpy(codes).double().T).float()
    assert torch.equal(results["portable"], exact)


def test_the_cpu_build_follows_the_cpus_flags(monkeypatch):
    monkeypatch.setattr(kernel.platform, "machine", lambda: "x86_64")
    avx512 = "fpu sse2 avx2 fma f16c avx512f avx512bw avx512vl avx512_vnni"
    monkeypatch.setattr(kernel, "cpuinfo_field", lambda key: avx512)
    assert kernel.runnable_builds() == ("avx512", "avx2", "portable")
    monkeypatch.setattr(kernel, "cpuinfo_field", lambda key: avx512.replace(" avx512_vnni", ""))
    assert kernel.cpu_build() == "avx2"
    monkeypatch.setattr(kernel, "cpuinfo_field", lambda key: "fpu sse2 avx2 fma f16c")
    assert kernel.cpu_build() == "avx2"
    monkeypatch.setattr(kernel, "cpuinfo_field", lambda key: "fpu sse2 avx fma")
    assert kernel.cpu_build() == "portable"
    monkeypatch.setattr(kernel.platform, "machine", lambda: "aarch64")
    monkeypatch.setattr(kernel, "cpuinfo_field", lambda key: "fp asimd")
    assert kernel.runnable_builds() == ("portable",)


def test_a_switched_off_kernel_refuses_gguf_weights_naming_the_fix(monkeypatch):
    matrix, _ = weights(T.Q8_0, n=4)
    monkeypatch.setenv(kernel.ENV_SWITCH, "0")
    with pytest.raises(ConfigError, match="SPECFLOW_QUANT_KERNEL=0.*model.weights=float"):
        quant_linear(torch.randn(1, K), matrix, None)


def test_types_the_kernel_does_not_multiply_are_refused_naming_the_fix():
    with pytest.raises(ConfigError, match="Q5_K.*model.weights=float"):
        check_part("blk.0.ffn_down.weight", int(T.Q5_K), (8, 256), 176)
    with pytest.raises(ConfigError, match="rows of 100 values need a multiple of 32"):
        check_part("blk.0.attn_q.weight", int(T.Q8_0), (8, 100), 34 * 3)
    check_part("output_norm.weight", int(T.F32), (1, 100), 400)  # floats pass
