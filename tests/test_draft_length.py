"""Draft-length policies: adaptive k converges to 0 for a useless drafter, to the cap for a
perfect one; the heuristic follows HF's schedule; greedy identity holds throughout."""

from __future__ import annotations

from collections import Counter

import pytest

from specflow.costs import RowPrices
from specflow.cpu.row_padding import RowProbe
from specflow.drafting import draft_with_model
from specflow.engine import SpeculativePipeline
from specflow.errors import ConfigError
from specflow.kv.stores import KVLayout, KVStores
from specflow.protocols import DraftPart, ModelUse
from specflow.scheduler import Scheduler, SeqRequest, generate
from specflow.state import DecodeState, Draft, PartStats, RoundReport
from stages.acceptors.standard import StandardAcceptor
from stages.draft_length.adaptive import (
    AdaptiveDraftLength,
    expected_tokens,
    expected_tokens_by_position,
)
from stages.draft_length.heuristic import HeuristicDraftLength
from stages.drafters.fallback import FallbackDrafter
from stages.drafters.pld import PLDDrafter
from stages.verifiers.full import FullVerifier
from tests.conftest import hf_greedy
from tests.test_engine_greedy import OracleDrafter

T1 = 0.010  # seconds of a one-token target pass in the synthetic cost model


def mid_request() -> DecodeState:
    """A synthetic request holding a prompt token and one generated token: past the first
    round, which draft_length.first_token_plain keeps plain for a drafter not yet measured
    (test_the_first_token_does_not_wait_for_a_drafters_catch_up)."""
    return DecodeState(tokens=[0, 0], prompt_len=1, max_len=10)


def simulate(policy, accept_all: bool, rounds: int = 200, k_max: int = 8,
             t_draft: float = 0.001, beta: float = 0.1) -> list[int]:
    """Feed a policy synthetic rounds; returns the k it chose each round."""
    state = mid_request()
    policy.begin(state)
    ks = []
    for _ in range(rounds):
        k = policy.choose(state, k_max)
        ks.append(k)
        accepted = k if accept_all else 0
        policy.observe(state, RoundReport(k, accepted, k * t_draft, T1 * (1 + beta * k)))
    return ks


def test_expected_tokens_geometric():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens(1.0, 4) == 5.0


def test_adaptive_skips_a_useless_drafter():
    ks = simulate(AdaptiveDraftLength(), accept_all=False)
    tail = ks[50:]
    assert sum(k == 0 for k in tail) >= 0.9 * len(tail)  # mostly plain rounds
    assert max(tail) <= 1  # re-probes are single tokens
    # cost relative to plain decoding over the tail: within 2 %
    cost = sum(k * 0.001 + T1 * (1 + 0.1 * k) for k in tail)
    assert cost <= 1.02 * T1 * len(tail)


def test_adaptive_grows_to_the_cap_for_a_perfect_drafter():
    ks = simulate(AdaptiveDraftLength(), accept_all=True)
    assert ks[10:] == [8] * (len(ks) - 10)


def test_heuristic_follows_hf_schedule():
    assert simulate(HeuristicDraftLength(initial=4), accept_all=True, rounds=4) == [4, 6, 8, 8]
    assert simulate(HeuristicDraftLength(initial=4), accept_all=False, rounds=5) == [4, 3, 2, 1, 1]


@pytest.mark.parametrize("mode", ["never", "always", "sometimes"])
def test_adaptive_pipeline_keeps_greedy_identity(tiny_target, mode):
    hf, lm = tiny_target
    prompt = [1, 5, 9, 17, 33, 5, 9]
    truth = hf_greedy(hf, prompt, 60)
    drafter = OracleDrafter(truth, len(prompt), lm.info.vocab_size, mode, k=6)
    ticks = iter(range(10**6))  # a deterministic clock: every reading is 1 ms later
    pipe = SpeculativePipeline(
        FullVerifier(lm), StandardAcceptor(), drafter=drafter, draft_length=AdaptiveDraftLength(),
        clock=lambda: next(ticks) * 1e-3,
    )
    gen = generate(pipe, prompt, 60)
    assert gen.tokens == truth
    assert len(gen.stats.asked_per_round) == gen.stats.rounds
    if mode == "always":  # every round drafts the most it may: min(k, tokens left - 1) ...
        generated = 0
        for i, chosen in enumerate(gen.stats.asked_per_round):
            assert chosen == (0 if i == 0 else min(6, len(truth) - generated - 1))
            # ... but round 1: plain, the first token first (the drafter not yet measured),
            # which also measures t1
            generated += chosen + 1
    if mode == "never":
        assert gen.stats.asked_per_round.count(0) > gen.stats.rounds // 2


