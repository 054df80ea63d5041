"""MetaSD: bandit selectors, the block-divergence reward, and lossless drafter pools."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from specflow.engine import SpeculativePipeline
from specflow.errors import ConfigError
from specflow.protocols import DraftPart
from specflow.results.measure import generation_metrics
from specflow.results.oracle import load_runs, oracle_report
from specflow.scheduler import generate
from specflow.state import Acceptance, DecodeState, Draft
from stages.acceptors.standard import StandardAcceptor
from stages.drafters.fallback import FallbackDrafter
from stages.drafters.model import ModelDrafter
from stages.drafters.pld import PLDDrafter
from stages.drafters.pool import PoolDrafter, block_divergence
from stages.selectors.fixed import FixedSelector
from stages.selectors.round_robin import RoundRobinSelector
from stages.selectors.ucb import DiscountedUCBSelector, UCBSelector
from stages.verifiers.full import FullVerifier
from tests.conftest import hf_greedy, make_pair

PROMPTS = [[1, 5, 9, 17, 33, 5, 9, 17], [3, 4, 5, 6, 7, 8, 3, 4, 5, 6]]
MAX_NEW = 24


# ---------------------------------------------------------------- synthetic bandits
def run_bandit(selector, means: list[float], horizon: int, seed: int = 0) -> list[int]:
    """Pull Bernoulli arms for ``horizon`` rounds; the arms chosen."""
    rng = random.Random(seed)
    stats = selector.begin(len(means))
    chosen = []
    for _ in range(horizon):
        arm = selector.select(stats)
        selector.update(stats, arm, float(rng.random() < means[arm]))
        chosen.append(arm)
    return chosen


def pseudo_regret(chosen: list[int], means: list[float]) -> float:
    best = max(means)
    return sum(best - means[a] for a in chosen)


def test_ucb_regret_grows_logarithmically():
    means = [0.2, 0.5, 0.8]
    short = run_bandit(UCBSelector(), means, 1000)
    long = run_bandit(UCBSelector(), means, 10000)
    r_short, r_long = pseudo_regret(short, means), pseudo_regret(long, means)
    assert 0 < r_long < 3 * r_short  # linear regret would be 10x
    assert long.count(2) / len(long) > 0.9
    # Auer et al. (2002): E[pulls of arm i] <= 8 ln T / gap^2 + 1 + pi^2 / 3.
    for arm in (0, 1):
        gap = means[2] - means[arm]
        for chosen in (short, long):
            bound = 8 * math.log(len(chosen)) / gap**2 + 1 + math.pi**2 / 3
            assert chosen.count(arm) <= bound


def test_ucb_tries_every_arm_first():
    sel = UCBSelector()
    stats = sel.begin(4)
    picks = []
    for _ in range(4):
        picks.append(sel.select(stats))
        sel.update(stats, picks[-1], 0.0)
    assert picks == [0, 1, 2, 3]


def switching_bandit(selector, seed: int = 1) -> float:
    """Bernoulli arms (0.9, 0.4) for 2000 rounds, then (0.4, 0.7) for 2000 (the best arm
    switches): the share of the last 2000 rounds that chose the new best arm."""
    rng = random.Random(seed)
    stats = selector.begin(2)
    late = []
    for t in range(4000):
        means = [0.9, 0.4] if t < 2000 else [0.4, 0.7]
        arm = selector.select(stats)
        selector.update(stats, arm, float(rng.random() < means[arm]))
        if t >= 2000:
            late.append(arm)
    return late.count(1) / len(late)


def test_discounted_ucb_tracks_a_switch_of_the_best_arm():
    tracked = switching_bandit(DiscountedUCBSelector(gamma=0.99))
    stuck = switching_bandit(UCBSelector())  # UCB1 averages in 2000 stale rewards
    assert tracked > 0.7
    assert tracked > stuck + 0.15


def test_fixed_and_round_robin():
    fixed = FixedSelector(2)
    stats = fixed.begin(3)
    assert [fixed.select(stats) for _ in range(3)] == [2, 2, 2]
    with pytest.raises(ConfigError, match="selector.arm=2 but the pool has 2 arms"):
        fixed.begin(2)
    rr = RoundRobinSelector()
    stats = rr.begin(3)
    assert [rr.select(stats) for _ in range(5)] == [0, 1, 2, 0, 1]
    other = rr.begin(3)  # another request: its own cycle, from arm 0
    assert rr.select(other) == 0 and rr.select(stats) == 2


def test_selectors_reset_per_request():
    for sel in (UCBSelector(), DiscountedUCBSelector()):
        old = sel.begin(2)
        for _ in range(5):
            sel.update(old, sel.select(old), 1.0)
        assert sum(old.counts) > 0
        new = sel.begin(2)
        assert new.counts == [0.0, 0.0] and new.sums == [0.0, 0.0]
        assert sel.select(new) == 0


def test_selector_without_reset_carries_the_run_over():
    sel = UCBSelector(reset=False)
    run_bandit(sel, [0.1, 0.9], 50)
    stats = sel.begin(2)
    assert sum(stats.counts) == 50 and stats.sums[1] > stats.sums[0]
    assert sel.select(stats) == 1  # the better arm straight away, no re-exploration
    assert sel.begin(2) is stats  # every request of the run shares the statistics
    assert sel.begin(3).counts == [0.0, 0.0, 0.0]  # another pool: nothing to carry over


def test_warm_start_starts_each_request_from_the_run():
    """prior = 2: the run's pulls per arm capped at 2, each arm keeping its run mean."""
    sel = UCBSelector(c=0.5, prior=2)
    first = sel.begin(3)
    assert first.counts == [0.0, 0.0, 0.0]  # nothing learned yet: a fresh start
    for arm, reward in [(0, 0.9), (1, 0.2), (2, 0.4), (0, 0.7), (0, 0.8), (1, 0.0)]:
        sel.update(first, arm, reward)
    second = sel.begin(3)
    assert second.counts == [2.0, 2.0, 1.0]  # min(3, 2), min(2, 2), min(1, 2)
    assert second.sums == pytest.approx([2.4 * 2 / 3, 0.2, 0.4])  # run means 0.8, 0.1, 0.4
    assert first.counts == [3.0, 2.0, 1.0]  # the first request's own statistics are its own
    # index = mean + 0.5 sqrt(2 ln 5 / n): 0.8 + 0.634, 0.1 + 0.634, 0.4 + 0.897 -> arm 0
    assert sel.select(second) == 0
    sel.update(second, 2, 1.0)  # a request's rounds teach the run too
    assert sel.begin(3).sums == pytest.approx([1.6, 0.2, 1.4])  # arm 2: 2 pulls, mean 0.7
    with pytest.raises(ConfigError, match="selector.reset=false already shares them"):
        UCBSelector(prior=4, reset=False)
    with pytest.raises(ConfigError, match="selector.prior must be >= 0"):
        UCBSelector(prior=-1)


