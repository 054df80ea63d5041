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
scheduler, ``specflow.scheduler``, admits and retires requests between rounds):
  1. per request i: k_i = min(drafter.k, tokens still to generate - 1)  (never past the end)
     k_i = draft_length.choose(state_i, k_i)     (optional policy, per request; 0 = plain)
  2. drafts = drafter.propose(states with k_i > 0, their k_i)           time/draft_s
  3. logits = target_verifier.score(states, drafts)  # [k_i+1, V] each  time/verify_s
  4. verdict_i = acceptor.accept(state_i, draft_i, logits_i)            time/accept_s
     drafter.observe(drafting states, ...)       (a pool's bandit reward; in accept_s)
  5. per request: draft_length.observe(...), stats, commit draft[:accepted] + [next_token].
Every stage reads the committed tokens from ``state.tokens``; model sessions sync to them
lazily (rollback of rejected drafts is implicit, see ``specflow.models.session``) and run
one batched forward per step for the whole batch (``forward_hidden``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from specflow.errors import ConfigError
from specflow.models.base import ModelInfo, check_same_tokenizer
from specflow.protocols import (
    Acceptor,
    Drafter,
    DraftLengthPolicy,
    IntermediateVerifier,
    ModelUse,
    TargetVerifier,
)
from specflow.sampling import warp
from specflow.state import (
    Acceptance,
    DecodeState,
    Draft,
    RequestLocal,
    RoundStats,
    SamplingParams,
    StageTimes,
)


@dataclass
class Generation:
    """The outcome of one ``generate`` call.

    Attributes:
        tokens: the generated token ids (prompt excluded), EOS included when hit.
        stats: round counters (tau, acceptance).
        times: seconds per stage.
        total_s: wall-clock seconds of the whole call, prefill included.
        stop_reason: "eos" or "length".
    """

    tokens: list[int]
    stats: RoundStats
    times: StageTimes
    total_s: float
    stop_reason: str
    nested_stats: dict[str, RoundStats] = field(default_factory=dict)
    nested_times: dict[str, StageTimes] = field(default_factory=dict)


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
        k: draft length when the pipeline is used as a drafter (``propose``).
        draft_length: a policy choosing k each round (default: the drafter's k).
        clock: seconds counter for the stage times (tests pass a deterministic one).
    """

    def __init__(
        self,
        target_verifier: TargetVerifier,
        acceptor: Acceptor,
        drafter: Drafter | None = None,
        intermediate_verifier: IntermediateVerifier | None = None,
        name: str = "pipeline",
        level: str = "target",
        k: int = 4,
        draft_length: DraftLengthPolicy | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if k < 1:
            raise ConfigError(f"k (draft length) must be >= 1, got {k}; set e.g. drafter.k=4")
        self.target_verifier = target_verifier
        self.acceptor = acceptor
        self.intermediate_verifier = intermediate_verifier
        if intermediate_verifier is not None:
            if drafter is None:
                raise ConfigError(
                    "an intermediate_verifier needs a drafter to pre-verify "
                    "(e.g. drafter=early_exit)"
                )
            from specflow.acceptance import StandardAcceptor

            check_exit_order(drafter, intermediate_verifier)

            drafter = SpeculativePipeline(
                intermediate_verifier,
                StandardAcceptor(),
                drafter=drafter,
                name=f"{name}/intermediate",
                level="intermediate",
                k=intermediate_verifier.accumulate,
            )
        self.drafter = drafter
        self.draft_length = draft_length
        self.clock = clock
        self.name = name
        self.level = level
        self.k = k
        self._inner: RequestLocal[DecodeState] = RequestLocal(self._new_inner)
        self._check_graph()

    # ------------------------------------------------------------------ validation
    def _check_graph(self) -> None:
        target = self.target_verifier.info
        if self.drafter is not None:
            for info in self.drafter.models():
                check_same_tokenizer(info, target)
            self.acceptor.check_draft_length(self.drafter.k)

    def models(self) -> list[ModelInfo]:
        """Every model this pipeline runs (``Drafter`` protocol)."""
        infos = [self.target_verifier.info]
        if self.drafter is not None:
            infos += self.drafter.models()
        return infos

    def uses(self) -> list[ModelUse]:
        """Every model session this pipeline runs: the target's, then the drafter's."""
        uses = self.target_verifier.uses()
        if self.drafter is not None:
            uses += self.drafter.uses()
        return uses

    @property
    def info(self) -> ModelInfo:
        return self.target_verifier.info

    # ------------------------------------------------------------------ one round
    def begin(self, states: list[DecodeState]) -> None:
        """New requests start: every stage prefills / resets (batched)."""
        self.target_verifier.begin(states)
        if self.draft_length is not None:
            for st in states:
                self.draft_length.begin(st)
        if self.drafter is not None:
            self.drafter.begin(states)

    def run_round(
        self, states: list[DecodeState], budgets: list[int]
    ) -> list[tuple[list[int], torch.Tensor]]:
        """One round over a batch: request i commits at most ``budgets[i]`` (>= 1) tokens.

        Returns per request the committed tokens and the target logits ``[k_i+1, V]`` of
        the round (a nesting pipeline uses them as its q).  Stages run once for the batch
        (one drafting forward per step, one verification forward); acceptance, the
        draft-length policy and the statistics are per request.  Every request waited for
        the whole batched stage, so each is charged its full time.
        """
        ks = [0] * len(states)
        if self.drafter is not None:
            for i, (st, budget) in enumerate(zip(states, budgets, strict=True)):
                k = min(self.drafter.k, budget - 1)
                if self.draft_length is not None and k > 0:
                    k = self.draft_length.choose(st, k)
                ks[i] = k
        drafting = [i for i, k in enumerate(ks) if k > 0]
        t0 = self.clock()
        drafts = [Draft([]) for _ in states]
        if drafting:
            proposed = self.drafter.propose(
                [states[i] for i in drafting], [ks[i] for i in drafting]
            )
            for i, draft in zip(drafting, proposed, strict=True):
                drafts[i] = draft
        t1 = self.clock()
        logits = self.target_verifier.score(states, drafts)  # each [k_i+1, V]
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
        for st, k, draft, verdict, lg in zip(states, ks, drafts, verdicts, logits, strict=True):
            st.stats.chosen_k.append(k)
            st.times.draft_s += t1 - t0
            st.times.verify_s += t2 - t1
            st.times.accept_s += t3 - t2
            accepted = verdict.num_accepted
            if self.draft_length is not None:
                # The drafter's catch-up (lazy prefill, tokens committed while it sat idle)
                # is not a per-token drafting cost: leave it out of the policy's t_draft.
                draft_s = max(0.0, t1 - t0 - draft.catchup_s) if k > 0 else 0.0
                self.draft_length.observe(
                    st, draft.k, accepted, draft_s, t2 - t1, catchup_s=draft.catchup_s
                )
            st.stats.record_round(self.level, draft.k, accepted)
            new = draft.tokens[:accepted] + [verdict.next_token]
            st.tokens.extend(new)
            out.append((new, lg))
        return out

    # ------------------------------------------------------------------ generate
    def generate(
        self,
        prompt: list[int],
        max_new_tokens: int,
        sampling: SamplingParams | None = None,
        seed: int = 0,
        stop_token_ids: tuple[int, ...] | None = None,
        on_round: Callable[[dict[str, int]], None] | None = None,
    ) -> Generation:
        """Generate up to ``max_new_tokens`` tokens after ``prompt`` (stop at EOS): a batch of
        one through ``specflow.scheduler.Scheduler`` with contiguous KV.

        ``on_round`` (optional) is called after every round with ``{"round", "k",
        "drafted", "accepted", "committed"}`` (the round-end hook of callbacks).
        """
        from specflow.scheduler import Scheduler, SeqRequest

        hook = None if on_round is None else (lambda _req, event: on_round(event))
        request = SeqRequest(prompt, max_new_tokens, seed, stop_token_ids=stop_token_ids)
        (result,) = Scheduler(self, batch_size=1).generate([request], sampling, on_round=hook)
        return result.generation

    # ------------------------------------------------------------------ as a drafter
    def propose(self, states: list[DecodeState], ks: list[int]) -> list[Draft]:
        """Draft ``ks[i]`` tokens per request for an outer pipeline by running this
        pipeline's rounds (batched) until every request has its tokens.

        The tokens follow this pipeline's target (lossless acceptor: its distribution), so
        q for the outer rule is this target's warped distribution at each committed token.
        """
        inners = [self._inner.get(st) for st in states]
        for inner, st in zip(inners, states, strict=True):
            inner.tokens = list(st.tokens)
        starts = [len(inner.tokens) for inner in inners]
        q_rows: list[list[torch.Tensor]] = [[] for _ in states]
        while True:
            todo = [i for i, inner in enumerate(inners) if len(inner.tokens) - starts[i] < ks[i]]
            if not todo:
                break
            budgets = [ks[i] - (len(inners[i].tokens) - starts[i]) for i in todo]
            results = self.run_round([inners[i] for i in todo], budgets)
            for i, (new, logits) in zip(todo, results, strict=True):
                if not states[i].sampling.greedy:
                    q_rows[i].append(warp(logits[: len(new)], states[i].sampling))
        drafts = []
        for i, inner in enumerate(inners):
            toks = inner.tokens[starts[i] : starts[i] + ks[i]]
            probs = torch.cat(q_rows[i])[: ks[i]] if q_rows[i] else None
            drafts.append(Draft(toks, probs))
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
        """This pipeline's own state inside an outer request (shares the model sessions)."""
        inner = DecodeState(
            tokens=list(state.tokens),
            prompt_len=state.prompt_len,
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
        )
        inner.stats = state.stats_for_level(self.level)
        return inner


def check_exit_order(drafter: Drafter, intermediate: IntermediateVerifier) -> None:
    """A drafter on the intermediate verifier's model must exit below it (L_d < L_i)."""
    for mine in intermediate.uses():
        for use in drafter.uses():
            if use.lm is mine.lm and use.exit_layer >= mine.exit_layer:
                raise ConfigError(
                    f"drafter.exit_layer={use.exit_layer} must be below "
                    f"intermediate_verifier.exit_layer={mine.exit_layer}: the intermediate "
                    f"verifier continues from the drafter's hidden states"
                )