def test_a_new_request_inherits_the_previous_evidence():
    """After a request whose drafts all failed, the next one starts with k = 0 at once."""
    policy = AdaptiveDraftLength()
    simulate(policy, accept_all=False, rounds=40)
    state = mid_request()
    policy.begin(state)
    assert policy.choose(state, 8) == 0  # the plain round measuring t1 ...
    policy.observe(state, RoundReport(0, 0, 0.0, T1))
    assert policy.choose(state, 8) == 0  # ... and the evidence says: don't draft
    fresh = AdaptiveDraftLength(prior_strength=0.0)
    simulate(fresh, accept_all=False, rounds=40)
    fresh.begin(state)
    assert fresh.choose(state, 8) == 0  # each request first measures t1 in a plain round
    fresh.observe(state, RoundReport(0, 0, 0.0, T1))
    assert fresh.choose(state, 8) > 0  # Beta(1, 1): optimistic again


def test_heuristic_keeps_one_k_per_part():
    """HF's schedule per part: the copier's full drafts grow its k, the head's failures
    shrink its own, neither moving the other's."""
    chosen = alternate_parts(HeuristicDraftLength(initial=4), lambda part: part)
    assert chosen["first"][:4] == [4, 6, 8, 8]
    assert chosen["then"][:5] == [4, 3, 2, 1, 1]
    pooled = alternate_parts(HeuristicDraftLength(initial=4), lambda part: "")
    assert pooled["first"][:3] == [4, 5, 6] and pooled["then"][:3] == [6, 7, 8]


def alternate_parts(policy, key_of) -> dict[str, list[int]]:
    """200 synthetic rounds alternating a fallback's copier (part ``first``: every token
    accepted) and its head (``then``: none), each fed to the policy under ``key_of(part)``;
    returns the k chosen per part."""
    state = mid_request()
    policy.begin(state)
    chosen: dict[str, list[int]] = {"first": [], "then": []}
    for r in range(200):
        part = "first" if r % 2 == 0 else "then"
        k = policy.choose(state, 8, key_of(part))
        chosen[part].append(k)
        accepted = k if part == "first" else 0
        policy.observe(state, RoundReport(k, accepted, k * 0.001, T1 * (1 + 0.1 * k),
                                          part=key_of(part)))
    return chosen


def test_adaptive_keeps_each_part_of_a_drafter_apart():
    """Per part, the copier is asked for its cap and the head for nothing (a 1-token
    re-probe now and then); pooled (one key for both: alpha about 1/2), both are asked for
    5-8 tokens: the copier's runs are cut and the head drafts tokens that all fail."""
    apart = alternate_parts(AdaptiveDraftLength(), lambda part: part)
    assert apart["first"] == [8, 0] + [8] * 98  # round 2: the plain round measuring t1
    assert apart["then"][:7] == [8, 1, 1, 1, 1, 1, 1]
    assert set(apart["then"][7:]) == {0, 1} and apart["then"].count(0) == 88
    pooled = alternate_parts(AdaptiveDraftLength(), lambda part: "")
    assert sum(pooled["first"]) == 526 and sum(apart["first"]) == 792
    assert pooled["then"].count(0) == 1 and min(pooled["then"][1:]) == 5
    assert alternate_parts(AdaptiveDraftLength(by_part=False), lambda part: part) == pooled


def test_a_plain_round_measures_t1_for_every_part():
    policy = AdaptiveDraftLength()
    state = mid_request()
    policy.begin(state)
    assert policy.choose(state, 4, "first") == 4  # no times yet: draft to measure them
    policy.observe(state, RoundReport(4, 4, 0.004, 0.014, part="first"))
    assert policy.choose(state, 4, "then") == 4
    policy.observe(state, RoundReport(4, 0, 0.004, 0.014, part="then"))
    assert policy.choose(state, 4, "then") == 0  # one plain round measures t1 ...
    policy.observe(state, RoundReport(0, 0, 0.0, T1, part="then"))
    for part in ("first", "then"):  # ... for both parts: the target's time
        model = policy.cost_model(state, part)
        assert model.t1 == T1 and model.t1_measured
        assert model.beta == pytest.approx(0.1)  # (0.014 / 0.010 - 1) / 4
    assert policy.cost_model(state, "then").plain_streak == 1
    assert policy.cost_model(state, "first").plain_streak == 0
    assert policy.choose(state, 4, "first") == 4  # no second plain round for "first"
    later = AdaptiveDraftLength()
    later.begin(state)
    later.observe(state, RoundReport(0, 0, 0.0, T1, part="then"))
    assert later.cost_model(state, "first").t1 == T1  # a part made later takes it too


