"""Run a pipeline over a workload, next to plain decoding, and write the results.

Every request (conversation) is decoded turn by turn (the chat template when the tokenizer
has one; turn i+1's prompt holds turn i's answer) by the scheduler
(``specflow.scheduler``), with up to ``runner.batch_size`` requests at once, and by plain
decoding of the target (the *baseline*) at the same batch size.  Then the outputs are
compared (fidelity), the task is scored, and the record is appended to ``requests.jsonl``
as soon as the request is done.  Warm-up generations run first and are not timed.

- Batch size 1: request by request, the baseline right before the method (side by side);
  the baseline may come from a cache on disk (per model + prompt + settings + machine) when
  ``runner.baseline_cache`` is on.
- Batch size N: a baseline pass over the workload, then the method's pass, each with
  continuous batching; a record's ``total_s`` is the request's latency (admission to
  finish), and ``summary["batch"]`` has the throughput across the batch of both.
"""

from __future__ import annotations

import gc
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from specflow.acceptance import LosslessAcceptor
from specflow.cache_root import cache_root
from specflow.engine import SpeculativePipeline
from specflow.errors import ConfigError, SpecflowError
from specflow.results.baselines import BaselineCache, CachedBaseline, machine_description
from specflow.results.measure import baseline_metrics, generation_metrics, percentile, task_scores
from specflow.results.records import (
    BaselinePass,
    BatchReport,
    DecodePass,
    RequestRecord,
    RunMeta,
    RunSummary,
    TurnRecord,
)
from specflow.results.run_folder import RunFolder, summarize
from specflow.sampling import SamplingParams
from specflow.scheduler import BatchResult, Generation, Scheduler, SeqRequest
from specflow.settings import RunSettings
from specflow.state import RoundStats, StageTimes
from specflow.workload import Request

log = logging.getLogger(__name__)

WARM_UP = "Count from one to twenty in words, then name the twelve months of the year."


DRIFT_WARN = 0.10  # a cached baseline that re-times more than 10 % off is reported


def set_aside_long_lived_objects() -> None:
    """Collect once, then move every object alive now (the loaded models' readers and
    tokenizers, compiled kernels: about 200 000 for a GGUF 1.5B) out of the garbage
    collector's reach (``gc.freeze``, as vLLM does after start-up), so the collections
    decoding triggers walk only what decoding allocates.  Unfrozen, a full collection of the
    GGUF 1.5B's process takes about 140 ms and the young ones cost a 1-row pass about 4%
    (2-core EPYC Zen 3).  Objects alive now that die later are still freed by reference
    counting; only their cycles stay.  Once per process; later calls do nothing.  Called by
    the entry points (``run.py``'s job, the benchmark) once their models are loaded, not by
    ``Runner`` itself: a process that embeds a runner keeps its collector as it is."""
    if gc.get_freeze_count():
        return
    gc.collect()
    gc.freeze()


class Tokenizer(Protocol):
    """What the runner needs of a tokenizer (a HF tokenizer satisfies it)."""

    chat_template: Any

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


@runtime_checkable
class RunCallback(Protocol):
    """What the runner calls on every callback (see ``callbacks/``; a hook a callback does
    not need is a no-op there).

    Records, summaries and meta are the typed results of ``specflow.results.records``.  ``meta``
    carries ``output_dir`` (the run folder) so loggers can write from the start.
    ``on_run_end`` is always called, also when the run crashes (``summary.complete`` is
    then false), and one callback failing there does not stop the others.  ``on_round_end``
    is called after every round only for callbacks whose ``wants_rounds`` is true.
    """

    wants_rounds: bool

    def on_run_start(self, meta: RunMeta, num_requests: int) -> None: ...

    def on_request_start(self, request: Request) -> None: ...

    def on_round_end(self, request: Request, event: dict[str, int]) -> None:
        """After every round: ``round``, ``k``, ``drafted``, ``accepted``, ``committed``."""

    def on_request_end(self, record: RequestRecord) -> None: ...

    def on_run_end(self, summary: RunSummary, folder: Path) -> None: ...


