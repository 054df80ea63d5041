"""The scheduler: continuous batching of requests through one pipeline's rounds.

``Scheduler.generate`` keeps up to ``batch_size`` requests active.  Each step it admits
queued requests while a slot is free and the KV stores can promise their worst-case length
(one batched prefill of the joiners: ``pipeline.begin``), runs ONE ``pipeline.run_round``
over every active request, then retires the finished ones (EOS: the round's tokens after
it are dropped; or ``max_new_tokens``), which release their KV storage.  A finished request's
``on_done`` may queue follow-ups (the next turn of a conversation) at the front.

Batch 1 is this loop with one slot: ``generate(pipeline, prompt, ...)`` is a batch of one.
The scheduler meets the pipeline only through the ``Pipeline`` protocol
(``specflow.protocols``): the engine and the scheduler do not import each other.
Each request has its own ``DecodeState`` (tokens, generator, statistics, the stages' data),
so greedy output is identical at every batch size, and sampling draws the same random
numbers as batch 1 for a seed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from specflow.errors import ConfigError, PromptTooLongError
from specflow.kv.paged import CacheFullError
from specflow.kv.stores import KVLayout, KVStores
from specflow.protocols import Pipeline
from specflow.sampling import SamplingParams
from specflow.state import DecodeState, RoundStats, StageTimes


@dataclass
class Generation:
    """The outcome of one request (``generate``, or a ``BatchResult``).

    Attributes:
        tokens: the generated token ids (prompt excluded), EOS included when hit.
        stats: round counters (tau, acceptance).
        times: seconds per stage.
        total_s: wall-clock seconds of the whole call, prefill included.
        stop_reason: "eos" or "length".
        nested_stats: round counters of nested pipelines, by level.
        nested_times: seconds per stage of nested pipelines, by level.
        ttft_s: time to first token: seconds from admission to the end of the round that
            committed the first generated token (the prefill and that round; vLLM's TTFT).
            The rest, ``total_s - ttft_s``, is the decode time over the other
            ``len(tokens) - 1`` tokens (``decode_s``).
    """

    tokens: list[int]
    stats: RoundStats
    times: StageTimes
    total_s: float
    stop_reason: str
    nested_stats: dict[str, RoundStats] = field(default_factory=dict)
    nested_times: dict[str, StageTimes] = field(default_factory=dict)
    ttft_s: float | None = None

    @property
    def decode_s(self) -> float | None:
        """Seconds after the first token, what speculation changes (``None``: TTFT not
        measured, e.g. a cached baseline from before it was)."""
        return None if self.ttft_s is None else max(0.0, self.total_s - self.ttft_s)


@dataclass
class SeqRequest:
    """One sequence to decode (one conversation turn).

    Attributes:
        prompt: prompt token ids (non-empty).
        max_new_tokens: generation budget (>= 1).
        seed: the sequence's generator seed.
        tag: anything the caller wants back with the result.
        sampling: overrides the batch's sampling params.
        stop_token_ids: overrides the target's EOS ids.
    """

    prompt: list[int]
    max_new_tokens: int
    seed: int = 0
    tag: Any = None
    sampling: SamplingParams | None = None
    stop_token_ids: tuple[int, ...] | None = None


@dataclass
class BatchResult:
    """A finished sequence: its ``Generation`` (``total_s`` = latency from admission to
    finish, prefill included) and ``queued_s`` (time spent waiting for a slot)."""

    request: SeqRequest
    generation: Generation
    queued_s: float
    finished_at: float


@dataclass
class BatchStats:
    """Whole-run counters of the last ``Scheduler.generate``."""

    wall_s: float = 0.0
    new_tokens: int = 0
    rounds: int = 0  # batched rounds
    mean_batch: float = 0.0  # mean active sequences per round
    occupancy: list[int] = field(default_factory=list)  # active sequences per round

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s else 0.0


@dataclass
class _Active:
    request: SeqRequest
    state: DecodeState
    stop_ids: set[int]
    joined: float
    queued_s: float
    stop_reason: str | None = None
    first_token_at: float | None = None  # when the round committing its first token ended


RoundHook = Callable[[SeqRequest, dict[str, int]], None]


class Scheduler:
    """``pipeline`` decoding up to ``batch_size`` requests at once (see module doc).

    Args:
        pipeline: the pipeline whose rounds run.
        batch_size: maximum number of active sequences.
        layout: where the keys/values live (contiguous or paged; device, dtype, kernel).
        max_context: paged: the longest sequence (prompt + new tokens + 1) the pools are
            sized for; they hold ``batch_size`` such sequences.
    """

    def __init__(
        self,
        pipeline: Pipeline,
        batch_size: int = 1,
        layout: KVLayout | None = None,
        max_context: int = 2048,
    ) -> None:
        if batch_size < 1:
            raise ConfigError(f"runner.batch_size must be >= 1, got {batch_size}")
        self.pipeline = pipeline
        self.batch_size = batch_size
        self.kv = KVStores(
            layout,
            max_seqs=batch_size,
            max_context=max_context,
            max_draft=pipeline.max_draft_len,  # static steps take up to k + 1 rows
        )
        self.models = list({id(use.lm): use.lm for use in pipeline.uses()}.values())
        self.kv.register(self.models)
        self.clock = pipeline.clock
        self.stats = BatchStats()

    def check(self, req: SeqRequest, sampling: SamplingParams) -> None:
        """Raise a clear error for a request that cannot run (empty prompt, too long...)."""
        if not req.prompt:
            raise ValueError("prompt must contain at least one token")
        if req.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {req.max_new_tokens}")
        self.pipeline.acceptor.check((req.sampling or sampling).greedy)
        limit = min(info.max_positions for info in self.pipeline.models())
        if len(req.prompt) + req.max_new_tokens > limit:
            raise PromptTooLongError(
                f"prompt of {len(req.prompt)} tokens + max_new_tokens={req.max_new_tokens} "
                f"exceeds the context of {limit} positions ({self.pipeline.info.name}); shorten "
                f"the prompt or set runner.max_new_tokens <= {max(limit - len(req.prompt), 1)}"
            )

    def _state(self, req: SeqRequest, sampling: SamplingParams) -> DecodeState:
        self.check(req, sampling)
        return DecodeState(
            tokens=list(req.prompt),
            prompt_len=len(req.prompt),
            max_len=len(req.prompt) + req.max_new_tokens + 1,
            sampling=req.sampling or sampling,
            generator=torch.Generator().manual_seed(req.seed),
            kv=self.kv,
            seq_id=self.kv.new_sequence(),
            clock=self.clock,
        )

    def generate(
        self,
        requests: Iterable[SeqRequest],
        sampling: SamplingParams | None = None,
        on_done: Callable[[BatchResult], list[SeqRequest] | None] | None = None,
        on_round: RoundHook | None = None,
    ) -> list[BatchResult]:
        """Decode every request (continuous batching); results in finishing order.

        ``on_done(result)`` may return follow-up requests (the next turn of a conversation):
        they go to the front of the queue.  ``on_round(request, event)`` is called after
        every round of every active request with ``{"round", "k", "drafted", "accepted",
        "committed"}``.
        """
        sampling = sampling or SamplingParams()
        queue = deque(requests)
        active: list[_Active] = []
        results: list[BatchResult] = []
        start = self.clock()
        enqueued = {id(r): start for r in queue}
        stats = BatchStats()
        try:
            while queue or active:
                self._admit(queue, active, sampling, enqueued)
                stats.occupancy.append(len(active))
                states = [a.state for a in active]
                budgets = [a.request.max_new_tokens - a.state.num_generated for a in active]
                rounds = self.pipeline.run_round(states, budgets)
                stats.rounds += 1
                still: list[_Active] = []
                # when this round ended, for the requests whose first token it committed
                ended = self.clock() if any(a.first_token_at is None for a in active) else 0.0
                for a, (new, _) in zip(active, rounds, strict=True):
                    if a.first_token_at is None and new:
                        a.first_token_at = ended
                    if on_round is not None:
                        on_round(a.request, _round_event(a.state, len(new)))
                    if not self._finished(a, new):
                        still.append(a)
                        continue
                    now = self.clock()
                    a.state.release()
                    result = BatchResult(a.request, _generation(a, now), a.queued_s, now)
                    results.append(result)
                    stats.new_tokens += len(result.generation.tokens)
                    follow = on_done(result) if on_done is not None else None
                    for r in reversed(follow or []):
                        queue.appendleft(r)
                        enqueued[id(r)] = now
                active = still
        finally:
            for a in active:  # an error mid-run: give the storage back
                a.state.release()
        stats.wall_s = self.clock() - start
        stats.mean_batch = sum(stats.occupancy) / len(stats.occupancy) if stats.occupancy else 0
        self.stats = stats
        return results

    @staticmethod
    def _finished(a: _Active, new: list[int]) -> bool:
        """EOS in the round's tokens (drop what follows it) or the budget is spent."""
        st = a.state
        hit = next((i for i, t in enumerate(new) if t in a.stop_ids), None)
        if hit is not None:
            del st.tokens[len(st.tokens) - len(new) + hit + 1 :]
            a.stop_reason = "eos"
        elif st.num_generated >= a.request.max_new_tokens:
            a.stop_reason = "length"
        return a.stop_reason is not None

    def _admit(
        self,
        queue: deque[SeqRequest],
        active: list[_Active],
        sampling: SamplingParams,
        enqueued: dict[int, float],
    ) -> None:
        """Move queued requests into free slots (while their KV fits); prefill them."""
        joiners: list[_Active] = []
        while queue and len(active) + len(joiners) < self.batch_size:
            req = queue[0]
            state = self._state(req, sampling)
            if not self.kv.can_admit(state.max_len):
                if not active and not joiners:
                    raise CacheFullError(
                        f"a request of {state.max_len} positions does not fit the KV pool "
                        f"({self.batch_size} x {self.kv.max_context} positions); raise "
                        f"max_context"
                    )
                break
            queue.popleft()
            if self.kv.layout.kind == "paged":  # promise its blocks in every pool now
                for lm in self.models:
                    state.session(lm)
            now = self.clock()
            stop = req.stop_token_ids
            stop_ids = set(self.pipeline.info.eos_token_ids if stop is None else stop)
            queued = now - enqueued.pop(id(req), now)
            joiners.append(_Active(req, state, stop_ids, now, queued))
        if not joiners:
            return
        t0 = self.clock()
        try:
            self.pipeline.begin([j.state for j in joiners])
        except BaseException:
            for j in joiners:
                j.state.release()
            raise
        dt = self.clock() - t0
        for j in joiners:
            j.state.times.prefill_s = dt
        active.extend(joiners)


def _round_event(state: DecodeState, committed: int) -> dict[str, int]:
    s = state.stats
    return {
        "round": s.rounds,
        "k": s.asked_per_round[-1],  # the draft length asked this round
        "drafted": s.drafted_per_round[-1],
        "accepted": s.accepted_per_round[-1],
        "committed": committed,
    }


def _generation(a: _Active, now: float) -> Generation:
    st = a.state
    return Generation(
        tokens=st.tokens[st.prompt_len :],
        stats=st.stats,
        times=st.times,
        total_s=now - a.joined,
        stop_reason=a.stop_reason or "length",
        nested_stats=st.nested_stats,
        nested_times=st.nested_times,
        ttft_s=(a.first_token_at if a.first_token_at is not None else now) - a.joined,
    )


def generate(
    pipeline: Pipeline,
    prompt: list[int],
    max_new_tokens: int,
    sampling: SamplingParams | None = None,
    seed: int = 0,
    stop_token_ids: tuple[int, ...] | None = None,
    on_round: Callable[[dict[str, int]], None] | None = None,
) -> Generation:
    """Generate up to ``max_new_tokens`` tokens after ``prompt`` (stop at EOS, or at
    ``stop_token_ids``): a batch of one through ``Scheduler`` with contiguous KV.

    ``on_round`` (optional) is called after every round with ``{"round", "k", "drafted",
    "accepted", "committed"}`` (the round-end hook of callbacks; ``k``: the draft length
    asked).
    """
    hook = None if on_round is None else (lambda _req, event: on_round(event))
    request = SeqRequest(prompt, max_new_tokens, seed, stop_token_ids=stop_token_ids)
    (result,) = Scheduler(pipeline, batch_size=1).generate([request], sampling, on_round=hook)
    return result.generation
