"""Greedy identity: every lossless pipeline equals HF ``generate(do_sample=False)``."""

from __future__ import annotations

import pytest

from specflow.engine import SpeculativePipeline
from specflow.errors import ConfigError, PromptTooLongError
from specflow.models.native import NativeLM
from specflow.models.tiny import tiny_hf_model, tiny_model_info
from specflow.protocols import DraftPart
from specflow.scheduler import generate
from specflow.state import DecodeState, Draft
from stages.acceptors.standard import StandardAcceptor
from stages.drafters.model import ModelDrafter
from stages.drafters.pld import PLDDrafter
from stages.verifiers.full import FullVerifier
from tests.conftest import hf_greedy

PROMPTS = [[1, 5, 9, 17, 33, 5, 9], [3, 4, 5, 6, 7, 8, 3, 4, 5, 6], [2]]
MAX_NEW = 40


class OracleDrafter:
    """A stub drafter that knows the right answer and proposes it correctly or wrongly.

    mode "always": the target's greedy continuation (every draft accepted);
    "never": each proposed token is off by one (every draft rejected at position 0);
    "sometimes": right except every third position.
    """

    name = "oracle"
    branches = 1

    def __init__(self, truth: list[int], prompt_len: int, vocab: int, mode: str, k: int = 4):
        self.truth, self.prompt_len, self.vocab, self.mode, self.k = (
            truth,
            prompt_len,
            vocab,
            mode,
            k,
        )

    def begin(self, states: list[DecodeState]) -> None:
        pass

    def models(self):
        return []

    def uses(self):
        return []

    def observe(self, states, drafts, target_logits, verdicts) -> None:
        pass

    def next_part(self, state):
        return DraftPart("", self.k, self.k)

    def propose(self, states: list[DecodeState], ks: list[int]) -> list[Draft]:
        return [self._one(st, k) for st, k in zip(states, ks, strict=True)]

    def _one(self, state: DecodeState, k: int) -> Draft:
        start = len(state.tokens) - self.prompt_len
        out = []
        for i, tok in enumerate(self.truth[start : start + k]):
            wrong = self.mode == "never" or (self.mode == "sometimes" and (start + i) % 3 == 2)
            out.append((tok + 1) % self.vocab if wrong else tok)
        return Draft(out)


def pipeline(lm, drafter=None, acceptor=None):
    return SpeculativePipeline(FullVerifier(lm), acceptor or StandardAcceptor(), drafter=drafter)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_plain_decoding_equals_hf_generate(tiny_target, prompt):
    hf, lm = tiny_target
    gen = generate(pipeline(lm), prompt, MAX_NEW)
    assert gen.tokens == hf_greedy(hf, prompt, MAX_NEW)
    assert gen.stats.rounds == len(gen.tokens)
    assert gen.stats.tau == 1.0


def test_plain_decoding_equals_hf_generate_qwen2(tiny_qwen):
    hf, lm = tiny_qwen
    for prompt in PROMPTS:
        assert generate(pipeline(lm), prompt, MAX_NEW).tokens == hf_greedy(hf, prompt, MAX_NEW)


