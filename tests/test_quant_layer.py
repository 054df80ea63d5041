"""The layer kernel (``specflow.quant.layer``): a quantized layer's work around its attention
computes exactly the float32 sequence its header writes (checked here step by step against
numpy's float32 and the product kernel), a row's bits do not depend on the rows beside it or
the threads, every build gives the portable build's bits, and a layer with a float matrix
goes to torch instead."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specflow.quant import kernel
from specflow.quant.layer import runs_quantized
from specflow.quant.matrix import QuantMatrix, QuantPart, quant_linear
from tests.test_gguf_model import tiny_gguf

f32 = np.float32


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """A tiny Qwen2 (q/k/v biases) as GGUF blocks: its NativeLM."""
    _, lm, _ = tiny_gguf("qwen2", tmp_path_factory.mktemp("gguf") / "qwen.gguf", 5, 2)
    return lm


def rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """The header's RMS norm: squares summed in 8 lanes, the fixed lane tree, float32."""
    lanes = np.zeros((x.shape[0], 8), f32)
    for c in range(0, x.shape[1], 8):
        lanes = lanes + x[:, c : c + 8] * x[:, c : c + 8]
    ss = ((lanes[:, 0] + lanes[:, 4]) + (lanes[:, 2] + lanes[:, 6])) + (
        (lanes[:, 1] + lanes[:, 5]) + (lanes[:, 3] + lanes[:, 7]))
    r = f32(1) / np.sqrt(ss / f32(x.shape[1]) + f32(eps))
    return (x * r[:, None]) * w


def exp_clamped(x: np.ndarray) -> np.ndarray:
    """vec_math.h's exp, operation for operation in float32."""
    shift = f32(12582912.0)
    tiny = x < f32(-87)
    xc = np.where(tiny, f32(-87), np.minimum(x, f32(88))).astype(f32)
    shifted = xc * f32(1.44269504088896341) + shift
    n = shifted - shift
    t = (xc - n * f32(0.693145751953125)) - n * f32(1.42860682030941723e-6)
    p = f32(1) / f32(720)
    for c in (f32(1) / f32(120), f32(1) / f32(24), f32(1) / f32(6), f32(0.5), f32(1), f32(1)):
        p = p * t + c
    ni = shifted.view(np.int32) - np.array(shift, f32).view(np.int32)
    two_n = ((ni + 127) << 23).astype(np.int32).view(f32)
    return np.where(tiny, f32(0), p * two_n).astype(f32)


def product(x: np.ndarray, w: QuantMatrix, b: torch.Tensor | None) -> np.ndarray:
    return quant_linear(torch.from_numpy(x), w, b).numpy()


def test_the_layer_kernel_computes_its_headers_float_sequence(qwen):
    w = qwen.layers[1]
    kern = qwen._quant_layer(w)
    assert kern is not None
    nh, kh, d = qwen.num_heads, qwen.num_kv_heads, qwen.head_dim
    hidden = torch.randn(3, qwen.hidden_size, generator=torch.Generator().manual_seed(1)) * 2
    positions = torch.tensor([4, 9, 31])
    qkv = kern.before_attention(hidden, qwen.cos, qwen.sin_signed, positions)

    x = rms(hidden.numpy(), w.ln1.numpy(), qwen.eps)
    want = product(x, w.wqkv, w.bqkv)
    cos, sin = qwen.cos[positions].numpy()[:, None], qwen.sin_signed[positions].numpy()[:, None]
    qk = want[:, : (nh + kh) * d].reshape(3, nh + kh, d)
    a, b = qk[..., : d // 2], qk[..., d // 2 :]
    rotated = np.concatenate([a * cos[..., : d // 2] + b * sin[..., : d // 2],
                              b * cos[..., d // 2 :] + a * sin[..., d // 2 :]], axis=-1)
    want[:, : (nh + kh) * d] = rotated.reshape(3, -1)
    assert torch.equal(qkv, torch.from_numpy(want))

    attended = torch.randn(3, nh * d, generator=torch.Generator().manual_seed(2))
    out = kern.after_attention(hidden, attended)
    h1 = hidden.numpy() + product(attended.numpy(), w.wo, w.bo)
    gu = product(rms(h1, w.ln2.numpy(), qwen.eps), w.w_gate_up, w.b_gate_up)
    g, u = np.split(gu, 2, axis=1)
    act = (g / (f32(1) + exp_clamped(f32(0) - g))) * u
    assert torch.equal(out, torch.from_numpy(h1 + product(act, w.w_down, w.b_down)))


def test_a_rows_bits_do_not_depend_on_the_rows_beside_it_or_the_threads(qwen):
    kern = qwen._quant_layer(qwen.layers[0])
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(6, qwen.hidden_size, generator=g)
    attended = torch.randn(6, qwen.num_heads * qwen.head_dim, generator=g)
    positions = torch.arange(10, 16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        together = (kern.before_attention(hidden, qwen.cos, qwen.sin_signed, positions),
                    kern.after_attention(hidden, attended))
        torch.set_num_threads(1)
        alone = [(kern.before_attention(hidden[i : i + 1], qwen.cos, qwen.sin_signed,
                                        positions[i : i + 1]),
                  kern.after_attention(hidden[i : i + 1], attended[i : i + 1]))
                 for i in range(6)]
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(together[0], torch.cat([a for a, _ in alone]))
    assert torch.equal(together[1], torch.cat([b for _, b in alone]))


VECTOR_BUILDS = [b for b in ("avx512", "avx2") if b in kernel.runnable_builds()]


@pytest.mark.skipif(not VECTOR_BUILDS, reason="this CPU runs only the portable build")
@pytest.mark.parametrize("build", VECTOR_BUILDS)
def test_each_vector_build_gives_the_portable_builds_bits(qwen, build, monkeypatch):
    kern = qwen._quant_layer(qwen.layers[1])
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(5, qwen.hidden_size, generator=g) * 3
    attended = torch.randn(5, qwen.num_heads * qwen.head_dim, generator=g) * 3
    results = {}
    for name in (build, "portable"):
        loaded = kernel.load_build(name)
        assert loaded.available, loaded.why
        monkeypatch.setattr("specflow.quant.matrix.kernel_status", lambda k=loaded: k)
        results[name] = (kern.before_attention(hidden, qwen.cos, qwen.sin_signed,
                                               torch.arange(5)),
                         kern.after_attention(hidden, attended))
    assert torch.equal(results[build][0], results["portable"][0])
    assert torch.equal(results[build][1], results["portable"][1])


def test_silu_saturates_instead_of_overflowing():
    g = np.array([-200, -90, -1, 0, 1, 90, 200], f32)
    silu = g / (f32(1) + exp_clamped(f32(0) - g))
    assert np.all(np.isfinite(silu))
    assert silu[3] == 0 and silu[5] == f32(90) and silu[6] == f32(200)


def test_a_layer_with_a_float_matrix_runs_on_torch(qwen):
    w = qwen.layers[0]
    assert runs_quantized(w.wqkv, w.wo, w.w_gate_up, w.w_down)
    floats = QuantMatrix((QuantPart(0, torch.zeros(4, 256), 256, 4),))
    assert not runs_quantized(w.wqkv, floats)
    assert not runs_quantized(torch.zeros(4, 256))
    five = QuantMatrix(w.wqkv.parts * 2)  # more parts than the kernel's descriptor holds
    assert not runs_quantized(five)
