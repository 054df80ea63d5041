"""Self-speculation and HiSpec: greedy identity, no recomputation, rollback, sampling law."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from specflow.engine import SpeculativePipeline
from specflow.errors import ConfigError
from specflow.kv.session import ModelSession
from specflow.kv.stores import KVStores
from specflow.sampling import SamplingParams
from specflow.scheduler import Scheduler, SeqRequest, generate
from specflow.state import DecodeState
from stages.acceptors.standard import StandardAcceptor
from stages.drafters.feature import FeatureDrafter
from stages.drafters.layer_skip import LayerSkipDrafter
from stages.drafters.model import ModelDrafter
from stages.verifiers.early_exit import EarlyExitVerifier
from stages.verifiers.full import FullVerifier
from tests.conftest import hf_greedy, make_pair, train_tiny_feature_head, two_token_law

PROMPTS = [[1, 5, 9, 17, 33, 5, 9], [3, 4, 5, 6, 7, 8, 3, 4, 5, 6]]
MAX_NEW = 40


class CountingLM:
    """Wraps a LayeredLM and fails if a layer computes a position twice in one incarnation.

    An incarnation of position p starts when layer 0 computes it (a new token there, after
    a rollback or for the first time); until the next one, each deeper layer may compute p
    at most once: layers are reused across stages (drafter -> intermediate -> target),
    never recomputed.  A token that one level rejected and a later level chose again is a
    new incarnation (its cache entries were dropped with the rejection).
    """

    def __init__(self, lm):
        self.lm = lm
        self.info = lm.info
        self.device, self.dtype = lm.device, lm.dtype
        self.live: dict[int, set[int]] = {}
        self.evals = [0] * lm.info.num_layers
        self.incarnations = 0

    @property
    def kv(self):
        return self.lm.kv

    def to(self, device, dtype):
        return self

    def embed(self, ids):
        return self.lm.embed(ids)

    def run_layer(self, layer, hidden, batch, memo):
        ((cache, t),) = batch  # one request
        start = cache.length
        for p in range(start, start + t):
            if layer == 0:
                self.live[p] = set()
                self.incarnations += 1
            assert layer not in self.live[p], f"layer {layer} recomputed position {p}"
            self.live[p].add(layer)
        self.evals[layer] += hidden.shape[0]
        return self.lm.run_layer(layer, hidden, batch, memo)

    def head(self, hidden, exit_layer):
        return self.lm.head(hidden, exit_layer)

    def exit_adapter(self, exit_layer):
        return self.lm.exit_adapter(exit_layer)

    def fused_layers(self):
        return None  # every layer through run_layer, which counts them


@pytest.fixture(scope="module")
def deep():
    """A 6-layer tiny target (exits 2 and 4 for drafting and pre-verification)."""
    return make_pair("llama", seed=3, num_layers=6)


def hispec(lm, k=3, l_d=2, l_i=4, accumulate=4, acceptor=None):
    return SpeculativePipeline(
        FullVerifier(lm),
        acceptor or StandardAcceptor(),
        drafter=ModelDrafter(lm, k=k, exit_layer=l_d),
        intermediate_verifier=EarlyExitVerifier(lm, exit_layer=l_i, accumulate=accumulate),
    )


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("exit_layer", [1, 3, 5])
def test_self_spec_equals_hf(deep, prompt, exit_layer):
    hf, lm = deep
    pipe = SpeculativePipeline(
        FullVerifier(lm), StandardAcceptor(), drafter=ModelDrafter(lm, k=3, exit_layer=exit_layer)
    )
    assert generate(pipe, prompt, MAX_NEW).tokens == hf_greedy(hf, prompt, MAX_NEW)


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize(("l_d", "l_i", "acc"), [(1, 3, 4), (2, 4, 2), (2, 5, 6)])
def test_hispec_equals_hf(deep, prompt, l_d, l_i, acc):
    hf, lm = deep
    gen = generate(hispec(lm, l_d=l_d, l_i=l_i, accumulate=acc), prompt, MAX_NEW)
    assert gen.tokens == hf_greedy(hf, prompt, MAX_NEW)
    inner = gen.nested_stats["intermediate"]
    assert inner.rounds > 0 and inner.drafted > 0
    assert gen.stats.tau == pytest.approx(1 + gen.stats.accepted / gen.stats.rounds)


def test_pld_feeds_the_intermediate_verifier(deep):
    from stages.drafters.pld import PLDDrafter

    hf, lm = deep
    pipe = SpeculativePipeline(
        FullVerifier(lm),
        StandardAcceptor(),
        drafter=PLDDrafter(k=3),
        intermediate_verifier=EarlyExitVerifier(lm, exit_layer=3, accumulate=4),
    )
    for prompt in PROMPTS:
        assert generate(pipe, prompt, MAX_NEW).tokens == hf_greedy(hf, prompt, MAX_NEW)


def test_layer_skip_equals_hf(deep):
    hf, lm = deep
    pipe = SpeculativePipeline(
        FullVerifier(lm), StandardAcceptor(), drafter=LayerSkipDrafter(lm, skip_layers=[1, 3], k=3)
    )
    for prompt in PROMPTS:
        assert generate(pipe, prompt, MAX_NEW).tokens == hf_greedy(hf, prompt, MAX_NEW)


def test_each_layer_runs_once_per_position_and_prefix(deep):
    """HiSpec's reuse: no layer ever computes the same position of the same prefix twice."""
    hf, lm = deep
    counting = CountingLM(lm)
    gen = generate(hispec(counting), PROMPTS[0], MAX_NEW)
    assert gen.tokens == hf_greedy(hf, PROMPTS[0], MAX_NEW)
    # One layer-0 evaluation per incarnation; deeper layers see fewer positions, since
    # drafts rejected at the intermediate exit never reach the target's layers.
    assert counting.evals[0] == counting.incarnations
    # (exit L_d = 2: layers 0-1 draft; L_i = 4: layers 2-3 pre-verify; layers 4-5: target)
    e = counting.evals
    assert e[0] == e[1] >= e[2] == e[3] > e[4] == e[5]