@pytest.mark.parametrize("mode", ["always", "never", "sometimes"])
@pytest.mark.parametrize("prompt", PROMPTS[:2])
def test_stub_drafts_keep_greedy_identity(tiny_target, prompt, mode):
    hf, lm = tiny_target
    truth = hf_greedy(hf, prompt, MAX_NEW)
    drafter = OracleDrafter(truth, len(prompt), lm.info.vocab_size, mode)
    gen = generate(pipeline(lm, drafter), prompt, MAX_NEW)
    assert gen.tokens == truth
    s = gen.stats
    if mode == "always":
        assert s.accepted == s.drafted  # every draft token kept
        assert s.rounds == -(-len(truth) // 5)  # k+1 = 5 tokens per round
    if mode == "never":
        assert s.accepted == 0 and s.rounds == len(truth)
    if mode == "sometimes":
        assert 0 < s.accepted < s.drafted
    assert s.tau == pytest.approx(1 + s.accepted / s.rounds)


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("k", [1, 3, 6])
def test_draft_model_sps_equals_hf(tiny_target, tiny_drafter, prompt, k):
    hf, lm = tiny_target
    _, draft_lm = tiny_drafter
    gen = generate(pipeline(lm, ModelDrafter(draft_lm, k=k)), prompt, MAX_NEW)
    assert gen.tokens == hf_greedy(hf, prompt, MAX_NEW)
    assert gen.stats.tau == pytest.approx(1 + gen.stats.accepted / gen.stats.rounds)


def test_self_drafting_accepts_everything(tiny_target):
    """The target drafting for itself (a second copy) agrees on every token."""
    hf, lm = tiny_target
    copy = NativeLM.from_hf(hf, tiny_model_info(hf, "copy"))
    prompt = PROMPTS[0]
    gen = generate(pipeline(lm, ModelDrafter(copy, k=4)), prompt, MAX_NEW)
    assert gen.tokens == hf_greedy(hf, prompt, MAX_NEW)
    assert gen.stats.accepted == gen.stats.drafted


@pytest.mark.parametrize("prompt", PROMPTS)
def test_pld_equals_hf(tiny_target, prompt):
    hf, lm = tiny_target
    gen = generate(pipeline(lm, PLDDrafter(k=5)), prompt, MAX_NEW)
    assert gen.tokens == hf_greedy(hf, prompt, MAX_NEW)


def test_nested_pipeline_pld_then_draft_model_equals_hf(tiny_target, tiny_drafter):
    hf, lm = tiny_target
    _, draft_lm = tiny_drafter
    inner = SpeculativePipeline(
        FullVerifier(draft_lm), StandardAcceptor(), drafter=PLDDrafter(k=3), level="draft", k=5
    )
    for prompt in PROMPTS:
        gen = generate(pipeline(lm, inner), prompt, MAX_NEW)
        assert gen.tokens == hf_greedy(hf, prompt, MAX_NEW)
        assert gen.nested_stats["draft"].rounds > 0


def test_rejection_acceptor_is_greedy_at_temperature_zero(tiny_target, tiny_drafter):
    hf, lm = tiny_target
    _, draft_lm = tiny_drafter
    pipe = pipeline(lm, ModelDrafter(draft_lm, k=3), StandardAcceptor())  # acceptor=rejection
    gen = generate(pipe, PROMPTS[1], MAX_NEW)
    assert gen.tokens == hf_greedy(hf, PROMPTS[1], MAX_NEW)


def test_eos_stops_generation():
    hf = tiny_hf_model("llama", seed=0, num_layers=2)
    lm = NativeLM.from_hf(hf, tiny_model_info(hf, "t"))
    prompt = PROMPTS[0]
    free = generate(pipeline(lm), prompt, MAX_NEW, stop_token_ids=())
    stop = free.tokens[5]
    gen = generate(pipeline(lm, PLDDrafter(k=4)), prompt, MAX_NEW, stop_token_ids=(stop,))
    assert gen.tokens == free.tokens[: free.tokens.index(stop) + 1]
    assert gen.stop_reason == "eos"


def test_clear_errors(tiny_target, tiny_qwen):
    _, lm = tiny_target
    _, other = tiny_qwen  # same vocab size, but a different tokenizer fingerprint
    object.__setattr__(other.info, "tokenizer_fingerprint", "another-tokenizer")
    with pytest.raises(ConfigError, match="different tokenizers"):
        pipeline(lm, ModelDrafter(other))
    object.__setattr__(other.info, "tokenizer_fingerprint", "tiny-vocab-128")
    with pytest.raises(ConfigError, match="k .*must be >= 1, got 0"):
        ModelDrafter(lm, k=0)
    with pytest.raises(ConfigError, match="exit_layer=9 is outside 1..4"):
        ModelDrafter(lm, exit_layer=9)
    with pytest.raises(PromptTooLongError, match="exceeds the context of 512"):
        generate(pipeline(lm), [1] * 500, 20)
    with pytest.raises(ConfigError, match="greedy-only"):
        from specflow.sampling import SamplingParams

        greedy_only = pipeline(lm, acceptor=StandardAcceptor(greedy_only=True))  # acceptor=exact
        generate(greedy_only, [1, 2], 4, SamplingParams(temperature=1.0))


def test_round_hook_sees_every_round(tiny_target, tiny_drafter):
    _, lm = tiny_target
    _, draft_lm = tiny_drafter
    events = []
    pipe = pipeline(lm, ModelDrafter(draft_lm, k=3))
    gen = generate(pipe, PROMPTS[0], MAX_NEW, on_round=events.append)
    assert [e["round"] for e in events] == list(range(1, gen.stats.rounds + 1))
    assert [e["accepted"] for e in events] == gen.stats.accepted_per_round
    assert sum(e["committed"] for e in events) >= len(gen.tokens)
