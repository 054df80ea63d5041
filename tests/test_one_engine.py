"""One engine at every batch size: each pipeline x batch {1, 3} x KV {contiguous, paged}.

Every lossless pipeline gives token for token HF ``generate``'s greedy output (the outside
oracle) whatever the batch size and KV layout; sampling follows the target's law at batch
3; the adaptive draft length decides per request at batch 3.
"""

from __future__ import annotations

import importlib

import pytest
from scipy.stats import chisquare

from specflow.cpu.row_padding import RowProbe
from specflow.engine import SpeculativePipeline
from specflow.kv.stores import KVLayout
from specflow.protocols import DraftPart
from specflow.sampling import SamplingParams
from specflow.scheduler import Scheduler, SeqRequest, generate
from specflow.state import Acceptance, DecodeState, Draft
from stages.acceptors.fly import FlyAcceptor
from stages.acceptors.standard import StandardAcceptor
from stages.draft_length.adaptive import AdaptiveDraftLength
from stages.drafters.fallback import FallbackDrafter
from stages.drafters.feature import FeatureDrafter, TreeGain
from stages.drafters.layer_skip import LayerSkipDrafter
from stages.drafters.model import ModelDrafter
from stages.drafters.pld import PLDDrafter
from stages.drafters.pool import PoolDrafter
from stages.selectors.fixed import FixedSelector
from stages.selectors.round_robin import RoundRobinSelector
from stages.selectors.single import SingleSelector
from stages.selectors.ucb import DiscountedUCBSelector, UCBSelector
from stages.verifiers.early_exit import EarlyExitVerifier
from stages.verifiers.full import FullVerifier
from tests.conftest import hf_greedy, make_pair, train_tiny_feature_head, two_token_law

PROMPTS = [
    [1, 5, 9, 17, 33, 5, 9],
    [3, 4, 5, 6, 7, 8, 3, 4, 5, 6],
    [2],
    [7, 7, 7, 7, 7, 7],
    [11, 12, 13, 14, 11, 12, 13, 14, 11, 12],
]
MAX_NEW = 24
SELECTORS = {
    "ucb": UCBSelector,
    "discounted_ucb": DiscountedUCBSelector,
    "fixed": lambda: FixedSelector(1),
    "round_robin": RoundRobinSelector,
    "single": SingleSelector,
}


@pytest.fixture(scope="module")
def target():
    """A 6-layer tiny target (early exits 2 and 4 for drafting and pre-verification)."""
    return make_pair("llama", seed=3, num_layers=6)


@pytest.fixture(scope="module")
def adapted():
    """The same 6-layer target as its own object, with attention adapters at exits 2 and 4
    moved away from their initialisation (as training would)."""
    from specflow.models.exit_heads import attach_heads
    from tests.test_adapter_head import perturbed_adapter

    hf, lm = make_pair("llama", seed=3, num_layers=6)
    attach_heads(lm, {2: perturbed_adapter(lm, 2, seed=0), 4: perturbed_adapter(lm, 4, seed=1)})
    return hf, lm


@pytest.fixture(scope="module")
def drafter():
    return make_pair("llama", seed=1, num_layers=2)


@pytest.fixture(scope="module")
def feature_head(target, tmp_path_factory) -> str:
    """A feature head for the target, trained on its own greedy answers (a few seconds)."""
    path = tmp_path_factory.mktemp("feature") / "feature_head.safetensors"
    train_tiny_feature_head(target[1], path)
    return str(path)