class _PartRecorder:
    """k = the limit, except 0 for the parts in ``skip``; per request, per round: the (part,
    limit) it was asked for (None: not asked, limit 0) and the part and draft length it was
    told about."""

    def __init__(self, skip: tuple[str, ...] = ()) -> None:
        self.skip = skip
        self.asked: dict[int, tuple[str, int] | None] = {}
        self.rounds: dict[int, list[tuple[tuple[str, int] | None, str, int]]] = {}

    def begin(self, state: DecodeState) -> None:
        self.rounds[id(state)] = []

    def use_prices(self, prices) -> None:
        pass

    def choose(self, state: DecodeState, limit: int, part: str = "") -> int:
        self.asked[id(state)] = (part, limit)
        return 0 if part in self.skip else limit

    def observe(self, state, report: RoundReport) -> None:
        self.rounds[id(state)].append(
            (self.asked.pop(id(state), None), report.part, report.drafted))


def test_the_engine_asks_and_tells_the_policy_by_part(tiny_target):
    """Prompt lookup where the context repeats, the oracle elsewhere: the engine asks for
    each round's length within the part's own k and reports the round to the same part."""
    hf, lm = tiny_target
    prompt = [1, 5, 9, 17, 33, 40, 5, 9]
    truth = hf_greedy(hf, prompt, 40)
    oracle = OracleDrafter(truth, len(prompt), lm.info.vocab_size, "always", k=2)
    recorder = _PartRecorder()
    pipe = SpeculativePipeline(
        FullVerifier(lm), StandardAcceptor(),
        drafter=FallbackDrafter(PLDDrafter(k=6, min_ngram=2), oracle),
        draft_length=recorder,
    )
    gen = generate(pipe, prompt, 40)
    assert gen.tokens == truth
    (rounds,) = recorder.rounds.values()
    assert len(rounds) == gen.stats.rounds
    for asked, part, drafted in rounds:
        if asked is None:  # one token left: nothing asked, a plain round
            assert drafted == 0
            continue
        assert asked[0] == part  # told about the part it was asked for
        assert asked[1] <= (6 if part == "first" else 2) and drafted <= asked[1]
    parts = Counter(part for asked, part, _ in rounds if asked is not None)
    assert set(parts) == {"first", "then"}
    assert max(asked[1] for asked, *_ in rounds if asked and asked[0] == "first") == 6
    # The request's counters per part add up to its totals.
    stats = gen.stats.parts
    assert {key: p.rounds for key, p in stats.items()} == Counter(p for _, p, _ in rounds)
    assert sum(p.drafted for p in stats.values()) == gen.stats.drafted
    assert sum(p.accepted for p in stats.values()) == gen.stats.accepted
    assert stats["then"].accepted == stats["then"].drafted  # the oracle is always right
    # plain rounds: only where one token was left (this recorder never asks for 0)
    assert sum(p.skipped for p in stats.values()) == sum(a is None for a, _, _ in rounds)


def test_in_a_batch_each_request_is_told_about_its_own_part(tiny_target):
    """Batch 2: one request copies its prompt (prompt lookup), the other has nothing to copy
    and its head part is asked for 0 (plain rounds): each plain round is reported under the
    part of the request it belongs to."""
    _, lm = tiny_target
    oracle = OracleDrafter([], 0, lm.info.vocab_size, "never", k=2)
    recorder = _PartRecorder(skip=("then",))
    pipe = SpeculativePipeline(
        FullVerifier(lm), StandardAcceptor(),
        drafter=FallbackDrafter(PLDDrafter(k=3, min_ngram=1), oracle),
        draft_length=recorder,
    )
    sched = Scheduler(pipe, 2, KVLayout(kind="contiguous"), max_context=64)
    # the plain request first: a part looked up by a stale index would be the other's
    results = sched.generate([SeqRequest([1, 2, 3], 4), SeqRequest([7] * 8, 4)])
    plain, copying = recorder.rounds.values()
    assert plain == [  # the limit: min(k, tokens left - 1); none asked with 1 left
        (("then", 2), "then", 0), (("then", 2), "then", 0), (("then", 1), "then", 0),
        (None, "then", 0),
    ]
    assert copying[0] == (("first", 3), "first", 1)  # 7 7 7 -> 7, the context's end
    assert results[0].generation.stats.parts == {"then": PartStats(4, 4, 0, 0)}


class _RecordingPolicy:
    """A fixed-k policy that records the draft seconds the engine reports."""

    def __init__(self) -> None:
        self.draft_s: list[float] = []

    def begin(self, state: DecodeState) -> None:
        pass

    def use_prices(self, prices) -> None:
        pass

    def choose(self, state: DecodeState, k_max: int, part: str = "") -> int:
        return k_max

    def observe(self, state, report: RoundReport) -> None:
        if report.drafted:  # rounds that drafted (the last round of a budget may not)
            self.draft_s.append(report.draft_s)


