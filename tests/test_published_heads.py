"""Published draft checkpoints: EAGLE-1/2 heads in their published layout load as feature
drafters, draft what the paper's forward drafts, stay lossless, and bad folders fail early;
a head trained here exports to that layout and reads back with identical drafts.

Each checkpoint is written here in the layout ``SafeAILab/EAGLE`` publishes (``config.json``
a Llama config with one layer; ``fc.*`` and ``layers.0.*`` keys; float16 tensors in
``model.safetensors`` or a pickled ``pytorch_model.bin``).  ``PaperEagle`` is EAGLE's draft
forward written from the paper, independently of ``specflow.models.eagle_head``: rotate-half
RoPE, repeated KV heads, a causal softmax, HF's RMSNorm, the features being HF's last hidden
state (after the final norm).
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
from specflow.kv.stores import KVStores
from specflow.models.eagle_export import save_eagle_folder
from specflow.models.feature_head import FeatureHead
from specflow.scheduler import generate
from specflow.state import DecodeState
from stages.acceptors.standard import StandardAcceptor
from stages.drafters.fallback import FallbackDrafter
from stages.drafters.feature import FeatureDrafter
from stages.drafters.pld import PLDDrafter
from stages.verifiers.full import FullVerifier
from tests.conftest import hf_greedy, make_pair, train_tiny_feature_head
from tests.test_one_engine import decode

PROMPTS = [[1, 5, 9, 17, 33, 5, 9], [3, 4, 5, 6, 7, 8, 3, 4, 5, 6], [2], [7, 7, 7, 7, 7, 7],
           [11, 12, 13, 14, 11, 12, 13, 14, 11, 12]]
MAX_NEW = 20


# ---------------------------------------------------------------------- published layout
def eagle_state(hf, seed: int, qkv_bias: bool = False, embed: bool = True
                ) -> dict[str, torch.Tensor]:
    """An EAGLE-1/2 head's state dict for target ``hf`` (random, float16), published keys."""
    c = hf.config
    h, nh, kh = c.hidden_size, c.num_attention_heads, c.num_key_value_heads
    d, i = h // nh, c.intermediate_size
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int, std: float = 0.15) -> torch.Tensor:
        return (std * torch.randn(*shape, generator=g)).half()

    pre = "layers.0."
    sd = {
        "fc.weight": w(h, 2 * h), "fc.bias": w(h),
        pre + "self_attn.q_proj.weight": w(nh * d, h), pre + "self_attn.k_proj.weight":
        w(kh * d, h), pre + "self_attn.v_proj.weight": w(kh * d, h),
        pre + "self_attn.o_proj.weight": w(h, nh * d),
        pre + "mlp.gate_proj.weight": w(i, h), pre + "mlp.up_proj.weight": w(i, h),
        pre + "mlp.down_proj.weight": w(h, i),
        pre + "post_attention_layernorm.weight": (1 + w(h, std=0.2).float()).half(),
    }
    if qkv_bias:
        for name, n in (("q", nh * d), ("k", kh * d), ("v", kh * d)):
            sd[pre + f"self_attn.{name}_proj.bias"] = w(n)
    if embed:
        sd["embed_tokens.weight"] = hf.model.embed_tokens.weight.detach().half()
    return sd


def eagle_config(hf) -> dict:
    c = hf.config
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "bias": True,
        "hidden_act": "silu", "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "num_hidden_layers": 1,
        "max_position_embeddings": c.max_position_embeddings, "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta if hasattr(c, "rope_theta") else 10000.0,
        "vocab_size": c.vocab_size, "torch_dtype": "float16",
    }