def build(method: str, lm, draft_lm, feature_head: str | None = None) -> SpeculativePipeline:
    """The pipeline a method's experiment config composes, on tiny models."""

    def pipe(drafter=None, acceptor=None, **kw) -> SpeculativePipeline:
        return SpeculativePipeline(
            FullVerifier(lm), acceptor or StandardAcceptor(), drafter=drafter, name=method, **kw
        )

    def pld_model() -> SpeculativePipeline:
        return SpeculativePipeline(
            FullVerifier(draft_lm), StandardAcceptor(), drafter=PLDDrafter(k=3), level="draft", k=4
        )

    if method == "ar":
        return pipe()
    if method == "pld":
        return pipe(PLDDrafter(k=5))
    if method == "sps":
        return pipe(ModelDrafter(draft_lm, k=3))
    if method == "sps_pld":
        return pipe(pld_model())
    if method == "pld_then_model":
        return pipe(FallbackDrafter(PLDDrafter(k=5, min_ngram=2), ModelDrafter(draft_lm, k=3)))
    if method in ("self_spec", "self_spec_adapter"):
        return pipe(ModelDrafter(lm, k=3, exit_layer=2))
    if method in ("hispec", "hispec_adapter"):
        return pipe(
            ModelDrafter(lm, k=2, exit_layer=2),
            intermediate_verifier=EarlyExitVerifier(lm, exit_layer=4, accumulate=3),
        )
    if method == "hispec_feature":  # the feature head drafts, exit 4 pre-verifies
        return pipe(
            FeatureDrafter(lm, head=feature_head, k=2),
            intermediate_verifier=EarlyExitVerifier(lm, exit_layer=4, accumulate=4),
        )
    if method == "layer_skip":
        return pipe(LayerSkipDrafter(lm, [1, 3], k=3))
    if method == "metasd_eagle":  # eagle_pld and PLD -> draft model, cost-aware reward
        arms = {
            "eagle_pld": FallbackDrafter(PLDDrafter(k=5, min_ngram=2),
                                         FeatureDrafter(lm, head=feature_head, k=2)),
            "pld_model": pld_model(),
        }
        return pipe(PoolDrafter(arms, UCBSelector(c=0.3, prior=6), reward="rate",
                                rate_scale=3.0))
    if method == "metasd_tree":  # the bd reward of a tree arm reads its top-1 chain's rows
        arms = {"pld": PLDDrafter(k=4),
                "tree": FeatureDrafter(lm, head=feature_head, k=2, branches=3,
                                       trees="always")}
        return pipe(PoolDrafter(arms, RoundRobinSelector()))
    if method == "metasd_adapter":  # the adapter's arm sits idle in some rounds
        arms = {"pld": PLDDrafter(k=4), "exit_early": ModelDrafter(lm, k=3, exit_layer=2)}
        return pipe(PoolDrafter(arms, RoundRobinSelector()))
    if method.startswith("metasd_"):
        arms = {
            "pld": PLDDrafter(k=4),
            "draft_model": ModelDrafter(draft_lm, k=3),
            "exit_early": ModelDrafter(lm, k=3, exit_layer=2),
            "pld_model": pld_model(),
        }
        if feature_head is not None:  # the target's own feature head as a fifth arm
            arms["feature"] = FeatureDrafter(lm, head=feature_head, k=3)
        selector = SELECTORS[method.removeprefix("metasd_")]()
        return pipe(PoolDrafter(arms, selector))
    if method == "feature":
        return pipe(FeatureDrafter(lm, head=feature_head, k=3))
    if method == "feature_tree":  # greedy requests draft 3 branches of depth 2
        return pipe(FeatureDrafter(lm, head=feature_head, k=2, branches=3, trees="always"))
    if method == "pld_then_feature_tree":
        return pipe(FallbackDrafter(PLDDrafter(k=5, min_ngram=2),
                                    FeatureDrafter(lm, head=feature_head, k=2, branches=2,
                                                   trees="always")))
    if method == "pld_then_feature":  # prompt lookup, the feature head where it finds nothing
        return pipe(FallbackDrafter(PLDDrafter(k=5, min_ngram=2),
                                    FeatureDrafter(lm, head=feature_head, k=2)))
    if method == "pld_then_feature_adaptive":  # a cost model per part (prompt lookup, head)
        return pipe(FallbackDrafter(PLDDrafter(k=5, min_ngram=2),
                                    FeatureDrafter(lm, head=feature_head, k=3)),
                    draft_length=AdaptiveDraftLength())
    if method == "feature_adaptive":
        return pipe(FeatureDrafter(lm, head=feature_head, k=5),
                    draft_length=AdaptiveDraftLength())
    if method == "fly_theta1":  # the normalized gate shut: FLy is exact acceptance
        return pipe(ModelDrafter(draft_lm, k=4), FlyAcceptor(theta=1.0, window=2))
    raise ValueError(method)


