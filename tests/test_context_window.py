"""A draft model that sees part of the prompt (``context_window``): which tokens its sessions
hold, lossless decoding through it (a model drafter, a nested pipeline, a pool arm; batch 1
and 3, contiguous and paged; greedy and sampled), and the refusals."""

from __future__ import annotations

import pytest

from specflow.catchup import context_start, session_tokens
from specflow.engine import SpeculativePipeline
from specflow.errors import ConfigError
from specflow.kv.stores import KVLayout
from specflow.sampling import SamplingParams
from specflow.scheduler import Scheduler, SeqRequest
from specflow.state import DecodeState
from stages.acceptors.standard import StandardAcceptor
from stages.drafters.fallback import FallbackDrafter
from stages.drafters.model import ModelDrafter
from stages.drafters.pld import PLDDrafter
from stages.drafters.pool import PoolDrafter
from stages.selectors.round_robin import RoundRobinSelector
from stages.verifiers.full import FullVerifier
from tests.conftest import hf_greedy, law_pvalue, make_pair, two_token_law
from tests.test_one_engine import MAX_NEW, PROMPTS, decode
from tests.test_token_tree import tree_drafter

WINDOW = 3


@pytest.fixture(scope="module")
def models():
    """(hf target, target, draft model): the draft a different random model."""
    hf, lm = make_pair("llama", seed=0, num_layers=4)
    return hf, lm, make_pair("llama", seed=1, num_layers=2)[1]


def test_context_start_keeps_the_last_window_prompt_tokens_and_what_follows():
    st = DecodeState(tokens=[9, 8, 7, 6, 5, 4, 3], prompt_len=5, max_len=16)
    assert context_start(st, None) == 0 and session_tokens(st, None) is st.tokens
    assert context_start(st, 3) == 2 and session_tokens(st, 3) == [7, 6, 5, 4, 3]
    assert context_start(st, 5) == 0 and context_start(st, 9) == 0


def build(method: str, lm, draft, window: int | None = WINDOW) -> SpeculativePipeline:
    def pipe(drafter) -> SpeculativePipeline:
        return SpeculativePipeline(FullVerifier(lm), StandardAcceptor(), drafter=drafter)

    if method == "pld_then_model":
        return pipe(FallbackDrafter(PLDDrafter(k=4, min_ngram=2),
                                    ModelDrafter(draft, k=3, context_window=window)))
    if method == "pld_then_tree_model":
        inner = SpeculativePipeline(FullVerifier(draft), StandardAcceptor(),
                                    drafter=tree_drafter(draft), level="draft", k=4,
                                    context_window=window)
        return pipe(FallbackDrafter(PLDDrafter(k=4, min_ngram=2), inner))
    if method == "pool_arm":
        arms = {"pld": PLDDrafter(k=4), "model": ModelDrafter(draft, k=3,
                                                               context_window=window)}
        return pipe(PoolDrafter(arms, RoundRobinSelector()))
    raise ValueError(method)


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
@pytest.mark.parametrize("batch_size", [1, 3])
@pytest.mark.parametrize("method", ["pld_then_model", "pld_then_tree_model", "pool_arm"])
def test_a_windowed_draft_model_gives_hf_greedy_tokens(method, batch_size, kind, models):
    """HF's greedy tokens; the draft model's sessions hold the last WINDOW prompt tokens and
    what follows, never more, and it drafted."""
    hf, lm, draft = models
    pipe = build(method, lm, draft)
    starts: list[int] = []  # context_start of each request seen with a draft session
    target = pipe.target_verifier
    score = target.score

    def watched(states, drafts):
        for st in states:
            session = st.sessions.get(id(draft))
            if session is not None and session.tokens:  # opened (paged) and drafted from
                start = context_start(st, WINDOW)
                prompt_part = st.tokens[start : st.prompt_len]  # the window, not the prompt
                assert session.tokens[: len(prompt_part)] == prompt_part
                assert session.computed(0) <= len(st.tokens) - start + 12  # + its drafts, trees
                starts.append(start)
        return score(states, drafts)

    target.score = watched
    gens, sched = decode(pipe, batch_size, kind, PROMPTS, MAX_NEW)
    assert [g.tokens for g in gens] == [hf_greedy(hf, p, MAX_NEW) for p in PROMPTS]
    assert max(sched.stats.occupancy) == batch_size
    assert sum(g.stats.drafted for g in gens) > 0
    assert max(starts) > 0  # some request's draft model saw only part of its prompt


