"""Batched speculative decoding: a ``SpeculativePipeline``'s rounds over many sequences.

``BatchedPipeline`` wraps an existing pipeline (the same stage objects, config and
acceptors) and decodes up to ``batch_size`` requests at once over paged KV caches.  One
batched round mirrors ``SpeculativePipeline.run_round`` for every active sequence ``i``:

  1. ``k_i = min(drafter.k, budget_i - 1)``
  2. drafting, by drafter kind:
       - none (plain decoding): nothing;
       - model-free (PLD, stubs): ``drafter.propose(state_i, k_i)`` per sequence;
       - a model at an exit (``ModelDrafter``: a draft model or an early exit of the target;
         ``LayerSkipDrafter``): step ``j`` is ONE batched forward of 1 token for every
         sequence with ``k_i > j``;
       - a nested pipeline (``pld_model``, HiSpec's intermediate level): its own batched
         rounds, recursively, until every sequence has ``k_i`` tokens;
  3. ONE batched verification forward over every sequence's ``k_i + 1`` positions;
  4. per-sequence acceptance with the pipeline's own acceptor (ragged: each sequence keeps
     its own prefix), stats as in the batch-1 engine;
  5. commit; rollback of rejected drafts is implicit (``PagedSession.set_tokens`` frees
     whole blocks beyond the kept prefix).

Continuous batching: after each round, finished sequences (EOS / ``max_new_tokens``) free
their blocks and leave; queued requests join while a slot and their worst-case KV blocks
are free, after one batched prefill forward of the joiners.  No sequence is padded to
another's length (attention pads per batch by at most ``k`` query rows).

Each sequence has its own ``DecodeState`` (tokens, generator, stats), so greedy output is
identical to batch 1, and sampling draws the same random numbers as batch 1 for a seed.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from specflow.engine import Generation, SpeculativePipeline
from specflow.errors import ConfigError, PromptTooLongError
from specflow.paged.batched_lm import BatchedLM, PagedSession, batched_hidden, batched_logits
from specflow.paged.cache import CacheFullError, PagedKVCache
from specflow.sampling import choose, warp
from specflow.state import DecodeState, Draft, SamplingParams

_SEQ_KEY = -1  # DecodeState.scratch key of the request's paged sequence id


@dataclass
class SeqRequest:
    """One sequence to decode (one conversation turn).

    Attributes:
        prompt: prompt token ids (non-empty).
        max_new_tokens: generation budget (>= 1).
        seed: the sequence's generator seed (as ``SpeculativePipeline.generate``).
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
class _Model:
    """One stage model on the batch's device and its paged cache."""

    lm: Any  # the stage's LayeredLM (sessions are keyed by id(lm), as in DecodeState)
    batched: BatchedLM
    cache: PagedKVCache | None = None


class PagedModels:
    """Every model a pipeline runs, each with a ``PagedKVCache`` of one shared block size."""

    def __init__(self, device: str | torch.device | None, dtype: Any, attention: str) -> None:
        self.device, self.dtype, self.attention = device, dtype, attention
        self.models: dict[int, _Model] = {}
        self._ids = itertools.count()

    def register(self, lm: Any) -> None:
        if id(lm) in self.models:
            return
        view_of = getattr(lm, "model", None)
        kept = getattr(lm, "kept", None)
        if view_of is not None and kept is not None:  # LayerSkipView
            batched = BatchedLM(
                view_of,
                device=self.device,
                dtype=self.dtype,
                attention=self.attention,
                layer_map=kept,
                name=lm.info.name,
            )
        else:
            batched = BatchedLM(lm, device=self.device, dtype=self.dtype, attention=self.attention)
        self.models[id(lm)] = _Model(lm, batched)

    def build_caches(self, num_blocks: int, block_size: int) -> None:
        for m in self.models.values():
            m.cache = m.batched.new_cache(num_blocks, block_size)

    @property
    def min_block_size(self) -> int:
        return max(m.batched.min_block_size for m in self.models.values())

    # ---------------------------------------------------------------- sequences
    def can_admit(self, max_len: int) -> bool:
        return all(m.cache.can_admit(max_len) for m in self.models.values())

    def admit(self, state: DecodeState) -> None:
        """Register ``state``'s sequence in every cache (blocks promised for ``max_len``)."""
        seq_id = next(self._ids)
        state.scratch[_SEQ_KEY] = seq_id
        for key, m in self.models.items():
            state.sessions[key] = PagedSession(m.batched, m.cache, seq_id, state.max_len)

    def release(self, state: DecodeState) -> None:
        for key in self.models:
            session = state.sessions.pop(key, None)
            if isinstance(session, PagedSession):
                session.release()

    def check_no_leaks(self) -> None:
        for m in self.models.values():
            m.cache.allocator.check_no_leaks()

    # ---------------------------------------------------------------- compute
    def session(self, state: DecodeState, lm: Any) -> PagedSession:
        return state.sessions[id(lm)]  # type: ignore[return-value]

    def logits(self, lm: Any, requests: list[tuple[PagedSession, int, int, int]]) -> list:
        """Batched ``session.logits`` for sessions of ``lm``; CPU float32 tensors."""
        if not requests:
            return []
        out = batched_logits(requests)
        if out[0].device.type != "cpu":
            sizes = [o.shape[0] for o in out]
            out = list(torch.cat(out).cpu().split(sizes))
        return out

    def prefill(self, states: list[DecodeState], lm: Any, exit_layer: int) -> None:
        """``verification.prefill`` for many requests: one batched forward."""
        reqs = []
        for st in states:
            sess = self.session(st, lm)
            sess.set_tokens(st.tokens)
            if len(st.tokens) > 1:
                reqs.append((sess, exit_layer, len(st.tokens) - 1))
        batched_hidden(reqs)