METHODS = [
    "ar",
    "pld",
    "sps",
    "sps_pld",
    "pld_then_model",
    "self_spec",
    "hispec",
    "self_spec_adapter",
    "hispec_adapter",
    "hispec_feature",
    "metasd_adapter",
    "layer_skip",
    *(f"metasd_{name}" for name in SELECTORS),
    "fly_theta1",
    "feature",
    "feature_adaptive",
    "pld_then_feature",
    "pld_then_feature_adaptive",
    "metasd_eagle",
    "feature_tree",
    "pld_then_feature_tree",
    "metasd_tree",
]


def decode(pipe, batch_size: int, kind: str, prompts, max_new: int, sampling=None, seeds=None):
    """Every prompt through the scheduler; generations in prompt order."""
    sched = Scheduler(pipe, batch_size, KVLayout(kind=kind, block_size=4), max_context=64)
    seeds = seeds or [0] * len(prompts)
    pairs = enumerate(zip(prompts, seeds, strict=True))
    reqs = [SeqRequest(p, max_new, seed=s, tag=i) for i, (p, s) in pairs]
    results = sched.generate(reqs, sampling)
    sched.kv.check_no_leaks()
    by_tag = {r.request.tag: r.generation for r in results}
    return [by_tag[i] for i in range(len(prompts))], sched


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
@pytest.mark.parametrize("batch_size", [1, 3])
@pytest.mark.parametrize("method", METHODS)
def test_every_pipeline_equals_hf_greedy(method, batch_size, kind, target, drafter,
                                        feature_head, adapted):
    hf, lm = adapted if method.endswith("_adapter") else target
    pipe = build(method, lm, drafter[1], feature_head)
    gens, sched = decode(pipe, batch_size, kind, PROMPTS, MAX_NEW)
    assert [g.tokens for g in gens] == [hf_greedy(hf, p, MAX_NEW) for p in PROMPTS]
    assert max(sched.stats.occupancy) == batch_size
    if method != "ar":
        assert sum(g.stats.drafted for g in gens) > 0  # speculation happened
    if method in ("metasd_ucb", "metasd_discounted_ucb", "metasd_round_robin", "metasd_adapter",
                  "metasd_eagle", "metasd_tree"):
        assert len({a for g in gens for a in g.stats.arms}) > 1  # several arms drafted
        assert all(0.0 <= r <= 1.0 for g in gens for r in g.stats.rewards)


def test_a_tree_keeps_paths_through_other_branches(target, feature_head):
    """The tree of 3 branches finds accepted tokens the chain misses (its other branches),
    and both give HF's greedy tokens."""
    hf, lm = target
    accepted = {}
    for branches in (1, 3):
        pipe = SpeculativePipeline(FullVerifier(lm), StandardAcceptor(),
                                   drafter=FeatureDrafter(lm, head=feature_head, k=2,
                                                          branches=branches, trees="always"))
        gens, _ = decode(pipe, 3, "paged", PROMPTS, MAX_NEW)
        assert [g.tokens for g in gens] == [hf_greedy(hf, p, MAX_NEW) for p in PROMPTS]
        accepted[branches] = sum(sum(g.stats.accepted_per_round) for g in gens)
        drafted = sum(g.stats.drafted for g in gens)
        rounds = sum(len(g.stats.accepted_per_round) for g in gens)
        assert drafted > rounds * branches  # trees of 3 x 2 nodes where the budget allows
    assert accepted[3] > accepted[1]


