"""Drafter ``pool`` (MetaSD): heterogeneous drafters, one chosen per round by a bandit.

The arms are any drafters (an independent draft model, prompt lookup, early exits of the
target, a nested pipeline...).  Each round ``selector.select()`` picks arm i; only arm i
drafts (``draft_limit(arm, asked)`` = ``min(asked, arm.k)`` tokens; the pool's k is the
largest arm k).  After verification the engine calls ``observe`` and
the pool reports ``selector.update(i, reward)``, with a reward in [0, 1]:

- ``bd`` (block divergence, MetaSD's default; dense and never exactly 0 for a model
  drafter): over the m >= 1 positions of the draft (all scored by the target),

      BD = 1 - (1/m) sum_{j<m} TV(q_j, p_j),   TV(q, p) = 1/2 sum_v |q(v) - p(v)|

  q_j is the drafter's distribution (``Draft.probs``), one-hot on the draft token when it
  has none (greedy drafting, prompt lookup): then TV = 1 - p_j(x_j).  p_j is the target's
  warped distribution when sampling; in greedy mode the softmax of the target's logits
  at temperature 1.  An empty draft (no lookup match) scores 0.
- ``be`` (block efficiency): accepted / asked, with asked the draft length asked of the
  pool this round.
- ``rate`` (cost-aware): what the round committed per unit of time.  BD and BE count
  tokens per round, so a costly drafter (a 0.5B model: k draft steps of ~1/3 of a target
  step each, and its catch-up after idle rounds) wins over a free one (prompt lookup) that
  commits fewer tokens per round but more per second.  With ``draft_s`` the arm's seconds
  this round (its catch-up included: a switch costs) and ``verify_s`` the verification's,

      rate = (accepted + 1) * t_ref / (draft_s + verify_s),   reward = min(1, rate / rate_scale)

  ``t_ref`` is the shortest verification seen by this pool in the run (about one target
  step), so plain decoding rates about 1 and a round as productive as two plain steps
  about 2.  ``rate_scale`` maps rates into [0, 1]; its default, k + 1 (k: the pool's
  largest arm k), is the most a round can rate (``verify_s >= t_ref``), so no round is
  clipped and a long prompt-lookup copy counts in full.  A smaller scale clips the best
  rounds to 1 and widens the gaps between the arms' means (the same as a larger UCB c).

**Switch cost** (``switch_horizon = H``, with ``rate``): an arm whose model sessions are
behind (its lazy prefill, tokens committed while it sat idle) must catch up before it
drafts, a one-off cost the per-round reward only sees after it is paid.  Before each
choice the pool estimates it, ``C_i = behind_i * s_i`` (positions behind times the arm's
measured catch-up seconds per position; 0 until measured), and spreads it over H rounds
of the arm (``d_i``: its measured seconds per round): its rate over those rounds drops by
the share ``C_i / (H d_i + C_i)``, so the selector sees each arm's index lowered by

    penalty_i = mean_i * C_i / (H * d_i + C_i)        (``BanditStats.penalties``)

A 0.5B arm 1,200 prompt positions behind is then less likely to be tried for one round in
a request that prompt lookup serves well.  Measured on Spec-Bench with H = 8 it brought no
gain, so it is off by default.

Arms that did not draft fall behind: their model sessions miss the tokens committed
meanwhile.  They catch up lazily, when next chosen, in one block before drafting
(``specflow.catchup.catch_up`` per model the arm uses, timed with the requests' clock); the
pool counts those positions and seconds in ``RoundStats.catchup_tokens`` / ``catchup_s``
for rounds where the chosen arm was idle in the previous pool round (a switch).  Every
pool round appends the arm and its reward to ``RoundStats.arms`` / ``rewards``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from specflow.catchup import CatchUp, catch_up, positions_behind
from specflow.errors import ConfigError
from specflow.protocols import (
    BanditStats,
    Drafter,
    ModelUse,
    Selector,
    draft_limit,
)
from specflow.sampling import warp
from specflow.state import Acceptance, DecodeState, Draft, RequestLocal
from stages.drafters.base import ComposedDrafter

log = logging.getLogger(__name__)

REWARDS = ("bd", "be", "rate")


def block_divergence(
    draft_tokens: list[int], q: torch.Tensor | None, target_probs: torch.Tensor
) -> float:
    """``1 - mean_j TV(q_j, p_j)`` over the m draft positions (see module doc).

    Args:
        draft_tokens: the m draft tokens.
        q: ``[m, V]`` the drafter's distributions, or ``None`` (one-hot on the tokens).
        target_probs: ``[>= m, V]`` the target's distributions at the draft positions.
    """
    m = len(draft_tokens)
    if m == 0:
        return 0.0
    p = target_probs[:m].float()
    if q is None:
        idx = torch.tensor(draft_tokens, dtype=torch.long)
        tv = 1.0 - p[torch.arange(m), idx]  # TV(one-hot at x, p) = 1 - p(x)
    else:
        tv = 0.5 * (q[:m].float() - p).abs().sum(-1)
    return float(1.0 - tv.mean().clamp(0.0, 1.0))


def sync_arm(states: list[DecodeState], uses: list[ModelUse]) -> CatchUp:
    """Bring each request's sessions of an arm's ``uses`` up to its committed tokens
    (``catch_up`` per model, one batched forward each): positions processed per request and
    seconds, summed over the uses."""
    behind = [0] * len(states)
    seconds = 0.0
    for use in uses:
        done = catch_up(states, use.lm, use.exit_layer, window=use.context_window)
        behind = [a + b for a, b in zip(behind, done.behind, strict=True)]
        seconds += done.seconds
    return CatchUp(behind, seconds)


@dataclass
class PendingRound:
    """A drafted round awaiting its reward: the arm, the draft length asked of the pool,
    the arm's seconds (catch-up included) and when the pool's drafting ended."""

    arm: int
    asked: int
    draft_s: float
    drafted_at: float


@dataclass
class PoolRequest:
    """A pool's per-request data: the bandit statistics it selects from, the arm that
    drafted last (a switch means catching up), and the round awaiting a reward."""

    bandit: BanditStats
    last: int | None = None
    pending: PendingRound | None = None


class PoolDrafter(ComposedDrafter):
    """A pool of drafters with a per-round selector (see module doc).

    Args:
        drafters: the arms: a mapping name -> drafter (config order = arm index), or a list.
        selector: chooses the arm each round (``ucb``, ``discounted_ucb``, ``fixed``...).
        reward: ``bd`` (block divergence), ``be`` (block efficiency) or ``rate``
            (committed tokens per reference step of time; see module doc).
        rate_scale: for ``rate``: the rate that scores 1 (tokens per target step);
            ``None``: k + 1, the most a round can rate.
        switch_horizon: for ``rate``: the rounds over which an arm's catch-up is spread
            when weighing a switch to it (see module doc); ``None``: no switch cost.
        name: the drafter's name.

    The arms are its parts (``ComposedDrafter``: their models, sessions and ``begin``); it
    is one part for a draft-length policy (``next_part``), as the selector chooses the arm
    inside ``propose``, after the length is asked.
    """

    def __init__(
        self,
        drafters: Mapping[str, Drafter] | list[Drafter],
        selector: Selector,
        reward: str = "bd",
        rate_scale: float | None = None,
        switch_horizon: float | None = None,
        name: str = "pool",
    ) -> None:
        if isinstance(drafters, Mapping):
            self.arm_names = [str(n) for n in drafters]
            self.arms = list(drafters.values())
        else:
            self.arms = list(drafters)
            self.arm_names = [a.name for a in self.arms]
        if not self.arms:
            raise ConfigError("drafter.drafters is empty: a pool needs at least one drafter")
        for name_, arm in zip(self.arm_names, self.arms, strict=True):
            if not isinstance(arm, Drafter):
                raise ConfigError(
                    f"drafter.drafters.{name_} is not a drafter ({type(arm).__name__}); "
                    f"give a _target_ node such as stages.drafters.pld.PLDDrafter"
                )
        if not isinstance(selector, Selector):
            raise ConfigError(
                f"drafter.selector is not a selector ({type(selector).__name__}); "
                f"use e.g. selector=ucb"
            )
        if reward not in REWARDS:
            raise ConfigError(f"drafter.reward must be one of {list(REWARDS)}, got '{reward}'")
        if rate_scale is not None and rate_scale <= 0:
            raise ConfigError(f"drafter.rate_scale must be > 0 or null, got {rate_scale}")
        if switch_horizon is not None and (switch_horizon <= 0 or reward != "rate"):
            raise ConfigError(
                f"drafter.switch_horizon={switch_horizon} needs drafter.reward=rate and a "
                "value > 0 (rounds): the switch cost is weighed in the rate's units"
            )
        self.switch_horizon = switch_horizon
        self.selector = selector
        self.reward = reward
        self._step_s = math.inf  # t_ref: the shortest verification seen in the run (rate)
        self.name = name
        self.parts = tuple(self.arms)
        self.k = max(arm.k for arm in self.arms)
        self.branches = max(arm.branches for arm in self.arms)
        self.rate_scale = float(self.k + 1) if rate_scale is None else rate_scale
        self._uses = [arm.uses() for arm in self.arms]
        n = len(self.arms)
        # Per arm, measured over the run: catch-up seconds and positions; round seconds
        # (drafting without catch-up, plus verification) and rounds.
        self._catchup = [[0.0, 0] for _ in range(n)]
        self._rounds = [[0.0, 0] for _ in range(n)]
        self._request: RequestLocal[PoolRequest] = RequestLocal(
            lambda _state: PoolRequest(self.selector.begin(len(self.arms)))
        )

    def begin(self, states: list[DecodeState]) -> None:
        """New requests: every arm prefills, each request's selector statistics start
        (fresh: MetaSD resets per request; or the run's, with ``reset=False``)."""
        super().begin(states)
        for st in states:
            self._request.set(st, PoolRequest(self.selector.begin(len(self.arms))))

    def propose(self, states: list[DecodeState], asked: list[int]) -> list[Draft]:
        """Each request's selector picks its arm; each arm drafts for its requests at once."""
        groups: dict[int, list[int]] = {}
        for i, st in enumerate(states):
            bandit = self._request.get(st).bandit
            if self.switch_horizon is not None:
                bandit.penalties = self._switch_penalties(st, bandit)
            arm = self.selector.select(bandit)
            groups.setdefault(arm, []).append(i)
        drafts: dict[int, Draft] = {}  # request index -> its arm's draft (its own object)
        clock = states[0].clock
        began: dict[int, tuple[float, float]] = {}  # arm -> (start, end) of its drafting
        for arm, idx in groups.items():
            start = clock()
            drafter = self.arms[arm]
            switched = [i for i in idx if self._request.get(states[i]).last != arm]
            sync = CatchUp([0] * len(switched))
            if switched and self._uses[arm]:
                sync = sync_arm([states[i] for i in switched], self._uses[arm])
                for i, n in zip(switched, sync.behind, strict=True):
                    states[i].stats.catchup_tokens += n
                    states[i].stats.catchup_s += sync.seconds
                if sum(sync.behind) > 0:
                    self._catchup[arm][0] += sync.seconds
                    self._catchup[arm][1] += sum(sync.behind)
            out = drafter.propose(
                [states[i] for i in idx], [draft_limit(drafter, asked[i]) for i in idx]
            )
            for i, draft in zip(idx, out, strict=True):
                if i in switched:
                    draft.catchup_s += sync.seconds
                draft.part = ""  # the pool is one part (next_part): an arm's parts stay inside
                drafts[i] = draft
            began[arm] = (start, clock())
        end = clock()
        for arm, idx in groups.items():
            for i in idx:
                mine = self._request.get(states[i])
                mine.last = arm
                mine.pending = PendingRound(arm, asked[i], began[arm][1] - began[arm][0], end)
        return [drafts[i] for i in range(len(states))]

    def _switch_penalties(self, state: DecodeState, bandit: BanditStats) -> list[float]:
        """``mean_i * C_i / (H d_i + C_i)`` per arm (module doc); 0 for the arm that drafted
        last, an arm without models, or one whose costs are not measured yet."""
        last = self._request.get(state).last
        out = []
        for arm, uses in enumerate(self._uses):
            (c_s, c_n), (r_s, r_n) = self._catchup[arm], self._rounds[arm]
            if arm == last or not uses or c_n == 0 or r_n == 0 or bandit.counts[arm] <= 0:
                out.append(0.0)
                continue
            behind = max(positions_behind(state, use.lm, use.exit_layer, use.context_window)
                         for use in uses)
            cost = behind * c_s / c_n
            mean = bandit.sums[arm] / bandit.counts[arm]
            horizon = self.switch_horizon or 0.0
            out.append(mean * cost / (horizon * r_s / r_n + cost) if cost > 0 else 0.0)
        return out

    def observe(
        self,
        states: list[DecodeState],
        drafts: list[Draft],
        target_logits: list[torch.Tensor],
        verdicts: list[Acceptance],
    ) -> None:
        """Each drafting request's reward for its arm (engine hook after the acceptor)."""
        now = states[0].clock() if states else 0.0  # the round's verification has ended
        for st, draft, logits, verdict in zip(states, drafts, target_logits, verdicts, strict=True):
            self._reward(st, draft, logits, verdict, now)

    def _reward(
        self,
        state: DecodeState,
        draft: Draft,
        target_logits: torch.Tensor,
        verdict: Acceptance,
        now: float,
    ) -> None:
        mine = self._request.get(state)
        if mine.pending is None:
            return
        arm, asked = mine.pending.arm, mine.pending.asked
        draft_s, drafted_at = mine.pending.draft_s, mine.pending.drafted_at
        mine.pending = None
        drafted = len(draft.tokens)
        if self.reward == "be":
            reward = verdict.num_accepted / asked
        elif self.reward == "rate":
            verify_s = max(now - drafted_at, 1e-9)  # the verification (and acceptance)
            self._step_s = min(self._step_s, verify_s)
            self._rounds[arm][0] += max(0.0, draft_s - draft.catchup_s) + verify_s
            self._rounds[arm][1] += 1
            rate = (verdict.num_accepted + 1) * self._step_s / (draft_s + verify_s)
            reward = min(1.0, rate / self.rate_scale)
        elif draft.parents is not None:  # a tree (greedy): its top-1 chain, on its rows
            chain = draft.first_chain()
            rows = [0, *(i + 1 for i in chain[:-1])]  # the target's row before each node
            p = target_logits[rows].float().softmax(-1)  # temperature 1
            reward = block_divergence([draft.tokens[i] for i in chain], None, p)
        elif state.sampling.greedy:
            p = target_logits[:drafted].float().softmax(-1)  # temperature 1
            reward = block_divergence(draft.tokens, draft.probs, p)
        else:
            p = warp(target_logits[:drafted], state.sampling)
            reward = block_divergence(draft.tokens, draft.probs, p)
        self.selector.update(mine.bandit, arm, reward)
        state.stats.arms.append(arm)
        state.stats.rewards.append(reward)
        log.debug("pool round: arm %d (%s) reward %.3f", arm, self.arm_names[arm], reward)
