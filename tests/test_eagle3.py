"""Published EAGLE-3 heads: the session keeps the target's layer inputs they read, a head in
the published layout loads as a feature drafter, drafts what the paper's forward drafts in
every round, stays lossless, and bad folders fail before any decoding.

Each checkpoint is written here in the layout ``SafeAILab/EAGLE`` publishes for EAGLE-3
(``config.json`` a Llama config with ``draft_vocab_size``; ``fc.weight``, ``midlayer.*`` (or
``layers.0.*``), ``norm.weight``, ``lm_head.weight``, ``d2t`` int64, ``t2d`` bool; float16
tensors).  ``paper_eagle3`` is EAGLE-3's draft forward written from the paper, independently
of ``specflow.models.eagle3_head``: the features are HF's ``hidden_states[l]`` (the input of
decoder layer ``l``) of three layers; its decoder layer is ``test_published_heads.paper_layer``
(rotate-half RoPE, repeated KV heads, a causal softmax) with q/k/v reading 2H.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from specflow.engine import SpeculativePipeline
from specflow.errors import ConfigError
from specflow.kv.session import ModelSession
from specflow.kv.stores import KVLayout
from specflow.protocols import Draft
from specflow.sampling import SamplingParams
from specflow.scheduler import Scheduler, SeqRequest, generate
from specflow.state import DecodeState
from stages.acceptors.standard import StandardAcceptor
from stages.drafters.fallback import FallbackDrafter
from stages.drafters.feature import FeatureDrafter
from stages.drafters.pld import PLDDrafter
from stages.drafters.pool import PoolDrafter
from stages.selectors.round_robin import RoundRobinSelector
from stages.verifiers.early_exit import EarlyExitVerifier
from stages.verifiers.full import FullVerifier
from tests.conftest import hf_greedy, law_pvalue, make_pair, two_token_law
from tests.test_one_engine import decode
from tests.test_published_heads import _rms, paper_layer

PROMPTS = [[1, 5, 9, 17, 33, 5, 9], [3, 4, 5, 6, 7, 8, 3, 4, 5, 6], [2], [7, 7, 7, 7, 7, 7],
           [11, 12, 13, 14, 11, 12, 13, 14, 11, 12]]
MAX_NEW = 20
LAYERS = 8  # EAGLE-3's default layers of an 8-layer target: 2, 4 and 5


# ---------------------------------------------------------------------- published layout
def eagle3_state(hf, seed: int, draft_ids: torch.Tensor, prefix: str = "midlayer.",
                 layers: int = 3) -> dict[str, torch.Tensor]:
    """An EAGLE-3 head's state dict for target ``hf`` (random, float16), published keys;
    ``draft_ids [V_d]``: the target's tokens of the draft vocabulary, ascending."""
    c = hf.config
    h, nh, kh, v = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.vocab_size
    d, i, vd = h // nh, c.intermediate_size, draft_ids.numel()
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int, std: float = 0.15) -> torch.Tensor:
        return (std * torch.randn(*shape, generator=g)).half()

    def norm(n: int) -> torch.Tensor:
        return (1 + w(n, std=0.2).float()).half()

    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[draft_ids] = True
    return {
        "fc.weight": w(h, layers * h),
        prefix + "self_attn.q_proj.weight": w(nh * d, 2 * h),
        prefix + "self_attn.k_proj.weight": w(kh * d, 2 * h),
        prefix + "self_attn.v_proj.weight": w(kh * d, 2 * h),
        prefix + "self_attn.o_proj.weight": w(h, nh * d),
        prefix + "mlp.gate_proj.weight": w(i, h), prefix + "mlp.up_proj.weight": w(i, h),
        prefix + "mlp.down_proj.weight": w(h, i),
        prefix + "input_layernorm.weight": norm(h), prefix + "hidden_norm.weight": norm(h),
        prefix + "post_attention_layernorm.weight": norm(h),
        "norm.weight": norm(h), "lm_head.weight": w(vd, h, std=0.5),
        "d2t": draft_ids - torch.arange(vd), "t2d": t2d,
    }


def eagle3_config(hf, draft_vocab: int, **extra) -> dict:
    c = hf.config
    return {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "bias": False,
        "hidden_act": "silu", "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "num_hidden_layers": 1,
        "max_position_embeddings": c.max_position_embeddings, "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": getattr(c, "rope_theta", 10000.0), "vocab_size": c.vocab_size,
        "draft_vocab_size": draft_vocab, "torch_dtype": "float16", **extra,
    }