def test_trees_only_where_their_rows_are_free(target, feature_head):
    """``trees=free_rows``: a round drafts trees when its verify rows with trees stay within
    max(min_rows, rows with chains): a 2 x 2 tree at batch 1 with 5 padded rows, chains at
    batch 3 (15 rows against 9) or unpadded; HF's tokens either way."""
    hf, lm = target
    want = [hf_greedy(hf, p, MAX_NEW) for p in PROMPTS]
    drafted = {}
    try:
        for min_rows, batch in ((5, 1), (5, 3), (1, 1)):
            lm.min_rows = min_rows
            draft = FeatureDrafter(lm, head=feature_head, k=2, branches=2)
            pipe = SpeculativePipeline(FullVerifier(lm), StandardAcceptor(), drafter=draft)
            gens, _ = decode(pipe, batch, "contiguous", PROMPTS, MAX_NEW)
            assert [g.tokens for g in gens] == want
            # the first round of the first two prompts (at batch 3 both draft in it)
            drafted[min_rows, batch] = [g.stats.drafted_per_round[0] for g in gens[:2]]
    finally:
        lm.min_rows = 1
    # 2 x 2 tree nodes, or a chain of 2
    assert drafted == {(5, 1): [4, 4], (5, 3): [2, 2], (1, 1): [2, 2]}


def test_tree_gain_counts_what_the_first_branch_alone_would_have_committed():
    """Two roots (nodes 0, 1), a chain under each (0 -> 2 -> 4, 1 -> 3): a path through
    the second root commits 3 tokens where the chain (the first branch) commits 1, a path
    along the first branch the same 3 as the chain; the decision prices rows by the probe."""
    tree = Draft([21, 22, 23, 24, 25], parents=[-1, -1, 0, 1, 2])
    gain = TreeGain(warmup=2, explore=4)
    gain.count(tree, Acceptance(2, 7, path=[1, 3]))
    gain.count(tree, Acceptance(2, 7, path=[0, 2]))
    gain.count(tree, Acceptance(0, 7, path=[]))
    assert (gain.tree_tokens, gain.chain_tokens, gain.trees_seen) == (7, 5, 3)
    probe = RowProbe({3: 1.0, 5: 1.3}, 1)
    # decisions 1, 2, 3: gain 1.4 >= 1.3; 4: explore; then with cost 1.5 > 1.4: chains
    assert [gain.pays(3, 5, probe) for _ in range(4)] == [True] * 4
    dear = RowProbe({3: 1.0, 5: 1.5}, 1)
    assert [gain.pays(3, 5, dear) for _ in range(4)] == [False, False, False, True]
    assert not gain.pays(3, 7, dear)  # 7 rows were not probed: not paid for
    assert not TreeGain().pays(3, 5, None)  # no probe (model.min_rows given): chains


@pytest.mark.parametrize("cost", [1.0, 100.0])
def test_measured_trees_follow_their_gain_and_the_probe(cost, target, feature_head):
    """``trees=measured`` at batch 1, unpadded (a tree always costs rows): where the probe
    prices every row count alike every round drafts a tree; where each row costs 100 times
    the one before, only the warm-up's and every ``explore``-th round do; HF's tokens
    either way."""
    hf, lm = target
    try:
        lm.row_probe = RowProbe({r: cost ** r for r in range(1, 7)}, 1)
        draft = FeatureDrafter(lm, head=feature_head, k=2, branches=2, trees="measured")
        pipe = SpeculativePipeline(FullVerifier(lm), StandardAcceptor(), drafter=draft)
        gens, _ = decode(pipe, 1, "contiguous", PROMPTS, MAX_NEW)
    finally:
        lm.row_probe = None
    assert [g.tokens for g in gens] == [hf_greedy(hf, p, MAX_NEW) for p in PROMPTS]
    gain = draft.tree_gain
    n = gain.decisions
    explored = min(n, gain.warmup) + sum(1 for d in range(gain.warmup + 1, n + 1)
                                         if d % gain.explore == 0)
    assert n > gain.explore
    assert gain.trees_seen == (n if cost == 1.0 else explored)
    # the engine's count of tree rounds (the run's records: ``tree_rounds``) agrees
    assert sum(g.stats.tree_rounds for g in gens) == gain.trees_seen
    assert gain.tree_tokens >= gain.chain_tokens > 0


