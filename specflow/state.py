"""Decoding state and the glossary every stage and metric uses.

Glossary (the one place these terms are defined; the README's "What a run writes" uses
them):

- **round**: one draft -> (intermediate verify) -> target verify -> accept cycle.  Plain
  decoding is a pipeline whose rounds draft nothing (asked = 0).
- **k** (config ``drafter.k``): a drafter's maximum draft length, the most tokens it
  proposes in one round (``Drafter.k``; a pipeline's rounds verify at most its drafter's k,
  ``SpeculativePipeline.max_draft_len``).
- **asked**: the draft length a round asks of the drafter for one request:
  ``0 <= asked <= min(k, budget - 1)`` (``budget - 1``: the round's bonus token must still
  fit ``max_new_tokens``), chosen by the draft-length policy (``RoundStats.asked_per_round``).
- **drafted**: the tokens the drafter proposed, ``len(Draft.tokens) <= asked`` (a lookup may
  find fewer; a drafter may stop when unsure).  A tree draft (``Draft.parents``) counts all
  its nodes, up to ``branches * asked``; its depth (``Draft.depth``) is ``<= asked``.
- **accepted tokens**: draft tokens the acceptor keeps in a round (0..drafted).
- **bonus / correction token**: the one token the target contributes each round: its own
  choice at the first rejected position (correction), or after the last draft token when
  all drafted tokens are accepted (bonus).  Every round therefore commits ``accepted + 1`` tokens
  (fewer only when EOS or ``max_new_tokens`` cuts the round short).
- **tau (mean accepted length)**: tokens the acceptor commits per target-verifier call,
  bonus included: ``tau = 1 + accepted / rounds``.  Plain decoding has tau = 1.00.  It
  counts the acceptor's decisions, before a stop (EOS / max_new_tokens) truncates a round.
- **acceptance rate**: accepted / drafted.
- **speedup**: tokens/s of a method / tokens/s of plain decoding of the same target, same
  machine, same prompts, measured in the same run.
- **fidelity**: the fraction of requests whose output equals plain greedy decoding exactly
  (a lossless method: 1.0).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, TypeVar, cast

import torch

from specflow.kv.tree import TreeLayout
from specflow.sampling import SamplingParams

if TYPE_CHECKING:
    from specflow.kv.base import LayeredLM
    from specflow.kv.session import ModelSession
    from specflow.kv.stores import KVStores

T = TypeVar("T")


@dataclass
class Draft:
    """What a drafter proposes in one round.

    Attributes:
        tokens: the proposed token ids (``drafted = len(tokens) <= asked``, see the glossary).
        probs: ``[drafted, V]`` the drafter's (warped) distributions q the tokens were
            sampled from, or ``None`` for a deterministic drafter (greedy argmax, prompt
            lookup): q is then one-hot on each token.
        catchup_s: seconds of the proposal spent bringing the drafter's own cache up to the
            committed tokens (its lazy prefill, the tokens committed since it last ran),
            read from ``DecodeState.clock`` like every stage time; where the catch-up rode
            along in the first drafting step's pass (a model drafter), that pass's share of
            it by the drafter's row prices (``specflow.drafting.draft_with_model``).  A cost
            of syncing, not of drafting: draft-length policies subtract it to measure the
            per-token drafting cost.
        parents: ``None`` for a chain (token i continues token i-1); for a *tree* draft
            (greedy only), node i's parent node (-1: it continues the last committed token),
            ``parents[i] < i``: ``tokens`` are the nodes in topological order and
            ``drafted`` counts them all.  The target verifies every node in one forward
            (``ModelSession.set_tree``) and the acceptor keeps one root-to-node path
            (``Acceptance.path``).
        part: the key of the drafter's part that drafted it (``DraftPart.key``; ``""``
            for a drafter of one part), what a draft-length policy keeps its evidence by.
    """

    tokens: list[int]
    probs: torch.Tensor | None = None
    catchup_s: float = 0.0
    parents: list[int] | None = None
    part: str = ""

    @property
    def depth(self) -> int:
        """The longest path of the draft: ``drafted`` for a chain, the tree's depth for a
        tree (the most draft tokens one round can accept; what a draft-length policy
        asked for)."""
        if self.parents is None:
            return len(self.tokens)
        return 1 + max(TreeLayout(0, tuple(self.parents)).depths, default=-1)

    def first_chain(self) -> list[int]:
        """Node indices of the chain of first children from the first root (a chain: every
        token): the tree's top-1 path, the drafter's own best guess."""
        if self.parents is None:
            return list(range(len(self.tokens)))
        chain: list[int] = []
        parent = -1
        while (nxt := next((i for i, p in enumerate(self.parents) if p == parent), None)) \
                is not None:
            chain.append(nxt)
            parent = nxt
        return chain

    def accepted_tokens(self, verdict: Acceptance) -> list[int]:
        """The draft tokens ``verdict`` keeps, in order (a chain's prefix, or a tree's
        path)."""
        if verdict.path is None:
            return self.tokens[: verdict.num_accepted]
        return [self.tokens[i] for i in verdict.path]


@dataclass
class Acceptance:
    """An acceptor's verdict on one round.

    Attributes:
        num_accepted: how many leading draft tokens are kept (0..drafted; for a tree, the
            length of the kept path).
        next_token: the bonus / correction token the target contributes.
        path: for a tree draft, the kept nodes root-level first (``len(path) ==
            num_accepted``); ``None`` for a chain.
    """

    num_accepted: int
    next_token: int
    path: list[int] | None = None


@dataclass(frozen=True)
class RoundReport:
    """What one request's round did, as its draft-length policy sees it
    (``DraftLengthPolicy.observe``).

    Attributes:
        drafted: tokens drafted (a tree: its depth; 0: a plain round).
        accepted: draft tokens kept (``Acceptance.num_accepted``).
        draft_s: seconds drafting, without the drafter's catch-up.
        verify_s: seconds of the target's verification pass.
        catchup_s: seconds the drafter spent catching up (lazy prefill, tokens committed
            while it sat idle).
        part: the drafter's part that drafted (``Draft.part``), or, for a plain round, the
            part the policy chose 0 for (``""`` for a drafter of one part).
        rows: the request's verify rows (its draft's tokens or tree nodes + 1; 0:
            ``drafted + 1``).
        batch_rows: the rows of the whole verification pass ``verify_s`` paid for, every
            request of the batch together (0: ``rows``).
    """

    drafted: int
    accepted: int
    draft_s: float
    verify_s: float
    catchup_s: float = 0.0
    part: str = ""
    rows: int = 0
    batch_rows: int = 0


@dataclass
class StageTimes:
    """Wall-clock seconds per stage, summed over a request.

    A nested pipeline (a pipeline drafter, HiSpec's intermediate level) has its own
    ``StageTimes`` in ``DecodeState.nested_times``; its seconds are part of the outer
    ``draft_s`` and are reported as ``nested/<level>/<stage>_s``.
    """

    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    accept_s: float = 0.0

    def as_dict(self, total_s: float) -> dict[str, float]:
        named = {
            "prefill_s": self.prefill_s,
            "draft_s": self.draft_s,
            "verify_s": self.verify_s,
            "accept_s": self.accept_s,
        }
        named["other_s"] = max(0.0, total_s - sum(named.values()))
        return named


@dataclass
class PartStats:
    """One part of a drafter's rounds (``Draft.part``; a fallback's prompt lookup or head):
    rounds it drafted or was asked for, of which ``skipped`` asked it for 0 tokens (plain
    rounds: a draft-length policy's choice, or one token left), and its tokens drafted and
    accepted.  Counted where a draft-length policy is set (the runner always sets one) or
    the part drafted."""

    rounds: int = 0
    skipped: int = 0
    drafted: int = 0
    accepted: int = 0


@dataclass
class RoundStats:
    """Counters of one request's rounds (see the glossary)."""

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    # Per named verification level (e.g. "intermediate", "target"): drafted and accepted.
    level_drafted: dict[str, int] = field(default_factory=dict)
    level_accepted: dict[str, int] = field(default_factory=dict)
    asked_per_round: list[int] = field(default_factory=list)  # see the glossary: asked
    tree_rounds: int = 0  # rounds whose draft was a token tree (``Draft.parents``)
    # Per named part of a drafter of parts (``DraftPart.key``), its rounds; a drafter of
    # one part (key "") adds none.
    parts: dict[str, PartStats] = field(default_factory=dict)
    drafted_per_round: list[int] = field(default_factory=list)
    accepted_per_round: list[int] = field(default_factory=list)
    # A drafter pool (MetaSD): per pool round, the chosen arm and its reward in [0, 1];
    # and the catch-up of idle arms' model sessions (positions processed, seconds).
    arms: list[int] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    catchup_tokens: int = 0
    catchup_s: float = 0.0

    @property
    def target_calls(self) -> int:
        """Target-verifier calls: one per round, by definition (a nested level's calls of
        its own verifier are that level's rounds)."""
        return self.rounds

    @property
    def tau(self) -> float:
        """Mean tokens committed per round, bonus included: ``1 + accepted / rounds``."""
        return 1.0 + self.accepted / self.rounds if self.rounds else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def record_round(
        self,
        level: str,
        drafted: int,
        accepted: int,
        tree: bool = False,
        part: str = "",
        asked: int | None = None,
    ) -> None:
        """Count one verified round (one target call) at verification level ``level``;
        ``tree``: its draft was a token tree (``drafted`` counts every node); ``part``: the
        drafter's part that drafted it or was asked to (``""``: no named part), ``asked``
        the length it was asked for (0: a plain round by a policy's choice)."""
        self.rounds += 1
        self.tree_rounds += int(tree)
        if part:
            stats = self.parts.setdefault(part, PartStats())
            stats.rounds += 1
            stats.skipped += int(asked == 0)
            stats.drafted += drafted
            stats.accepted += accepted
        self.drafted += drafted
        self.accepted += accepted
        self.drafted_per_round.append(drafted)
        self.accepted_per_round.append(accepted)
        if drafted:
            self.record_level(level, drafted, accepted)

    def record_level(self, level: str, drafted: int, accepted: int) -> None:
        self.level_drafted[level] = self.level_drafted.get(level, 0) + drafted
        self.level_accepted[level] = self.level_accepted.get(level, 0) + accepted


class RequestLocal(Generic[T]):
    """One stage's typed per-request data (a drafter's vocabulary subset, a policy's cost
    model, a pool's pending arm...).  A stage owns one ``RequestLocal`` per kind of data;
    ``local.get(state)`` is that request's value, made by ``factory(state)`` on first use.
    The value lives in the request's ``DecodeState`` (keyed by this object), so it ends with
    the request.
    """

    def __init__(self, factory: Callable[[DecodeState], T]) -> None:
        self.factory = factory

    def get(self, state: DecodeState) -> T:
        value = state.locals.get(self)
        if value is None:
            value = state.locals[self] = self.factory(state)
        return cast(T, value)  # stored under this key by ``factory`` or ``set``: a T

    def set(self, state: DecodeState, value: T) -> None:
        state.locals[self] = value


@dataclass
class DecodeState:
    """Everything one request's decoding knows; stages read and update it.

    Attributes:
        tokens: committed token ids, prompt first (the last one is not yet processed by
            the target: every round starts by scoring it).
        prompt_len: number of prompt tokens at the start of ``tokens``.
        max_len: context budget of this request (prompt + max_new_tokens + slack for drafts).
        sampling: how tokens are chosen.
        generator: the request's random generator (sampling is reproducible per seed).
        kv: where the request's model sessions keep their keys/values (the scheduler's).
        seq_id: the request's sequence id in ``kv`` (its paged block tables).
        sessions: one ``ModelSession`` per model (keyed by ``id(model)``), shared by every
            stage using that model; opened through ``kv`` on first use.
        locals: the stages' typed per-request data (see ``RequestLocal``).
        clock: the run's seconds counter (the scheduler sets the pipeline's injected clock;
            tests pass a deterministic one).  A stage that times part of its own work (a
            drafter's catch-up, ``Draft.catchup_s``) reads this clock, so its seconds can be
            compared with, and subtracted from, the engine's stage times.
    """

    tokens: list[int]
    prompt_len: int
    max_len: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    generator: torch.Generator = field(default_factory=torch.Generator)
    kv: KVStores | None = None
    seq_id: int = 0
    sessions: dict[int, ModelSession] = field(default_factory=dict)
    stats: RoundStats = field(default_factory=RoundStats)
    times: StageTimes = field(default_factory=StageTimes)
    locals: dict[RequestLocal, object] = field(default_factory=dict)
    # Round counters of nested pipelines (a pipeline used as a drafter), by level name.
    nested_stats: dict[str, RoundStats] = field(default_factory=dict)
    nested_times: dict[str, StageTimes] = field(default_factory=dict)
    clock: Callable[[], float] = time.perf_counter

    def stats_for_level(self, level: str) -> RoundStats:
        """The counters of the nested pipeline named ``level`` (created on first use)."""
        return self.nested_stats.setdefault(level, RoundStats())

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    def session(self, model: LayeredLM) -> ModelSession:
        """The request's session of ``model`` (opened on first use, synced lazily)."""
        sess = self.sessions.get(id(model))
        if sess is None:
            if self.kv is None:
                raise RuntimeError(
                    "DecodeState.kv is not set, so the request has nowhere to keep its keys/"
                    "values: states come from the scheduler (specflow.scheduler.Scheduler); "
                    "a state built by hand needs kv=KVStores() (specflow.kv.stores)"
                )
            sess = self.kv.open(model, self.max_len, self.seq_id)
            self.sessions[id(model)] = sess
        return sess

    def release(self) -> None:
        """The request is over: every session gives its KV storage back."""
        for sess in self.sessions.values():
            sess.release()
        self.sessions.clear()