def build_prompt(
    tokenizer: Tokenizer, messages: list[dict[str, str]], settings: RunSettings
) -> list[int]:
    """Token ids of a conversation ending with a user turn, ready for the answer."""
    if settings.use_chat_template and tokenizer.chat_template:
        msgs = messages
        if settings.system_prompt:
            msgs = [{"role": "system", "content": settings.system_prompt}, *messages]
        ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # BatchEncoding
            ids = ids["input_ids"]
        return list(ids)
    text = "\n\n".join(m["content"] for m in messages)
    return list(tokenizer.encode(text))


@dataclass
class TurnResult:
    """One decoded turn of a conversation: its prompt, the generation, the seconds it
    waited for a slot, and whether it came from the baseline cache."""

    prompt: list[int]
    generation: Generation
    queued_s: float = 0.0
    cached: bool = False


@dataclass
class _Conversation:
    """A request being decoded turn by turn: the messages so far and the finished turns."""

    request: Request
    messages: list[dict[str, str]]
    turns: list[TurnResult] = field(default_factory=list)


@dataclass
class _Measured:
    """What ``decode_requests`` measured for the summary's ``batch``: the cached baseline's
    re-timing and each pass over the requests (``None`` until it ran)."""

    baseline_drift: float | None = None
    decoding: DecodePass | None = None
    baseline: BaselinePass | None = None


