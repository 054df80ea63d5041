"""Shared fixtures: tiny random-init models (seconds) and their native wrappers."""

from __future__ import annotations

import os

os.environ.setdefault("MKL_CBWR", "AUTO")
if os.environ.get("PYTEST_XDIST_WORKER"):  # one of several workers: one thread each
    os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from specflow.models.native import NativeLM  # noqa: E402
from specflow.models.tiny import tiny_hf_model, tiny_model_info  # noqa: E402


def make_pair(arch: str = "llama", seed: int = 0, packed: bool = False, **kw):
    """(hf_model, NativeLM) sharing weights.  Unpacked unless ``packed``: oneDNN's packed
    matmul costs about 60 us a call whatever its size, six times a tiny model's dense one, and
    the engine's tests run tens of thousands of them; the packed path has tests of its own."""
    hf = tiny_hf_model(arch, seed=seed, **kw)
    return hf, NativeLM.from_hf(hf, tiny_model_info(hf, f"tiny-{arch}-{seed}"), packed=packed)


@pytest.fixture(scope="session")
def tiny_target():
    return make_pair("llama", seed=0, num_layers=4)


@pytest.fixture(scope="session")
def tiny_drafter():
    """A different random model with the same vocabulary: drafts sometimes accepted."""
    return make_pair("llama", seed=1, num_layers=2)


@pytest.fixture(scope="session")
def tiny_qwen():
    return make_pair("qwen2", seed=2, num_layers=4)


_ORACLE: dict = {}


def hf_greedy(hf_model, prompt: list[int], max_new: int) -> list[int]:
    """The outside oracle: HF generate, greedy, EOS honoured (memoised per model+prompt)."""
    key = (id(hf_model), tuple(prompt), max_new)
    if key not in _ORACLE:
        _ORACLE[key] = _hf_greedy(hf_model, prompt, max_new)
    return list(_ORACLE[key])


def _hf_greedy(hf_model, prompt: list[int], max_new: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf_model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new,
        do_sample=False,
        eos_token_id=hf_model.config.eos_token_id,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def two_token_law(lm, prompt: list[int], sampling) -> dict[tuple[int, int], float]:
    """The target's exact law of its next two sampled tokens after ``prompt``:
    ``{(t1, t2): p(t1) p(t2 | t1)}`` over the tokens the warp keeps."""
    from specflow.kv.session import ModelSession
    from specflow.sampling import warp

    top = lm.info.num_layers
    n = len(prompt)
    sess = ModelSession(lm, n + 8)
    sess.set_tokens(prompt)
    p1 = warp(sess.logits(top, n - 1, n), sampling)[0]
    law = {}
    for t1 in p1.nonzero().flatten().tolist():
        sess.set_tokens(prompt + [t1])
        p2 = warp(sess.logits(top, n, n + 1), sampling)[0]
        for t2 in p2.nonzero().flatten().tolist():
            law[(t1, t2)] = float(p1[t1] * p2[t2])
    return law


def law_pvalue(results, law: dict[tuple[int, int], float]) -> float:
    """The chi-square p-value of the scheduler ``results``' two-token outputs against the
    target's exact ``law`` (``two_token_law``)."""
    from scipy.stats import chisquare

    counts = dict.fromkeys(law, 0)
    for r in results:
        counts[tuple(r.generation.tokens)] += 1
    cells = list(law)
    total = sum(law.values())  # 1 up to float32 rounding; chisquare wants the sums equal
    expected = [law[c] / total * len(results) for c in cells]
    return chisquare([counts[c] for c in cells], expected).pvalue


class CharTokenizer:
    """A tokenizer for runner tests: one id per character, no chat template."""

    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % 50 for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return " ".join(map(str, ids))


class NoopCallback:
    """Every ``RunCallback`` hook as a no-op (test callbacks override what they record)."""

    wants_rounds = False

    def on_run_start(self, meta, num_requests) -> None:
        pass

    def on_request_start(self, request) -> None:
        pass

    def on_round_end(self, request, event) -> None:
        pass

    def on_request_end(self, record) -> None:
        pass

    def on_run_end(self, summary, folder) -> None:
        pass


def train_tiny_feature_head(lm, path, steps: int = 80, seed: int = 0, style: str = "specflow"):
    """A feature head (of ``style``) for the tiny ``lm``, trained for ``steps`` Adam steps on
    the model's own greedy answers to random prompts (``train_heads`` data path and loss),
    saved to ``path``; returns ``(head, training sequences)``."""
    from specflow.models.feature_head import FeatureHead, save_feature_head
    from train_heads.feature_data import FeatureSequences
    from train_heads.feature_module import collate, feature_losses
    from train_heads.generate import generate_with_hidden

    gen = torch.Generator().manual_seed(seed)
    vocab = lm.info.vocab_size
    prompts = [torch.randint(1, vocab, (6,), generator=gen).tolist() for _ in range(24)]
    gens = generate_with_hidden(lm, prompts, [], 20, 12, (), progress=False)
    data = FeatureSequences.from_generated(gens, lm.info.num_layers)
    torch.manual_seed(seed)
    head = FeatureHead.from_target(lm, torch.arange(vocab), style=style)
    opt = torch.optim.Adam(head.parameters(), lr=3e-3)
    batch = collate(data, list(range(data.num_seqs)), skip=0)
    for _ in range(steps):
        out = feature_losses(head, batch, lm.embed_weight.detach(), lm.final_norm, lm.lm_head,
                             lm.eps, reg_weight=1.0, kl_weight=1.0, depth=2)
        opt.zero_grad()
        out["loss"].backward()
        opt.step()
    head.eval().requires_grad_(False)
    save_feature_head(path, head, lm.info, extra={"test": True})
    return head, data
