"""Published Medusa heads: the layout ``FasterDecoding/Medusa`` publishes loads, drafts what
the paper's heads draft (a chain, or the Cartesian tree of their top tokens), stays lossless
at batch 1 and 3, contiguous and paged, and bad folders fail before decoding.

``paper_heads`` is Medusa's head written from the paper, independently of
``specflow.models.medusa_head``: residual SiLU blocks over HF's last hidden state (after the
final norm), then the head's own LM head.
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
from specflow.sampling import SamplingParams
from specflow.state import DecodeState
from stages.acceptors.standard import StandardAcceptor
from stages.drafters.medusa import MedusaDrafter, cartesian_tree
from stages.verifiers.full import FullVerifier
from tests.conftest import hf_greedy, make_pair
from tests.test_one_engine import decode

PROMPTS = [[1, 5, 9, 17, 33, 5, 9], [3, 4, 5, 6, 7, 8, 3, 4, 5, 6], [2], [7, 7, 7, 7, 7, 7],
           [11, 12, 13, 14, 11, 12, 13, 14, 11, 12]]
MAX_NEW = 20


def medusa_state(hf, heads: int, layers: int, seed: int) -> dict[str, torch.Tensor]:
    """Published keys: ``{j}.{l}.linear.{weight,bias}`` and ``{j}.{layers}.weight``; head 0's
    LM head starts from the target's (as Medusa initialises it), the rest random."""
    h, v = hf.config.hidden_size, hf.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    sd: dict[str, torch.Tensor] = {}
    for j in range(heads):
        for m in range(layers):
            sd[f"{j}.{m}.linear.weight"] = 0.1 * torch.randn(h, h, generator=g)
            sd[f"{j}.{m}.linear.bias"] = 0.1 * torch.randn(h, generator=g)
        base = hf.lm_head.weight.detach() if j == 0 else torch.zeros(v, h)
        sd[f"{j}.{layers}.weight"] = base + 0.3 * torch.randn(v, h, generator=g)
    # contiguous: an unpacked target's lm_head may be a strided view
    return {k: t.half().contiguous() for k, t in sd.items()}


def write_medusa(folder: Path, sd: dict[str, torch.Tensor], stated_heads: int, layers: int,
                 safetensors: bool = False) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {"medusa_num_heads": stated_heads, "medusa_num_layers": layers,
           "base_model_name_or_path": "tiny-llama-3"}
    (folder / "config.json").write_text(json.dumps(cfg))
    if safetensors:
        save_file(sd, str(folder / "medusa_lm_head.safetensors"))
    else:
        torch.save(sd, folder / "medusa_lm_head.pt")
    return folder


def paper_heads(hf, sd: dict, layers: int, prompt: list[int], heads: int) -> torch.Tensor:
    """Medusa's logits ``[heads, V]`` after ``prompt``: the heads over HF's last hidden state
    of the position before the last token."""
    with torch.no_grad():
        x0 = hf(torch.tensor([prompt[:-1]]), output_hidden_states=True).hidden_states[-1][0, -1]
        out = []
        for j in range(heads):
            x = x0
            for m in range(layers):
                x = x + F.silu(sd[f"{j}.{m}.linear.weight"].float() @ x
                               + sd[f"{j}.{m}.linear.bias"].float())
            out.append(sd[f"{j}.{layers}.weight"].float() @ x)
    return torch.stack(out)


@pytest.fixture(scope="module")
def target():
    return make_pair("llama", seed=3, num_layers=4)


@pytest.fixture(scope="module")
def medusa(target, tmp_path_factory):
    hf, _ = target
    sd = medusa_state(hf, heads=4, layers=1, seed=7)
    # the config states 3 heads, the file holds 4: the keys decide
    return write_medusa(tmp_path_factory.mktemp("medusa") / "medusa-tiny", sd, 3, 1), sd


def _propose(lm, folder: Path, prompt: list[int], k: int, top, sampling=None):
    st = DecodeState(tokens=list(prompt), prompt_len=len(prompt), max_len=64, kv=KVStores(),
                     sampling=sampling or SamplingParams())
    drafter = MedusaDrafter(lm, heads=str(folder), k=k, top=top)
    FullVerifier(lm).begin([st])
    drafter.begin([st])
    return drafter.propose([st], [k])[0], drafter


