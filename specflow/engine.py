"""The engine: a speculative pipeline and its round loop.

A ``SpeculativePipeline`` is ``drafter -> [intermediate verifier] -> target verifier ->
acceptor``.  Plain decoding is the pipeline without a drafter (every round drafts 0 tokens
and commits the target's own token).  A pipeline is itself a ``Drafter`` (``propose``), so
pipelines nest: PLD -> draft model -> target is a pipeline whose drafter is a pipeline.

An intermediate verifier (HiSpec) is that nesting too: ``drafter -> intermediate`` is an
inner pipeline (level "intermediate") whose verifier scores at an early exit with the
lossless rule and which accumulates ``intermediate_verifier.accumulate`` provisionally
accepted tokens (N_i) before the outer target verifier runs.  Its time is reported as
``intermediate_s`` (its verification) inside the outer ``draft_s``.

One round (``run_round``):
  1. k = min(drafter.k, tokens still to generate - 1)            (never draft past the end)
     k = draft_length.choose(state, k)                  (optional policy; 0 = a plain round)
  2. draft = drafter.propose(state, k)                           time/draft_s
  3. logits = target_verifier.score(state, draft)  # [k+1, V]    time/verify_s
  4. verdict = acceptor.accept(state, draft, logits)             time/accept_s
     if the drafter proposed (k > 0) and has ``observe``:
     drafter.observe(state, draft, logits, verdict)  (a pool's bandit reward; in accept_s)
  5. commit draft[:accepted] + [next_token]; stats: rounds += 1, accepted += accepted.
Every stage reads the committed tokens from ``state.tokens``; model sessions sync to them
lazily (rollback of rejected drafts is implicit, see ``specflow.models.session``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from specflow.errors import ConfigError, PromptTooLongError
from specflow.models.base import ModelInfo, check_same_tokenizer
from specflow.protocols import (
    Acceptor,
    Drafter,
    DraftLengthPolicy,
    IntermediateVerifier,
    TargetVerifier,
)
from specflow.sampling import warp
from specflow.state import DecodeState, Draft, RoundStats, SamplingParams, StageTimes


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
        self._check_graph()

    # ------------------------------------------------------------------ validation
    def _check_graph(self) -> None:
        target = self.target_verifier.info
        if self.drafter is not None:
            for info in self.drafter.models():
                check_same_tokenizer(info, target)
            check_k = getattr(self.acceptor, "check_draft_length", None)
            if check_k is not None:
                check_k(self.drafter.k)

    def models(self) -> list[ModelInfo]:
        """Every model this pipeline runs (``Drafter`` protocol)."""
        infos = [self.target_verifier.info]
        if self.drafter is not None:
            infos += self.drafter.models()
        return infos

    @property
    def info(self) -> ModelInfo:
        return self.target_verifier.info

    # ------------------------------------------------------------------ one round
    def begin(self, state: DecodeState) -> None:
        """Start a request: every stage prefills / resets."""
        self.target_verifier.begin(state)
        if self.draft_length is not None:
            self.draft_length.begin(state)
        if self.drafter is not None:
            self.drafter.begin(state)

    def run_round(self, state: DecodeState, budget: int) -> tuple[list[int], torch.Tensor]:
        """One round committing at most ``budget`` (>= 1) tokens to ``state.tokens``.

        Returns the committed tokens and the target logits ``[k+1, V]`` of the round (a
        nesting pipeline uses them as its q).
        """
        times, stats = state.times, state.stats
        k = 0
        if self.drafter is not None:
            k = min(self.drafter.k, budget - 1)
            if self.draft_length is not None and k > 0:
                k = self.draft_length.choose(state, k)
        stats.chosen_k.append(k)
        t0 = self.clock()
        draft = self.drafter.propose(state, k) if k > 0 else Draft([])
        t1 = self.clock()
        times.draft_s += t1 - t0
        logits = self.target_verifier.score(state, draft)  # [k+1, V]
        t2 = self.clock()
        times.verify_s += t2 - t1
        verdict = self.acceptor.accept(state, draft, logits)
        observe = getattr(self.drafter, "observe", None) if k > 0 else None
        if observe is not None:  # optional drafter hook, e.g. a bandit's reward (MetaSD)
            observe(state, draft, logits, verdict)
        times.accept_s += self.clock() - t2
        accepted = verdict.num_accepted
        if self.draft_length is not None:
            # The drafter's catch-up (lazy prefill, tokens committed while it sat idle) is
            # not a per-token drafting cost: leave it out of the policy's t_draft.
            draft_s = max(0.0, t1 - t0 - draft.catchup_s)
            self.draft_length.observe(
                state, draft.k, accepted, draft_s, t2 - t1, catchup_s=draft.catchup_s
            )
        stats.record_round(self.level, draft.k, accepted)
        new = draft.tokens[:accepted] + [verdict.next_token]
        state.tokens.extend(new)
        return new, logits

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
        """Generate up to ``max_new_tokens`` tokens after ``prompt`` (stop at EOS).

        ``on_round`` (optional) is called after every round with ``{"round", "k",
        "drafted", "accepted", "committed"}`` (the round-end hook of callbacks).
        """
        if not prompt:
            raise ValueError("prompt must contain at least one token")
        if max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        sampling = sampling or SamplingParams()
        self.acceptor.check(sampling.greedy)
        limit = min(info.max_positions for info in self.models())
        if len(prompt) + max_new_tokens > limit:
            raise PromptTooLongError(
                f"prompt of {len(prompt)} tokens + max_new_tokens={max_new_tokens} exceeds the "
                f"context of {limit} positions ({self.info.name}); shorten the prompt or set "
                f"runner.max_new_tokens <= {max(limit - len(prompt), 0)}"
            )
        stop_ids = set(self.info.eos_token_ids if stop_token_ids is None else stop_token_ids)
        generator = torch.Generator().manual_seed(seed)
        state = DecodeState(
            tokens=list(prompt),
            prompt_len=len(prompt),
            max_len=len(prompt) + max_new_tokens + 1,
            sampling=sampling,
            generator=generator,
        )
        start = self.clock()
        self.begin(state)
        state.times.prefill_s = self.clock() - start
        stop_reason = "length"
        while state.num_generated < max_new_tokens:
            before = len(state.tokens)
            new, _ = self.run_round(state, max_new_tokens - state.num_generated)
            if on_round is not None:
                s = state.stats
                on_round({
                    "round": s.rounds,
                    "k": s.chosen_k[-1],
                    "drafted": s.drafted_per_round[-1],
                    "accepted": s.accepted_per_round[-1],
                    "committed": len(new),
                })
            hit = next((i for i, t in enumerate(new) if t in stop_ids), None)
            if hit is not None:
                del state.tokens[before + hit + 1 :]
                stop_reason = "eos"
                break
        total = self.clock() - start
        return Generation(
            tokens=state.tokens[state.prompt_len :],
            stats=state.stats,
            times=state.times,
            total_s=total,
            stop_reason=stop_reason,
            nested_stats=state.nested_stats,
            nested_times=state.nested_times,
        )

    # ------------------------------------------------------------------ as a drafter
    def propose(self, state: DecodeState, k: int) -> Draft:
        """Draft ``k`` tokens for an outer pipeline by running this pipeline's rounds.

        The tokens follow this pipeline's target (lossless acceptor: its distribution), so
        q for the outer rule is this target's warped distribution at each committed token.
        """
        inner = self._inner_state(state)
        inner.tokens = list(state.tokens)
        start = len(inner.tokens)
        q_rows: list[torch.Tensor] = []
        while len(inner.tokens) - start < k:
            new, logits = self.run_round(inner, k - (len(inner.tokens) - start))
            if not state.sampling.greedy:
                q_rows.append(warp(logits[: len(new)], state.sampling))
        tokens = inner.tokens[start : start + k]
        probs = torch.cat(q_rows)[:k] if q_rows else None
        return Draft(tokens, probs)

    def _inner_state(self, state: DecodeState) -> DecodeState:
        """This pipeline's own state inside an outer request (shares the model sessions)."""
        inner = state.scratch.get(id(self))
        if not isinstance(inner, DecodeState):
            inner = DecodeState(
                tokens=list(state.tokens),
                prompt_len=state.prompt_len,
                max_len=state.max_len,
                sampling=state.sampling,
                generator=state.generator,
                sessions=state.sessions,
                times=state.nested_times.setdefault(self.level, StageTimes()),
                scratch=state.scratch,
                nested_stats=state.nested_stats,
                nested_times=state.nested_times,
            )
            inner.stats = state.stats_for_level(self.level)
            state.scratch[id(self)] = inner
        return inner


def check_exit_order(drafter: object, intermediate: object) -> None:
    """A drafter on the intermediate verifier's model must exit below it (L_d < L_i)."""
    same_model = getattr(drafter, "lm", None) is getattr(intermediate, "lm", object())
    d_exit, i_exit = getattr(drafter, "exit_layer", None), getattr(intermediate, "exit_layer", None)
    if same_model and d_exit is not None and i_exit is not None and d_exit >= i_exit:
        raise ConfigError(
            f"drafter.exit_layer={d_exit} must be below intermediate_verifier.exit_layer="
            f"{i_exit}: the intermediate verifier continues from the drafter's hidden states"
        )
