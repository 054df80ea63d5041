"""A ``NativeLM`` over GGUF blocks as published (``model.weights=gguf``).

Tiny Llama and Qwen2 models written as GGUF files in the tests (every block type the kernel
multiplies, a Llama's q/k rows permuted as llama.cpp's converter does) compute what the HF
model of the same (dequantized) weights computes, up to the 8-bit activations; every lossless
pipeline gives the quantized model's own greedy tokens at batch 1 and 3 and, sampling, its
law; the settings it cannot take are refused before loading, naming the fix.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from specflow.engine import SpeculativePipeline
from specflow.errors import ConfigError
from specflow.kv.stores import KVLayout
from specflow.models.gguf_native import loaded_bytes, native_from_gguf, unpermute_rows
from specflow.models.loading import load_model
from specflow.models.tiny import tiny_hf_model, tiny_model_info
from specflow.sampling import SamplingParams
from specflow.scheduler import Scheduler, SeqRequest
from tests.conftest import law_pvalue, two_token_law
from tests.gguf_tiny import dequantize, llama_permute, quantize, write_gguf
from tests.test_one_engine import FullVerifier, StandardAcceptor, build

# A type per tensor: every type the kernel multiplies, K-quants where a row is 256 or 512
TYPES = {"attn_q": T.Q4_K, "attn_k": T.Q8_0, "attn_v": T.Q6_K, "attn_output": T.Q5_0,
         "ffn_gate": T.Q4_K, "ffn_up": T.Q4_1, "ffn_down": T.Q6_K, "token_embd": T.Q8_0,
         "output": T.Q4_0}
PROMPTS = [[1, 5, 9, 17, 33, 5, 9], [3, 4, 5, 6, 7, 8, 3, 4, 5, 6], [2], [7, 7, 7, 7, 7, 7]]
MAX_NEW = 20


def tiny_gguf(arch: str, path, seed: int, num_layers: int, **overrides):
    """(hf, the quantized NativeLM of its GGUF file, hf with the dequantized weights)."""
    hf = tiny_hf_model(arch, seed=seed, num_layers=num_layers, hidden_size=256, **overrides)
    write_gguf(hf, path, TYPES)
    info = tiny_model_info(hf, f"tiny-gguf-{arch}-{seed}")
    lm = native_from_gguf(path, hf.config, info)
    return hf, lm, dequantized_twin(hf)


def dequantized_twin(hf):
    """A copy of ``hf`` whose matrices are the values its GGUF blocks decode to."""
    twin = copy.deepcopy(hf)
    names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
             "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
    with torch.no_grad():
        for name, module in twin.named_modules():
            key = name.rsplit(".", 1)[-1]
            if key in names:
                w = module.weight.float().numpy()
                t = TYPES[names[key]]
                module.weight.copy_(torch.from_numpy(dequantize(quantize(w, t), t)))
        emb = twin.model.embed_tokens.weight
        emb.copy_(torch.from_numpy(dequantize(quantize(emb.numpy(), T.Q8_0), T.Q8_0)))
        if twin.lm_head.weight is not emb:
            head = twin.lm_head.weight
            head.copy_(torch.from_numpy(dequantize(quantize(head.numpy(), T.Q4_0), T.Q4_0)))
    return twin


@pytest.fixture(scope="module")
def gguf_target(tmp_path_factory):
    return tiny_gguf("llama", tmp_path_factory.mktemp("gguf") / "target.gguf", 3, 6)


@pytest.fixture(scope="module")
def gguf_drafter(tmp_path_factory):
    return tiny_gguf("llama", tmp_path_factory.mktemp("gguf") / "drafter.gguf", 1, 2)


@pytest.fixture(scope="module")
def plain_tokens(gguf_target):
    """The quantized target's own greedy tokens: plain decoding, one request at a time."""
    lm = gguf_target[1]
    return decode(build("ar", lm, lm), 1)


def decode(pipe, batch_size: int, prompts=PROMPTS, max_new: int = MAX_NEW):
    sched = Scheduler(pipe, batch_size, KVLayout(kind="contiguous"), max_context=64)
    results = sched.generate([SeqRequest(p, max_new, tag=i) for i, p in enumerate(prompts)])
    sched.kv.check_no_leaks()
    by_tag = {r.request.tag: r.generation.tokens for r in results}
    return [by_tag[i] for i in range(len(prompts))]