# ---------------------------------------------------------------- rewards
P = torch.tensor(
    [[0.7, 0.1, 0.1, 0.1], [0.25, 0.25, 0.25, 0.25], [0.1, 0.2, 0.3, 0.4]]
)  # the target's distributions at 3 draft positions, V = 4
TOKENS = [0, 2, 1]


def test_block_divergence_hand_computed():
    # One-hot q: TV_j = 1 - p_j(x_j) = 0.3, 0.75, 0.8 -> BD = 1 - 1.85/3 = 1.15/3.
    assert block_divergence(TOKENS, None, P) == pytest.approx(1.15 / 3)
    # TV = 1/2 (0.2 + 0.4 + 0.1 + 0.1) = 0.4;  0;  1/2 (0.3 + 0.1 + 0.1 + 0.3) = 0.4.
    q = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.25] * 4, [0.4, 0.3, 0.2, 0.1]])
    assert block_divergence(TOKENS, q, P) == pytest.approx(1 - 0.8 / 3)
    assert block_divergence([], None, P) == 0.0


class StubDrafter:
    """Proposes ``TOKENS`` (q one-hot)."""

    name = "stub"
    branches = 1
    k = 3

    def begin(self, states: list[DecodeState]) -> None:
        pass

    def models(self) -> list:
        return []

    def uses(self) -> list:
        return []

    def observe(self, states, drafts, target_logits, verdicts) -> None:
        pass

    def next_part(self, state):
        return DraftPart("", self.k, self.k)

    def propose(self, states: list[DecodeState], ks: list[int]) -> list[Draft]:
        return [Draft(TOKENS[:k]) for k in ks]


