"""The round's contract, each concept declared once: the draft length (one cap, ``k`` /
asked / drafted), the one lossless acceptor, one catch-up timed with the pipeline's clock,
and an engine and a scheduler that do not import each other."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

from specflow import drafting
from specflow.catchup import catch_up
from specflow.costs import RowPrices
from specflow.drafting import draft_with_model
from specflow.engine import SpeculativePipeline
from specflow.errors import ConfigError
from specflow.kv.session import forward_exit_hidden
from specflow.kv.stores import KVStores
from specflow.protocols import DraftPart, Pipeline, draft_limit
from specflow.scheduler import generate
from specflow.state import DecodeState, Draft
from stages.acceptors.standard import StandardAcceptor
from stages.drafters.fallback import FallbackDrafter
from stages.drafters.model import ModelDrafter
from stages.drafters.pld import PLDDrafter
from stages.drafters.pool import PoolDrafter
from stages.selectors.fixed import FixedSelector
from stages.verifiers.early_exit import EarlyExitVerifier
from stages.verifiers.full import FullVerifier
from tests.conftest import hf_greedy

ROOT = Path(__file__).resolve().parents[1]
PROMPT = [1, 5, 9, 17, 33, 5, 9, 17]


class Ticks:
    """A deterministic clock: every reading is one second after the previous one."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


class Asked:
    """A model-free drafter proposing ``asked[i]`` copies of token 0 and recording each
    call's ``asked`` (``None`` tokens: propose nothing)."""

    name = "asked"
    branches = 1

    def __init__(self, k: int, token: int | None = 0) -> None:
        self.k = k
        self.token = token
        self.calls: list[list[int]] = []

    def begin(self, states):
        pass

    def models(self):
        return []

    def uses(self):
        return []

    def observe(self, states, drafts, target_logits, verdicts):
        pass

    def next_part(self, state):
        return DraftPart("", self.k, self.k)

    def propose(self, states, asked):
        self.calls.append(list(asked))
        return [Draft([] if self.token is None else [self.token] * n) for n in asked]


class Spy:
    """A target verifier recording how many tokens each draft it scores has."""

    def __init__(self, verifier: FullVerifier) -> None:
        self.inner = verifier
        self.info = verifier.info
        self.scored: list[int] = []

    def uses(self):
        return self.inner.uses()

    def begin(self, states):
        self.inner.begin(states)

    def row_prices(self, states):
        return self.inner.row_prices(states)

    def score(self, states, drafts):
        self.scored += [len(d.tokens) for d in drafts]
        return self.inner.score(states, drafts)


def _state(tokens: list[int], clock=None) -> DecodeState:
    kw = {} if clock is None else {"clock": clock}
    return DecodeState(tokens=list(tokens), prompt_len=len(tokens), max_len=64, kv=KVStores(),
                       **kw)


# ---------------------------------------------------------------- engine <-> scheduler
# (that they never import each other is tests/test_layering.py's circle check)
def test_the_pipeline_is_what_the_scheduler_runs(tiny_target):
    _, lm = tiny_target
    assert isinstance(SpeculativePipeline(FullVerifier(lm), StandardAcceptor()), Pipeline)


# ---------------------------------------------------------------- the draft length
def test_max_draft_len_is_the_drafters_k(tiny_target):
    _, lm = tiny_target
    plain = SpeculativePipeline(FullVerifier(lm), StandardAcceptor())
    assert plain.max_draft_len == 0 and plain.k is None
    pld = SpeculativePipeline(FullVerifier(lm), StandardAcceptor(), PLDDrafter(k=5))
    assert pld.max_draft_len == 5
    both = FallbackDrafter(PLDDrafter(k=3), Asked(k=6))
    assert SpeculativePipeline(FullVerifier(lm), StandardAcceptor(), both).max_draft_len == 6
    hispec = SpeculativePipeline(
        FullVerifier(lm), StandardAcceptor(), drafter=ModelDrafter(lm, k=7, exit_layer=1),
        intermediate_verifier=EarlyExitVerifier(lm, exit_layer=2, accumulate=3),
    )
    assert hispec.max_draft_len == 3  # the intermediate level's accumulated tokens


