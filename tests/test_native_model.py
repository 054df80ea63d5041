"""NativeLM and HFBackendLM against HF transformers on tiny random Llama/Qwen2 models."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, MistralConfig, Qwen2Config

from specflow.cpu.detect import probe_cpu
from specflow.errors import ConfigError
from specflow.kv import contiguous
from specflow.kv.base import KVSpec
from specflow.kv.contiguous import KVCache, layer_caches
from specflow.kv.session import ModelSession
from specflow.models.hf_backend import HFBackendLM
from specflow.models.native import NativeLM, rotate, supports
from specflow.models.tiny import tiny_hf_model, tiny_model_info

ATOL = 1e-4
ARCHS = ["llama", "qwen2"]
N_LAYERS = 4


def random_tokens(n: int, seed: int, vocab: int = 128) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


@torch.inference_mode()
def hf_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    """Logits ``[T, V]`` of one full HF forward over ``tokens``."""
    return hf_model(torch.tensor([tokens])).logits[0].float()


@torch.inference_mode()
def hf_exit_logits(hf_model, tokens: list[int], layer: int) -> torch.Tensor:
    """``lm_head(final_norm(h_layer))`` ``[T, V]`` from HF's ``output_hidden_states``."""
    out = hf_model(torch.tensor([tokens]), output_hidden_states=True)
    h = out.hidden_states[layer][0]  # [T, H], the input of decoder layer ``layer``
    return hf_model.lm_head(hf_model.model.norm(h)).float()


def native(arch: str, **kw) -> tuple[torch.nn.Module, NativeLM]:
    hf = tiny_hf_model(arch, num_layers=N_LAYERS, **kw)
    return hf, NativeLM.from_hf(hf, tiny_model_info(hf, f"tiny-{arch}"))


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float = ATOL) -> None:
    assert actual.shape == expected.shape
    assert actual.dtype == torch.float32
    err = (actual - expected).abs().max().item()
    assert err <= atol, f"max abs error {err} > {atol}"


# ---------------------------------------------------------------- tiny models are informative
@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_model_greedy_output_varies(arch):
    hf = tiny_hf_model(arch)
    ids = torch.tensor([random_tokens(8, seed=1)])
    with torch.inference_mode():
        out = hf.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False)
    new = out[0, 8:].tolist()
    assert len(set(new)) >= 12, new
    assert (
        tiny_hf_model(arch, seed=0)
        .state_dict()["lm_head.weight"]
        .equal(hf.state_dict()["lm_head.weight"])
    )
    assert not tiny_hf_model(arch, seed=1).lm_head.weight.equal(hf.lm_head.weight)


# ---------------------------------------------------------------- (a) full forward
FULL_FORWARD_CASES = [
    ("llama", {}),
    ("qwen2", {}),
    ("llama", {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True}),
    ("qwen2", {"tie_word_embeddings": False, "num_key_value_heads": 4}),  # no GQA
]