def write(folder: Path, config: dict, state: dict[str, torch.Tensor]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: t.contiguous() for k, t in state.items()}, str(folder / "model.safetensors"))
    return folder


def draft_vocab(vocab: int, size: int, seed: int) -> torch.Tensor:
    """A draft vocabulary of ``size`` of the ``vocab`` tokens (ascending)."""
    return torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))[:size].sort()[0]


# ---------------------------------------------------------------------- the paper's forward
def paper_eagle3(sd: dict, cfg: dict, embed: torch.Tensor, x: torch.Tensor,
                 tokens: torch.Tensor) -> torch.Tensor:
    """EAGLE-3's decoder layer over a whole sequence: ``x [T, H]`` (``fc`` of the target's
    features, or fed-back outputs) and ``tokens [T]`` (row p: t_{p+1}) -> ``[T, H]``."""
    s = {k: v.float() for k, v in sd.items()}
    pre = "layers.0." if "layers.0.hidden_norm.weight" in s else "midlayer."
    eps = cfg["rms_norm_eps"]
    u = torch.cat([_rms(embed[tokens], s[pre + "input_layernorm.weight"], eps),
                   _rms(x, s[pre + "hidden_norm.weight"], eps)], -1)  # [T, 2H]
    return paper_layer(s, pre, cfg, u, x)


def paper_draft(hf, sd: dict, cfg: dict, committed: list[int], layers: tuple[int, ...],
                k: int, first: int | None = None) -> list[int]:
    """EAGLE-3's greedy chain of ``k`` drafts after ``committed`` (features: HF's inputs of
    ``layers`` over all but the last token), or the branch whose first token is the
    ``first``-th most likely (a tree's branch)."""
    ids = torch.tensor([committed])
    s = {key: val.float() for key, val in sd.items()}
    to_target = torch.arange(s["lm_head.weight"].shape[0]) + sd["d2t"].long()
    with torch.no_grad():
        hs = hf(ids[:, :-1], output_hidden_states=True).hidden_states
        x = torch.cat([hs[layer][0] for layer in layers], -1) @ s["fc.weight"].T  # [n-1, H]
        tokens, embed = ids[0, 1:], hf.model.embed_tokens.weight
        out: list[int] = []
        for step in range(k):
            y = paper_eagle3(sd, cfg, embed, x, tokens)[-1]  # [H]
            logits = s["lm_head.weight"] @ _rms(y, s["norm.weight"], cfg["rms_norm_eps"])
            pick = logits.topk(first + 1).indices[first] if step == 0 and first else \
                logits.argmax()
            out.append(int(to_target[pick]))
            x = torch.cat([x, y[None]])
            tokens = torch.cat([tokens, torch.tensor(out[-1:])])
    return out


# ---------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def target():
    return make_pair("llama", seed=3, num_layers=LAYERS)


@pytest.fixture(scope="module")
def head(target, tmp_path_factory) -> tuple[Path, dict, dict]:
    hf, _ = target
    ids = draft_vocab(hf.config.vocab_size, 96, seed=2)
    sd, cfg = eagle3_state(hf, seed=11, draft_ids=ids), eagle3_config(hf, 96)
    return write(tmp_path_factory.mktemp("eagle3") / "EAGLE3-tiny", cfg, sd), sd, cfg


