"""The roles a stage can play.  Stages are plain classes chosen by config (``_target_``);
they satisfy these protocols structurally, with no base class to inherit from.  Every
member that the engine, the scheduler (``Pipeline``) or another stage calls is declared
here, and ``draft_limit`` is the one cap of a draft length by a drafter's ``k``.

Stages are batch-first: a round runs over a batch of requests (``states``, one
``DecodeState`` each; batch 1 is a list of one).  A round (see ``specflow.engine``) is::

    drafts = drafter.propose(states, asked)                    # d_i <= asked_i tokens (+ q)
    logits = target_verifier.score(states, drafts)             # [d_i+1, V] target logits each
    verdict_i = acceptor.accept(state_i, draft_i, logits_i)    # accepted prefix + bonus token
    drafter.observe(states, drafts, logits, verdicts)          # e.g. a bandit's reward
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from specflow.costs import RowPrices
from specflow.kv.base import KVSpec, LayerBatch, LayeredLM, ModelInfo, RowPaddedLM
from specflow.state import Acceptance, DecodeState, Draft, RoundReport


@dataclass(frozen=True)
class ModelUse:
    """A model a stage runs and the exit it reads (its session's deepest layer needed).

    Used to place models, size KV pools, bring an idle drafter's session up to date, and
    check exit orders (HiSpec: a drafter that runs the model's layers exits below the
    intermediate verifier, which continues from them).  ``reads_only``: the stage runs none
    of the model's decoder layers on its drafts, it reads what the model's own verifier
    computed at ``exit_layer`` for committed positions (a feature drafter reads ``h_N``), so
    no exit order applies to it.  ``layer_inputs``: decoder layers whose inputs the stage
    reads beside ``h_N`` (an EAGLE-3 head's three), kept by every request's session of the
    model from its first position on (``ModelSession.keep_layer_inputs``).
    ``context_window``: the stage's sessions of this model hold only the last
    ``context_window`` prompt tokens and every token after them (``specflow.catchup``: a
    draft model's shorter prefill); ``None``: the whole sequence.
    """

    lm: LayeredLM
    exit_layer: int
    reads_only: bool = False
    layer_inputs: tuple[int, ...] = ()
    context_window: int | None = None


@dataclass(frozen=True)
class DraftPart:
    """The part of a drafter that will draft a request's next round, known before it drafts
    (``Drafter.next_part``), so a draft-length policy can keep apart what each part is
    worth: a fallback drafter's prompt lookup (free, its copies accepted in long runs once
    it matches) and its draft model or feature head (paid per token, accepted less often).

    Attributes:
        key: names the part within the drafter: ``""`` for a drafter of one part; a
            fallback's ``"first"`` / ``"then"``, prefixed to its parts' own keys
            (``"then.first"``).  ``Draft.part`` is the key of the part that drafted.
        k: the most tokens that part drafts in one round (its ``Drafter.k``).
        available: the most tokens it can draft for the request now, found without
            drafting: ``k`` for a model drafter (it always drafts), the continuation of
            the latest match for prompt lookup (0: no match).
    """

    key: str
    k: int
    available: int


def sub_part(prefix: str, key: str) -> str:
    """The key of part ``key`` of a drafter that is part ``prefix`` of another."""
    return f"{prefix}.{key}" if key else prefix


@runtime_checkable
class Drafter(Protocol):
    """Proposes draft tokens continuing each request's ``state.tokens``.

    ``k`` (config ``drafter.k``, >= 1) is the drafter's maximum draft length: the most
    tokens it proposes in one round (see the glossary in ``specflow.state``).  A drafter
    made of drafters (a fallback, a pool) has the largest ``k`` of its parts and asks each
    part through ``draft_limit``; a nested pipeline's ``k`` is the most tokens it drafts for
    the outer pipeline.

    ``branches`` (>= 1) is the most branches a draft of this drafter can have: 1 for a
    drafter of chains only, m > 1 for one that may propose a token tree (``Draft.parents``;
    a feature head's ``drafter.branches``).  A drafter made of drafters has the largest of
    its parts'; a nested pipeline drafts chains (its committed tokens).  The engine refuses,
    when a pipeline is built, trees where they cannot be verified: under an intermediate
    verifier, or with an acceptor that walks chains only (``Acceptor.accepts_trees``).
    """

    name: str
    k: int
    branches: int

    def begin(self, states: list[DecodeState]) -> None:
        """New requests start (reset per-request state; prefill may happen here)."""

    def next_part(self, state: DecodeState) -> DraftPart:
        """The part that would draft the request's next round (``DraftPart``), without
        drafting or changing any state; a drafter of one part: ``DraftPart("", k, k)``
        (prompt lookup: its match's length as ``available``)."""

    def propose(self, states: list[DecodeState], asked: list[int]) -> list[Draft]:
        """Up to ``asked[i]`` tokens (``1 <= asked[i] <= k``; a tree draft: depth up to
        ``asked[i]``, ``Draft.parents``) continuing
        ``states[i].tokens`` (fewer, even 0, is fine).  A drafter of parts sets each
        draft's ``Draft.part`` to the key of the part that drafted it, always a key its
        ``next_part`` can return (a pool, one part, clears its arms' keys)."""

    def observe(
        self,
        states: list[DecodeState],
        drafts: list[Draft],
        target_logits: list[torch.Tensor],
        verdicts: list[Acceptance],
    ) -> None:
        """After acceptance, for the requests that drafted this round (a pool's reward)."""

    def models(self) -> list[ModelInfo]:
        """Models this drafter runs (for tokenizer / depth checks); [] for model-free ones."""

    def uses(self) -> list[ModelUse]:
        """The model sessions this drafter drafts with; [] for model-free ones."""


def draft_limit(drafter: Drafter | DraftPart, wanted: int) -> int:
    """The draft length to ask ``drafter`` (or one part of it) for when ``wanted`` tokens
    would do: ``min(wanted, drafter.k)``, the one place a draft length is capped by a
    drafter's ``k`` (the engine, with ``wanted = budget - 1``, of the drafter or, with a
    draft-length policy, of the part that will draft; a fallback or a pool, for each of its
    parts)."""
    return min(wanted, drafter.k)


class FeatureHeadRunner(Protocol):
    """A feature-level draft head placed beside its target (``drafter=feature``): the
    project's own head (``specflow.models.feature_head.FeatureDraftModel``) or a published
    EAGLE-1/2 head (``specflow.models.eagle_head.EagleDraftModel``) or a published EAGLE-3
    head (``specflow.models.eagle3_head.Eagle3DraftModel``).

    ``layer_inputs``: the target's decoder layers whose inputs the head reads (``()``: it
    reads ``h_N`` only); ``features(h_N [R, H], inputs [R, H * len(layer_inputs)]) -> f [R,
    H]``: what the target computed at a position, as the head reads it;
    ``step(f [R, H], t_{p+1} [R], batch) -> f^ [R, H]``: one row per position (a
    feature or a fed-back prediction, and the token after it), appended to each request's
    head cache (``kv``: one layer); ``logits(f^ [R, H]) -> [R, S]`` over the draft
    vocabulary, whose target ids are ``ids [S]``; ``to_vocab([R, S] probabilities) ->
    [R, V]``.  ``target``: the placed target (its device, row padding and row probe).
    """

    target: RowPaddedLM
    ids: torch.Tensor
    layer_inputs: tuple[int, ...]

    @property
    def kv(self) -> KVSpec: ...

    def features(self, final: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor: ...

    def step(self, feats: torch.Tensor, next_ids: torch.Tensor, batch: LayerBatch
             ) -> torch.Tensor: ...

    def logits(self, predicted: torch.Tensor) -> torch.Tensor: ...

    def to_vocab(self, probs: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class TargetVerifier(Protocol):
    """Scores drafts with the target model in one batched forward pass."""

    info: ModelInfo

    def begin(self, states: list[DecodeState]) -> None:
        """New requests start: prefill their prompts (one batched forward)."""

    def score(self, states: list[DecodeState], drafts: list[Draft]) -> list[torch.Tensor]:
        """Target logits ``[d_i+1, V]`` per request (``d_i = len(drafts[i].tokens)``): row j
        is (for a chain; a tree: ``specflow.verification.score_at_exit``) the target's
        distribution for draft position j given the committed tokens and
        ``draft.tokens[:j]`` (row d_i: the bonus)."""

    def uses(self) -> list[ModelUse]:
        """The model session this verifier scores with (the target at its exit)."""

    def row_prices(self, states: list[DecodeState]) -> RowPrices | None:
        """What a scoring pass over n rows of the model these requests' sessions run costs
        against a one-token step, as measured in this process
        (``specflow.costs.RowPrices``), or ``None`` where it is not measured (a
        draft-length policy then measures it from its rounds)."""


@runtime_checkable
class IntermediateVerifier(TargetVerifier, Protocol):
    """Pre-verifies drafts at an early exit before the target sees them (HiSpec).

    It scores like a target verifier (``score`` at its exit layer); the engine runs
    ``drafter -> intermediate`` as an inner pipeline with the lossless rule until
    ``accumulate`` (N_i) provisionally accepted tokens are collected.
    """

    accumulate: int


@runtime_checkable
class Acceptor(Protocol):
    """Decides how much of a draft to keep, and the target's bonus / correction token.

    Acceptance is per request (each sequence keeps its own prefix: ragged batches).
    ``accepts_trees``: it can walk a tree draft (``Draft.parents``) and return the kept path
    (``Acceptance.path``); the engine refuses tree drafts for the others."""

    lossless: bool
    accepts_trees: bool

    def check(self, greedy: bool) -> None:
        """Raise ``ConfigError`` when this acceptor cannot work with the sampling mode."""

    def check_draft_length(self, k: int) -> None:
        """Raise ``ConfigError`` when this acceptor cannot work with drafts of up to ``k``
        tokens (the pipeline's ``max_draft_len``; FLy: its window must be below k); called
        when the pipeline is built."""

    def accept(self, state: DecodeState, draft: Draft, target_logits: torch.Tensor) -> Acceptance:
        """``target_logits [d+1, V]`` (d: the tokens drafted; for a tree, row 0 follows the
        committed tokens and row i+1 node i) -> accepted prefix length (or path) and next
        token."""


@dataclass
class BanditStats:
    """What a selector knows: per arm (discounted) pulls and summed rewards, and the pool
    rounds so far.  A selector starts each request from one (``Selector.begin``): a fresh
    one (MetaSD resets per request), or one shared by every request of the run."""

    counts: list[float] = field(default_factory=list)
    sums: list[float] = field(default_factory=list)
    rounds: int = 0
    # Statistics this request's rounds also feed (a selector's run-wide prior), or None.
    teaches: BanditStats | None = None
    # Per arm, what choosing it now would cost in reward units (a pool's switch cost: an
    # idle arm's catch-up), subtracted from its index by a selector; [] = none.
    penalties: list[float] = field(default_factory=list)


@runtime_checkable
class Selector(Protocol):
    """Chooses which drafter of a pool drafts a request's round (MetaSD)."""

    def begin(self, num_arms: int) -> BanditStats:
        """The statistics a new request starts from."""

    def select(self, stats: BanditStats) -> int:
        """The arm for this round."""

    def update(self, stats: BanditStats, arm: int, reward: float) -> None:
        """The chosen arm's reward in [0, 1]."""


@runtime_checkable
class DraftLengthPolicy(Protocol):
    """Chooses the draft length each request's round asks for (0 = skip drafting: a plain
    round).

    Per request: its evidence lives in the request's state, so every sequence of a batch
    has its own draft length.  Per part: ``part`` is the key of the drafter's part that
    drafts the round (``Drafter.next_part``; ``""`` for a drafter of one part), so a
    policy may keep each part's evidence apart (a fallback's prompt lookup and its head)."""

    def begin(self, state: DecodeState) -> None: ...

    def use_prices(self, prices: RowPrices | None) -> None:
        """The target verifier's ``row_prices``, given by the engine as requests begin;
        ``None`` where not measured, or where the target's passes are partial (a drafter or
        an intermediate verifier ran its first layers)."""

    def choose(self, state: DecodeState, limit: int, part: str = "") -> int:
        """The asked draft length, in ``0..limit`` (``limit = min(part's k, budget - 1)``,
        >= 1), for a round drafted by ``part``."""

    def observe(self, state: DecodeState, report: RoundReport) -> None:
        """What the request's round did (tokens drafted and accepted, seconds drafting,
        verifying and catching up, the part that drafted, verify rows)."""

    def forget(self) -> None:
        """Drop what earlier requests taught it (a prior a policy carries from request to
        request), so the next request starts as a run's first: called after the runner's
        untimed warm-up, whose fixed prompt says nothing of the workload."""


@runtime_checkable
class Pipeline(Protocol):
    """What the scheduler runs (``specflow.engine.SpeculativePipeline``): the rounds of a
    batch of requests.  Declared here so the scheduler and the engine never import each
    other."""

    acceptor: Acceptor
    clock: Callable[[], float]

    @property
    def info(self) -> ModelInfo:
        """The target model (its name, EOS ids)."""

    @property
    def max_draft_len(self) -> int:
        """The most draft tokens one round sends to the target verifier (0: plain)."""

    def models(self) -> list[ModelInfo]:
        """Every model the pipeline runs (their context limits bound a request)."""

    def uses(self) -> list[ModelUse]:
        """Every model session the pipeline runs (the scheduler registers their KV)."""

    def begin(self, states: list[DecodeState]) -> None:
        """New requests start: every stage prefills / resets (batched)."""

    def forget_requests(self) -> None:
        """Stages drop what earlier requests taught them (the draft-length policy's prior),
        so the next request starts as a run's first: the runner calls it after its untimed
        warm-up."""

    def run_round(
        self, states: list[DecodeState], budgets: list[int]
    ) -> list[tuple[list[int], torch.Tensor]]:
        """One round; request i commits at most ``budgets[i]`` (>= 1) tokens.  Returns per
        request the committed tokens and the round's target logits."""