def test_rounds_ask_within_the_cap_and_verify_what_was_drafted(tiny_target):
    """asked_i = min(k, budget_i - 1) without a policy; the verifier sees d_i <= asked_i."""
    hf, lm = tiny_target
    spy = Spy(FullVerifier(lm))
    pipe = SpeculativePipeline(spy, StandardAcceptor(), drafter=Asked(k=4))
    gen = generate(pipe, PROMPT, 10)
    assert gen.tokens == hf_greedy(hf, PROMPT, 10)
    left = 10  # the round's budget: tokens still to generate
    stats = gen.stats
    for asked, drafted, accepted in zip(stats.asked_per_round, stats.drafted_per_round,
                                        stats.accepted_per_round, strict=True):
        assert asked == min(4, left - 1) == drafted
        left -= accepted + 1
    assert spy.scored == gen.stats.drafted_per_round
    assert max(spy.scored) <= pipe.max_draft_len


def test_draft_limit_is_the_one_cap():
    drafter = Asked(k=3)
    assert [draft_limit(drafter, n) for n in (0, 1, 3, 9)] == [0, 1, 3, 3]


def test_a_fallback_asks_each_part_within_its_own_k():
    first, then = Asked(k=2, token=None), Asked(k=5)
    fallback = FallbackDrafter(first, then)
    drafts = fallback.propose([_state([1, 2, 3]), _state([4, 5, 6])], [4, 1])
    assert first.calls == [[2, 1]] and then.calls == [[4, 1]]
    assert [len(d.tokens) for d in drafts] == [4, 1]


def test_a_pool_asks_its_arm_within_the_arms_k_and_returns_one_draft_per_request():
    small, big = Asked(k=2), Asked(k=6)
    pool = PoolDrafter({"small": small, "big": big}, FixedSelector(arm=0))
    assert pool.k == 6
    states = [_state([1, 2, 3]), _state([4, 5, 6]), _state([7, 8, 9])]
    for st in states:
        pool.begin([st])
    drafts = pool.propose(states, [5, 1, 2])
    assert small.calls == [[2, 1, 2]] and big.calls == []
    assert len({id(d) for d in drafts}) == len(states)  # no object shared between requests


def test_a_nested_pipeline_without_k_is_refused(tiny_target, tiny_drafter):
    _, lm = tiny_target
    _, draft_lm = tiny_drafter
    nested = SpeculativePipeline(FullVerifier(draft_lm), StandardAcceptor(), PLDDrafter(k=3))
    with pytest.raises(ConfigError, match=r"drafter\.k=None.*set drafter\.k="):
        SpeculativePipeline(FullVerifier(lm), StandardAcceptor(), drafter=nested)
    with pytest.raises(ConfigError, match=r"k=0.*must be >= 1"):
        SpeculativePipeline(FullVerifier(draft_lm), StandardAcceptor(), level="draft", k=0)


# ---------------------------------------------------------------- the lossless acceptor
@pytest.mark.parametrize("name", ["exact", "rejection"])
def test_both_lossless_configs_are_the_one_acceptor(name):
    acceptor = instantiate(OmegaConf.load(ROOT / "conf" / "acceptor" / f"{name}.yaml"))
    assert type(acceptor) is StandardAcceptor and acceptor.lossless
    if name == "exact":
        with pytest.raises(ConfigError, match="acceptor=exact is greedy-only"):
            acceptor.check(greedy=False)
    else:
        acceptor.check(greedy=False)
    acceptor.check(greedy=True)


def test_every_acceptor_config_is_the_lossless_class_or_fly():
    """No second lossless class behind any config (acceptors, nested pipelines)."""
    found = []
    for path in sorted((ROOT / "conf").rglob("*.yaml")):
        text = path.read_text()
        found += [line.split(":", 1)[1].split("#")[0].strip() for line in text.splitlines()
                  if "_target_:" in line and "Acceptor" in line]
    assert found
    assert set(found) <= {"stages.acceptors.standard.StandardAcceptor",
                          "stages.acceptors.fly.FlyAcceptor"}