def test_measured_trees_probe_a_target_that_was_not_probed(target, feature_head):
    """A target whose ``min_rows`` was given has no prices: ``trees=measured`` probes it
    when the drafter is built, leaving its row padding as it was.  A packed model gets every row
    count timed (the warm-up then drafts trees); an unpacked one nothing (no row count is
    paid for: chains only)."""
    hf, lm = target
    assert lm.row_probe is None and lm.min_rows == 1
    try:
        draft = FeatureDrafter(lm, head=feature_head, k=2, branches=2, trees="measured")
        probe = lm.row_probe
        pipe = SpeculativePipeline(FullVerifier(lm), StandardAcceptor(), drafter=draft)
        gens, _ = decode(pipe, 1, "contiguous", PROMPTS[:2], MAX_NEW)
        assert isinstance(probe, RowProbe)
        assert sorted(probe.seconds) == ([1, 2, 3, 4, 5, 6] if lm.packed else [])
        assert lm.min_rows == 1
    finally:
        lm.row_probe = None
    assert [g.tokens for g in gens] == [hf_greedy(hf, p, MAX_NEW) for p in PROMPTS[:2]]
    gain = draft.tree_gain
    assert gain.decisions > gain.warmup
    if lm.packed:
        assert gain.trees_seen >= gain.warmup
    else:
        assert gain.trees_seen == 0


def test_ragged_acceptance_within_a_batch(target, drafter):
    """Sequences of one batch keep different prefixes in the same round."""
    hf, lm = target
    gens, sched = decode(build("self_spec", lm, drafter[1]), 3, "paged", PROMPTS[:3], MAX_NEW)
    assert sched.stats.occupancy[0] == 3  # the three ran together from round 1
    # while all three were active (zip stops at the shortest)
    rounds = zip(*(g.stats.accepted_per_round for g in gens), strict=False)
    assert any(len(set(r)) > 1 for r in rounds)


def test_min_confidence_stops_drafts_at_every_batch_size(target, drafter):
    hf, lm = target
    pipe = SpeculativePipeline(
        FullVerifier(lm), StandardAcceptor(),
        drafter=ModelDrafter(drafter[1], k=6, min_confidence=0.9),
    )
    want = [hf_greedy(hf, p, MAX_NEW) for p in PROMPTS]
    for batch_size, kind in [(1, "contiguous"), (3, "paged")]:
        gens, _ = decode(pipe, batch_size, kind, PROMPTS, MAX_NEW)
        assert [g.tokens for g in gens] == want
        drafted = [d for g in gens for d in g.stats.drafted_per_round]
        asked = [k for g in gens for k in g.stats.asked_per_round]
        assert sum(drafted) < sum(asked)  # some drafts stopped early


# ---------------------------------------------------------------- sampling


@pytest.mark.parametrize("which", ["model", "feature", "feature_tree"])
def test_sampling_follows_the_target_law_at_batch_three(which, target, drafter, feature_head):
    """Two sampled tokens, batch 3 (paged), rejection sampling with a draft model or a
    feature head: the joint law of the output is the target's (chi-square), and each
    request draws exactly what it draws at batch 1 for its seed."""
    _, lm = target
    sampling = SamplingParams(temperature=1.0, top_k=3)
    draft = (ModelDrafter(drafter[1], k=2) if which == "model"
             else FeatureDrafter(lm, head=feature_head, k=2,
                                 branches=3 if which == "feature_tree" else 1,
                                 trees="always"))
    pipe = SpeculativePipeline(FullVerifier(lm), StandardAcceptor(), drafter=draft)
    if which == "feature_tree":  # a tree drafter drafts chains for sampled requests
        propose = draft.propose

        def chains_only(states, asked):
            drafts = propose(states, asked)
            assert all(d.parents is None for d in drafts)
            return drafts

        draft.propose = chains_only
    prompt = [1, 5, 9]
    law = two_token_law(lm, prompt, sampling)
    trials = 900
    sched = Scheduler(pipe, 3, KVLayout(kind="paged", block_size=4), max_context=16)
    reqs = [SeqRequest(prompt, 2, seed=s, stop_token_ids=()) for s in range(trials)]
    results = sched.generate(reqs, sampling)
    counts = dict.fromkeys(law, 0)
    for r in results:
        counts[tuple(r.generation.tokens)] += 1
    cells = list(law)
    total = sum(law.values())  # 1 up to float32 rounding; chisquare wants the sums equal
    expected = [law[c] / total * trials for c in cells]
    pvalue = chisquare([counts[c] for c in cells], expected).pvalue
    assert pvalue > 1e-3, (pvalue, counts)
    one = generate(pipe, prompt, 2, sampling, seed=7, stop_token_ids=()).tokens
    assert next(r for r in results if r.request.seed == 7).generation.tokens == one