@pytest.mark.parametrize(("reward", "expected"), [("bd", 1.15 / 3), ("be", 1 / 3)])
def test_pool_reward_from_target_logits(reward, expected):
    """Greedy: p = softmax(target logits) (temperature 1); logits = log P give back P."""
    sel = UCBSelector()
    pool = PoolDrafter({"a": StubDrafter(), "b": StubDrafter()}, sel, reward=reward)
    state = DecodeState(tokens=[1, 2], prompt_len=2, max_len=16)
    pool.begin([state])
    (draft,) = pool.propose([state], [3])
    logits = torch.cat([P.log(), torch.zeros(1, 4)])  # [k+1, V]
    pool.observe([state], [draft], [logits], [Acceptance(1, 3)])
    assert state.stats.arms == [0]
    assert state.stats.rewards[0] == pytest.approx(expected)
    bandit = pool._request.get(state).bandit
    assert bandit.sums[0] == pytest.approx(expected) and bandit.counts == [1.0, 0.0]
    other = DecodeState(tokens=[1, 2], prompt_len=2, max_len=16)
    pool.begin([other])
    assert pool._request.get(other).bandit.counts == [0.0, 0.0]  # reset per request


def test_a_pool_is_one_part_whatever_its_arms_drafts_carry():
    """An arm that is a fallback marks its drafts ``first`` / ``then``; the pool, one part to
    a draft-length policy (``next_part``: ""), hands them on as its own part, so a policy
    is told about the part it was asked for."""
    state = DecodeState(tokens=[1, 2, 3, 1, 2], prompt_len=5, max_len=16)
    fallback = FallbackDrafter(PLDDrafter(k=2, min_ngram=2), StubDrafter())
    assert [d.part for d in fallback.propose([state], [2])] == ["first"]
    pool = PoolDrafter({"eagle_pld": fallback}, FixedSelector(0))
    pool.begin([state])
    assert pool.next_part(state) == DraftPart("", 3, 3)
    (draft,) = pool.propose([state], [2])
    assert (draft.tokens, draft.part) == ([3, 1], "")


class FakeClock:
    """Seconds that move only when a test (or a stub drafter) moves them."""

    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class TimedStub(StubDrafter):
    """``StubDrafter`` whose drafting takes ``cost`` seconds of a fake clock."""

    def __init__(self, clock: FakeClock, cost: float) -> None:
        self.clock, self.cost = clock, cost

    def propose(self, states: list[DecodeState], ks: list[int]) -> list[Draft]:
        self.clock.t += self.cost
        return super().propose(states, ks)


def test_rate_reward_is_tokens_per_reference_step_of_time():
    """rate = (accepted + 1) * t_ref / (draft_s + verify_s), t_ref = the shortest
    verification so far; reward = min(1, rate / rate_scale)."""
    clock = FakeClock()
    arms = {"slow": TimedStub(clock, 0.5), "free": TimedStub(clock, 0.0)}
    pool = PoolDrafter(arms, RoundRobinSelector(), reward="rate", rate_scale=2.0)
    state = DecodeState(tokens=[1, 2], prompt_len=2, max_len=16, clock=clock)
    pool.begin([state])
    logits = torch.zeros(4, 4)
    # (verification seconds, accepted) per round; arms alternate slow, free, slow.
    for verify_s, accepted in [(0.25, 1), (0.2, 0), (0.25, 3)]:
        (draft,) = pool.propose([state], [3])
        clock.t += verify_s
        pool.observe([state], [draft], [logits], [Acceptance(accepted, 3)])
    # 1: t_ref 0.25, rate 2 * 0.25 / 0.75 = 2/3.  2: t_ref 0.2, rate 1 * 0.2 / 0.2 = 1.
    # 3: rate 4 * 0.2 / 0.75 = 16/15.
    assert state.stats.arms == [0, 1, 0]
    assert state.stats.rewards == pytest.approx([1 / 3, 1 / 2, 8 / 15])
    (draft,) = pool.propose([state], [3])  # free: 4 tokens in 0.2 s, rate 4 -> capped
    clock.t += 0.2
    pool.observe([state], [draft], [logits], [Acceptance(3, 3)])
    assert state.stats.rewards[-1] == 1.0
    with pytest.raises(ConfigError, match="rate_scale must be > 0"):
        PoolDrafter(arms, RoundRobinSelector(), reward="rate", rate_scale=0.0)
    # By default the scale is k + 1 = 4 (the stubs' k = 3): the most a round can rate.
    assert PoolDrafter(arms, RoundRobinSelector(), reward="rate").rate_scale == 4.0