def test_the_window_shortens_the_draft_models_prefill(models):
    """One request of a 10-token prompt: the draft model processes the last 3 prompt
    tokens and the generated ones, the target all 10."""
    _, lm, draft = models
    pipe = SpeculativePipeline(FullVerifier(lm), StandardAcceptor(),
                               drafter=ModelDrafter(draft, k=3, context_window=WINDOW))
    prompt = PROMPTS[1]  # 10 tokens
    sched = Scheduler(pipe, 1, KVLayout(kind="contiguous"), max_context=64)
    seen: dict[str, int] = {}
    score = pipe.target_verifier.score

    def watched(states, drafts):
        session = states[0].sessions.get(id(draft))
        if session is not None:
            seen["draft"] = max(seen.get("draft", 0), len(session.tokens))
            seen["first"] = seen.get("first", session.tokens[0])
        seen["target"] = len(states[0].tokens)
        return score(states, drafts)

    pipe.target_verifier.score = watched
    sched.generate([SeqRequest(prompt, 6, stop_token_ids=())])
    assert seen["first"] == prompt[len(prompt) - WINDOW]
    assert seen["draft"] <= seen["target"] - (len(prompt) - WINDOW) + 4


def test_a_windowed_draft_model_samples_the_targets_law(models):
    _, lm, draft = models
    sampling = SamplingParams(temperature=1.0, top_k=3)
    prompt = [1, 5, 9, 17, 33]
    law = two_token_law(lm, prompt, sampling)
    pipe = SpeculativePipeline(FullVerifier(lm), StandardAcceptor(),
                               drafter=ModelDrafter(draft, k=2, context_window=2))
    sched = Scheduler(pipe, 3, KVLayout(kind="paged", block_size=4), max_context=16)
    results = sched.generate(
        [SeqRequest(prompt, 2, seed=s, stop_token_ids=()) for s in range(600)], sampling)
    assert law_pvalue(results, law) > 1e-3
    assert sum(r.generation.stats.drafted for r in results) > 0


def test_windows_are_refused_where_they_cannot_hold(models):
    _, lm, draft = models
    with pytest.raises(ConfigError, match="drafter.context_window must be >= 1 or null, got 0"):
        ModelDrafter(draft, k=2, context_window=0)
    with pytest.raises(ConfigError, match="only a nested pipeline"):
        SpeculativePipeline(FullVerifier(lm), StandardAcceptor(), context_window=4)
    with pytest.raises(ConfigError, match=r"context_window\) on \['tiny-llama-0'\], which is "
                                          r"also this pipeline's target"):
        SpeculativePipeline(FullVerifier(lm), StandardAcceptor(),
                            drafter=ModelDrafter(lm, k=2, exit_layer=2, context_window=4))


@pytest.mark.parametrize("window", [None, WINDOW])
def test_a_nested_tree_drafter_indexes_each_request_once(models, window):
    """A nested pipeline hands its tree drafter a fresh token list every outer round; the
    suffix index carries the request's entries over (``SuffixIndex.replace``) instead of
    indexing its text again: after a run it holds one sequence per request, its text up to
    the last outer round (then the inner pipeline's last drafts, at most k + 1 tokens
    before the end differing), and the output is still HF's."""
    hf, lm, draft = models
    inner = SpeculativePipeline(FullVerifier(draft), StandardAcceptor(),
                                drafter=tree_drafter(draft), level="draft", k=4,
                                context_window=window)
    pipe = SpeculativePipeline(FullVerifier(lm), StandardAcceptor(), drafter=inner)
    sched = Scheduler(pipe, 3, KVLayout(kind="paged", block_size=4), max_context=64)
    prompts = PROMPTS[:3]
    res = sched.generate([SeqRequest(p, MAX_NEW, tag=i) for i, p in enumerate(prompts)])
    got = {r.request.tag: r.generation for r in res}
    assert [got[i].tokens for i in range(3)] == [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    assert all(got[i].stats.rounds > 3 for i in range(3))  # many outer rounds, fresh lists
    seqs = inner.drafter.suffix.sequences()
    assert len(seqs) == 3
    for p, g in zip(prompts, (got[i] for i in range(3)), strict=True):
        start = max(0, len(p) - window) if window else 0
        text = (p + g.tokens)[start:]
        shared = [next((j for j, (a, b) in enumerate(zip(s, text, strict=False)) if a != b),
                       min(len(s), len(text))) for s in seqs]
        assert max(shared) >= len(text) - 5 and sorted(shared)[-2] < len(text) - 5