def test_llama_q_k_rows_are_put_back_in_hf_order():
    w = np.arange(4 * 8 * 3).reshape(4 * 8, 3)  # 4 heads of 8 rows
    assert np.array_equal(llama_permute(w, 4)[unpermute_rows(32, 4)], w)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_quantized_model_computes_what_its_dequantized_weights_compute(arch, tmp_path):
    # weights of a trained model's scale (the tiny default, 0.25, is chaotic: any rounding
    # grows layer to layer)
    hf, lm, twin = tiny_gguf(arch, tmp_path / "m.gguf", seed=4, num_layers=2,
                             initializer_range=0.05)
    assert lm.quantized and lm.kv.row_exact
    prompt = torch.tensor([[1, 5, 9, 17, 33, 5, 9, 2, 40]])
    with torch.no_grad():
        want = twin(prompt).logits[0]  # [T, V]
    got = pipe_logits(lm, prompt[0].tolist())  # [T, V]
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < 0.03, rel  # the 8-bit activations' error, nothing larger
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.8
    assert loaded_bytes(lm) < sum(p.numel() * 4 for p in hf.parameters()) / 3


def pipe_logits(lm, prompt: list[int]) -> torch.Tensor:
    """The model's logits at every position of ``prompt`` (one prefill)."""
    from specflow.kv.session import ModelSession

    sess = ModelSession(lm, len(prompt) + 1)
    sess.set_tokens(prompt)
    return sess.logits(lm.info.num_layers, 0, len(prompt))


METHODS = ["pld", "sps", "sps_pld", "pld_then_model", "self_spec", "hispec", "layer_skip",
           "metasd_ucb", "fly_theta1"]


@pytest.mark.parametrize("batch_size", [1, 3])
@pytest.mark.parametrize("method", METHODS)
def test_every_pipeline_gives_the_quantized_models_own_greedy_tokens(method, batch_size,
                                                                     gguf_target, gguf_drafter,
                                                                     plain_tokens):
    lm, draft_lm = gguf_target[1], gguf_drafter[1]
    assert decode(build(method, lm, draft_lm), batch_size) == plain_tokens


@pytest.mark.parametrize("batch_size", [1, 3])
def test_token_trees_give_the_quantized_models_own_greedy_tokens(batch_size, gguf_target,
                                                                 plain_tokens):
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    lm = gguf_target[1]
    node = OmegaConf.load("conf/drafter/suffix_recycle.yaml")
    node.model = None
    node.row_cost = 0.1
    drafter = instantiate(node, model=lm)
    pipe = SpeculativePipeline(FullVerifier(lm), StandardAcceptor(), drafter=drafter,
                               name="suffix_recycle")
    assert decode(pipe, batch_size) == plain_tokens


@pytest.fixture(scope="module")
def gguf_three_layers(tmp_path_factory):
    """An odd number of layers: the fused forward's last layer writes the other buffer."""
    return tiny_gguf("qwen2", tmp_path_factory.mktemp("gguf") / "three.gguf", 5, 3)


def same_state(a, b, length: int) -> bool:
    """Whether two sessions of one model hold the same keys, values, lengths and ``h_N``."""
    return (a.layer_evals == b.layer_evals and a.final_start == b.final_start
            and torch.equal(a.final_hidden, b.final_hidden)
            and all(x.length == y.length == length
                    and torch.equal(x.k[:, :length], y.k[:, :length])
                    and torch.equal(x.v[:, :length], y.v[:, :length])
                    for x, y in zip(a.caches, b.caches, strict=True)))