def test_pool_refuses_bad_config():
    with pytest.raises(ConfigError, match="reward must be one of"):
        PoolDrafter([StubDrafter()], UCBSelector(), reward="tokens")
    with pytest.raises(ConfigError, match="is empty"):
        PoolDrafter({}, UCBSelector())
    with pytest.raises(ConfigError, match="not a drafter"):
        PoolDrafter({"x": object()}, UCBSelector())


# ---------------------------------------------------------------- lossless pools
@pytest.fixture(scope="module")
def deep_target():
    """A 6-layer target: early exits at 2 and 4 are arms."""
    return make_pair("llama", seed=3, num_layers=6)


def make_arms(target_lm, draft_lm) -> dict:
    nested = SpeculativePipeline(
        FullVerifier(draft_lm), StandardAcceptor(), drafter=PLDDrafter(k=3), level="draft", k=5
    )
    return {
        "pld": PLDDrafter(k=5),
        "draft_model": ModelDrafter(draft_lm, k=3),
        "exit2": ModelDrafter(target_lm, k=4, exit_layer=2),
        "exit4": ModelDrafter(target_lm, k=4, exit_layer=4),
        "pld_model": nested,
    }


def pool_pipeline(target_lm, drafter) -> SpeculativePipeline:
    return SpeculativePipeline(FullVerifier(target_lm), StandardAcceptor(), drafter=drafter)


SELECTORS = {
    "ucb_bd": (lambda: UCBSelector(), "bd"),
    "ucb_be": (lambda: UCBSelector(), "be"),
    "discounted_ucb": (lambda: DiscountedUCBSelector(gamma=0.9), "bd"),
    "round_robin": (lambda: RoundRobinSelector(), "bd"),
    "ucb_rate_warm": (lambda: UCBSelector(c=0.3, prior=2), "rate"),
}
SWITCH = {"ucb_rate_warm": 4.0}  # switch_horizon per selector case (default: off)


@pytest.mark.parametrize("selector", sorted(SELECTORS))
def test_pool_is_lossless_whatever_the_arm(deep_target, tiny_drafter, selector):
    hf, lm = deep_target
    _, draft_lm = tiny_drafter
    make_selector, reward = SELECTORS[selector]
    pool = PoolDrafter(
        make_arms(lm, draft_lm), make_selector(), reward=reward,
        switch_horizon=SWITCH.get(selector),
    )
    pipe = pool_pipeline(lm, pool)
    for prompt in PROMPTS:
        gen = generate(pipe, prompt, MAX_NEW)
        assert gen.tokens == hf_greedy(hf, prompt, MAX_NEW)
        s = gen.stats
        pool_rounds = sum(1 for k in s.asked_per_round if k > 0)
        assert len(s.arms) == len(s.rewards) == pool_rounds > 0
        assert all(0.0 <= r <= 1.0 for r in s.rewards)
        if selector == "round_robin":
            assert s.arms == [i % 5 for i in range(pool_rounds)]
            assert s.catchup_tokens > 0  # idle arms catch up when their turn comes


def test_pool_when_sampling(deep_target, tiny_drafter):
    """Sampling: BD uses the drafters' q (one-hot for PLD) and the target's warped p."""
    from specflow.sampling import SamplingParams
    from stages.acceptors.standard import StandardAcceptor

    _, lm = deep_target
    _, draft_lm = tiny_drafter
    pool = PoolDrafter(make_arms(lm, draft_lm), RoundRobinSelector())
    pipe = SpeculativePipeline(FullVerifier(lm), StandardAcceptor(), drafter=pool)
    gen = generate(pipe, PROMPTS[1], 16, SamplingParams(temperature=0.8), seed=3)
    assert len(gen.tokens) == 16 or gen.stop_reason == "eos"
    assert gen.stats.rewards and all(0.0 <= r <= 1.0 for r in gen.stats.rewards)