def test_cartesian_tree_layout():
    nodes, parents = cartesian_tree([[5, 6], [7, 8], [9]])
    assert nodes == [5, 6, 7, 8, 7, 8, 9, 9, 9, 9]
    assert parents == [-1, -1, 0, 0, 1, 1, 2, 3, 4, 5]


@pytest.mark.parametrize("safetensors", [False, True])
def test_drafts_equal_the_papers_heads(safetensors, target, tmp_path):
    """Chain: each head's argmax; tree: the Cartesian product of the heads' top tokens."""
    hf, lm = target
    sd = medusa_state(hf, heads=3, layers=2, seed=1)
    folder = write_medusa(tmp_path / "m", sd, 3, 2, safetensors=safetensors)
    for prompt in PROMPTS[:2]:
        want = paper_heads(hf, sd, 2, prompt, 3)  # [3, V]
        chain, drafter = _propose(lm, folder, prompt, 3, 1)
        assert drafter.k == 3 and chain.parents is None
        assert chain.tokens == want.argmax(-1).tolist()
        tree, _ = _propose(lm, folder, prompt, 3, [3, 2, 1])
        tops = [want[j].topk(m).indices.tolist() for j, m in enumerate([3, 2, 1])]
        assert (tree.tokens, tree.parents) == cartesian_tree(tops)
        assert len(tree.tokens) == 3 + 6 + 6
    assert len(set(chain.tokens)) > 1


def test_keys_decide_the_head_count_and_sampling_drafts_chains(target, medusa):
    """The file's 4 heads are used though its config says 3; a sampled request drafts a
    chain with each head's warped distribution as q."""
    _, lm = target
    folder, _ = medusa
    draft, drafter = _propose(lm, folder, PROMPTS[0], 4, 2,
                              SamplingParams(temperature=0.8))
    assert drafter.k == 4 and draft.parents is None and len(draft.tokens) == 4
    assert draft.probs is not None and draft.probs.shape == (4, lm.info.vocab_size)
    assert torch.allclose(draft.probs.sum(-1), torch.ones(4))


def _decode(pipe, batch_size: int, kind: str) -> list[list[int]]:
    gens, _ = decode(pipe, batch_size, kind, PROMPTS, MAX_NEW)
    assert sum(g.stats.drafted for g in gens) > 0
    assert sum(g.stats.accepted for g in gens) > 0  # head 0 starts from the LM head
    return [g.tokens for g in gens]


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
@pytest.mark.parametrize("batch_size", [1, 3])
@pytest.mark.parametrize("top", [1, [2, 2, 1]])
def test_medusa_is_lossless(top, batch_size, kind, target, medusa):
    hf, lm = target
    pipe = SpeculativePipeline(FullVerifier(lm), StandardAcceptor(),
                               drafter=MedusaDrafter(lm, heads=str(medusa[0]), k=3, top=top))
    assert _decode(pipe, batch_size, kind) == [hf_greedy(hf, p, MAX_NEW) for p in PROMPTS]


def test_bad_medusa_folders_are_refused(target, tmp_path):
    hf, lm = target
    sd = medusa_state(hf, heads=2, layers=1, seed=0)
    del sd["1.0.linear.bias"]
    folder = write_medusa(tmp_path / "missing", sd, 2, 1)
    with pytest.raises(ConfigError, match=r"medusa_lm_head\.pt: key '1\.0\.linear\.bias' is "
                       r"missing; fix: "):
        MedusaDrafter(lm, heads=str(folder))
    sd = medusa_state(hf, heads=2, layers=1, seed=0)
    sd["0.0.linear.weight"] = sd["0.0.linear.weight"][:, :32].contiguous()
    folder = write_medusa(tmp_path / "shape", sd, 2, 1)
    with pytest.raises(ConfigError, match=r"key '0\.0\.linear\.weight' has shape \[64, 32\], "
                       r"expected \[64, 64\]; fix: "):
        MedusaDrafter(lm, heads=str(folder))
    other = make_pair("llama", seed=3, num_layers=4, vocab_size=96)[0]
    folder = write_medusa(tmp_path / "other", medusa_state(other, 2, 1, 0), 2, 1)
    with pytest.raises(ConfigError, match=r"key '0\.1\.weight' has shape \[96, 64\] but the "
                       r"target's LM head is \[128, 64\]: the heads were made for another "
                       r"target.*fix: "):
        MedusaDrafter(lm, heads=str(folder))