class _CatchingUpDrafter:
    """Proposes nothing useful; each proposal takes 5 clock ticks, 3 of them catch-up."""

    k = 2

    def __init__(self, clock_ticks: list[int]) -> None:
        self.clock_ticks = clock_ticks

    name = "catching_up"
    branches = 1

    def models(self):
        return []

    def uses(self):
        return []

    def observe(self, states, drafts, target_logits, verdicts) -> None:
        pass

    def begin(self, states: list[DecodeState]) -> None:
        pass

    def next_part(self, state):
        return DraftPart("", self.k, self.k)

    def propose(self, states: list[DecodeState], ks: list[int]) -> list[Draft]:
        self.clock_ticks[0] += 5
        return [Draft([0] * k, catchup_s=3.0) for k in ks]


def test_the_policy_sees_draft_time_without_the_drafters_catch_up(tiny_target):
    _, lm = tiny_target
    ticks = [0]

    def clock() -> float:
        return float(ticks[0])

    policy = _RecordingPolicy()
    pipe = SpeculativePipeline(
        FullVerifier(lm), StandardAcceptor(), drafter=_CatchingUpDrafter(ticks),
        draft_length=policy, clock=clock,
    )
    generate(pipe, [1, 5, 9], 7)
    assert policy.draft_s == [2.0] * len(policy.draft_s), policy.draft_s


def test_model_drafter_reports_its_catch_up(tiny_target):
    _, lm = tiny_target
    state = DecodeState(tokens=list(range(1, 40)), prompt_len=39, max_len=64, kv=KVStores())
    (draft,) = draft_with_model([state], lm, lm.info.num_layers, [2])
    assert len(draft.tokens) == 2 and draft.catchup_s > 0.0  # the lazy prefill of 38 tokens
    state.tokens += draft.tokens[:1]
    (again,) = draft_with_model([state], lm, lm.info.num_layers, [2])
    assert again.catchup_s == 0.0  # one position behind: it rides along the first step


def test_each_request_measures_t1_in_one_plain_round():
    """t1 is measured (a plain round early in every request), not derived from drafting
    rounds with a guessed beta: a drafter costing 0.5 t1 per token with beta = 0.5 and
    alpha = 0.5 loses to plain decoding, and the policy sees it."""
    policy = AdaptiveDraftLength(optimism=0.0)
    state = mid_request()
    policy.begin(state)
    assert policy.choose(state, 4) == 4  # first: measure drafting
    policy.observe(state, RoundReport(4, 1, 4 * 0.5 * T1, T1 * (1 + 0.5 * 4)))
    assert policy.choose(state, 4) == 0  # then: measure t1
    policy.observe(state, RoundReport(0, 0, 0.0, T1))
    model = policy.cost_model(state)
    assert model.t1 == T1 and model.t1_measured
    assert policy.choose(state, 4) == 0  # E[tokens|k] / cost < 1 / t1 for every k


def _policy_after_one_request(catchup_per_position: float) -> AdaptiveDraftLength:
    """A policy whose first request measured: drafting pays (every draft accepted, cheap
    draft steps), t1 = T1, and a drafter catch-up of ``catchup_per_position`` s/position."""
    policy = AdaptiveDraftLength(optimism=0.0, prior_strength=8.0)
    state = DecodeState(tokens=list(range(100)), prompt_len=100, max_len=400)
    policy.begin(state)
    policy.observe(state, RoundReport(4, 4, 4 * 0.001, T1 * 1.4,
                                      catchup_s=100 * catchup_per_position))
    policy.observe(state, RoundReport(0, 0, 0.0, T1))  # t1 measured
    return policy


@pytest.mark.parametrize(
    ("per_position", "max_new", "expected"),
    [
        (1e-4, 50, 4),  # catch-up 0.01 s: cheap next to 50 tokens of savings -> draft
        (5e-3, 50, 0),  # catch-up 0.5 s > what drafting can save on 50 tokens -> stay plain
        (5e-3, 2000, 4),  # ... but worth it over 2000 tokens
    ],
)
def test_a_cold_drafter_drafts_only_when_its_catch_up_pays_back(per_position, max_new, expected):
    policy = _policy_after_one_request(per_position)
    state = DecodeState(tokens=list(range(100)), prompt_len=100, max_len=100 + max_new + 2)
    policy.begin(state)
    policy.observe(state, RoundReport(0, 0, 0.0, T1))  # this request's t1 probe
    state.tokens.append(0)  # its token
    assert policy.choose(state, 4) == expected


@pytest.mark.parametrize("first_token_plain", [True, False])
def test_the_first_token_does_not_wait_for_a_drafters_catch_up(first_token_plain):
    """A drafter that would catch up first (here a cheap one that pays back) drafts from
    the request's second round: its first token comes after one target pass.  (Priced rows:
    without them, a request's first round with inherited timings is plain anyway, to
    measure t1.)"""
    policy = _policy_after_one_request(1e-4)
    policy.first_token_plain = first_token_plain
    policy.use_prices(FLAT_TO_6)
    state = DecodeState(tokens=list(range(100)), prompt_len=100, max_len=300)
    policy.begin(state)
    assert policy.choose(state, 4) == (0 if first_token_plain else 4)
    policy.observe(state, RoundReport(0, 0, 0.0, T1))
    state.tokens.append(0)
    assert policy.choose(state, 4) == 4


