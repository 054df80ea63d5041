"""Weight-only int8 copies of a model (``model.quantize=int8``): the quantization's numbers,
the passes that use them, the row probe that chooses them, the refusals, and pipelines
drafting with an int8 model giving HF's greedy tokens and the target's sampled law."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specflow.app import prepare_run
from specflow.cpu.int8_weights import Int8Matrix, int8_linear, quantize_int8
from specflow.cpu.row_padding import (
    RowProbe,
    apply_min_rows,
    choose_int8_rows,
    probe_min_rows,
    row_padding_info,
    row_prices,
)
from specflow.engine import SpeculativePipeline
from specflow.errors import ConfigError
from specflow.kv.stores import KVLayout
from specflow.models.native import NativeLM, linear
from specflow.sampling import SamplingParams
from specflow.scheduler import Scheduler, SeqRequest
from stages.acceptors.standard import StandardAcceptor
from stages.drafters.fallback import FallbackDrafter
from stages.drafters.model import ModelDrafter
from stages.drafters.pld import PLDDrafter
from stages.verifiers.full import FullVerifier
from tests.conftest import hf_greedy, law_pvalue, make_pair, two_token_law
from tests.test_configs import _compose
from tests.test_models_loading import WORDS, _load, _tiny_folder
from tests.test_one_engine import MAX_NEW, PROMPTS, decode
from tests.test_token_tree import tree_drafter

BF16_STEP = 2.0**-8  # bfloat16's relative spacing: 8 bits of mantissa


def test_quantize_int8_rounds_each_row_to_its_own_scale():
    """Row 0: scale bf16(2.54 / 127) = 0.02001953125, q = round(w / scale); row 1 is zero
    (the smallest normal scale, q = 0); dequantized within half a scale of the weights."""
    w = torch.tensor([[2.54, -1.27, 0.0, 0.01], [0.0, 0.0, 0.0, 0.0]])
    m = quantize_int8(w)
    assert m.q.dtype == torch.int8 and m.scale.dtype == torch.bfloat16
    assert m.dtype == torch.float32 and m.shape == (2, 4)
    assert m.scale[0].item() == 0.02001953125
    assert m.q.tolist() == [[127, -63, 0, 0], [0, 0, 0, 0]]
    assert m.scale[1].item() > 0
    err = (m.dequantized() - w).abs()
    assert bool((err <= m.scale.float()[:, None] / 2 + 1e-7).all())


def test_int8_linear_is_the_dequantized_product_with_bf16_inputs():
    """y = bf16(x) @ (s q).T + b, returned in x's dtype; ``linear`` sends an Int8Matrix there;
    against the full-precision product the error is the quantization's."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(24, 16, generator=g) * 0.1  # [out, in]
    x = torch.randn(3, 16, generator=g)  # [N, in]
    b = torch.randn(24, generator=g)
    m = quantize_int8(w)
    y = int8_linear(x, m, b)
    assert y.dtype == torch.float32 and y.shape == (3, 24)
    ref = x.bfloat16().float() @ m.dequantized().T + b
    torch.testing.assert_close(y, ref, atol=0.02, rtol=BF16_STEP * 4)
    assert torch.equal(linear(x, m, b), y)
    assert (y - F.linear(x, w, b)).abs().max().item() < 0.1
    assert not torch.equal(y, F.linear(x, w, b))  # it is another product


@pytest.fixture(scope="module")
def pair():
    return make_pair("llama", seed=7, num_layers=2)


