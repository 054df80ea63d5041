"""The engine: a speculative pipeline and its round, batch-first.

A ``SpeculativePipeline`` is ``drafter -> [intermediate verifier] -> target verifier ->
acceptor``.  Plain decoding is the pipeline without a drafter (every round drafts 0 tokens
and commits the target's own token).  A pipeline is itself a ``Drafter`` (``propose``), so
pipelines nest: PLD -> draft model -> target is a pipeline whose drafter is a pipeline.

An intermediate verifier (HiSpec) is that nesting too: ``drafter -> intermediate`` is an
inner pipeline (level "intermediate") whose verifier scores at an early exit with the
lossless rule and which accumulates ``intermediate_verifier.accumulate`` provisionally
accepted tokens (N_i) before the outer target verifier runs.  Its time is reported as
``intermediate_s`` (its verification) inside the outer ``draft_s``.

One round (``run_round``) runs over a batch of requests (batch 1 is a batch of one; the
scheduler, ``specflow.scheduler``, admits and retires requests between rounds).  Draft
lengths (glossary in ``specflow.state``): ``k`` is the drafter's maximum, ``asked_i`` what
this round asks for request i, ``d_i = len(draft_i.tokens) <= asked_i`` what it drafted.
  1. per request i: limit_i = min(drafter.k, budget_i - 1)   (``draft_limit``: the one cap;
     budget_i - 1 keeps the bonus token within max_new_tokens); with a policy:
     part_i = drafter.next_part(state_i), limit_i = min(part_i.k, budget_i - 1) and
     asked_i = draft_length.choose(state_i, limit_i, part_i.key)  (0 = a plain round)
  2. drafts = drafter.propose(states with asked_i > 0, their asked_i)   time/draft_s
  3. logits = target_verifier.score(states, drafts)  # [d_i+1, V] each  time/verify_s
  4. verdict_i = acceptor.accept(state_i, draft_i, logits_i)            time/accept_s
     drafter.observe(drafting states, ...)       (a pool's bandit reward; in accept_s)
  5. per request: draft_length.observe(state_i, RoundReport(...)), stats (per part too),
     commit draft[:accepted] + [next_token]
     (a tree draft, ``Draft.parents``: the accepted path's tokens, ``Acceptance.path``).

Stage times are read from the pipeline's ``clock``; the requests carry the same clock
(``DecodeState.clock``) for what stages time themselves (a drafter's catch-up), so
``draft_s - catchup_s`` subtracts seconds of one counter.  Every stage reads the committed
tokens from ``state.tokens``; model sessions sync to them lazily (rollback of rejected
drafts is implicit, see ``specflow.kv.session``) and run one batched forward per step for
the whole batch (``forward_hidden``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

import torch

from specflow.acceptance import LosslessAcceptor
from specflow.catchup import catch_up, context_start
from specflow.errors import ConfigError, SpecflowError
from specflow.kv.base import ModelInfo, check_same_tokenizer
from specflow.protocols import (
    Acceptor,
    Drafter,
    DraftLengthPolicy,
    DraftPart,
    IntermediateVerifier,
    ModelUse,
    TargetVerifier,
    draft_limit,
)
from specflow.sampling import warp
from specflow.state import (
    Acceptance,
    DecodeState,
    Draft,
    RequestLocal,
    RoundReport,
    StageTimes,
)


class SpeculativePipeline:
    """drafter -> [intermediate verifier] -> target verifier -> acceptor (see module doc).

    Args:
        target_verifier: scores drafts with the target model.
        acceptor: keeps a prefix of each draft and adds the bonus / correction token.
        drafter: proposes tokens; ``None`` is plain autoregressive decoding.
        intermediate_verifier: optional pre-verification (HiSpec).
        name: the method name reported in results.
        level: name of this pipeline's verification level in per-level acceptance
            ("target" for the outermost pipeline; e.g. "draft" for a nested one).
        k: only for a pipeline nested as an outer pipeline's drafter: its ``Drafter.k``, the
            most tokens it proposes per outer round (config: the nested node's ``k``).
            ``None`` (a top-level pipeline, as ``graph.build_pipeline`` builds it): not a
            drafter.  This pipeline's own rounds draft at most ``max_draft_len``.
        draft_length: a policy choosing each round's asked draft length (default: the
            limit, ``min(drafter.k, budget - 1)``).
        clock: seconds counter for the stage times, given to the requests it creates or
            nests (``DecodeState.clock``); tests pass a deterministic one.
        context_window: only for a nested pipeline: its requests hold the outer request's
            last ``context_window`` prompt tokens and every token after them
            (``specflow.catchup``), so its models prefill at most that much of a long
            prompt.  ``None``: the whole prompt.  Its models must not be the outer
            target (refused by the outer pipeline).
    """

    def __init__(
        self,
        target_verifier: TargetVerifier,
        acceptor: Acceptor,
        drafter: Drafter | None = None,
        intermediate_verifier: IntermediateVerifier | None = None,
        name: str = "pipeline",
        level: str = "target",
        k: int | None = None,
        draft_length: DraftLengthPolicy | None = None,
        clock: Callable[[], float] = time.perf_counter,
        context_window: int | None = None,
    ) -> None:
        if k is not None and k < 1:
            raise ConfigError(
                f"k={k}: a nested pipeline's k (the most tokens it drafts for the outer "
                f"pipeline per round) must be >= 1; set e.g. drafter.k=4"
            )
        if context_window is not None and (k is None or context_window < 1):
            raise ConfigError(
                f"context_window={context_window}: only a nested pipeline (a drafter, k set) "
                f"may see part of the prompt, and then at least 1 token; set it on the "
                f"drafter node, or null"
            )
        self.context_window = context_window
        self.target_verifier = target_verifier
        self.acceptor = acceptor
        self.intermediate_verifier = intermediate_verifier
        if intermediate_verifier is not None:
            if drafter is None:
                raise ConfigError(
                    "an intermediate_verifier needs a drafter to pre-verify "
                    "(e.g. drafter=early_exit)"
                )
            check_exit_order(drafter, intermediate_verifier)
            if drafter.branches > 1:
                raise ConfigError(
                    f"drafter.branches={drafter.branches}: an intermediate_verifier verifies "
                    f"chains at its exit, not token trees; draft chains (drafter.branches=1) "
                    f"or drop the intermediate_verifier"
                )

            drafter = SpeculativePipeline(
                intermediate_verifier,
                LosslessAcceptor(),
                drafter=drafter,
                name=f"{name}/intermediate",
                level="intermediate",
                k=intermediate_verifier.accumulate,
                clock=clock,
            )
        self.drafter = drafter
        self.draft_length = draft_length
        # Whether the target verifier's passes are whole: no stage before it runs the
        # target's first layers for the drafted positions (an early-exit drafter, a pool
        # with one as an arm, an intermediate verifier), so its seconds are a whole pass
        # over its rows and the row probe's prices apply to them
        # (``DraftLengthPolicy.use_prices``).  A layer-skip drafter runs a view of the
        # target with its own cache, and a feature head only reads it: whole.
        target_lms = {id(use.lm) for use in target_verifier.uses()}
        windowed = sorted({use.lm.info.name for use in (drafter.uses() if drafter else [])
                           if use.context_window is not None and id(use.lm) in target_lms})
        if windowed:
            raise ConfigError(
                f"the drafter sees part of the prompt (context_window) on {windowed}, which "
                f"is also this pipeline's target; the target holds every token: set the "
                f"drafter's context_window=null"
            )
        self._whole_passes = drafter is None or not any(
            id(use.lm) in target_lms and not use.reads_only for use in drafter.uses())
        self.clock = clock
        self.name = name
        self.level = level
        self.k = k
        self.branches = 1  # a nested pipeline drafts its committed tokens: a chain
        self._inner: RequestLocal[DecodeState] = RequestLocal(self._new_inner)
        self._check_graph()

    # ------------------------------------------------------------------ validation
    def _check_graph(self) -> None:
        target = self.target_verifier.info
        if self.drafter is not None:
            k = self.drafter.k
            if k is None or k < 1:
                raise ConfigError(
                    f"drafter.k={k}: the drafter's k (the most tokens it proposes per "
                    f"round) must be >= 1; set drafter.k=4 (for a nested pipeline, its own "
                    f"k: the tokens it drafts for the outer pipeline)"
                )
            for info in self.drafter.models():
                check_same_tokenizer(info, target)
            self.acceptor.check_draft_length(self.max_draft_len)
            if self.drafter.branches > 1 and not self.acceptor.accepts_trees:
                raise ConfigError(
                    f"drafter.branches={self.drafter.branches}: the drafter may propose token "
                    f"trees but this pipeline's acceptor ({type(self.acceptor).__name__}) "
                    f"verifies chains only; draft chains (drafter.branches=1; "
                    f"drafter.then.branches in eagle_pld) or use acceptor=exact"
                )

    @property
    def max_draft_len(self) -> int:
        """The most draft tokens one round of this pipeline sends to its target verifier:
        its drafter's ``k`` (0 without a drafter: plain decoding).  Every round drafts
        ``len(draft.tokens) <= asked <= max_draft_len`` tokens per request, so a target
        verification covers at most ``max_draft_len + 1`` positions per request.  (A nested
        pipeline's own rounds have their own ``max_draft_len``.)"""
        return 0 if self.drafter is None else self.drafter.k

    def models(self) -> list[ModelInfo]:
        """Every model this pipeline runs (``Drafter`` protocol)."""
        infos = [self.target_verifier.info]
        if self.drafter is not None:
            infos += self.drafter.models()
        return infos

    def uses(self) -> list[ModelUse]:
        """Every model session this pipeline runs: the target's, then the drafter's (with
        this pipeline's ``context_window``, where it has one)."""
        uses = self.target_verifier.uses()
        if self.drafter is not None:
            uses += self.drafter.uses()
        if self.context_window is not None:
            uses = [replace(use, context_window=self.context_window) for use in uses]
        return uses

    @property
    def info(self) -> ModelInfo:
        return self.target_verifier.info

    # ------------------------------------------------------------------ one round
    def forget_requests(self) -> None:
        """The draft-length policy drops its prior from earlier requests
        (``DraftLengthPolicy.forget``; the runner calls this after its warm-up).  A nested
        pipeline drafting for this one keeps its own policy's."""
        if self.draft_length is not None:
            self.draft_length.forget()

    def begin(self, states: list[DecodeState]) -> None:
        """New requests start: every stage prefills / resets (batched).  First, each
        request's sessions learn which exits with an attention adapter a stage reads
        (``ModelSession.read_exit``: the adapter must see every position, the prefill's too)
        and which layers' inputs a stage reads (``ModelSession.keep_layer_inputs``, likewise).

        A nested pipeline (``k`` set: a drafter) does not prefill its verifier here: like a
        model drafter, it catches up on its first ``propose`` (``Draft.catchup_s``), so a
        pool arm that is never chosen for a request never pays for that request's prompt."""
        for use in self.uses():
            if use.lm.exit_adapter(use.exit_layer) is not None:
                for st in states:
                    st.session(use.lm).read_exit(use.exit_layer)
            if use.layer_inputs:
                for st in states:
                    st.session(use.lm).keep_layer_inputs(use.layer_inputs)
        if self.k is None:
            self.target_verifier.begin(states)
        if self.draft_length is not None and states:
            # What a verify pass of n rows costs, where measured (the row probe of the model
            # the sessions run) and the passes are whole: the policy then prices a draft's
            # rows instead of fitting their cost from round times.
            self.draft_length.use_prices(
                self.target_verifier.row_prices(states) if self._whole_passes else None)
            for st in states:
                self.draft_length.begin(st)
        if self.drafter is not None:
            self.drafter.begin(states)

    def run_round(
        self, states: list[DecodeState], budgets: list[int]
    ) -> list[tuple[list[int], torch.Tensor]]:
        """One round over a batch: request i commits at most ``budgets[i]`` (>= 1) tokens.

        Returns per request the committed tokens and the target logits ``[d_i+1, V]`` of
        the round (a nesting pipeline uses them as its q).  Stages run once for the batch
        (one drafting forward per step, one verification forward); acceptance, the
        draft-length policy and the statistics are per request.  Every request waited for
        the whole batched stage, so each is charged its full time.
        """
        asked = [0] * len(states)
        parts = [""] * len(states)  # per request: the drafter's part a policy asks for
        if self.drafter is not None:
            policy = self.draft_length
            for i, (st, budget) in enumerate(zip(states, budgets, strict=True)):
                if policy is None:
                    asked[i] = draft_limit(self.drafter, budget - 1)
                    continue
                # The policy asks the part that will draft, within that part's own k.
                part = self.drafter.next_part(st)
                parts[i] = part.key
                limit = draft_limit(part, budget - 1)
                asked[i] = policy.choose(st, limit, part.key) if limit > 0 else limit
        drafting = [i for i, n in enumerate(asked) if n > 0]
        t0 = self.clock()
        drafts = [Draft([]) for _ in states]
        if drafting:
            proposed = self.drafter.propose(
                [states[i] for i in drafting], [asked[i] for i in drafting]
            )
            for i, draft in zip(drafting, proposed, strict=True):
                drafts[i] = draft
        t1 = self.clock()
        if self.drafter is not None and self.drafter.branches == 1 and any(
                d.parents is not None for d in drafts):
            raise SpecflowError(
                f"{self.name}: drafter {self.drafter.name!r} declares branches=1 (chains "
                f"only) but proposed a token tree (Draft.parents): a drafter that may draft "
                f"trees must declare its branches (specflow.protocols.Drafter)"
            )
        logits = self.target_verifier.score(states, drafts)  # each [d_i+1, V]
        t2 = self.clock()
        verdicts = [
            self.acceptor.accept(st, d, lg)
            for st, d, lg in zip(states, drafts, logits, strict=True)
        ]
        if drafting:  # a drafter's hook, e.g. a bandit's reward (MetaSD)
            self.drafter.observe(
                [states[i] for i in drafting],
                [drafts[i] for i in drafting],
                [logits[i] for i in drafting],
                [verdicts[i] for i in drafting],
            )
        t3 = self.clock()
        out = []
        batch_rows = sum(len(d.tokens) + 1 for d in drafts)  # the verification pass's rows
        rounds = zip(states, asked, parts, drafts, verdicts, logits, strict=True)
        for st, n, part, draft, verdict, lg in rounds:
            st.stats.asked_per_round.append(n)
            st.times.draft_s += t1 - t0
            st.times.verify_s += t2 - t1
            st.times.accept_s += t3 - t2
            drafted, accepted = len(draft.tokens), verdict.num_accepted
            # The part that drafted, or for a plain round the part asked.
            round_part = draft.part if n > 0 else part
            if self.draft_length is not None:
                # The drafter's catch-up (lazy prefill, tokens committed while it sat idle)
                # is not a per-token drafting cost: leave it out of the policy's t_draft.
                # Both are read from one clock (``DecodeState.clock`` is this ``clock``).
                draft_s = max(0.0, t1 - t0 - draft.catchup_s) if n > 0 else 0.0
                # A tree's nodes are not a longer draft: the policy sees its depth.
                self.draft_length.observe(st, RoundReport(
                    draft.depth, accepted, draft_s, t2 - t1, catchup_s=draft.catchup_s,
                    part=round_part, rows=drafted + 1, batch_rows=batch_rows,
                ))
            st.stats.record_round(
                self.level, drafted, accepted, tree=draft.parents is not None,
                part=round_part, asked=n,
            )
            new = draft.accepted_tokens(verdict) + [verdict.next_token]
            st.tokens.extend(new)
            out.append((new, lg))
        return out

    # ------------------------------------------------------------------ as a drafter
    def next_part(self, state: DecodeState) -> DraftPart:
        """One part (``Drafter.next_part``): a nested pipeline drafts its ``k`` tokens."""
        k = self.k or 0
        return DraftPart("", k, k)

    def propose(self, states: list[DecodeState], asked: list[int]) -> list[Draft]:
        """Draft ``asked[i]`` tokens per request for an outer pipeline by running this
        pipeline's rounds (batched) until every request has its tokens.

        The tokens follow this pipeline's target (lossless acceptor: its distribution), so
        q for the outer rule is this target's warped distribution at each committed token.
        """
        # This pipeline's verifier may be behind: its lazy prefill, rounds it sat out (a pool's
        # idle arm).  Its one usual position (the last committed token) rides along with the
        # first round's verification (slack 1).
        catchup_s = 0.0
        window = self.context_window
        for use in self.target_verifier.uses():
            catchup_s += catch_up(states, use.lm, use.exit_layer, slack=1, window=window).seconds
        inners = [self._inner.get(st) for st in states]
        for inner, st in zip(inners, states, strict=True):
            inner.tokens = st.tokens[context_start(st, window):]  # a copy
        starts = [len(inner.tokens) for inner in inners]
        q_rows: list[list[torch.Tensor]] = [[] for _ in states]
        while True:
            todo = [
                i for i, inner in enumerate(inners) if len(inner.tokens) - starts[i] < asked[i]
            ]
            if not todo:
                break
            budgets = [asked[i] - (len(inners[i].tokens) - starts[i]) for i in todo]
            results = self.run_round([inners[i] for i in todo], budgets)
            for i, (new, logits) in zip(todo, results, strict=True):
                if not states[i].sampling.greedy:
                    q_rows[i].append(warp(logits[: len(new)], states[i].sampling))
        drafts = []
        for i, inner in enumerate(inners):
            toks = inner.tokens[starts[i] : starts[i] + asked[i]]
            probs = torch.cat(q_rows[i])[: asked[i]] if q_rows[i] else None
            drafts.append(Draft(toks, probs, catchup_s=catchup_s))
        return drafts

    def observe(
        self,
        states: list[DecodeState],
        drafts: list[Draft],
        target_logits: list[torch.Tensor],
        verdicts: list[Acceptance],
    ) -> None:
        """``Drafter`` hook: nothing (this pipeline's own drafter observed its rounds)."""

    def _new_inner(self, state: DecodeState) -> DecodeState:
        """This pipeline's own state inside an outer request (shares the model sessions;
        its stages time themselves with this pipeline's clock; with a ``context_window`` its
        tokens start at ``context_start``)."""
        start = context_start(state, self.context_window)
        inner = DecodeState(
            tokens=state.tokens[start:],  # a copy
            prompt_len=state.prompt_len - start,
            max_len=state.max_len,
            sampling=state.sampling,
            generator=state.generator,
            kv=state.kv,
            seq_id=state.seq_id,
            sessions=state.sessions,
            times=state.nested_times.setdefault(self.level, StageTimes()),
            locals=state.locals,
            nested_stats=state.nested_stats,
            nested_times=state.nested_times,
            clock=self.clock,
        )
        inner.stats = state.stats_for_level(self.level)
        return inner


def check_exit_order(drafter: Drafter, intermediate: IntermediateVerifier) -> None:
    """A drafter that runs the intermediate verifier's model must exit below it (L_d < L_i);
    one that only reads the model's features (``ModelUse.reads_only``) may read any exit."""
    for mine in intermediate.uses():
        for use in drafter.uses():
            if use.lm is mine.lm and not use.reads_only and use.exit_layer >= mine.exit_layer:
                raise ConfigError(
                    f"drafter.exit_layer={use.exit_layer} must be below "
                    f"intermediate_verifier.exit_layer={mine.exit_layer}: the intermediate "
                    f"verifier continues from the drafter's hidden states"
                )