@pytest.mark.parametrize("arm", range(5))
def test_fixed_arm_equals_that_drafter_alone(deep_target, tiny_drafter, arm):
    _, lm = deep_target
    _, draft_lm = tiny_drafter
    arms = make_arms(lm, draft_lm)
    alone = pool_pipeline(lm, list(arms.values())[arm])
    pooled = pool_pipeline(lm, PoolDrafter(arms, FixedSelector(arm)))
    for prompt in PROMPTS:
        a, b = generate(alone, prompt, MAX_NEW), generate(pooled, prompt, MAX_NEW)
        assert b.tokens == a.tokens
        assert b.stats.accepted_per_round == a.stats.accepted_per_round
        assert b.stats.drafted_per_round == a.stats.drafted_per_round
        assert set(b.stats.arms) == {arm}
        # Never idle, so the only catch-up is the draft model's lazy prefill at the arm's
        # first round (arms 1 and 4 run the draft model; 0 is PLD, 2 and 3 the target's
        # exits, prefilled by the target verifier); the positions before the last token.
        assert b.stats.catchup_tokens == (len(prompt) - 1 if arm in (1, 4) else 0)


def test_pool_metrics_for_the_runner(deep_target, tiny_drafter):
    _, lm = deep_target
    _, draft_lm = tiny_drafter
    pipe = pool_pipeline(lm, PoolDrafter(make_arms(lm, draft_lm), RoundRobinSelector()))
    gens = [generate(pipe, p, MAX_NEW) for p in PROMPTS]
    m = generation_metrics(gens).to_json()  # as the record's metrics are written
    assert m["arms"] == gens[0].stats.arms + gens[1].stats.arms
    assert len(m["arm_rewards"]) == len(m["arms"])
    assert sum(m["arm_counts"]) == len(m["arms"]) and len(m["arm_counts"]) == 5
    assert m["catchup_tokens"] > 0 and m["catchup_s"] >= 0
    plain = generation_metrics([generate(pool_pipeline(lm, None), [1, 2], 4)])
    assert plain.pool is None and "arms" not in plain.to_json()


def test_switch_penalty_spreads_an_idle_arms_catch_up(deep_target, tiny_drafter):
    """penalty_i = mean_i * C_i / (H d_i + C_i), C_i = positions behind * measured seconds
    per catch-up position, d_i = measured seconds per round; 0 for the arm that drafted last
    and for arms without models."""
    from specflow.kv.stores import KVStores

    _, lm = deep_target
    _, draft_lm = tiny_drafter
    arms = {"pld": PLDDrafter(k=5), "draft_model": ModelDrafter(draft_lm, k=3)}
    pool = PoolDrafter(arms, RoundRobinSelector(), reward="rate", switch_horizon=4.0)
    pipe = pool_pipeline(lm, pool)
    prompt = PROMPTS[1]
    ticks = iter(range(10**6))
    state = DecodeState(
        tokens=list(prompt), prompt_len=len(prompt), max_len=64, kv=KVStores(),
        clock=lambda: float(next(ticks)),
    )
    pipe.begin([state])
    for _ in range(4):  # pld, model (its lazy prefill), pld, model (catches up again)
        pipe.run_round([state], [16])
    assert state.stats.arms == [0, 1, 0, 1]
    (c_s, c_n), (r_s, r_n) = pool._catchup[1], pool._rounds[1]
    assert c_n == state.stats.catchup_tokens > len(prompt) - 1 and r_n == 2
    pipe.run_round([state], [16])  # pld drafts: the model falls behind again
    bandit = pool._request.get(state).bandit  # round robin keeps no means: set some
    bandit.counts, bandit.sums = [2.0, 2.0], [0.6, 0.5]
    penalties = pool._switch_penalties(state, bandit)
    from specflow.kv.session import common_prefix_length

    session = state.session(draft_lm)
    done = min(
        session.computed(draft_lm.info.num_layers - 1),
        common_prefix_length(session.tokens, state.tokens),
    )
    behind = len(state.tokens) - 1 - done
    cost = behind * c_s / c_n
    assert behind > 0 and penalties[0] == 0.0  # PLD has no model to catch up
    assert penalties[1] == pytest.approx(0.25 * cost / (4.0 * r_s / r_n + cost))
    assert 0.0 < penalties[1] < 0.25
    with pytest.raises(ConfigError, match="needs drafter.reward=rate"):
        PoolDrafter(arms, RoundRobinSelector(), reward="bd", switch_horizon=4.0)