@pytest.mark.parametrize("which", ["gguf_target", "gguf_three_layers"])
def test_the_fused_forward_computes_the_layer_loops_bits(which, request):
    from specflow.kv.fused import FusedForward
    from specflow.kv.session import ModelSession, forward_logits

    lm = request.getfixturevalue(which)[1]
    n = lm.info.num_layers
    prompt = [1, 5, 9, 17, 33, 5, 9, 2, 40, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]

    def pair():
        fused, loop = ModelSession(lm, 40), ModelSession(lm, 40)
        loop.fused = None  # every forward through the layer loop
        assert isinstance(fused.fused, FusedForward)
        return fused, loop

    fused, loop = pair()
    for length in (9, 10, 13, 18, 19):  # a prefill of 9 rows, then 1, 3, 5 and 1 more rows
        got = []
        for sess in (fused, loop):
            start = len(sess.tokens)
            sess.set_tokens(prompt[:length])
            got.append(forward_logits([(sess, n, max(start - 1, 0), length)])[0])
        assert torch.equal(got[0], got[1]) and same_state(fused, loop, length)
    assert fused.fused.steps == 5 and fused.layer_evals == 19 * n
    # a batch: the rows of two sequences in one forward, as the layer loop batches them
    second = pair()
    got = []
    for a, b in ((fused, second[0]), (loop, second[1])):
        b.set_tokens(prompt[3:9])
        a.set_tokens(prompt[:20])
        got.append(forward_logits([(a, n, 18, 20), (b, n, 0, 6)]))
    assert fused.fused.steps == 6 and second[0].fused.steps == 1
    assert all(torch.equal(x, y) for x, y in zip(got[0], got[1], strict=True))
    assert same_state(fused, loop, 20) and same_state(second[0], second[1], 6)
    # an early exit leaves the layers at different positions: the loop runs, and then the
    # next full forward too
    for sess in (fused, loop):
        sess.set_tokens(prompt[:22])
        sess.hidden(n - 1, 21)
    got = [forward_logits([(sess, n, 19, 22)])[0] for sess in (fused, loop)]
    assert fused.fused.steps == 6 and torch.equal(got[0], got[1]) and same_state(fused, loop, 22)
    # a token tree: each node over the prefix and its ancestors, as the loop attends it; the
    # next tokens keep the path they spell
    for sess in (fused, loop):
        sess.set_tree(prompt[:22], [20, 21, 22, 23], [-1, 0, -1, 2])
    got = [forward_logits([(sess, n, 21, 26)])[0] for sess in (fused, loop)]
    assert fused.fused.steps == 7 and torch.equal(got[0], got[1])
    assert same_state(fused, loop, 26)
    for sess in (fused, loop):
        sess.set_tokens(prompt[:22] + [22, 23, 7])
    got = [forward_logits([(sess, n, 24, 25)])[0] for sess in (fused, loop)]
    assert fused.fused.steps == 8 and torch.equal(got[0], got[1])
    assert same_state(fused, loop, 25)


def test_no_fused_forward_where_the_layer_loop_must_run(gguf_target):
    from specflow.kv.contiguous import layer_caches
    from specflow.kv.fused import fused_path
    from specflow.models.native import NativeLM

    float_lm = NativeLM.from_hf(gguf_target[2], tiny_model_info(gguf_target[2], "twin"))
    assert float_lm.fused_layers() is None  # float weights
    assert fused_path(float_lm, layer_caches(float_lm, 8)) is None
    lm = gguf_target[1]
    caches = layer_caches(lm, 8)
    assert fused_path(lm, caches) is not None
    assert fused_path(lm, caches[:-1]) is None  # not one cache a layer


def test_sampling_follows_the_quantized_targets_law(gguf_target, gguf_drafter):
    lm = gguf_target[1]
    sampling = SamplingParams(temperature=1.0, top_k=3)
    pipe = build("sps", lm, gguf_drafter[1])
    prompt = [1, 5, 9]
    law = two_token_law(lm, prompt, sampling)
    sched = Scheduler(pipe, 3, KVLayout(kind="contiguous"), max_context=16)
    results = sched.generate([SeqRequest(prompt, 2, seed=s, stop_token_ids=())
                              for s in range(600)], sampling)
    assert law_pvalue(results, law) > 1e-3


def test_the_paged_layout_is_refused_naming_the_fix(gguf_target):
    pipe = build("pld", gguf_target[1], gguf_target[1])
    with pytest.raises(ConfigError, match="runner.kv_layout=contiguous"):
        Scheduler(pipe, 2, KVLayout(kind="paged", block_size=4), max_context=32)


SETTINGS = dict(dtype="float32", backend="auto", trust_remote_code=False, packed_weights=None)


@pytest.mark.parametrize("change,fix", [
    ({"quantize": "int8"}, "model.quantize=null"),
    ({"dtype": "bfloat16"}, "model.dtype=float32"),
    ({"backend": "hf"}, "model.backend=auto"),
    ({"packed_weights": True}, "model.packed_weights=null"),
    ({"weights": "int4"}, "use one of float, gguf"),
])
def test_settings_gguf_weights_cannot_take_are_refused_before_loading(change, fix, tmp_path):
    settings = {**SETTINGS, "weights": "gguf", **change}
    with pytest.raises(ConfigError, match=fix):
        load_model(str(tmp_path / "absent.gguf"), **settings)


def test_a_folder_without_a_gguf_file_is_refused_naming_the_fix(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="model.weights=float"):
        load_model(str(tmp_path), **SETTINGS, weights="gguf")