# ---------------------------------------------------------------- draft-length policy


class WrongDrafter:
    """Always proposes a token the target will not pick (its greedy choice + 1)."""

    name = "wrong"
    branches = 1
    k = 4

    def __init__(self, truth: dict[tuple[int, ...], list[int]], vocab: int, ticks: list[int]):
        self.truth, self.vocab, self.ticks = truth, vocab, ticks

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
        self.ticks[0] += 5  # drafting costs 5 clock ticks per batched call
        out = []
        for st, k in zip(states, ks, strict=True):
            truth = self.truth[tuple(st.tokens[: st.prompt_len])]
            done = st.num_generated
            out.append(Draft([(t + 1) % self.vocab for t in truth[done : done + k]]))
        return out


def test_adaptive_policy_per_sequence_at_batch_three(target):
    """The adaptive policy records k per round per sequence and converges to k = 0 (plain
    rounds, with rare one-token re-probes) for a drafter that is always wrong."""
    hf, lm = target
    max_new = 60
    prompts = PROMPTS[:3]
    truth = {tuple(p): hf_greedy(hf, p, max_new) for p in prompts}
    ticks = [0]

    def clock() -> float:  # one tick per call, plus what the drafter adds
        ticks[0] += 1
        return float(ticks[0])

    pipe = SpeculativePipeline(
        FullVerifier(lm),
        StandardAcceptor(),
        drafter=WrongDrafter(truth, lm.info.vocab_size, ticks),
        draft_length=AdaptiveDraftLength(prior_strength=0.0),
        clock=clock,
    )
    gens, sched = decode(pipe, 3, "contiguous", prompts, max_new)
    assert [g.tokens for g in gens] == [truth[tuple(p)] for p in prompts]
    assert sched.stats.occupancy[0] == 3
    for g in gens:
        ks = g.stats.asked_per_round
        assert len(ks) == g.stats.rounds == len(g.stats.drafted_per_round)
        # round 1 plain (the first token first: the drafter not yet measured), round 2
        # drafts the limit to measure it
        assert ks[:2] == [0, 4] and g.stats.accepted == 0
        tail = ks[len(ks) // 2 :]
        probes = sum(1 for k in tail if k > 0)
        assert set(tail) <= {0, 1} and probes <= len(tail) // 16 + 1, ks


def test_batch_one_and_three_give_the_same_rounds(target, drafter):
    """A request's rounds do not depend on its batch mates (greedy, fixed k)."""
    _, lm = target
    pipe = build("sps", lm, drafter[1])
    one, _ = decode(pipe, 1, "contiguous", PROMPTS, MAX_NEW)
    three, _ = decode(pipe, 3, "paged", PROMPTS, MAX_NEW)
    for a, b in zip(one, three, strict=True):
        assert a.stats.accepted_per_round == b.stats.accepted_per_round


@pytest.mark.parametrize("module", ["batch_engine", "batched_lm", "batch_runner"])
def test_no_mirrored_engine_left(module):
    """One round function and one decoder layer: the batched copies are gone."""
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(f"specflow.kv.{module}")