def test_caches_after_rollback_equal_a_fresh_computation(deep):
    _, lm = deep
    pipe = hispec(lm)
    state = DecodeState(
        tokens=list(PROMPTS[1]), prompt_len=len(PROMPTS[1]), max_len=80, kv=KVStores()
    )
    pipe.begin([state])
    for _ in range(6):
        pipe.run_round([state], [30])
    session = state.session(lm)
    session.set_tokens(state.tokens)  # rollback of whatever the last round left
    fresh = ModelSession(lm, 80)
    fresh.set_tokens(state.tokens)
    fresh.prefill()
    n = len(state.tokens) - 1
    session.prefill()
    for layer in range(lm.info.num_layers):
        a, b = session.caches[layer], fresh.caches[layer]
        assert a.length == b.length == n
        torch.testing.assert_close(
            a.k[:, :n], b.k[:, :n], atol=1e-4, rtol=1e-4
        )  # block vs step rounding
        torch.testing.assert_close(
            a.v[:, :n], b.v[:, :n], atol=1e-4, rtol=1e-4
        )  # block vs step rounding


def test_bad_exit_layers_are_refused(deep):
    _, lm = deep
    with pytest.raises(ConfigError, match="exit_layer=6 must be in 1..5"):
        EarlyExitVerifier(lm, exit_layer=6)
    with pytest.raises(ConfigError, match="drafter.exit_layer=4 must be below"):
        hispec(lm, l_d=4, l_i=3)
    with pytest.raises(ConfigError, match="needs a drafter"):
        SpeculativePipeline(
            FullVerifier(lm),
            StandardAcceptor(),
            intermediate_verifier=EarlyExitVerifier(lm, exit_layer=2),
        )


@pytest.fixture(scope="module")
def deep_feature_head(deep, tmp_path_factory) -> str:
    """A feature head for ``deep``, trained on its own greedy answers (a few seconds)."""
    path = tmp_path_factory.mktemp("feature") / "feature_head.safetensors"
    train_tiny_feature_head(deep[1], path)
    return str(path)


@pytest.mark.parametrize("drafter", ["early_exit", "feature"])
def test_hispec_sampling_follows_the_target_law(deep, deep_feature_head, drafter):
    """The first two tokens' joint law is the target's (chi-square).  With the feature head
    the pipeline generates 4 tokens (N_i = 3), so after a rejection at exit 4 the head drafts
    again after the verifier's provisional token, from its own predicted features."""
    _, lm = deep
    sampling = SamplingParams(temperature=1.0, top_k=3)
    if drafter == "early_exit":
        pipe, new = hispec(lm, k=2, accumulate=2, acceptor=StandardAcceptor()), 2
    else:
        pipe = SpeculativePipeline(
            FullVerifier(lm), StandardAcceptor(),
            drafter=FeatureDrafter(lm, head=deep_feature_head, k=2),
            intermediate_verifier=EarlyExitVerifier(lm, exit_layer=4, accumulate=3),
        )
        new = 4
    prompt = [1, 5, 9]
    law = two_token_law(lm, prompt, sampling)
    trials = 1200  # 32 requests a round: each draws what it draws alone (checked for seed 7)
    reqs = [SeqRequest(prompt, new, seed=s, stop_token_ids=()) for s in range(trials)]
    results = Scheduler(pipe, 32, max_context=16).generate(reqs, sampling)
    counts = dict.fromkeys(law, 0)
    for r in results:
        counts[tuple(r.generation.tokens[:2])] += 1
    cells = list(law)
    assert (
        chisquare(
            [counts[c] for c in cells], [law[c] * trials / sum(law.values()) for c in cells]
        ).pvalue
        > 1e-3
    )
    alone = generate(pipe, prompt, new, sampling, seed=7, stop_token_ids=()).tokens
    assert next(r for r in results if r.request.seed == 7).generation.tokens == alone