def write_eagle(folder: Path, config: dict, state: dict[str, torch.Tensor],
                pickled: bool = False) -> Path:
    """The folder as published: ``config.json`` + ``model.safetensors`` (or
    ``pytorch_model.bin``)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    if pickled:
        torch.save(state, folder / "pytorch_model.bin")
    else:
        save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
    return folder


# ---------------------------------------------------------------------- the paper's forward
def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def paper_eagle(sd: dict[str, torch.Tensor], cfg: dict, embed: torch.Tensor,
                feats: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """EAGLE-1's draft model over a whole sequence: ``feats [T, H]`` (the target's normed
    last hidden states, or fed-back predictions) and ``tokens [T]`` (row p: t_{p+1}) ->
    predicted features ``[T, H]``; row p attends to rows <= p."""
    s = {k: v.float() for k, v in sd.items()}
    x = torch.cat([embed[tokens], feats], -1) @ s["fc.weight"].T + s["fc.bias"]  # no norm
    return paper_layer(s, "layers.0.", cfg, x, x)


def paper_layer(s: dict[str, torch.Tensor], pre: str, cfg: dict, u: torch.Tensor,
                x: torch.Tensor) -> torch.Tensor:
    """An EAGLE head's decoder layer (float32 state ``s``, keys under ``pre``) over a whole
    sequence: q/k/v read ``u [T, H or 2H]`` (biases where ``s`` holds them), rotate-half RoPE,
    repeated KV heads, causal softmax, the residual ``x [T, H]``, then the post-attention
    norm and SwiGLU MLP -> ``[T, H]``."""
    nh, kh = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    t, h = x.shape
    d = h // nh
    a = pre + "self_attn."
    q = (u @ s[a + "q_proj.weight"].T + s.get(a + "q_proj.bias", 0)).view(t, nh, d)
    k = (u @ s[a + "k_proj.weight"].T + s.get(a + "k_proj.bias", 0)).view(t, kh, d)
    v = (u @ s[a + "v_proj.weight"].T + s.get(a + "v_proj.bias", 0)).view(t, kh, d)
    inv = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, d, 2).float() / d))
    ang = torch.arange(t).float()[:, None] * inv
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
    q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
    k, v = k.repeat_interleave(nh // kh, dim=1), v.repeat_interleave(nh // kh, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / d**0.5
    scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    att = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(t, nh * d)
    y = x + att @ s[a + "o_proj.weight"].T
    m = pre + "mlp."
    z = _rms(y, s[pre + "post_attention_layernorm.weight"], cfg["rms_norm_eps"])
    return y + (F.silu(z @ s[m + "gate_proj.weight"].T) * (z @ s[m + "up_proj.weight"].T)) \
        @ s[m + "down_proj.weight"].T


def paper_chain(hf, sd: dict, cfg: dict, prompt: list[int], k: int) -> list[int]:
    """EAGLE's greedy chain of ``k`` drafts after ``prompt`` (the target ran on all but the
    last token): features of HF's forward, each prediction fed back, argmax of the LM head."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        feats = hf(ids[:, :-1], output_hidden_states=True).hidden_states[-1][0]  # [n-1, H]
        tokens = ids[0, 1:]
        embed, head = hf.model.embed_tokens.weight, hf.lm_head.weight
        out: list[int] = []
        for _ in range(k):
            a = paper_eagle(sd, cfg, embed, feats, tokens)[-1]  # [H]
            out.append(int((head @ a).argmax()))
            feats = torch.cat([feats, a[None]])
            tokens = torch.cat([tokens, torch.tensor(out[-1:])])
    return out


# ---------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def target():
    return make_pair("llama", seed=3, num_layers=4)


@pytest.fixture(scope="module")
def eagle(target, tmp_path_factory) -> tuple[Path, dict, dict]:
    hf, _ = target
    sd, cfg = eagle_state(hf, seed=11), eagle_config(hf)
    return write_eagle(tmp_path_factory.mktemp("eagle") / "EAGLE-tiny", cfg, sd), sd, cfg


@pytest.fixture(scope="module")
def trained(target, tmp_path_factory) -> tuple:
    """An ``eagle``-style feature head trained on the target's own greedy answers
    (``train_heads``' data path and loss), saved in the project's format and exported in
    EAGLE's layout: ``(head, own file, EAGLE folder, training sequences)``."""
    _, lm = target
    where = tmp_path_factory.mktemp("trained")
    head, data = train_tiny_feature_head(lm, where / "feature_head.safetensors", steps=80,
                                         style="eagle")
    folder = save_eagle_folder(where / "eagle", head, lm.info)
    return head, where / "feature_head.safetensors", folder, data


def _propose(lm, head: str, prompt: list[int], k: int) -> list[int]:
    st = DecodeState(tokens=list(prompt), prompt_len=len(prompt), max_len=64, kv=KVStores())
    drafter = FeatureDrafter(lm, head=head, k=k)
    FullVerifier(lm).begin([st])  # the target's prefill: h_N of the prompt
    drafter.begin([st])
    return drafter.propose([st], [k])[0].tokens


# ---------------------------------------------------------------------- drafts
@pytest.mark.parametrize("pickled", [False, True])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_drafts_equal_the_papers_forward(arch, pickled, tmp_path):
    """The loaded head's greedy chain is the paper forward's, for a Llama target and a
    Qwen2 one (q/k/v biases in the head), from safetensors and from a pickled ``.bin``."""
    hf, lm = make_pair(arch, seed=4, num_layers=3)
    sd, cfg = eagle_state(hf, seed=5, qkv_bias=arch == "qwen2"), eagle_config(hf)
    folder = write_eagle(tmp_path / "head", cfg, sd, pickled=pickled)
    for prompt in PROMPTS[:3]:
        prompt = prompt if len(prompt) > 1 else prompt + [4]
        want = paper_chain(hf, sd, cfg, prompt, 5)
        assert _propose(lm, str(folder), prompt, 5) == want
    assert len(set(want)) > 1  # the drafts tell positions apart