def test_a_drafter_without_a_catch_up_drafts_the_first_token():
    """Prompt lookup (no model: its rounds never report a catch-up), once measured in a
    request, drafts in the next request's first round; in the run's first request nothing
    says it needs no catch-up, so that first round is plain."""
    policy = AdaptiveDraftLength(optimism=0.0, prior_strength=8.0)
    policy.use_prices(FLAT_TO_6)
    first = DecodeState(tokens=list(range(100)), prompt_len=100, max_len=400)
    policy.begin(first)
    assert policy.choose(first, 4) == 0
    policy.observe(first, RoundReport(4, 4, 4 * 0.001, T1, rows=5, batch_rows=5))
    state = DecodeState(tokens=list(range(100)), prompt_len=100, max_len=400)
    policy.begin(state)
    assert policy.cost_model(state).t_catchup is None
    assert policy.choose(state, 4) == 4


@pytest.mark.parametrize(("prefill_per_position", "expected"), [(1e-4, 4), (4e-3, 0)])
def test_a_catch_up_is_priced_as_one_pass_over_the_positions_behind(prefill_per_position,
                                                                    expected):
    """c, the seconds per further position, comes from a long catch-up (the prefill of 100
    positions); a short catch-up's dearer positions (5 at 4 ms) do not stand for a long
    one's.  60 positions behind then cost t_draft + 59 c: with c = 0.1 ms (6.9 ms in all)
    drafting pays back over the 20 tokens left (about 5.6 ms saved a token); with c = 4 ms
    (0.237 s) it does not."""
    policy = AdaptiveDraftLength(optimism=0.0, ema=1.0)
    state = DecodeState(tokens=list(range(100)), prompt_len=100, max_len=400)
    policy.begin(state)
    model = policy.cost_model(state)
    policy.observe(state, RoundReport(4, 4, 4 * 0.001, T1 * 1.4,
                                      catchup_s=0.001 + 99 * prefill_per_position))
    assert model.t_catchup == pytest.approx(prefill_per_position)
    state.tokens += [0] * 5
    policy.observe(state, RoundReport(4, 4, 4 * 0.001, T1 * 1.4, catchup_s=5 * 0.004))
    assert model.t_catchup == pytest.approx(prefill_per_position)  # a short one: not refit
    policy.observe(state, RoundReport(0, 0, 0.0, T1))  # t1 measured
    state.tokens += [0] * 60
    state.max_len = len(state.tokens) + 21  # 20 tokens still allowed
    assert policy.choose(state, 4) == expected


def test_forget_drops_the_prior_a_request_would_inherit():
    """After ``forget`` (the runner's warm-up done) a request starts from nothing: no
    inherited times or acceptance: its first round is plain (the first token first: nothing
    says the drafter needs no catch-up), its second drafts the limit to measure."""
    policy = _policy_after_one_request(1e-4)
    inherited = DecodeState(tokens=list(range(100)), prompt_len=100, max_len=200)
    policy.begin(inherited)
    model = policy.cost_model(inherited)
    assert (model.t_draft, model.tried) == (pytest.approx(0.001), pytest.approx(4.0))
    policy.forget()
    fresh = DecodeState(tokens=list(range(100)), prompt_len=100, max_len=200)
    policy.begin(fresh)
    model = policy.cost_model(fresh)
    assert (model.t_draft, model.t1, model.t_catchup, model.tried) == (None, None, None, 0.0)
    assert policy.choose(fresh, 4) == 0
    policy.observe(fresh, RoundReport(0, 0, 0.0, T1))
    fresh.tokens.append(0)
    assert policy.choose(fresh, 4) == 4


def test_the_runners_warm_up_teaches_the_policy_nothing(tiny_target, tmp_path):
    """The warm-up's rounds go through the policy, then ``Pipeline.forget_requests``: the
    run's first request inherits nothing from it."""
    from specflow.results.records import RunMeta
    from specflow.results.run_folder import RunFolder
    from specflow.runner import Runner
    from specflow.sampling import SamplingParams
    from specflow.settings import RunSettings
    from specflow.workload import Request
    from tests.conftest import CharTokenizer

    _, lm = tiny_target
    seen: list[tuple[float | None, float | None]] = []
    forgotten: list[list[str]] = []

    class FirstRequestsPrior(AdaptiveDraftLength):
        def begin(self, state: DecodeState) -> None:
            super().begin(state)
            model = self.cost_model(state)
            seen.append((model.t_draft, model.t1))  # what the request inherited

        def forget(self) -> None:
            forgotten.append(sorted(self._last))  # the parts the warm-up taught
            super().forget()

    pipe = SpeculativePipeline(FullVerifier(lm), StandardAcceptor(), drafter=PLDDrafter(k=4),
                               draft_length=FirstRequestsPrior())
    settings = RunSettings(max_new_tokens=6, warmup=True, baseline=False)
    runner = Runner(pipe, CharTokenizer(), settings, SamplingParams())
    runner.run([Request("a", "qa", ("abcabcabc",))], RunFolder(tmp_path, resume=False),
               RunMeta(method="pld"))
    assert forgotten == [[""]]  # the warm-up's rounds taught the one part, then were dropped
    assert seen == [(None, None), (None, None)]  # the warm-up's request, the run's first