class Runner:
    """Decodes requests with a method and its plain-decoding baseline (see module doc)."""

    def __init__(
        self,
        pipeline: SpeculativePipeline,
        tokenizer: Tokenizer,
        settings: RunSettings,
        sampling: SamplingParams,
        callbacks: list[Any] | None = None,
    ) -> None:
        self.pipeline = pipeline
        self.baseline = SpeculativePipeline(pipeline.target_verifier, LosslessAcceptor(),
                                            name="ar", clock=pipeline.clock)
        self.tokenizer = tokenizer
        self.settings = settings
        self.sampling = sampling
        self.callbacks: list[RunCallback] = list(callbacks or [])
        for cb in self.callbacks:
            if not isinstance(cb, RunCallback):
                raise ConfigError(
                    f"callback {type(cb).__name__} is not a run callback: it needs "
                    f"wants_rounds and on_run_start, on_request_start, on_round_end, "
                    f"on_request_end, on_run_end (see specflow.runner.RunCallback)"
                )
        use_cache = settings.baseline_cache and settings.batch_size == 1
        baselines = cache_root(settings.cache_dir) / "baselines"
        self.baseline_cache = BaselineCache(baselines if use_cache else None)
        self._measured = _Measured()  # the batch section of the summary, as measured

    # ---------------------------------------------------------------- callbacks
    def _each(self, call: Callable[[RunCallback], None], safe: bool = False) -> None:
        """``call(cb)`` for every callback; ``safe``: log a failure and go on with the others."""
        for cb in self.callbacks:
            if not safe:
                call(cb)
                continue
            try:
                call(cb)
            except Exception:  # noqa: BLE001 - every logger must get to finish
                log.exception("callback %s failed", type(cb).__name__)

    def _round_hook(self) -> Callable[[SeqRequest, dict[str, int]], None] | None:
        """``on_round(seq_request, event)`` for the scheduler when a callback wants rounds."""
        wanted = [cb for cb in self.callbacks if cb.wants_rounds]
        if not wanted:
            return None

        def on_round(seq: SeqRequest, event: dict[str, int]) -> None:
            for cb in wanted:
                cb.on_round_end(seq.tag.request, event)

        return on_round

    # ---------------------------------------------------------------- decoding
    def _scheduler(self, pipeline: SpeculativePipeline, max_context: int) -> Scheduler:
        s = self.settings
        return Scheduler(pipeline, s.batch_size, s.layout(), max_context=max_context)

    def _max_context(self, requests: list[Request]) -> int:
        """A KV budget per sequence: every turn's text + answers + chat overhead."""
        s = self.settings
        worst = 0
        for r in requests:
            msgs = [{"role": "user", "content": t} for t in r.turns]
            prompt = len(build_prompt(self.tokenizer, msgs, s))
            worst = max(worst, prompt + len(r.turns) * (s.max_new_tokens + 64) + 1)
        limit = min(info.max_positions for info in self.pipeline.models())
        return min(worst, limit)

    def _next_turn(self, conv: _Conversation, cache: bool) -> SeqRequest | None:
        """The conversation's next turn to decode; turns found in the baseline cache are
        taken from there.  ``None`` when every turn is done."""
        s = self.settings
        while len(conv.turns) < len(conv.request.turns):
            conv.messages.append({"role": "user", "content": conv.request.turns[len(conv.turns)]})
            prompt = build_prompt(self.tokenizer, conv.messages, s)
            hit = self._cached_baseline(prompt) if cache else None
            if hit is None:
                return SeqRequest(prompt, s.max_new_tokens, s.seed, tag=conv)
            gen = Generation(hit.tokens, RoundStats(), StageTimes(), hit.total_s, "cached",
                             ttft_s=hit.ttft_s)
            self._finish_turn(conv, TurnResult(prompt, gen, cached=True))
        return None

    def _baseline_key(self, prompt: list[int]) -> str:
        s = self.settings
        return self.baseline_cache.key(
            self.pipeline, prompt, s.max_new_tokens, self.sampling, s.seed
        )

    def _cached_baseline(self, prompt: list[int]) -> CachedBaseline | None:
        """The baseline of ``prompt`` from the cache (no key is computed when it is off)."""
        if self.baseline_cache.directory is None:
            return None
        return self.baseline_cache.get(self._baseline_key(prompt))

    def _finish_turn(self, conv: _Conversation, turn: TurnResult) -> None:
        conv.turns.append(turn)
        text = self.tokenizer.decode(turn.generation.tokens, skip_special_tokens=True)
        conv.messages.append({"role": "assistant", "content": text})

    def _decode(
        self,
        scheduler: Scheduler,
        requests: list[Request],
        cache: bool = False,
        on_request: Any = None,
        on_round: Any = None,
    ) -> dict[str, list[TurnResult]]:
        """Every conversation, turn by turn; ``request_id -> turns``.  ``on_request(request,
        turns)`` is called as soon as a conversation's last turn ends."""
        done: dict[str, list[TurnResult]] = {}

        def finished(conv: _Conversation) -> None:
            done[conv.request.request_id] = conv.turns
            if on_request is not None:
                on_request(conv.request, conv.turns)

        def on_done(result: BatchResult) -> list[SeqRequest]:
            conv: _Conversation = result.request.tag
            turn = TurnResult(result.request.prompt, result.generation, result.queued_s)
            self._finish_turn(conv, turn)
            if cache and self.baseline_cache.directory is not None:
                self.baseline_cache.put(
                    self._baseline_key(turn.prompt),
                    CachedBaseline(turn.generation.tokens, turn.generation.total_s,
                                   turn.generation.ttft_s),
                )
            follow = self._next_turn(conv, cache)
            if follow is None:
                finished(conv)
                return []
            return [follow]

        first: list[SeqRequest] = []
        for req in requests:
            conv = _Conversation(req, [])
            nxt = self._next_turn(conv, cache)
            if nxt is None:
                finished(conv)
            else:
                first.append(nxt)
        scheduler.generate(first, self.sampling, on_done=on_done, on_round=on_round)
        return done

    def _check_prompts(self, scheduler: Scheduler, requests: list[Request]) -> None:
        """Refuse a prompt that cannot fit before anything runs (warm-up included)."""
        s = self.settings
        for r in requests:
            prompt = build_prompt(self.tokenizer, [{"role": "user", "content": r.turns[0]}], s)
            try:
                scheduler.check(SeqRequest(prompt, s.max_new_tokens), self.sampling)
            except SpecflowError as exc:
                raise type(exc)(f"request {r.request_id}: {exc}") from None

    def warmup(self, schedulers: list[Scheduler], requests: list[Request]) -> None:
        """Untimed short generations so that first-call costs don't land in a measurement: a
        fixed prompt (``WARM_UP``), none of the workload's, so that a drafter that keeps what it
        has seen (token trees' tables, suffix index) is handed no measured answer; as many as
        a batch of the run holds.  Then each pipeline forgets what the warm-up taught its
        draft-length policy (``Pipeline.forget_requests``)."""
        s = self.settings
        n = min(8, s.max_new_tokens)
        prompt = build_prompt(self.tokenizer, [{"role": "user", "content": WARM_UP}], s)
        warm = [SeqRequest(list(prompt), n) for _ in requests[: s.batch_size]]
        for scheduler in schedulers:
            scheduler.generate(warm, self.sampling)
            # what the warm-up taught the stages (how often a draft was right on its prompt)
            # is not the workload's: the first request starts as a run's first would
            scheduler.pipeline.forget_requests()

    def _record(
        self, request: Request, turns: list[TurnResult], base: list[TurnResult] | None
    ) -> RequestRecord:
        """The JSONL record of a request (method's turns, and the baseline's when run)."""
        gens = [t.generation for t in turns]
        texts = [self.tokenizer.decode(g.tokens, skip_special_tokens=True) for g in gens]
        compared = None
        baseline_task = None
        if base is not None:
            b_gens = [t.generation for t in base]
            cached = all(t.cached for t in base)
            compared = baseline_metrics(gens, b_gens, cached, self.sampling.greedy)
            base_text = self.tokenizer.decode(b_gens[-1].tokens, skip_special_tokens=True)
            baseline_task = task_scores(request, base_text)
        return RequestRecord(
            request_id=request.request_id,
            category=request.category,
            subcategory=request.subcategory,
            output_text=texts[-1],
            turns=[
                TurnRecord(
                    prompt_tokens=len(t.prompt),
                    output_text=text,
                    output_tokens=t.generation.tokens,
                    new_tokens=len(t.generation.tokens),
                    total_s=t.generation.total_s,
                    stop_reason=t.generation.stop_reason,
                    ttft_s=t.generation.ttft_s,
                )
                for t, text in zip(turns, texts, strict=True)
            ],
            metrics=generation_metrics(gens, sum(t.queued_s for t in turns), compared),
            task=task_scores(request, texts[-1]),
            baseline_task=baseline_task,
        )

    # ---------------------------------------------------------------- the run
    def run(self, requests: list[Request], folder: RunFolder, meta: RunMeta) -> RunSummary:
        """Decode every request not already in ``folder``; always writes ``summary.json``.

        ``meta`` (method, models, config) gets the machine, start time and run folder."""
        todo = [r for r in requests if r.request_id not in folder.done_ids]
        if len(todo) < len(requests):
            log.info(
                "resume: %d of %d requests already done", len(requests) - len(todo), len(requests)
            )
        meta = replace(
            meta,
            machine=machine_description(),
            started=time.strftime("%Y-%m-%d %H:%M:%S"),
            output_dir=str(folder.path.resolve()),
        )
        complete = False
        try:
            self._each(lambda cb: cb.on_run_start(meta, len(todo)))
            self.decode_requests(todo, folder)
            complete = True
        finally:
            wanted = {r.request_id for r in requests}
            records = [r for r in folder.records if r.request_id in wanted]
            summary = summarize(records, meta, complete, self._batch_summary(records))
            try:
                folder.write_summary(summary)
            finally:
                self._each(lambda cb: cb.on_run_end(summary, folder.path), safe=True)
        return summary

    def decode_requests(self, todo: list[Request], folder: RunFolder) -> None:
        """Warm up, then decode: request by request at batch size 1 (baseline right before
        the method), or a baseline pass then the method's pass at batch size N; each record
        is appended as soon as its request is done."""
        s = self.settings
        self._measured = _Measured()
        if not todo:
            return
        max_context = self._max_context(todo)
        method = self._scheduler(self.pipeline, max_context)
        base = self._scheduler(self.baseline, max_context) if s.baseline else None
        self._check_prompts(method, todo)
        log.info("decoding: batch_size=%d device=%s kv=%s", s.batch_size, s.device, s.layout().kind)
        if s.warmup:
            self.warmup([method] + ([base] if base is not None else []), todo)
        if base is not None and self.baseline_cache.directory is not None:
            self._check_drift(base, todo[0])
        on_round = self._round_hook()
        chunks = [[r] for r in todo] if s.batch_size == 1 else [todo]
        base_wall = method_wall = 0.0
        base_tokens = method_tokens = 0
        for chunk in chunks:
            for r in chunk:
                self._each(lambda cb, r=r: cb.on_request_start(r))
            base_turns = None
            if base is not None:
                base_turns = self._decode(base, chunk, cache=True)
                base_wall += base.stats.wall_s
                base_tokens += base.stats.new_tokens

            def on_request(req: Request, turns: list[TurnResult], bt: Any = base_turns) -> None:
                record = self._record(req, turns, bt[req.request_id] if bt is not None else None)
                folder.append(record)
                self._each(lambda cb: cb.on_request_end(record))

            self._decode(method, chunk, on_request=on_request, on_round=on_round)
            method_wall += method.stats.wall_s
            method_tokens += method.stats.new_tokens
        pools = method.kv.pools
        throughput = method_tokens / method_wall if method_wall else 0.0
        self._measured.decoding = DecodePass(
            kv=method.kv.report(),
            attention=pools[0].attention.name if pools else "contiguous",
            block_size=pools[0].block_size if pools else None,
            wall_s=method_wall,
            new_tokens=method_tokens,
            throughput_tokens_per_s=throughput,
            mean_active=method.stats.mean_batch,
        )
        if base is not None and base_wall:
            base_tp = base_tokens / base_wall
            self._measured.baseline = BaselinePass(
                baseline_wall_s=base_wall,
                baseline_throughput_tokens_per_s=base_tp,
                throughput_speedup=throughput / base_tp if base_tp else None,
            )

    def _check_drift(self, base: Scheduler, request: Request) -> None:
        """Re-time the cached baseline of the first request's first turn: a machine slower or
        faster than when the cache was filled would skew every cached speedup."""
        s = self.settings
        prompt = build_prompt(self.tokenizer, [{"role": "user", "content": request.turns[0]}], s)
        hit = self._cached_baseline(prompt)
        if hit is None or not hit.total_s:
            return
        (fresh,) = base.generate([SeqRequest(prompt, s.max_new_tokens, s.seed)], self.sampling)
        drift = fresh.generation.total_s / hit.total_s
        self._measured.baseline_drift = drift
        if abs(drift - 1.0) > DRIFT_WARN:
            log.warning(
                "the cached baseline of %s took %.2fs, now %.2fs (%.0f%% %s): cached speedups "
                "compare against another machine state; runner.baseline_cache=false measures "
                "side by side",
                request.request_id,
                hit.total_s,
                fresh.generation.total_s,
                abs(drift - 1.0) * 100,
                "slower" if drift > 1 else "faster",
            )

    def _batch_summary(self, records: list[RequestRecord]) -> BatchReport:
        """``batch``: size, device, KV layout, throughput across the batch and latencies."""
        s = self.settings
        lat = [r.metrics.latency_s for r in records]
        return BatchReport(
            batch_size=s.batch_size,
            device=s.device,
            baseline_drift=self._measured.baseline_drift,
            decoding=self._measured.decoding,
            baseline=self._measured.baseline,
            latency_s_mean=statistics.fmean(lat) if lat else None,
            latency_s_p50=percentile(lat, 0.5),
            latency_s_p90=percentile(lat, 0.9),
        )