def test_int8_rows_run_the_int8_copies_and_other_rows_the_models_own(pair):
    """After ``make_int8_copies`` nothing changes until ``set_int8_rows``; then passes of
    those row counts (layers and LM head) multiply the copies, other counts the own
    weights; greedy tokens mostly agree."""
    hf, _ = pair
    lm = NativeLM.from_hf(hf, pair[1].info)
    h = lm.embed(torch.tensor([3, 5, 7, 11]))  # [4, H]
    own = lm.head(h, lm.info.num_layers)
    lm.make_int8_copies()
    assert all(isinstance(getattr(w, m), Int8Matrix) for w in lm.int8_layers
               for m in ("wqkv", "wo", "w_gate_up", "w_down"))
    assert torch.equal(lm.head(h, lm.info.num_layers), own)  # no int8 rows yet
    lm.set_int8_rows(frozenset({1, 4}))
    q4 = lm.head(h, lm.info.num_layers)
    assert not torch.equal(q4, own)
    expect = F.linear(F.rms_norm(h, (lm.hidden_size,), lm.final_norm, lm.eps).bfloat16(),
                      lm.int8_head.dequantized().bfloat16()).float()
    torch.testing.assert_close(q4, expect, atol=0.05, rtol=0.02)
    assert torch.equal(lm.head(h[:3], lm.info.num_layers), own[:3])  # 3 rows: own weights
    assert (q4.argmax(-1) == own.argmax(-1)).float().mean().item() >= 0.75
    lm.set_int8_rows(frozenset())
    bare = NativeLM.from_hf(hf, pair[1].info)
    with pytest.raises(ValueError, match="without int8 copies"):
        bare.set_int8_rows(frozenset({1}))


def test_the_probe_times_int8_copies_and_chooses_where_they_win(pair):
    """A packed model's probe times its int8 copies at every count; ``choose_int8_rows``
    takes the counts where int8 beats the own pass (padded, or dense where dense runs) by
    more than the margin, and the prices follow what runs."""
    hf, _ = pair
    lm = NativeLM.from_hf(hf, pair[1].info, packed=False)
    lm.make_int8_copies()
    probe = probe_min_rows(lm, candidates=(1, 2), layers=1, repeats=1, priced=(4,))
    assert sorted(probe.int8) == [1, 2, 4] and sorted(probe.seconds) == [1, 2]
    assert probe.chosen == 1  # an unpacked model is never padded
    fake = RowProbe({1: 10.0, 2: 10.0, 3: 10.0}, 3, {8: 20.0}, {2: 5.0},
                    {1: 4.0, 2: 4.9, 3: 9.6, 8: 30.0})
    # 1 row: own = packed padded to 3 = 10 -> int8 4 wins; 2 rows run dense (5): 4.9 is
    # within the 5 % margin; 3 rows: 9.6 vs 10 within the margin; 8: 30 > 20.
    assert choose_int8_rows(fake, 3, frozenset({2})) == frozenset({1})
    assert choose_int8_rows(fake, 1, frozenset()) == frozenset({1, 2})
    lm.row_probe, lm.min_rows = fake, 3
    lm.set_int8_rows(frozenset({1}))
    prices = row_prices(lm)
    # seconds as run: 1 -> 4 (int8), 2 -> 10, 3 -> 10, 8 -> 20: price(n) = S(n) / S(1)
    assert [prices(n) for n in (1, 2, 8)] == [1.0, 2.5, 5.0]
    info = row_padding_info(lm)
    assert info["int8_rows"] == [1] and info["int8_ms"]["1"] == 4000.0
    lm.set_int8_rows(frozenset())


def test_apply_min_rows_uses_int8_copies_at_one_row_or_where_probed(pair, monkeypatch):
    hf, _ = pair
    lm = NativeLM.from_hf(hf, pair[1].info, packed=False)
    lm.make_int8_copies()
    apply_min_rows(lm, 2)  # given: no probe, one-row passes on the copies
    assert lm.min_rows == 2 and lm.int8_rows == frozenset({1})
    monkeypatch.setattr("specflow.cpu.row_padding.probe_min_rows",
                        lambda model: RowProbe({1: 1.0, 2: 1.0}, 1, {}, {}, {1: 0.5, 2: 1.2}))
    apply_min_rows(lm, None)
    assert lm.min_rows == 1 and lm.int8_rows == frozenset({1})


def test_load_model_makes_int8_copies_and_refuses_bad_values(tmp_path):
    folder = str(_tiny_folder(tmp_path / "tiny", WORDS))
    loaded = _load(folder, quantize="int8")
    assert loaded.lm.int8_layers and loaded.lm.int8_head is not None
    assert _load(folder) is not loaded  # cached apart from the unquantized model
    assert not _load(folder).lm.int8_layers
    with pytest.raises(ConfigError, match=r"model.quantize='int4' is unknown; use one of int8 "
                                          r"or null \(with model.weights=gguf: q4_0, q4_1"):
        _load(folder, quantize="int4")
    with pytest.raises(ConfigError, match=r"model.quantize=q4_0 re-quantizes a GGUF file's "
                                          r"blocks: it goes with model.weights=gguf"):
        _load(folder, quantize="q4_0")
    with pytest.raises(ConfigError, match="needs the native backend"):
        _load(folder, backend="hf", quantize="int8")