def _model_of(stage: Any, verifier: bool) -> tuple[Any, int] | None:
    """``(lm, exit)`` a stage runs, or None for a model-free stage."""
    view = getattr(stage, "view", None)
    if view is not None:  # LayerSkipDrafter
        return view, view.info.num_layers
    lm = getattr(stage, "lm", None)
    if lm is None:
        return None
    exit_layer = getattr(stage, "exit_layer", None)
    if exit_layer is None:
        if not verifier:
            return None
        exit_layer = lm.info.num_layers
    return lm, exit_layer


class _Level:
    """One ``SpeculativePipeline`` (a level of nesting) run for a batch of states."""

    def __init__(self, pipeline: SpeculativePipeline, models: PagedModels) -> None:
        self.p = pipeline
        self.models = models
        target = _model_of(pipeline.target_verifier, verifier=True)
        if target is None:
            raise ConfigError(
                f"batched decoding: target verifier {type(pipeline.target_verifier).__name__} "
                f"has no model (.lm)"
            )
        self.v_lm, self.v_exit = target
        models.register(self.v_lm)
        d = pipeline.drafter
        self.inner: _Level | None = None
        self.d_model: tuple[Any, int] | None = None
        if d is None:
            self.kind = "none"
        elif isinstance(d, SpeculativePipeline):
            self.kind = "pipeline"
            self.inner = _Level(d, models)
        elif (found := _model_of(d, verifier=False)) is not None:
            if getattr(d, "vocab_subset", None) is not None:
                raise ConfigError(
                    "batched decoding drafts over the full vocabulary: set "
                    "drafter.vocab_subset=null, or runner.batch_size=1 to keep it"
                )
            self.kind = "model"
            self.d_model = found
            models.register(found[0])
        elif not d.models():
            self.kind = "free"
        else:
            raise ConfigError(
                f"batched decoding does not support drafter {type(d).__name__}; use "
                f"runner.batch_size=1 or a model/pld/layer_skip/pipeline drafter"
            )

    # ---------------------------------------------------------------- begin
    def begin(self, states: list[DecodeState]) -> None:
        self.models.prefill(states, self.v_lm, self.v_exit)
        if self.kind == "model":
            self.models.prefill(states, *self.d_model)
        elif self.kind == "pipeline":
            self.inner.begin(states)
        elif self.kind == "free":
            for st in states:
                self.p.drafter.begin(st)

    # ---------------------------------------------------------------- drafting
    def _draft(self, states: list[DecodeState], ks: list[int]) -> list[Draft]:
        if self.kind == "none":
            return [Draft([]) for _ in states]
        if self.kind == "free":
            return [
                self.p.drafter.propose(st, k) if k > 0 else Draft([])
                for st, k in zip(states, ks, strict=True)
            ]
        if self.kind == "pipeline":
            return self.inner.propose(states, ks)
        return self._draft_with_model(states, ks)

    def _draft_with_model(self, states: list[DecodeState], ks: list[int]) -> list[Draft]:
        """``drafting.draft_with_model`` for the batch: one forward per drafting step."""
        lm, exit_layer = self.d_model
        sessions = [self.models.session(st, lm) for st in states]
        for sess, st, k in zip(sessions, states, ks, strict=True):
            if k > 0:
                sess.set_tokens(st.tokens)
        tokens: list[list[int]] = [[] for _ in states]
        q_rows: list[list[torch.Tensor]] = [[] for _ in states]
        for step in range(max(ks, default=0)):
            active = [i for i, k in enumerate(ks) if k > step]
            reqs = []
            for i in active:
                n = len(sessions[i].tokens)
                reqs.append((sessions[i], exit_layer, n - 1, n))
            for i, logits in zip(active, self.models.logits(lm, reqs), strict=True):
                st = states[i]
                ids, probs = choose(logits, st.sampling, st.generator)
                sessions[i].extend(ids)
                tokens[i] += ids
                if probs is not None:
                    q_rows[i].append(probs)
        return [Draft(t, torch.cat(q) if q else None) for t, q in zip(tokens, q_rows, strict=True)]

    def propose(self, states: list[DecodeState], ks: list[int]) -> list[Draft]:
        """``SpeculativePipeline.propose`` for the batch (this level is a drafter)."""
        inners = [self.p._inner_state(st) for st in states]
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

    # ---------------------------------------------------------------- one round
    def run_round(
        self, states: list[DecodeState], budgets: list[int]
    ) -> list[tuple[list[int], torch.Tensor]]:
        """``SpeculativePipeline.run_round`` for every state: ``(committed, logits)`` each."""
        k_max = self.p.drafter.k if self.p.drafter is not None else 0
        ks = [min(k_max, b - 1) for b in budgets]
        t0 = time.perf_counter()
        drafts = self._draft(states, ks)
        t1 = time.perf_counter()
        reqs = []
        for st, draft in zip(states, drafts, strict=True):
            sess = self.models.session(st, self.v_lm)
            n = len(st.tokens)
            sess.set_tokens(st.tokens + draft.tokens)
            reqs.append((sess, self.v_exit, n - 1, n + draft.k))
        all_logits = self.models.logits(self.v_lm, reqs)  # each [k_i + 1, V]
        t2 = time.perf_counter()
        out = []
        for st, draft, logits in zip(states, drafts, all_logits, strict=True):
            verdict = self.p.acceptor.accept(st, draft, logits)
            accepted = verdict.num_accepted
            st.stats.record_round(self.p.level, draft.k, accepted)
            new = draft.tokens[:accepted] + [verdict.next_token]
            st.tokens.extend(new)
            out.append((new, logits))
        t3 = time.perf_counter()
        for st in states:  # every sequence waited for the whole batched stage
            st.times.draft_s += t1 - t0
            st.times.verify_s += t2 - t1
            st.times.accept_s += t3 - t2
        return out


