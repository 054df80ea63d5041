"""Drafter ``pool`` (MetaSD): heterogeneous drafters, one chosen per round by a bandit.

The arms are any drafters (an independent draft model, prompt lookup, early exits of the
target, a nested pipeline...).  Each round ``selector.select()`` picks arm i; only arm i
drafts (``min(arm.k, k)`` tokens).  After verification the engine calls ``observe`` and
the pool reports ``selector.update(i, reward)``, with a reward in [0, 1]:

- ``bd`` (block divergence, MetaSD's default; dense and never exactly 0 for a model
  drafter): over the m >= 1 positions of the draft (all scored by the target),

      BD = 1 - (1/m) sum_{j<m} TV(q_j, p_j),   TV(q, p) = 1/2 sum_v |q(v) - p(v)|

  q_j is the drafter's distribution (``Draft.probs``), one-hot on the draft token when it
  has none (greedy drafting, prompt lookup): then TV = 1 - p_j(x_j).  p_j is the target's
  warped distribution when sampling; in greedy mode the softmax of the target's logits
  at temperature 1.  An empty draft (no lookup match) scores 0.
- ``be`` (block efficiency): accepted / k, with k the draft length asked of the pool.

Arms that did not draft fall behind: their model sessions miss the tokens committed
meanwhile.  They catch up lazily, when next chosen, in one block (before drafting); the
pool counts those positions and seconds in ``RoundStats.catchup_tokens`` / ``catchup_s``
for rounds where the chosen arm was idle in the previous pool round (a switch).  Every
pool round appends the arm and its reward to ``RoundStats.arms`` / ``rewards``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

import torch

from specflow.errors import ConfigError
from specflow.models.base import LayeredLM, ModelInfo
from specflow.protocols import Drafter, Selector
from specflow.sampling import warp
from specflow.state import Acceptance, DecodeState, Draft

log = logging.getLogger(__name__)

REWARDS = ("bd", "be")


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


def arm_sessions(arm: Any) -> list[tuple[LayeredLM, int]]:
    """``(model, exit layer)`` of every model session an arm drafts with (for catch-up).

    A model drafter exposes ``lm`` (and ``exit_layer``), a layer-skip drafter ``view``, a
    nested pipeline its ``target_verifier.lm`` and, recursively, its drafter's sessions.
    """
    out: list[tuple[LayeredLM, int]] = []
    for attr in ("lm", "view"):
        lm = getattr(arm, attr, None)
        if lm is not None and hasattr(lm, "info"):
            out.append((lm, getattr(arm, "exit_layer", None) or lm.info.num_layers))
    verifier = getattr(arm, "target_verifier", None)
    lm = getattr(verifier, "lm", None)
    if lm is not None:
        out.append((lm, lm.info.num_layers))
    inner = getattr(arm, "drafter", None)
    if inner is not None:
        out += arm_sessions(inner)
    return out


def catch_up(state: DecodeState, sessions: list[tuple[LayeredLM, int]]) -> int:
    """Bring each session up to the committed tokens (all but the last, as prefill does).

    Returns the number of positions processed at layer 0 (summed over the sessions).
    """
    end = len(state.tokens) - 1
    behind = 0
    for lm, exit_layer in sessions:
        session = state.session(lm)
        session.set_tokens(state.tokens)
        behind += max(0, end - session.computed(0))
        if end > 0:
            session.hidden(exit_layer, end)
    return behind


class PoolDrafter:
    """A pool of drafters with a per-round selector (see module doc).

    Args:
        drafters: the arms: a mapping name -> drafter (config order = arm index), or a list.
        selector: chooses the arm each round (``ucb``, ``discounted_ucb``, ``fixed``...).
        reward: ``bd`` (block divergence) or ``be`` (block efficiency).
        name: the drafter's name.
    """

    def __init__(
        self,
        drafters: Mapping[str, Drafter] | list[Drafter],
        selector: Selector,
        reward: str = "bd",
        name: str = "pool",
    ) -> None:
        if isinstance(drafters, Mapping):
            self.arm_names = [str(n) for n in drafters]
            self.arms = list(drafters.values())
        else:
            self.arms = list(drafters)
            self.arm_names = [getattr(a, "name", f"arm{i}") for i, a in enumerate(self.arms)]
        if not self.arms:
            raise ConfigError("drafter.drafters is empty: a pool needs at least one drafter")
        for name_, arm in zip(self.arm_names, self.arms, strict=True):
            if not isinstance(arm, Drafter):
                raise ConfigError(
                    f"drafter.drafters.{name_} is not a drafter ({type(arm).__name__}); "
                    f"give a _target_ node such as stages.pld_drafter.PLDDrafter"
                )
        if not isinstance(selector, Selector):
            raise ConfigError(
                f"drafter.selector is not a selector ({type(selector).__name__}); "
                f"use e.g. selector=ucb"
            )
        if reward not in REWARDS:
            raise ConfigError(f"drafter.reward must be one of {list(REWARDS)}, got '{reward}'")
        self.selector = selector
        self.reward = reward
        self.name = name
        self.k = max(arm.k for arm in self.arms)
        self._sessions = [arm_sessions(arm) for arm in self.arms]

    def models(self) -> list[ModelInfo]:
        infos: list[ModelInfo] = []
        for arm in self.arms:
            infos += arm.models()
        return infos

    def begin(self, state: DecodeState) -> None:
        """A new request: every arm prefills, the selector forgets (MetaSD resets per request)."""
        for arm in self.arms:
            arm.begin(state)
        self.selector.begin(len(self.arms))
        state.scratch[id(self)] = {"pending": None, "last": None}

    def propose(self, state: DecodeState, k: int) -> Draft:
        mine = state.scratch[id(self)]
        arm = self.selector.select()
        drafter = self.arms[arm]
        catchup_s = 0.0
        if mine["last"] != arm and self._sessions[arm]:
            t0 = time.perf_counter()
            behind = catch_up(state, self._sessions[arm])
            catchup_s = time.perf_counter() - t0
            state.stats.catchup_tokens += behind
            state.stats.catchup_s += catchup_s
        mine["last"] = arm
        mine["pending"] = (arm, k)
        draft = drafter.propose(state, min(drafter.k, k))
        draft.catchup_s += catchup_s
        return draft

    def observe(
        self, state: DecodeState, draft: Draft, target_logits: torch.Tensor, verdict: Acceptance
    ) -> None:
        """The reward of the round's arm (engine hook after the acceptor)."""
        mine = state.scratch[id(self)]
        if mine["pending"] is None:
            return
        arm, k = mine["pending"]
        mine["pending"] = None
        if self.reward == "be":
            reward = verdict.num_accepted / k
        elif state.sampling.greedy:
            p = target_logits[: draft.k].float().softmax(-1)  # temperature 1
            reward = block_divergence(draft.tokens, draft.probs, p)
        else:
            p = warp(target_logits[: draft.k], state.sampling)
            reward = block_divergence(draft.tokens, draft.probs, p)
        self.selector.update(arm, reward)
        state.stats.arms.append(arm)
        state.stats.rewards.append(reward)
        log.debug("pool round: arm %d (%s) reward %.3f", arm, self.arm_names[arm], reward)