def test_nested_pipeline_prefills_its_verifier_lazily(deep_target, tiny_drafter):
    """PLD -> draft model as a drafter: ``begin`` leaves the draft model's session empty
    (a pool arm never chosen never pays for the prompt); the first ``propose`` catches up
    and reports it as ``Draft.catchup_s``; the output is still the target's greedy."""
    from specflow.kv.stores import KVStores

    hf, lm = deep_target
    _, draft_lm = tiny_drafter
    nested = make_arms(lm, draft_lm)["pld_model"]
    pipe = pool_pipeline(lm, nested)
    prompt = PROMPTS[1]
    ticks = iter(range(10**6))  # each reading one second later: a timed step lasts 1 s
    state = DecodeState(
        tokens=list(prompt),
        prompt_len=len(prompt),
        max_len=64,
        kv=KVStores(),
        clock=lambda: float(next(ticks)),
    )
    pipe.begin([state])
    assert state.session(draft_lm).computed(0) == 0
    assert state.session(lm).computed(5) == len(prompt) - 1  # the target prefilled
    (draft,) = nested.propose([state], [3])
    assert state.session(draft_lm).computed(0) >= len(prompt) - 1
    assert len(draft.tokens) == 3 and draft.catchup_s == 1.0  # one catch-up forward, timed
    state.tokens += draft.tokens  # all accepted, then the bonus: one position behind
    state.tokens.append(7)
    (draft,) = nested.propose([state], [3])
    assert draft.catchup_s == 0.0  # that position rides along with verification (slack 1)
    gen = generate(pipe, prompt, MAX_NEW)
    assert gen.tokens == hf_greedy(hf, prompt, MAX_NEW)


# ---------------------------------------------------------------- oracle
def record(rid: str, tokens: int, seconds: float, baseline_s: float = 3.0) -> dict:
    return {
        "request_id": rid,
        "metrics": {
            "new_tokens": tokens,
            "total_s": seconds,
            "tokens_per_s": tokens / seconds,
            "baseline_s": baseline_s,
            "speedup": baseline_s / seconds,
        },
    }


def test_oracle_picks_the_best_drafter_per_request(tmp_path):
    runs = {
        "pld": {"a": record("a", 100, 1.0), "b": record("b", 100, 4.0)},
        "sps": {"a": record("a", 100, 2.0), "b": record("b", 100, 2.0)},
    }
    metasd = {"a": record("a", 100, 1.5), "b": record("b", 100, 2.5)}
    rep = oracle_report(runs, metasd)
    assert rep["oracle_choice"] == {"a": "pld", "b": "sps"}
    assert rep["oracle_tokens_per_s"] == pytest.approx(200 / 3.0)
    assert rep["best_single_run"] == "sps"  # 200/4 > 200/5
    assert rep["metasd_vs_oracle"] == pytest.approx((200 / 4.0) / (200 / 3.0))
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "requests.jsonl").write_text("\n".join(json.dumps(r) for r in runs["pld"].values()))
    assert set(load_runs([folder])[str(folder)]) == {"a", "b"}


def test_oracle_by_side_by_side_speedup():
    """Run "sps" ran on a slow machine (baselines 2x longer): by tokens/s it loses request a,
    by speedup it wins it."""
    runs = {
        "pld": {"a": record("a", 100, 1.0, baseline_s=2.0), "b": record("b", 100, 4.0, 2.0)},
        "sps": {"a": record("a", 100, 1.5, baseline_s=4.0), "b": record("b", 100, 2.0, 4.0)},
    }
    metasd = {"a": record("a", 100, 1.0, 2.0), "b": record("b", 100, 2.0, 2.0)}
    assert oracle_report(runs)["oracle_choice"] == {"a": "pld", "b": "sps"}
    rep = oracle_report(runs, metasd, by="speedup")
    assert rep["oracle_choice"] == {"a": "sps", "b": "sps"}
    assert rep["oracle_speedup"] == pytest.approx(8.0 / 3.5)
    assert rep["runs_speedup"] == {"pld": pytest.approx(4.0 / 5.0), "sps": pytest.approx(8.0 / 3.5)}
    assert rep["metasd_speedup"] == pytest.approx(4.0 / 3.0)
    assert rep["metasd_vs_oracle"] == pytest.approx((4.0 / 3.0) / (8.0 / 3.5))
    with pytest.raises(ValueError, match="by='x'"):
        oracle_report(runs, by="x")

