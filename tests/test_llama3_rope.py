"""Llama 3.1/3.2's RoPE (``rope_type: llama3``) on the native backend: the rescaled
frequencies of all three wavelength bands, logits equal to HF's, and speculative decoding
token-identical to HF's greedy output at batch 1 and 3, contiguous and paged."""

from __future__ import annotations

import math

import pytest
import torch

from specflow.engine import SpeculativePipeline
from specflow.models.native import NativeLM, rope_inv_freq, supports
from specflow.models.tiny import tiny_hf_model, tiny_model_info
from stages.acceptors.standard import StandardAcceptor
from stages.drafters.pld import PLDDrafter
from stages.drafters.token_tree.drafter import TokenTreeDrafter
from stages.drafters.token_tree.recycling import RecyclingTable
from stages.drafters.token_tree.suffix_index import SuffixIndex
from stages.verifiers.full import FullVerifier
from tests.conftest import hf_greedy
from tests.test_one_engine import decode

# head_dim 16, theta 10^4: wavelengths 6.3, 19.9, 62.8, 199, ... against an original context
# of 64 with factors 1 and 4 (bands: < 16 kept, 16..64 blended, > 64 divided by 8)
ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
PROMPTS = [[1, 5, 9, 5, 9, 5, 9, 5, 9, 5, 9, 5, 9, 2, 7] * 3, [3, 4, 5, 6] * 9, [2, 8, 2, 9] * 10]


@pytest.fixture(scope="module")
def llama31():
    hf = tiny_hf_model("llama", seed=5, num_layers=3, rope_parameters=dict(ROPE))
    return hf, NativeLM.from_hf(hf, tiny_model_info(hf, "tiny-llama-3.1"))


def test_llama3_frequencies_by_band():
    """Worked by hand: f_i = 10^(-4 i / 8); band by wavelength 2 pi / f_i."""
    got = rope_inv_freq(16, 10000.0, ROPE)
    base = [10000.0 ** (-2 * i / 16) for i in range(8)]
    want = []
    for f in base:
        wavelen = 2 * math.pi / f
        if wavelen < 16:
            want.append(f)
        elif wavelen > 64:
            want.append(f / 8)
        else:
            m = (64 / wavelen - 1) / 3
            want.append((1 - m) * f / 8 + m * f)
    assert torch.allclose(got, torch.tensor(want), rtol=1e-6)
    assert [round(2 * math.pi / f, 1) for f in base[:3]] == [6.3, 19.9, 62.8]  # one per band


def test_llama3_rope_is_supported_and_its_tables_are_hfs(llama31):
    hf, lm = llama31
    assert supports(hf.config) == (True, "")
    assert lm.rope_scaling is not None and lm.rope_scaling["rope_type"] == "llama3"
    x = torch.zeros(1, 100, 64)
    with torch.no_grad():
        cos, sin = hf.model.rotary_emb(x, torch.arange(100)[None])  # [1, T, D]
    assert torch.allclose(lm.cos[:100], cos[0], atol=1e-6)
    half = lm.head_dim // 2
    assert torch.allclose(lm.sin_signed[:100, half:], sin[0, :, half:], atol=1e-6)


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
@pytest.mark.parametrize("batch_size", [1, 3])
@pytest.mark.parametrize("drafter", ["pld", "token_tree"])
def test_speculation_on_llama3_rope_equals_hf_greedy(llama31, drafter, batch_size, kind):
    hf, lm = llama31
    draft = PLDDrafter(k=4) if drafter == "pld" else TokenTreeDrafter(
        lm, k=4, branches=3, suffix=SuffixIndex(max_ngram=4), recycling=RecyclingTable(width=4))
    pipe = SpeculativePipeline(FullVerifier(lm), StandardAcceptor(), drafter=draft)
    gens, _ = decode(pipe, batch_size, kind, PROMPTS, 12)
    assert [g.tokens for g in gens] == [hf_greedy(hf, p, 12) for p in PROMPTS]
    assert sum(g.stats.drafted for g in gens) > 0


def test_default_rope_would_differ(llama31):
    """The scaling matters for these weights: the same model with default RoPE decodes
    other tokens (so the tests above can fail)."""
    hf, _ = llama31
    plain = tiny_hf_model("llama", seed=5, num_layers=3, rope_theta=10000.0)
    assert [hf_greedy(plain, p, 12) for p in PROMPTS] != [hf_greedy(hf, p, 12) for p in PROMPTS]


@pytest.mark.parametrize("head_rope", ["llama3", "default"])
def test_an_eagle_head_uses_the_rope_its_config_states(llama31, head_rope, tmp_path):
    """An EAGLE-1/2 folder for the Llama-3.1-style target: a head whose config states the
    target's llama3 RoPE shares the target's tables; one with default RoPE gets default-RoPE
    tables of its own.  Either way drafting stays lossless."""
    from specflow.models.decoder_params import rope_tables
    from specflow.models.published_heads import load_published_head
    from stages.drafters.feature import FeatureDrafter
    from tests.test_published_heads import eagle_config, eagle_state, write_eagle

    hf, lm = llama31
    config = eagle_config(hf)
    config.pop("rope_scaling", None)
    config.pop("rope_parameters", None)
    config["rope_theta"] = 10000.0
    if head_rope == "llama3":
        config["rope_scaling"] = {k: v for k, v in ROPE.items() if k != "rope_theta"}
    folder = write_eagle(tmp_path / "eagle", config, eagle_state(hf, seed=3))
    placed = load_published_head(str(folder), lm.info, lm.embed_weight).place(lm)
    if head_rope == "llama3":
        assert placed.cos is lm.cos
    else:
        cos, _ = rope_tables(lm.cos.shape[0], lm.head_dim, 10000.0, lm.device)
        assert torch.equal(placed.cos, cos.to(lm.dtype)) and not torch.allclose(placed.cos, lm.cos)
    pipe = SpeculativePipeline(FullVerifier(lm), StandardAcceptor(),
                               drafter=FeatureDrafter(lm, head=str(folder), k=3))
    gens, _ = decode(pipe, 1, "paged", PROMPTS, 12)
    assert [g.tokens for g in gens] == [hf_greedy(hf, p, 12) for p in PROMPTS]