def test_re_probes_are_skipped_while_the_catch_up_is_too_expensive():
    """A useless model drafter: after `probe_every` plain rounds the policy re-probes only
    if catching the drafter up costs at most `probe_budget` of the remaining time."""
    for per_position, expect_probe in [(1e-5, True), (2e-2, False)]:
        policy = AdaptiveDraftLength(probe_every=4)
        state = DecodeState(tokens=list(range(100)), prompt_len=100, max_len=200)
        policy.begin(state)
        policy.observe(state, RoundReport(4, 0, 4 * T1, T1 * 1.4, catchup_s=100 * per_position))
        ks = []
        for _ in range(30):
            k = policy.choose(state, 4)
            ks.append(k)
            policy.observe(state, RoundReport(k, 0, T1 * k, T1 * (1 + 0.1 * k)))
            state.tokens.append(0)
        # behind by >= 4 positions since the last draft: 2e-2 s/position * 4 = 0.08 s > 5 %
        # of the remaining <= 95 tokens * 10 ms; 1e-5 s/position is always cheap enough
        assert (1 in ks) == expect_probe, ks


def test_beta_is_refit_against_the_latest_t1():
    """beta compares the drafting rounds' verification with the current t1: a verification
    measured after the context grew counts as a cost of drafting only until a plain round
    re-measures t1 at that context (exact numbers: ema = 1 keeps the latest measurement)."""
    policy = AdaptiveDraftLength(optimism=0.0, ema=1.0)
    state = mid_request()
    policy.begin(state)
    model = policy.cost_model(state)
    # t1 still derived: beta unchanged
    policy.observe(state, RoundReport(4, 1, 4 * 0.05 * T1, T1 * 1.4))
    assert model.beta == pytest.approx(0.1) and not model.t1_measured
    policy.observe(state, RoundReport(0, 0, 0.0, T1))  # t1 = T1: beta = (1.4 / 1 - 1) / 4
    assert model.beta == pytest.approx(0.1)
    # the context grew: every pass slower
    policy.observe(state, RoundReport(2, 1, 2 * 0.05 * T1, 1.5 * T1))
    assert model.beta == pytest.approx(0.25)  # against the old t1: (1.5 - 1) / 2
    policy.observe(state, RoundReport(0, 0, 0.0, 1.5 * T1))  # a plain round at the new context
    assert model.beta == 0.0  # (1.5 / 1.5 - 1) / 2: no marginal cost after all


def _rounds_until_it_drafts_again(idle_discount: float, limit: int = 60) -> int | None:
    """Ten failed one-token drafts, then plain rounds: the first round that drafts again
    (no re-probes: probe_every is out of reach), or None."""
    policy = AdaptiveDraftLength(probe_every=10**6, idle_discount=idle_discount, ema=1.0)
    state = mid_request()
    policy.begin(state)
    policy.observe(state, RoundReport(0, 0, 0.0, T1))  # t1 measured
    for _ in range(10):
        policy.observe(state, RoundReport(1, 0, 0.3 * T1, T1))  # rejected; beta = 0, a 0.3 t1 draft
    for r in range(limit):
        if policy.choose(state, 2) > 0:
            return r
        policy.observe(state, RoundReport(0, 0, 0.0, T1))
    return None


def test_idle_discount_lets_a_skipped_drafter_back_in():
    """Evidence fades while a drafter sits out (idle_discount < 1), so the optimistic prior
    brings it back after a few plain rounds; with 1 (the default) it waits for a re-probe."""
    assert _rounds_until_it_drafts_again(1.0) is None
    # 10 failed drafts leave 8.0 positions of evidence (discount 0.95), alpha 0.15 with
    # optimism; drafting pays once alpha > t_draft / t1 = 0.3 (beta 0), i.e. once the
    # evidence has faded to about 8.0 * 0.9^10 = 2.8 positions: the tenth plain round
    assert _rounds_until_it_drafts_again(0.9) == 10
    with pytest.raises(ConfigError, match="idle_discount"):
        AdaptiveDraftLength(idle_discount=0.0)