@pytest.mark.parametrize(("arch", "overrides"), FULL_FORWARD_CASES)
def test_full_forward_matches_hf(arch, overrides):
    hf = tiny_hf_model(arch, num_layers=N_LAYERS, **overrides)
    tokens = random_tokens(24, seed=2)
    expected = hf_logits(hf, tokens)
    lm = NativeLM.from_hf(hf, tiny_model_info(hf, arch))
    caches = layer_caches(lm, 32)
    h = lm.embed(torch.tensor(tokens))  # [T, H]
    for layer in range(N_LAYERS):
        h = lm.run_layer(layer, h, [(caches[layer], h.shape[0])], {})
    assert_close(lm.head(h, N_LAYERS), expected)
    assert [c.length for c in caches] == [24] * N_LAYERS
    # The HF model still computes the same after NativeLM re-laid its weights.
    assert_close(hf_logits(hf, tokens), expected, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_unpacked_weights_are_shared_with_hf(arch):
    hf = tiny_hf_model(arch, num_layers=N_LAYERS)
    lm = NativeLM.from_hf(hf, tiny_model_info(hf, f"tiny-{arch}"), packed=False)
    assert not lm.packed
    attn, mlp = hf.model.layers[1].self_attn, hf.model.layers[1].mlp
    ptr = lm.layers[1].wqkv.untyped_storage().data_ptr()
    for lin in (attn.q_proj, attn.k_proj, attn.v_proj):
        assert lin.weight.untyped_storage().data_ptr() == ptr
    ptr = lm.layers[1].w_gate_up.untyped_storage().data_ptr()
    assert mlp.up_proj.weight.untyped_storage().data_ptr() == ptr
    assert lm.layers[1].ln1.data_ptr() == hf.model.layers[1].input_layernorm.weight.data_ptr()
    emb = hf.model.embed_tokens.weight.untyped_storage().data_ptr()
    assert lm.embed_weight.untyped_storage().data_ptr() == emb
    tied = lm.lm_head.untyped_storage().data_ptr() == emb
    assert tied == (arch == "qwen2")  # tiny llama unties, tiny qwen2 ties


@pytest.mark.parametrize("arch", ARCHS)
def test_packed_weights_leave_hf_untouched(arch):
    """Packed (the CPU fp32 default): the matrices are oneDNN copies holding exactly the HF
    weights, the HF tensors keep their storage and layout, and the logits agree with the
    unpacked model (same greedy tokens)."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch has no oneDNN")
    from specflow.models.native import dense

    hf = tiny_hf_model(arch, num_layers=N_LAYERS)
    attn = hf.model.layers[1].self_attn
    before = {n: (p.data_ptr(), p.stride()) for n, p in hf.named_parameters()}
    lm = NativeLM.from_hf(hf, tiny_model_info(hf, f"tiny-{arch}"))
    assert lm.packed and lm.layers[1].wqkv.is_mkldnn and lm.head_weight.is_mkldnn
    assert {n: (p.data_ptr(), p.stride()) for n, p in hf.named_parameters()} == before
    qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
    assert torch.equal(dense(lm.layers[1].wqkv), qkv)
    assert torch.equal(dense(lm.head_weight), hf.lm_head.weight)
    tokens = random_tokens(24, seed=2)
    plain = NativeLM.from_hf(
        tiny_hf_model(arch, num_layers=N_LAYERS), tiny_model_info(hf, arch), packed=False
    )
    outs = []
    for model in (lm, plain):
        s = ModelSession(model, 32)
        s.set_tokens(tokens)
        outs.append(s.logits(N_LAYERS, 0, 24))
    assert_close(outs[0], outs[1], atol=1e-5)
    assert outs[0].argmax(-1).tolist() == outs[1].argmax(-1).tolist()
    # Placed in bfloat16 on the CPU the copy is packed again where oneDNN runs bf16 (not on
    # an AVX2-only CPU: tests/test_cpu_probe.py); in float16 (never packed) dense.
    bf16 = lm.to("cpu", torch.bfloat16)
    assert bf16.packed == probe_cpu().can_pack(torch.bfloat16)
    assert dense(bf16.layers[1].wqkv).dtype == torch.bfloat16
    fp16 = lm.to("cpu", torch.float16)
    assert not fp16.packed and fp16.layers[1].wqkv.dtype == torch.float16


def test_packed_weights_refused_where_unavailable():
    hf = tiny_hf_model("qwen2", num_layers=N_LAYERS).to(torch.float16)
    with pytest.raises(ConfigError) as err:
        NativeLM.from_hf(hf, tiny_model_info(hf, "tiny"), packed=True)
    assert str(err.value) == (
        "tiny: packed_weights=true with float16: only float32 and bfloat16 matrices are "
        "packed, not float16; set packed_weights=null or false"
    )


# ---------------------------------------------------------------- (b) session blocks
@pytest.mark.parametrize("arch", ARCHS)
def test_session_blocks_and_rollback_match_full_forward(arch):
    hf, lm = native(arch)
    seq = random_tokens(20, seed=3)
    final = seq[:13] + [(t + 1) % 128 for t in seq[13:17]]  # differs from seq from position 13
    ref_seq, ref_final = hf_logits(hf, seq), hf_logits(hf, final)
    assert not torch.allclose(ref_seq[13:16], ref_final[13:16], atol=1e-2)

    s = ModelSession(lm, 32)
    s.set_tokens(seq[:8])
    s.prefill()
    assert_close(s.logits(N_LAYERS, 7, 8), ref_seq[7:8])
    for p in range(8, 11):  # 1-token decode steps
        s.extend([seq[p]])
        assert_close(s.logits(N_LAYERS, p, p + 1), ref_seq[p : p + 1])
    s.extend(seq[11:16])  # a 5-token verification block
    assert_close(s.logits(N_LAYERS, 11, 16), ref_seq[11:16])
    s.set_tokens(final)  # rollback to 13 positions, then a different continuation
    assert [s.computed(layer) for layer in range(N_LAYERS)] == [13] * N_LAYERS
    assert_close(s.logits(N_LAYERS, 13, 17), ref_final[13:17])
    assert s.layer_evals == N_LAYERS * (16 + 4)


# ---------------------------------------------------------------- (c) rollback == never drafted
@pytest.mark.parametrize("arch", ARCHS)
def test_rollback_leaves_cache_as_if_never_drafted(arch):
    _, lm = native(arch)
    prompt = random_tokens(10, seed=4)
    drafted, plain = ModelSession(lm, 32), ModelSession(lm, 32)
    for s in (drafted, plain):
        s.set_tokens(prompt)
        s.logits(N_LAYERS, 9, 10)
    drafted.extend([5, 6, 7, 8, 9])
    drafted.logits(N_LAYERS, 10, 15)
    drafted.set_tokens(prompt + [42])
    plain.extend([42])
    got, want = drafted.logits(N_LAYERS, 10, 11), plain.logits(N_LAYERS, 10, 11)
    assert torch.equal(got, want)
    for a, b in zip(drafted.caches, plain.caches, strict=True):
        assert a.length == b.length == 11
        assert torch.equal(a.k[:, :11], b.k[:, :11])
        assert torch.equal(a.v[:, :11], b.v[:, :11])
    drafted.extend([3, 1, 4])
    plain.extend([3, 1, 4])
    assert torch.equal(drafted.logits(N_LAYERS, 11, 14), plain.logits(N_LAYERS, 11, 14))


@pytest.mark.parametrize("arch", ARCHS)
def test_long_blocks_take_sdpa_and_match_hf(arch, monkeypatch):
    """A prefill of >= SDPA_ROWS rows from position 0 (SDPA's is_causal) and a long block
    after cached keys (its explicit lower-right mask) match HF's forward; blocks below the
    threshold never reach SDPA."""
    hf, lm = native(arch)
    calls: list[tuple[int, int]] = []
    real = contiguous._sdpa_block

    def spy(q, cache, start, end, scale, memo):
        calls.append((start, end))
        return real(q, cache, start, end, scale, memo)

    monkeypatch.setattr(contiguous, "_sdpa_block", spy)
    n = contiguous.SDPA_ROWS
    seq = random_tokens(2 * n + 20, seed=9)
    ref = hf_logits(hf, seq)
    s = ModelSession(lm, len(seq) + 1)
    s.set_tokens(seq[: n + 5])
    s.prefill()  # n + 4 rows from position 0
    assert calls == [(0, n + 4)] * N_LAYERS
    assert_close(s.logits(N_LAYERS, n + 4, n + 5), ref[n + 4 : n + 5])  # one row: bmm
    assert len(calls) == N_LAYERS
    s.extend(seq[n + 5 :])  # n + 15 rows after n + 5 cached positions
    assert_close(s.logits(N_LAYERS, n + 5, len(seq)), ref[n + 5 :])
    assert calls[N_LAYERS:] == [(n + 5, len(seq))] * N_LAYERS
    calls.clear()
    s.set_tokens(seq[: n + 5])
    s.extend(seq[n + 5 : 2 * n + 4])  # n - 1 rows: the bmms
    assert_close(s.logits(N_LAYERS, n + 5, 2 * n + 4), ref[n + 5 : 2 * n + 4])
    assert calls == []


def test_rotate_equals_the_rope_formula_bit_for_bit():
    """``rotate`` on a strided slice (as of the fused q/k/v output) is exactly
    ``x * cos + roll(x, D/2) * sin_signed``: the same products and sums, rounded alike."""
    g = torch.Generator().manual_seed(0)
    fused = torch.randn(7, 5 * 16, generator=g)
    x = fused[:, : 4 * 16].view(7, 4, 16)  # [N, H, D], row stride 80
    cos = torch.randn(7, 1, 16, generator=g)
    sin = torch.randn(7, 1, 16, generator=g)
    got = rotate(x, cos, sin)
    assert got.is_contiguous()
    assert torch.equal(got, x * cos + x.roll(8, -1) * sin)


def test_kv_cache_truncate_only_lowers_length():
    c = KVCache(KVSpec(1, 2, 4), 8)
    c.length = 5
    c.truncate(7)
    assert c.length == 5
    c.truncate(3)
    assert c.length == 3
    with pytest.raises(ValueError):
        c.truncate(-1)


# ---------------------------------------------------------------- (d) early exit
@pytest.mark.parametrize("arch", ARCHS)
def test_early_exit_then_deeper_exit_reuses_layers(arch):
    hf, lm = native(arch)
    tokens = random_tokens(15, seed=5)
    ref2, ref4 = hf_exit_logits(hf, tokens, 2), hf_logits(hf, tokens)
    assert not torch.allclose(ref2, ref4, atol=1e-2)

    s = ModelSession(lm, 32)
    s.set_tokens(tokens[:12])
    s.prefill(exit_layer=2)
    assert [s.computed(layer) for layer in range(N_LAYERS)] == [11, 11, 0, 0]
    assert_close(s.logits(2, 0, 12), ref2[:12])
    assert_close(s.logits(4, 0, 12), ref4[:12])
    assert s.layer_evals == 12 * N_LAYERS
    s.extend(tokens[12:15])
    assert_close(s.logits(2, 12, 15), ref2[12:15])
    assert s.layer_evals == 12 * N_LAYERS + 3 * 2
    assert_close(s.logits(4, 12, 15), ref4[12:15])
    assert s.layer_evals == 15 * N_LAYERS


def test_exit_head_replaces_final_norm():
    _, lm = native("llama")
    h = torch.randn(3, lm.hidden_size, generator=torch.Generator().manual_seed(6))
    proj = torch.nn.Linear(lm.hidden_size, lm.hidden_size).eval()
    lm.exit_heads[2] = proj
    with torch.no_grad():
        expected = F.linear(proj(h), lm.lm_head)
        final = F.linear(F.rms_norm(h, (lm.hidden_size,), lm.final_norm, lm.eps), lm.lm_head)
    logits = lm.head(h, 2)
    assert_close(logits, expected, atol=1e-5)
    logits[:, 0] = float("-inf")  # callers may edit logits in place (not inference tensors)
    assert_close(lm.head(h, N_LAYERS), final, atol=1e-5)  # other exits keep the final norm
    with pytest.raises(ValueError):
        lm.head(h, N_LAYERS + 1)


def test_bf16_model_keeps_dtype_and_matches_hf_loosely():
    hf = tiny_hf_model("qwen2", num_layers=2, initializer_range=0.05).to(torch.bfloat16)
    tokens = random_tokens(12, seed=7)
    expected = hf_logits(hf, tokens)
    lm = NativeLM.from_hf(hf, tiny_model_info(hf, "bf16"))
    assert lm.layers[0].wqkv.dtype == torch.bfloat16
    s = ModelSession(lm, 16)
    s.set_tokens(tokens)
    got = s.logits(2, 0, 12)
    assert s.caches[0].k.dtype == torch.bfloat16
    assert_close(got, expected, atol=0.1 * expected.abs().max().item())


# ---------------------------------------------------------------- (e) HF backend
@pytest.mark.parametrize("arch", ARCHS)
def test_hf_backend_through_session_matches_hf(arch):
    hf = tiny_hf_model(arch, num_layers=N_LAYERS)
    lm = HFBackendLM(hf, tiny_model_info(hf, arch))
    assert lm.info.num_layers == 1 and lm.info.decoder_layers == N_LAYERS
    seq = random_tokens(18, seed=8)
    final = seq[:12] + [(t + 3) % 128 for t in seq[12:16]]
    ref_seq, ref_final = hf_logits(hf, seq), hf_logits(hf, final)

    s = ModelSession(lm, 32)
    s.set_tokens(seq[:8])
    s.prefill()
    assert_close(s.logits(1, 7, 8), ref_seq[7:8])
    s.extend([seq[8]])
    assert_close(s.logits(1, 8, 9), ref_seq[8:9])
    s.extend(seq[9:15])
    assert_close(s.logits(1, 9, 15), ref_seq[9:15])
    s.set_tokens(final)
    assert s.computed(0) == 12
    assert_close(s.logits(1, 12, 16), ref_final[12:16])


# ---------------------------------------------------------------- (f) supports()
@pytest.mark.parametrize(
    ("config", "reason"),
    [
        (MistralConfig(), "model_type"),
        (LlamaConfig(hidden_act="gelu"), "hidden_act"),
        (
            LlamaConfig(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}),
            "rope_type",
        ),
        (Qwen2Config(use_sliding_window=True, num_hidden_layers=4, max_window_layers=2), "layer"),
        (LlamaConfig(num_attention_heads=6, num_key_value_heads=4, hidden_size=96), "multiple"),
    ],
)
def test_supports_rejects_with_reason(config, reason):
    ok, why = supports(config)
    assert not ok
    assert reason in why


def test_supports_accepts_llama_and_qwen2_and_from_hf_refuses_others():
    assert supports(LlamaConfig()) == (True, "")
    assert supports(Qwen2Config()) == (True, "")
    assert supports(Qwen2Config(use_sliding_window=True, num_hidden_layers=24)) == (True, "")
    hf = tiny_hf_model("llama", hidden_act="gelu")
    with pytest.raises(ConfigError, match="hidden_act"):
        NativeLM.from_hf(hf, tiny_model_info(hf, "gelu"))