@pytest.mark.parametrize("kind", ["int8", "q4_0"])
def test_a_quantized_target_is_refused(kind, tmp_path):
    cfg = _compose([f"model.quantize={kind}"])
    with pytest.raises(ConfigError, match=rf"model.quantize={kind}: the target's quantized "
                                          r"copies or re-quantized blocks would change its "
                                          r"outputs.*"
                                          r"drafter.model.quantize=int8, or q4_0 / q4_1"):
        prepare_run(cfg, tmp_path / "out")


_INT8_SELF: list = []


def int8_self_draft(target_pair) -> NativeLM:
    """The target's own weights as a second model whose every pass runs on int8 copies: a
    draft that agrees with the target on most tokens, not all (made once)."""
    if not _INT8_SELF:
        hf, lm = target_pair
        draft = NativeLM.from_hf(hf, lm.info)
        draft.make_int8_copies()
        draft.set_int8_rows(frozenset(range(1, 257)))
        _INT8_SELF.append(draft)
    return _INT8_SELF[0]


@pytest.fixture(scope="module")
def target():
    return make_pair("llama", seed=0, num_layers=4)


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
@pytest.mark.parametrize("batch_size", [1, 3])
@pytest.mark.parametrize("method", ["pld_then_model", "pld_then_tree_model"])
def test_an_int8_draft_model_gives_hf_greedy_tokens(method, batch_size, kind, target):
    """The target's int8 copy drafting (as pld_sps does, and as pld_tree_sps's draft model
    verifying its own token trees): HF's greedy tokens, most drafts accepted, some not."""
    hf, lm = target
    draft = int8_self_draft(target)
    if method == "pld_then_model":
        inner = ModelDrafter(draft, k=4)
    else:
        inner = SpeculativePipeline(FullVerifier(draft), StandardAcceptor(),
                                    drafter=tree_drafter(draft), level="draft", k=4)
    pipe = SpeculativePipeline(FullVerifier(lm), StandardAcceptor(),
                               drafter=FallbackDrafter(PLDDrafter(k=4, min_ngram=2), inner))
    prompts = PROMPTS * 2
    gens, sched = decode(pipe, batch_size, kind, prompts, MAX_NEW)
    assert [g.tokens for g in gens] == [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    assert max(sched.stats.occupancy) == batch_size
    drafted = sum(g.stats.drafted for g in gens)
    accepted = sum(g.stats.accepted for g in gens)
    assert 0 < accepted and accepted > drafted // 2


def test_an_int8_draft_model_samples_the_targets_law(target):
    """Sampled (batch 3, paged, rejection sampling with the int8 model's q): the joint law
    of two sampled tokens is the target's."""
    _, lm = target
    sampling = SamplingParams(temperature=1.0, top_k=3)
    prompt = [1, 5, 9]
    law = two_token_law(lm, prompt, sampling)
    pipe = SpeculativePipeline(FullVerifier(lm), StandardAcceptor(),
                               drafter=ModelDrafter(int8_self_draft(target), k=2))
    sched = Scheduler(pipe, 3, KVLayout(kind="paged", block_size=4), max_context=16)
    results = sched.generate(
        [SeqRequest(prompt, 2, seed=s, stop_token_ids=()) for s in range(600)], sampling)
    assert law_pvalue(results, law) > 1e-3
    assert sum(r.generation.stats.accepted for r in results) > 0


def test_the_draft_models_of_pld_sps_and_pld_tree_sps_take_int8_copies():
    """One 0.5B, loaded once: the draft pipeline's drafter and verifier ask for the same
    model (int8 copies included); the target never does."""
    tree = _compose(["+experiment=pld_tree_sps"])
    inner = tree.drafter.then
    assert inner.drafter.model.quantize == inner.target_verifier.model.quantize == "int8"
    assert inner.drafter.model == inner.target_verifier.model
    assert tree.model.quantize is None
    chain = _compose(["+experiment=pld_sps"])
    assert chain.drafter.then.model.quantize == "int8" and chain.model.quantize is None