@dataclass
class _Active:
    request: SeqRequest
    state: DecodeState
    stop_ids: set[int]
    joined: float
    queued_s: float
    stop_reason: str | None = None


@dataclass
class BatchStats:
    """Whole-run counters of the last ``BatchedPipeline.generate``."""

    wall_s: float = 0.0
    new_tokens: int = 0
    rounds: int = 0  # batched rounds
    mean_batch: float = 0.0  # mean active sequences per round
    occupancy: list[int] = field(default_factory=list)  # active sequences per round

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s else 0.0


class BatchedPipeline:
    """``pipeline`` decoding up to ``batch_size`` requests at once (see module doc).

    Args:
        pipeline: the batch-1 pipeline (its stages and acceptor are used as they are).
        batch_size: maximum number of active sequences.
        device, dtype: where the models run (default: where they are loaded).
        attention: ``auto`` | ``sdpa`` | ``flash``.
        block_size: KV block size (default 16; 256 with flash).
        max_context: the longest sequence (prompt + new tokens + 1) the pool is sized for;
            the pool holds ``batch_size`` such sequences.
        num_blocks: override the pool size (blocks per model).
    """

    def __init__(
        self,
        pipeline: SpeculativePipeline,
        *,
        batch_size: int = 8,
        device: str | torch.device | None = None,
        dtype: Any = None,
        attention: str = "auto",
        block_size: int | None = None,
        max_context: int = 2048,
        num_blocks: int | None = None,
    ) -> None:
        if batch_size < 1:
            raise ConfigError(f"runner.batch_size must be >= 1, got {batch_size}")
        self.pipeline = pipeline
        self.batch_size = batch_size
        self.models = PagedModels(device, dtype, attention)
        self.root = _Level(pipeline, self.models)
        multiple = self.models.min_block_size
        bs = block_size or max(16, multiple)
        if bs % multiple:
            raise ConfigError(f"KV block size {bs} must be a multiple of {multiple}")
        self.block_size = bs
        self.num_blocks = num_blocks or batch_size * math.ceil(max_context / bs)
        self.models.build_caches(self.num_blocks, bs)
        self.stats = BatchStats()

    @property
    def attention(self) -> str:
        return self.models.models[id(self.root.v_lm)].batched.attention

    def _state(self, req: SeqRequest, sampling: SamplingParams) -> DecodeState:
        if not req.prompt:
            raise ValueError("prompt must contain at least one token")
        if req.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {req.max_new_tokens}")
        sampling = req.sampling or sampling
        self.pipeline.acceptor.check(sampling.greedy)
        limit = min(info.max_positions for info in self.pipeline.models())
        if len(req.prompt) + req.max_new_tokens > limit:
            raise PromptTooLongError(
                f"prompt of {len(req.prompt)} tokens + max_new_tokens={req.max_new_tokens} "
                f"exceeds the context of {limit} positions ({self.pipeline.info.name})"
            )
        return DecodeState(
            tokens=list(req.prompt),
            prompt_len=len(req.prompt),
            max_len=len(req.prompt) + req.max_new_tokens + 1,
            sampling=sampling,
            generator=torch.Generator().manual_seed(req.seed),
        )

    def generate(
        self,
        requests: Iterable[SeqRequest],
        sampling: SamplingParams | None = None,
        on_done: Callable[[BatchResult], list[SeqRequest] | None] | None = None,
    ) -> list[BatchResult]:
        """Decode every request (continuous batching); results in finishing order.

        ``on_done(result)`` may return follow-up requests (the next turn of a conversation):
        they go to the front of the queue.
        """
        sampling = sampling or SamplingParams()
        queue = deque(requests)
        active: list[_Active] = []
        results: list[BatchResult] = []
        start = time.perf_counter()
        enqueued = {id(r): start for r in queue}
        stats = BatchStats()
        try:
            while queue or active:
                self._admit(queue, active, sampling, enqueued)
                stats.occupancy.append(len(active))
                states = [a.state for a in active]
                budgets = [a.request.max_new_tokens - a.state.num_generated for a in active]
                befores = [len(st.tokens) for st in states]
                self.root.run_round(states, budgets)
                stats.rounds += 1
                still: list[_Active] = []
                for a, before in zip(active, befores, strict=True):
                    st = a.state
                    new = st.tokens[before:]
                    hit = next((i for i, t in enumerate(new) if t in a.stop_ids), None)
                    if hit is not None:
                        del st.tokens[before + hit + 1 :]
                        a.stop_reason = "eos"
                    elif st.num_generated >= a.request.max_new_tokens:
                        a.stop_reason = "length"
                    if a.stop_reason is None:
                        still.append(a)
                        continue
                    now = time.perf_counter()
                    self.models.release(st)
                    result = BatchResult(a.request, self._generation(a, now), a.queued_s, now)
                    results.append(result)
                    stats.new_tokens += len(result.generation.tokens)
                    follow = on_done(result) if on_done is not None else None
                    for r in reversed(follow or []):
                        queue.appendleft(r)
                        enqueued[id(r)] = now
                active = still
        finally:
            for a in active:  # an error mid-run: give the blocks back
                self.models.release(a.state)
        stats.wall_s = time.perf_counter() - start
        stats.mean_batch = sum(stats.occupancy) / len(stats.occupancy) if stats.occupancy else 0
        self.stats = stats
        return results

    def _admit(
        self,
        queue: deque[SeqRequest],
        active: list[_Active],
        sampling: SamplingParams,
        enqueued: dict[int, float],
    ) -> None:
        """Move queued requests into free slots (while their KV blocks fit); prefill them."""
        joiners: list[_Active] = []
        while queue and len(active) + len(joiners) < self.batch_size:
            req = queue[0]
            state = self._state(req, sampling)
            if not self.models.can_admit(state.max_len):
                if not active and not joiners:
                    raise CacheFullError(
                        f"a request of {state.max_len} positions does not fit the KV pool "
                        f"({self.num_blocks} blocks of {self.block_size}); raise max_context"
                    )
                break
            queue.popleft()
            self.models.admit(state)
            now = time.perf_counter()
            stop = req.stop_token_ids
            stop_ids = set(self.pipeline.info.eos_token_ids if stop is None else stop)
            queued = now - enqueued.pop(id(req), now)
            joiners.append(_Active(req, state, stop_ids, now, queued))
        if not joiners:
            return
        t0 = time.perf_counter()
        self.root.begin([j.state for j in joiners])
        dt = time.perf_counter() - t0
        for j in joiners:
            j.state.times.prefill_s = dt
        active.extend(joiners)

    @staticmethod
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
        )