@pytest.fixture(scope="module")
def trained(target, tmp_path_factory) -> Path:
    """An EAGLE-3 head (full vocabulary, no ``d2t``) trained by the paper's forward on the
    target's greedy answers to ``PROMPTS`` (one teacher-forced step, cross-entropy against
    the next-but-one token; 40 Adam steps, under a second), so the lossless tests see drafts
    accepted; written in the published layout."""
    hf, _ = target
    v = hf.config.vocab_size
    sd = eagle3_state(hf, seed=1, draft_ids=torch.arange(v))
    del sd["d2t"], sd["t2d"]
    cfg = eagle3_config(hf, v)
    data = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor(prompt + hf_greedy(hf, prompt, MAX_NEW))
            hs = hf(ids[None], output_hidden_states=True).hidden_states
            data.append((torch.cat([hs[layer][0] for layer in (2, 4, 5)], -1), ids))
    params = {k: t.float().clone().requires_grad_(True) for k, t in sd.items()}
    opt = torch.optim.Adam(params.values(), lr=1e-2)
    embed = hf.model.embed_tokens.weight.detach()
    for _ in range(40):
        loss = torch.zeros(())
        for feats, ids in data:
            y = paper_eagle3(params, cfg, embed, feats[:-2] @ params["fc.weight"].T, ids[1:-1])
            logits = _rms(y, params["norm.weight"], cfg["rms_norm_eps"]) \
                @ params["lm_head.weight"].T
            loss = loss + F.cross_entropy(logits, ids[2:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    state = {k: t.detach().half() for k, t in params.items()}
    return write(tmp_path_factory.mktemp("trained") / "EAGLE3-trained", cfg, state)


# ---------------------------------------------------------------------- the session
def _hf_inputs(hf, tokens: list[int], layers: tuple[int, ...]) -> torch.Tensor:
    """HF's inputs of ``layers`` (``hidden_states[l]``), concatenated: ``[n, H * k]``."""
    with torch.no_grad():
        hs = hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    return torch.cat([hs[layer][0] for layer in layers], -1)


def test_the_session_keeps_layer_inputs_through_a_tree_and_truncation(target):
    """The kept inputs of layers 2, 4, 5 are HF's ``hidden_states`` of those layers after a
    prefill, after a verified tree keeps one path (its rows moved into place, the other
    branch's gone), and after truncation; ``h_N`` beside them is unchanged; declared late,
    the layers are refused."""
    hf, lm = target
    layers = (2, 4, 5)
    sess = ModelSession(lm, 64)
    sess.keep_layer_inputs(layers)
    sess.retain_final_from(0)
    prompt = [1, 5, 9, 17, 33, 5, 9]
    sess.set_tokens(prompt)
    sess.logits(lm.info.num_layers, 0, len(prompt))
    n = len(prompt)
    torch.testing.assert_close(sess.final_layer_inputs(0, n), _hf_inputs(hf, prompt, layers),
                               atol=1e-4, rtol=1e-4)
    # A tree of two branches after the prompt: [40, 41] and [50, 51, 52]; keep the second.
    sess.set_tree(prompt, [40, 50, 41, 51, 52], [-1, -1, 0, 1, 3])
    sess.logits(lm.info.num_layers, n - 1, n + 5)
    kept = prompt + [50, 51, 52]
    sess.set_tokens(kept)
    want = _hf_inputs(hf, kept, layers)
    torch.testing.assert_close(sess.final_layer_inputs(0, len(kept)), want,
                               atol=1e-4, rtol=1e-4)
    with torch.no_grad():
        h_n = hf.model.norm.weight  # h_N is kept unnormed: compare after the final norm
        final = hf(torch.tensor([kept]), output_hidden_states=True).hidden_states[-1][0]
    torch.testing.assert_close(F.rms_norm(sess.final_features(0, len(kept)), (64,), h_n,
                                          1e-6), final, atol=1e-4, rtol=1e-4)
    sess.set_tokens(kept[:-2])
    assert sess.final_layer_inputs(0, len(kept) - 2).shape == (len(kept) - 2, 3 * 64)
    with pytest.raises(RuntimeError, match=r"not kept"):
        sess.final_layer_inputs(0, len(kept))
    late = ModelSession(lm, 64)
    late.set_tokens(prompt)
    late.logits(lm.info.num_layers, 0, 2)
    with pytest.raises(RuntimeError, match=r"keep_layer_inputs\(\[2, 4, 5\]\) after the "
                       r"session computed positions.*before the pipeline's begin"):
        late.keep_layer_inputs(layers)


# ---------------------------------------------------------------------- drafts
class Recording:
    """A drafter wrapper that records each round's committed tokens and drafts."""

    def __init__(self, inner: FeatureDrafter) -> None:
        self.inner = inner
        self.k = inner.k
        self.rounds: list[tuple[list[int], Draft]] = []

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def propose(self, states: list[DecodeState], asked: list[int]) -> list[Draft]:
        drafts = self.inner.propose(states, asked)
        self.rounds += [(list(st.tokens), d) for st, d in zip(states, drafts, strict=True)]
        return drafts


@pytest.mark.parametrize("layout", ["midlayer", "layers.0", "layer_ids"])
def test_drafts_equal_the_papers_forward_in_every_round(layout, target, tmp_path):
    """Decoding with a published EAGLE-3 head, every round's greedy chain is the paper
    forward's over the committed tokens (the kept layer inputs of every verified position):
    the decoder layer under ``midlayer.`` or ``layers.0.``, and layers named by the config's
    ``eagle_aux_hidden_state_layer_ids``."""
    hf, lm = target
    ids = draft_vocab(hf.config.vocab_size, 96, seed=5)
    prefix = "layers.0." if layout == "layers.0" else "midlayer."
    sd = eagle3_state(hf, seed=7, draft_ids=ids, prefix=prefix)
    extra = {"eagle_aux_hidden_state_layer_ids": [6, 1, 3]} if layout == "layer_ids" else {}
    layers = (1, 3, 6) if layout == "layer_ids" else (2, 4, 5)
    cfg = eagle3_config(hf, 96, **extra)
    folder = write(tmp_path / "head", cfg, sd)
    drafter = Recording(FeatureDrafter(lm, head=str(folder), k=4))
    assert drafter.uses()[0].layer_inputs == layers
    pipe = SpeculativePipeline(FullVerifier(lm), StandardAcceptor(), drafter=drafter)
    gens, _ = decode(pipe, 1, "contiguous", PROMPTS[:2], MAX_NEW)
    assert [g.tokens for g in gens] == [hf_greedy(hf, p, MAX_NEW) for p in PROMPTS[:2]]
    assert len(drafter.rounds) > 4
    for committed, draft in drafter.rounds:
        assert draft.tokens == paper_draft(hf, sd, cfg, committed, layers, len(draft.tokens))
    assert len({t for _, d in drafter.rounds for t in d.tokens}) > 3  # positions told apart
    assert {t for _, d in drafter.rounds for t in d.tokens} <= set(ids.tolist())


def test_tree_drafts_equal_the_papers_branches(target, head):
    """A tree of three branches: branch ``b`` starts with the ``b``-th most likely draft
    token and continues greedily, as the paper's forward over the committed tokens."""
    hf, lm = target
    folder, sd, cfg = head
    drafter = Recording(FeatureDrafter(lm, head=str(folder), k=3, branches=3, trees="always"))
    pipe = SpeculativePipeline(FullVerifier(lm), StandardAcceptor(), drafter=drafter)
    gens, _ = decode(pipe, 1, "paged", PROMPTS[:2], MAX_NEW)
    assert [g.tokens for g in gens] == [hf_greedy(hf, p, MAX_NEW) for p in PROMPTS[:2]]
    trees = [(c, d) for c, d in drafter.rounds if d.parents is not None]
    assert len(trees) > 4
    for committed, draft in trees:
        depth = len(draft.tokens) // 3
        branches = [[draft.tokens[b]] + [draft.tokens[3 * s + b] for s in range(1, depth)]
                    for b in range(3)]
        assert branches == [paper_draft(hf, sd, cfg, committed, (2, 4, 5), depth, first=b)
                            for b in range(3)]


# ---------------------------------------------------------------------- lossless
@pytest.mark.parametrize("kind", ["contiguous", "paged"])
@pytest.mark.parametrize("batch_size", [1, 3])
@pytest.mark.parametrize("how", ["chain", "tree", "pld_then_eagle3", "hispec", "metasd"])
def test_an_eagle3_head_is_lossless(how, batch_size, kind, target, trained):
    """A chain, a tree, behind prompt lookup, pre-verified at exit 6 of 8 (HiSpec: the
    layer inputs are kept across the partial forwards) and as an arm of a MetaSD pool:
    HF's greedy tokens, drafts accepted."""
    hf, lm = target
    folder = str(trained)
    drafter = {
        "chain": lambda: FeatureDrafter(lm, head=folder, k=3),
        "tree": lambda: FeatureDrafter(lm, head=folder, k=2, branches=3, trees="always"),
        "pld_then_eagle3": lambda: FallbackDrafter(PLDDrafter(k=3),
                                                   FeatureDrafter(lm, head=folder, k=2)),
        "hispec": lambda: FeatureDrafter(lm, head=folder, k=2),
        "metasd": lambda: PoolDrafter({"pld": PLDDrafter(k=3), "eagle3": FeatureDrafter(
            lm, head=folder, k=2, branches=3, trees="always")}, RoundRobinSelector()),
    }[how]()
    inter = EarlyExitVerifier(lm, exit_layer=6, accumulate=4) if how == "hispec" else None
    pipe = SpeculativePipeline(FullVerifier(lm), StandardAcceptor(), drafter=drafter,
                               intermediate_verifier=inter)
    gens, _ = decode(pipe, batch_size, kind, PROMPTS, MAX_NEW)
    assert [g.tokens for g in gens] == [hf_greedy(hf, p, MAX_NEW) for p in PROMPTS]
    assert sum(g.stats.drafted for g in gens) > 0
    assert sum(g.stats.accepted for g in gens) > 0


# ---------------------------------------------------------------------- bad checkpoints
def test_bad_eagle3_folders_are_refused_before_decoding(target, tmp_path):
    """A missing key, a wrong shape, a head for another target, a ``d2t`` that maps two
    draft tokens onto one, and a target too shallow for EAGLE-3's default layers: each one
    error naming the file, the key and the fix, when the drafter is built."""
    hf, lm = target
    ids = draft_vocab(hf.config.vocab_size, 96, seed=2)
    cfg = eagle3_config(hf, 96)

    def refused(name: str, sd: dict, pattern: str, config: dict = cfg, on=lm) -> None:
        folder = write(tmp_path / name, config, sd)
        with pytest.raises(ConfigError, match=pattern):
            FeatureDrafter(on, head=str(folder))

    sd = eagle3_state(hf, 1, ids)
    del sd["midlayer.hidden_norm.weight"]
    refused("missing", sd, r"model\.safetensors: key 'midlayer\.hidden_norm\.weight' is "
            r"missing; fix: ")
    sd = eagle3_state(hf, 1, ids, layers=2)
    refused("shape", sd, r"model\.safetensors: key 'fc\.weight' has shape \[64, 128\], "
            r"expected \[64, 192\]; fix: ")
    other = make_pair("llama", seed=9, num_layers=LAYERS)[0]
    sd = {**eagle3_state(hf, 1, ids), "embed_tokens.weight":
          other.model.embed_tokens.weight.detach().half()}
    refused("other", sd, r"key 'embed_tokens\.weight' is not the target's embedding: the "
            r"head was made for another target.*fix: ")
    sd = eagle3_state(hf, 1, ids)
    sd["d2t"] = sd["d2t"].clone()
    sd["d2t"][1] = sd["d2t"][0] - 1  # draft token 1 -> draft token 0's target token
    refused("d2t", sd, r"key 'd2t' maps draft tokens outside the target's 128 tokens or two "
            r"onto one; fix: ")
    shallow_hf, shallow = make_pair("llama", seed=3, num_layers=4)
    refused("shallow", eagle3_state(shallow_hf, 1, ids), r"config\.json: key "
            r"'eagle_aux_hidden_state_layer_ids': EAGLE-3's default layers for a target of 4 "
            r"layers are \[2, 2, 1\], which are not distinct.*fix: name the layers",
            config=eagle3_config(shallow_hf, 96), on=shallow)


# ---------------------------------------------------------------------- sampling
def test_sampling_with_a_draft_vocabulary_follows_the_target_law(target, trained, tmp_path):
    """Two sampled tokens, batch 3 (paged), rejection sampling with an EAGLE-3 head whose
    draft vocabulary holds 96 of the 128 tokens (the trained head's LM-head rows of those,
    ``d2t``/``t2d`` written; q is zero outside them, ``to_vocab``): the joint law of the
    output is the target's (chi-square), drafts are accepted, and a request draws at batch 3
    what it draws alone for its seed."""
    from safetensors.torch import load_file

    hf, lm = target
    v = hf.config.vocab_size
    used = {t for p in PROMPTS for t in p + hf_greedy(hf, p, MAX_NEW)}
    left_out = [t for t in torch.randperm(v, generator=torch.Generator().manual_seed(1)).tolist()
                if t not in used][:32]
    ids = torch.tensor(sorted(set(range(v)) - set(left_out)))
    sd = load_file(str(trained / "model.safetensors"))
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[ids] = True
    sd.update({"lm_head.weight": sd["lm_head.weight"][ids], "d2t": ids - torch.arange(96),
               "t2d": t2d})
    folder = write(tmp_path / "sub", eagle3_config(hf, 96), sd)
    sampling = SamplingParams(temperature=1.0, top_k=3)
    pipe = SpeculativePipeline(FullVerifier(lm), StandardAcceptor(),
                               drafter=FeatureDrafter(lm, head=str(folder), k=2))
    prompt = PROMPTS[1]
    law = two_token_law(lm, prompt, sampling)
    trials = 900
    sched = Scheduler(pipe, 3, KVLayout(kind="paged", block_size=4), max_context=24)
    reqs = [SeqRequest(prompt, 2, seed=s, stop_token_ids=()) for s in range(trials)]
    results = sched.generate(reqs, sampling)
    pvalue = law_pvalue(results, law)
    assert pvalue > 1e-3, pvalue
    assert sum(r.generation.stats.accepted for r in results) > 100
    one = generate(pipe, prompt, 2, sampling, seed=7, stop_token_ids=()).tokens
    assert next(r for r in results if r.request.seed == 7).generation.tokens == one