# ---------------------------------------------------------------- one catch-up, one clock
def test_catch_up_is_timed_with_the_requests_clock(tiny_target):
    _, lm = tiny_target
    states = [_state(list(range(1, 20)), Ticks()), _state([3, 4], Ticks())]
    done = catch_up(states, lm, lm.info.num_layers)
    assert done.behind == [18, 1] and done.seconds == 1.0  # one reading after another
    again = catch_up(states, lm, lm.info.num_layers)
    assert again.behind == [0, 0] and again.seconds == 0.0  # nothing to do, nothing timed
    states[0].tokens.append(7)
    assert catch_up(states, lm, lm.info.num_layers, slack=1).behind == [0, 0]


def test_a_drafters_catch_up_rides_along_its_first_step(tiny_target, monkeypatch):
    """The lazy prefill (38 positions) and the first drafting step are one pass of 39 rows,
    timed once with the requests' clock (1 tick); the catch-up's share of it is what the
    step's single row would not have cost: 1 - 1/39 without row prices, 1 - price(1) /
    price(39) with the drafter's own."""
    _, lm = tiny_target
    passes = []
    monkeypatch.setattr(drafting, "forward_exit_hidden",
                        lambda queries: passes.append(queries) or forward_exit_hidden(queries))
    state = _state(list(range(1, 40)), Ticks())
    (draft,) = draft_with_model([state], lm, lm.info.num_layers, [2])
    assert len(draft.tokens) == 2 and len(passes) == 2  # the catch-up needed no pass of its own
    assert draft.catchup_s == 1.0 - 1.0 / 39.0
    prices = RowPrices({1: 1.0, 2: 1.5, 40: 7.0}, 1)  # price(39) = 1 + 6 * 37/38 + 0.5
    monkeypatch.setattr(drafting, "row_prices", lambda model: prices)
    again = _state(list(range(1, 40)), Ticks())
    (draft,) = draft_with_model([again], lm, lm.info.num_layers, [2])
    assert draft.catchup_s == pytest.approx(1.0 - 1.0 / prices(39), abs=1e-12)
    assert draft.tokens == [7, 125]  # the same tokens whichever way the time is split


def test_a_pool_times_an_arms_catch_up_with_the_requests_clock(tiny_target, tiny_drafter):
    _, lm = tiny_target
    _, draft_lm = tiny_drafter
    pool = PoolDrafter([ModelDrafter(draft_lm, k=2)], FixedSelector(arm=0))
    state = _state(list(range(1, 30)), Ticks())
    pool.begin([state])
    (draft,) = pool.propose([state], [2])
    assert state.stats.catchup_tokens == 28 and state.stats.catchup_s == 1.0
    assert draft.catchup_s == 1.0  # the pool's switch; the arm itself is then up to date


class _RecordingPolicy:
    """Always the limit; records the draft and catch-up seconds the engine reports."""

    def __init__(self) -> None:
        self.draft_s: list[float] = []
        self.catchup_s: list[float] = []

    def begin(self, state):
        pass

    def use_prices(self, prices):
        pass

    def choose(self, state, limit, part=""):
        return limit

    def observe(self, state, report):
        if report.drafted:
            self.draft_s.append(report.draft_s)
            self.catchup_s.append(report.catchup_s)


def test_the_engine_subtracts_catch_up_seconds_of_its_own_clock(tiny_target, tiny_drafter):
    """With a ticking clock every stage time is a whole number of ticks: a drafter's
    catch-up read from another counter would not add up with the policy's draft_s to the
    proposal's ticks."""
    _, lm = tiny_target
    _, draft_lm = tiny_drafter
    policy = _RecordingPolicy()
    pipe = SpeculativePipeline(FullVerifier(lm), StandardAcceptor(), ModelDrafter(draft_lm, k=3),
                               draft_length=policy, clock=Ticks())
    gen = generate(pipe, PROMPT, 12)
    assert gen.stats.drafted > 0
    # the first round: t0, the first step's two readings (the lazy prefill of 7 positions
    # rides along: 8 rows, 1 of them the step's), t1 -> 3 ticks, 7/8 of one of them catch-up
    assert policy.catchup_s[0] == 7.0 / 8.0
    assert policy.draft_s[0] == 3.0 - 7.0 / 8.0
    # later rounds: one position behind, no catch-up, whole ticks
    assert policy.catchup_s[1:] == [0.0] * (len(policy.catchup_s) - 1)
    assert all(s == int(s) for s in policy.draft_s[1:])