def test_the_row_probe_prices_the_quantized_kernel_and_never_pads(gguf_target):
    from specflow.cpu.row_padding import apply_min_rows, probe_min_rows, row_prices

    lm = gguf_target[1]
    probe = probe_min_rows(lm, candidates=(1, 2, 3), layers=2, repeats=1, priced=(5, 8))
    assert probe.chosen == 1 and set(probe.seconds) == {1, 2, 3} and set(probe.priced) == {5, 8}
    assert not probe.dense and not probe.int8 and not probe.float_rows
    lm.row_probe = probe
    apply_min_rows(lm, None)
    assert lm.min_rows == 1 and not lm.dense_rows and not lm.float_rows
    prices = row_prices(lm)
    assert prices is not None and prices(1) == 1.0 and prices(8) >= prices(2) >= 1.0


def test_a_vocabulary_subset_scores_the_quantized_heads_rows(gguf_drafter):
    """The subset's prefix is the quantized head's own rows (the same bits as the full head);
    the extra ids' rows are decoded from the file's blocks."""
    from specflow.drafting import SubVocabHead
    from specflow.kv.session import ModelSession

    lm = gguf_drafter[1]
    head = SubVocabHead.build(lm, 40, always=[100, 70, 100])
    prefix = head.prefix
    assert head.ids.tolist() == list(range(prefix)) + sorted({*range(prefix, 40), 70, 100})
    torch.testing.assert_close(head.extra_weight, lm.lm_head.rows_of(head.ids[prefix:]))
    session = ModelSession(lm, 16)
    session.set_tokens([1, 5, 9, 17])
    top = lm.info.num_layers
    full = session.logits(top, 0, 4)  # [4, V]
    sub = head.logits(lm, session.exit_hidden(top, 0, 4), top)  # [4, N]
    assert torch.equal(sub[:, :prefix], full[:, :prefix])
    torch.testing.assert_close(sub[:, prefix:], full[:, head.ids[prefix:]], rtol=0.05, atol=0.05)


@pytest.mark.parametrize("batch_size", [1, 3])
def test_a_quantized_drafter_with_a_vocabulary_subset_keeps_the_targets_tokens(
        batch_size, gguf_target, gguf_drafter, plain_tokens):
    from stages.drafters.model import ModelDrafter

    lm, draft_lm = gguf_target[1], gguf_drafter[1]
    pipe = SpeculativePipeline(FullVerifier(lm), StandardAcceptor(),
                               drafter=ModelDrafter(draft_lm, k=3, vocab_subset=40))
    assert decode(pipe, batch_size) == plain_tokens


# --- a draft model's blocks re-quantized to 4 bits (model.quantize=q4_0 | q4_1) ----------------

@pytest.mark.parametrize("kind,source", [("q4_0", T.Q8_0), ("q4_0", T.Q6_K), ("q4_1", T.Q5_0),
                                         ("q4_1", T.Q8_0)])
def test_a_requantized_part_holds_ggmls_reference_blocks_of_its_decoded_values(kind, source,
                                                                               monkeypatch):
    from specflow.quant.matrix import dequantize as decode_part
    from specflow.quant.matrix import part_from_numpy
    from specflow.quant.requantize import REQUANTIZE_TYPES, requantize_part

    monkeypatch.setattr("specflow.quant.requantize.CHUNK_ROWS", 16)  # chunks 16, 16 and 8 rows
    w = np.random.default_rng(0).normal(0, 0.05, (40, 512)).astype(np.float32)
    part = part_from_numpy(int(source), quantize(w, source), 512)
    got = requantize_part(part, kind)
    target = T(REQUANTIZE_TYPES[kind])
    assert (got.ggml_type, got.rows, got.cols) == (int(target), 40, 512)
    assert got.nbytes < part.nbytes
    values = decode_part(part).numpy()  # what the file's blocks hold, as ggml decodes them
    want = dequantize(quantize(values, target), target)  # gguf-py's reference, round trip
    assert np.array_equal(decode_part(got).numpy(), want)


@pytest.mark.parametrize("kind,source", [("q4_0", T.Q4_K), ("q4_0", T.Q4_0), ("q4_1", T.Q4_0),
                                         ("q4_1", T.Q4_1)])