# ---------------------------------------------------------------------- export
EAGLE_KEYS = {"fc.weight", "fc.bias", *(f"layers.0.self_attn.{p}_proj.weight" for p in "qkvo"),
              *(f"layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
              "layers.0.post_attention_layernorm.weight"}


def _training_chain(head, hf, prompt: list[int], k: int) -> list[int]:
    """The head's greedy chain by its *training* forward (whole sequences recomputed, each
    prediction fed back as the next row's feature)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        feats = hf(ids[:, :-1], output_hidden_states=True).hidden_states[-1][0]  # normed
        tokens, embed = ids[0, 1:], hf.model.embed_tokens.weight
        out: list[int] = []
        for _ in range(k):
            t = len(tokens)
            a = head(feats[None], embed[tokens][None], torch.ones(1, t, dtype=torch.bool))[0]
            a = a[0, -1]
            out.append(int((hf.lm_head.weight @ a).argmax()))
            feats = torch.cat([feats, a[None]])
            tokens = torch.cat([tokens, torch.tensor(out[-1:])])
    return out


def test_export_round_trip_gives_identical_drafts(target, trained):
    """The export holds exactly EAGLE-1/2's keys and config; loaded back through the
    published-head loader it drafts what the head drafts in the project's own format, what
    its training forward predicts, and what the paper's forward over the exported tensors
    predicts."""
    from safetensors.torch import load_file

    hf, lm = target
    head, own, folder, data = trained
    cfg = json.loads((folder / "config.json").read_text())
    state = load_file(str(folder / "model.safetensors"))
    assert set(state) == EAGLE_KEYS and cfg["num_hidden_layers"] == 1 and cfg["bias"]
    assert cfg["specflow_target"]["weights_fingerprint"] == lm.info.weights_fingerprint
    prompts = [data.seq(i)[0][: data.seq(i)[2]].tolist() for i in (0, 1)] + PROMPTS[:2]
    for prompt in prompts:
        via_eagle = _propose(lm, str(folder), prompt, 5)
        assert via_eagle == _propose(lm, str(own), prompt, 5)
        assert via_eagle == _training_chain(head, hf, prompt, 5)
        assert via_eagle == paper_chain(hf, state, cfg, prompt, 5)


def test_the_exported_head_is_accepted(target, trained):
    """Trained, the exported head's drafts are accepted (tau > 1.5) on prompts like its
    training data; the specflow-style head has no EAGLE layout and is refused."""
    hf, lm = target
    _, _, folder, data = trained
    pipe = SpeculativePipeline(FullVerifier(lm), StandardAcceptor(),
                               drafter=FeatureDrafter(lm, head=str(folder), k=4))
    for i in (0, 1):
        prompt = data.seq(i)[0][: data.seq(i)[2]].tolist()
        gen = generate(pipe, prompt, 20)
        assert gen.tokens == hf_greedy(hf, prompt, 20)
        assert gen.stats.tau > 1.5
    plain = FeatureHead.from_target(lm, torch.arange(lm.info.vocab_size))
    with pytest.raises(ConfigError, match=r"style 'specflow' .* cannot be written in EAGLE's "
                       r"layout; fix: train it with head\.style=eagle"):
        save_eagle_folder(folder.parent / "refused", plain, lm.info)


# ---------------------------------------------------------------------- lossless
def _decode(pipe, batch_size: int, kind: str) -> list[list[int]]:
    gens, _ = decode(pipe, batch_size, kind, PROMPTS, MAX_NEW)
    assert sum(g.stats.drafted for g in gens) > 0
    assert sum(g.stats.accepted for g in gens) > 0
    return [g.tokens for g in gens]


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
@pytest.mark.parametrize("batch_size", [1, 3])
@pytest.mark.parametrize("how", ["chain", "tree", "pld_then_eagle"])
def test_an_eagle_head_is_lossless(how, batch_size, kind, target, trained):
    """A trained head exported in EAGLE's layout, as a chain, a tree and behind prompt
    lookup: HF's greedy tokens, drafts accepted."""
    hf, lm = target
    head = str(trained[2])
    drafter = {
        "chain": lambda: FeatureDrafter(lm, head=head, k=3),
        "tree": lambda: FeatureDrafter(lm, head=head, k=2, branches=3, trees="always"),
        "pld_then_eagle": lambda: FallbackDrafter(PLDDrafter(k=3),
                                                  FeatureDrafter(lm, head=head, k=2)),
    }[how]()
    pipe = SpeculativePipeline(FullVerifier(lm), StandardAcceptor(), drafter=drafter)
    assert _decode(pipe, batch_size, kind) == [hf_greedy(hf, p, MAX_NEW) for p in PROMPTS]


# ---------------------------------------------------------------------- bad checkpoints
def test_a_head_for_another_target_is_refused(target, tmp_path):
    """Another target's embedding in the head, or another hidden size in its config: one
    error naming the file, the key and the fix, when the drafter is built."""
    _, lm = target
    other_hf, _ = make_pair("llama", seed=9, num_layers=4)
    folder = write_eagle(tmp_path / "other", eagle_config(other_hf), eagle_state(other_hf, 1))
    with pytest.raises(ConfigError, match=r"model\.safetensors: key 'embed_tokens\.weight' is "
                       r"not the target's embedding: the head was made for another target.*"
                       r"fix: "):
        FeatureDrafter(lm, head=str(folder))
    wide = make_pair("llama", seed=9, num_layers=4, hidden_size=32)[0]
    folder = write_eagle(tmp_path / "wide", eagle_config(wide), eagle_state(wide, 1, embed=False))
    with pytest.raises(ConfigError, match=r"config\.json: key 'hidden_size' is 32 but the "
                       r"target's is 64: the head was made for another target.*fix: "):
        FeatureDrafter(lm, head=str(folder))


def test_a_missing_key_and_a_wrong_shape_are_refused(target, tmp_path):
    hf, lm = target
    sd = eagle_state(hf, 1)
    del sd["layers.0.mlp.down_proj.weight"]
    folder = write_eagle(tmp_path / "missing", eagle_config(hf), sd)
    with pytest.raises(ConfigError, match=r"model\.safetensors: key 'layers\.0\.mlp\.down_proj"
                       r"\.weight' is missing; fix: "):
        FeatureDrafter(lm, head=str(folder))
    sd = eagle_state(hf, 1)
    sd["fc.weight"] = sd["fc.weight"][:, :100].contiguous()
    folder = write_eagle(tmp_path / "shape", eagle_config(hf), sd, pickled=True)
    with pytest.raises(ConfigError, match=r"pytorch_model\.bin: key 'fc\.weight' has shape "
                       r"\[64, 100\], expected \[64, 128\]; fix: "):
        FeatureDrafter(lm, head=str(folder))


# ---------------------------------------------------------------------- LayerSkip recipe
@pytest.fixture(scope="module")
def layerskip_folder(tmp_path_factory) -> tuple:
    """A local model folder (a tiny random Llama + a word-level tokenizer, as an HF folder)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from specflow.models.tiny import tiny_hf_model

    hf = tiny_hf_model("llama", seed=3, num_layers=6)
    vocab = {f"w{i}": i for i in range(hf.config.vocab_size)}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, "w0")),
                                  unk_token="w0", bos_token="w0",
                                  eos_token=f"w{hf.config.vocab_size - 1}")
    folder = tmp_path_factory.mktemp("layerskip") / "tiny-early-exit"
    hf.save_pretrained(folder)
    tok.save_pretrained(folder)
    return hf, folder


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
@pytest.mark.parametrize("batch_size", [1, 3])
@pytest.mark.parametrize("experiment", ["layerskip", "layerskip_hispec"])
def test_layerskip_experiments_on_a_local_folder(experiment, batch_size, kind,
                                                 layerskip_folder):
    """``+experiment=layerskip`` (and its HiSpec variant) on a local model folder: exits
    through the shared final norm and LM head (no exit heads), HF's greedy tokens."""
    from hydra import compose, initialize_config_dir

    from specflow.config import register_configs
    from specflow.graph import build_pipeline

    hf, folder = layerskip_folder
    register_configs()
    conf = Path(__file__).resolve().parents[1] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            f"+experiment={experiment}", f"model.name={folder}", "drafter.exit_layer=2",
            "drafter.k=3", *(["intermediate_verifier.exit_layer=4",
                              "intermediate_verifier.accumulate=2"]
                             if experiment == "layerskip_hispec" else [])])
    assert cfg.model.exit_heads is None
    pipe = build_pipeline(cfg)
    assert not pipe.target_verifier.lm.exit_heads  # the shared final norm + LM head
    assert _decode(pipe, batch_size, kind) == [hf_greedy(hf, p, MAX_NEW) for p in PROMPTS]