def _first_token_only(policy, rounds: int = 120) -> list[int]:
    """A drafter whose first draft token is always accepted and every later one rejected
    (a feature head after its first step, exaggerated): the k chosen each round."""
    state = mid_request()
    policy.begin(state)
    ks = []
    for _ in range(rounds):
        k = policy.choose(state, 4)
        ks.append(k)
        policy.observe(state, RoundReport(k, min(k, 1), k * 0.1 * T1, T1 * (1 + 0.1 * k)))
    return ks


def test_per_position_acceptance_stops_where_acceptance_stops():
    """The geometric model pools the first position (always accepted) with the second (never)
    into alpha = 1/2 and keeps drafting past the first token; per position, alpha_1 -> 1 and
    alpha_2 -> 0, so k = 1: 2 tokens for 1.2 steps, where k = 2 buys nothing for 0.2 more.
    (Two rounds of the 100 re-try a deeper position: its prior is the pooled rate, and the
    optimism bonus of a rarely tried position.)"""
    per_position = _first_token_only(AdaptiveDraftLength(acceptance="per_position"))
    assert Counter(per_position[20:]) == {1: 98, 2: 1, 3: 1}
    geometric = _first_token_only(AdaptiveDraftLength())
    assert Counter(geometric[20:]) == {2: 100}  # alpha = 1/2 pooled: one token too many
    with pytest.raises(ConfigError, match="acceptance"):
        AdaptiveDraftLength(acceptance="tree")


def test_expected_tokens_by_position():
    assert expected_tokens_by_position([0.5, 0.5, 0.5], 2) == pytest.approx(
        expected_tokens(0.5, 2))
    assert expected_tokens_by_position([1.0, 0.0, 1.0], 3) == 2.0
    assert expected_tokens_by_position([0.3, 0.2], 2) == pytest.approx(1 + 0.3 + 0.06)


def test_plain_decoding_with_a_policy(tiny_target):
    """No drafter, the default policy set (what a run's config builds for plain decoding):
    every round is a plain round, reported to the policy as one."""
    hf, lm = tiny_target
    prompt = [1, 5, 9, 17]
    recorder = _PartRecorder()
    pipe = SpeculativePipeline(FullVerifier(lm), StandardAcceptor(), draft_length=recorder)
    gen = generate(pipe, prompt, 6)
    assert gen.tokens == hf_greedy(hf, prompt, 6)
    assert list(recorder.rounds.values()) == [[(None, "", 0)] * 6]


# Priced rows: one pass costs a step up to 6 rows (the padding pays for them), then half a
# step a row more (8 rows: 2 steps, extrapolated beyond).
FLAT_TO_6 = RowPrices({1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0, 5: 1.0, 6: 1.0, 8: 2.0}, 1)


def _priced_rounds(policy, rounds: int, alpha_all: bool = True, width: int = 1,
                   others: int = 0) -> list[int]:
    """Synthetic rounds whose verification takes exactly ``T1 * FLAT_TO_6(rows)``: a draft of
    depth k verifies ``1 + width * k`` rows of its own, ``others`` rows of other requests."""
    state = mid_request()
    policy.begin(state)
    ks = []
    for _ in range(rounds):
        k = policy.choose(state, 8)
        ks.append(k)
        own = 1 + width * k
        policy.observe(state, RoundReport(k, k if alpha_all else 0, k * 0.001,
                       T1 * FLAT_TO_6(own + others), rows=own, batch_rows=own + others))
    return ks


def test_priced_rows_stop_a_perfect_drafter_where_rows_start_to_cost():
    """With the probe's prices, a drafter whose every token is accepted is asked for 5 (6
    verify rows, what a step pays for), not the cap of 8, and no round is a plain one:
    every round measures t1 as seconds over the price of its rows."""
    policy = AdaptiveDraftLength(row_prices=True)
    policy.use_prices(FLAT_TO_6)
    assert policy.prices is FLAT_TO_6
    ks = _priced_rounds(policy, 40)
    assert ks == [8] + [5] * 39
    state = mid_request()
    policy.begin(state)
    assert policy.choose(state, 8) == 5  # a new request: no plain round to measure t1
    assert policy.cost_model(state).t1 == pytest.approx(T1)
    unpriced = AdaptiveDraftLength(row_prices=False)
    unpriced.use_prices(FLAT_TO_6)
    assert unpriced.prices is None
    assert _priced_rounds(unpriced, 3)[1] == 0  # without prices: the plain round for t1