def test_a_part_of_no_more_bits_than_the_chosen_type_is_kept_as_the_file_holds_it(kind, source):
    from specflow.quant.matrix import part_from_numpy
    from specflow.quant.requantize import requantize_part

    w = np.random.default_rng(1).normal(0, 0.05, (16, 256)).astype(np.float32)
    part = part_from_numpy(int(source), quantize(w, source), 256)
    assert requantize_part(part, kind) is part


@pytest.mark.parametrize("batch_size", [1, 3])
def test_a_requantized_drafter_keeps_the_targets_tokens(batch_size, gguf_target, plain_tokens,
                                                        tmp_path):
    """The drafter's file (every type of ``TYPES``) re-quantized to Q4_0: each part of more
    bits than 4.5 a weight becomes Q4_0, the rest keep the file's blocks (the embedding,
    only looked up, too); its drafts change, the target's tokens do not."""
    # weights of a trained model's scale (see the test of the dequantized twin above)
    hf = tiny_hf_model("llama", seed=1, num_layers=2, hidden_size=256, initializer_range=0.05)
    write_gguf(hf, tmp_path / "drafter.gguf", TYPES)
    info = tiny_model_info(hf, "tiny-gguf-drafter-q4_0")
    draft_lm = native_from_gguf(tmp_path / "drafter.gguf", hf.config, info, requantize="q4_0")
    layer = draft_lm.layers[0]
    kinds = {name: [T(p.ggml_type).name for p in getattr(layer, name).parts]
             for name in ("wqkv", "wo", "w_gate_up", "w_down")}
    assert kinds == {"wqkv": ["Q4_K", "Q4_0", "Q4_0"], "wo": ["Q4_0"],
                     "w_gate_up": ["Q4_K", "Q4_0"], "w_down": ["Q4_0"]}
    assert T(draft_lm.lm_head.parts[0].ggml_type) == T.Q4_0  # the file's Q4_0, kept
    assert T(draft_lm.embed_weight.parts[0].ggml_type) == T.Q8_0
    published_lm = native_from_gguf(tmp_path / "drafter.gguf", hf.config, info)
    assert loaded_bytes(draft_lm) < loaded_bytes(published_lm)
    # its logits stay the published drafter's, up to the 4-bit rounding
    published = pipe_logits(published_lm, PROMPTS[1])  # [T, V]
    got = pipe_logits(draft_lm, PROMPTS[1])
    assert not torch.equal(got, published)
    rel = ((got - published).norm() / published.norm()).item()
    agree = (got.argmax(-1) == published.argmax(-1)).float().mean().item()
    assert rel < 0.35 and agree >= 0.6  # random weights' 4-bit rounding (unrelated: rel ~1.4)
    lm = gguf_target[1]
    assert decode(build("sps", lm, draft_lm), batch_size) == plain_tokens


def test_a_tied_embedding_is_requantized_with_the_lm_head_it_is(tmp_path):
    hf = tiny_hf_model("llama", seed=2, num_layers=2, hidden_size=256, tie_word_embeddings=True)
    write_gguf(hf, tmp_path / "tied.gguf", TYPES)  # no output.weight: the Q8_0 embedding
    info = tiny_model_info(hf, "tiny-gguf-tied")
    lm = native_from_gguf(tmp_path / "tied.gguf", hf.config, info, requantize="q4_1")
    assert lm.embed_weight is lm.lm_head and T(lm.lm_head.parts[0].ggml_type) == T.Q4_1
    published = native_from_gguf(tmp_path / "tied.gguf", hf.config, info)
    rel = ((lm.embed_weight.rows_of(torch.arange(8)) - published.embed_weight.rows_of(
        torch.arange(8))).norm() / published.embed_weight.rows_of(torch.arange(8)).norm()).item()
    assert 0.0 < rel < 0.2  # its lookups read the 4-bit values


def test_requantized_weights_have_their_own_fingerprint_and_a_bad_kind_is_refused(gguf_drafter):
    from specflow.quant.requantize import requantize_part, requantized_fingerprint

    file_fp = "0123456789abcdef"
    prints = {requantized_fingerprint(file_fp, kind) for kind in ("q4_0", "q4_1")}
    assert len(prints) == 2 and file_fp not in prints and all(len(p) == 16 for p in prints)
    assert requantized_fingerprint("fedcba9876543210", "q4_0") not in prints
    with pytest.raises(ConfigError, match=r"model.quantize='int4' cannot re-quantize GGUF "
                                          r"blocks; use one of q4_0, q4_1 or null"):
        requantize_part(gguf_drafter[1].layers[0].wo.parts[0], "int4")