def test_priced_rows_count_a_trees_nodes_and_the_rest_of_the_batch():
    """A tree of 2 branches verifies 2 rows a depth: the perfect drafter is asked for depth
    2 (5 rows), not 5.  Beside 4 rows of other requests a chain of 1 fills the 6 rows a step
    pays for; t1 is the pass's seconds over the price of all its rows."""
    tree = AdaptiveDraftLength(row_prices=True)
    tree.use_prices(FLAT_TO_6)
    assert _priced_rounds(tree, 20, width=2)[1:] == [2] * 19
    batch = AdaptiveDraftLength(row_prices=True)
    batch.use_prices(FLAT_TO_6)
    assert _priced_rounds(batch, 20, others=4)[1:] == [1] * 19
    state = mid_request()
    batch.begin(state)
    assert batch.choose(state, 8) == 1  # a new request inherits the batch's other rows
    assert batch.cost_model(state, "then").others == 4.0  # and so does a new part
    # 8 rows: 2 steps
    batch.observe(state, RoundReport(3, 3, 0.003, T1 * 2.0, rows=4, batch_rows=8))
    assert batch.cost_model(state).t1 == pytest.approx(T1)


def test_priced_rows_still_skip_a_useless_drafter():
    """Its tokens cost 0.1 of a step each and are never accepted: after the first rounds
    only 1-token re-probes, costing under 2 % over plain decoding."""
    policy = AdaptiveDraftLength(row_prices=True)
    policy.use_prices(FLAT_TO_6)
    ks = _priced_rounds(policy, 200, alpha_all=False)
    tail = ks[50:]
    assert max(tail) <= 1 and sum(k == 0 for k in tail) >= 0.85 * len(tail)
    cost = sum(k * 0.001 + T1 * FLAT_TO_6(k + 1) for k in tail)
    assert cost <= 1.02 * T1 * len(tail)


class _ExitDrafter:
    """The oracle, declaring that it runs the target's first 2 layers (an early exit's
    ``uses``) unless ``reads_only`` (a feature head's)."""

    def __init__(self, oracle: OracleDrafter, lm, reads_only: bool) -> None:
        self.oracle, self.lm, self.reads_only = oracle, lm, reads_only
        self.name, self.k, self.branches = "exit", oracle.k, 1

    def __getattr__(self, member):
        return getattr(self.oracle, member)

    def uses(self):
        return [ModelUse(self.lm, 2, reads_only=self.reads_only)]


def test_the_engine_gives_prices_of_whole_passes_and_each_passs_rows(tiny_target):
    """The engine hands the policy the target verifier's prices as requests begin: none for
    a model never probed, none where a drafter runs the target's first layers (the verify
    pass is then partial), the probe's otherwise.  It reports each round's rows: at batch 2
    in lockstep, the request's own and both requests' together."""
    hf, lm = tiny_target
    prompt = [1, 5, 9, 17, 33, 5, 9]
    truth = hf_greedy(hf, prompt, 8)

    def prices_given(drafter) -> RowPrices | None:
        policy = AdaptiveDraftLength(row_prices=True)
        pipe = SpeculativePipeline(FullVerifier(lm), StandardAcceptor(), drafter=drafter,
                                   draft_length=policy)
        assert generate(pipe, prompt, 8).tokens == truth
        return policy.prices

    before = lm.row_probe
    try:
        lm.row_probe = None
        assert prices_given(PLDDrafter(k=3)) is None
        lm.row_probe = RowProbe({1: 1.0, 2: 1.5}, 1)
        oracle = OracleDrafter(truth, len(prompt), lm.info.vocab_size, "always", k=3)
        assert prices_given(PLDDrafter(k=3)) == RowPrices({1: 1.0, 2: 1.5}, lm.min_rows)
        assert prices_given(_ExitDrafter(oracle, lm, reads_only=True)) is not None
        assert prices_given(_ExitDrafter(oracle, lm, reads_only=False)) is None
    finally:
        lm.row_probe = before
    recorder = _RowsRecorder()
    pipe = SpeculativePipeline(FullVerifier(lm), StandardAcceptor(),
                               drafter=PLDDrafter(k=3, min_ngram=1), draft_length=recorder)
    sched = Scheduler(pipe, 2, KVLayout(kind="contiguous"), max_context=64)
    sched.generate([SeqRequest([7] * 8, 6), SeqRequest([7] * 8, 6)])
    first, second = recorder.rows.values()
    assert first == second and first
    assert all(rows == drafted + 1 and batch == 2 * rows for rows, batch, drafted in first)
    assert any(drafted > 0 for *_, drafted in first)


class _RowsRecorder:
    """Always the limit; per request, each round's (rows, batch_rows, drafted) the engine
    reports."""

    def __init__(self) -> None:
        self.rows: dict[int, list[tuple[int, int, int]]] = {}

    def begin(self, state: DecodeState) -> None:
        self.rows[id(state)] = []

    def use_prices(self, prices) -> None:
        pass

    def choose(self, state: DecodeState, limit: int, part: str = "") -> int:
        return limit

    def observe(self, state, report: RoundReport) -> None:
        self.rows[id(state)].append((report.rows, report.batch_rows, report.drafted))
