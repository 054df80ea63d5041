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

import logging
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from specflow.acceptance import StandardAcceptor
from specflow.baselines import BaselineCache, machine_description
from specflow.engine import Generation, SpeculativePipeline
from specflow.errors import ConfigError, SpecflowError
from specflow.records import generation_metrics, percentile, task_scores
from specflow.results import RunFolder, summarize
from specflow.scheduler import BatchResult, Scheduler, SeqRequest
from specflow.settings import RunSettings
from specflow.state import RoundStats, SamplingParams, StageTimes
from specflow.workload import Request

log = logging.getLogger(__name__)


DRIFT_WARN = 0.10  # a cached baseline that re-times more than 10 % off is reported


class Tokenizer(Protocol):
    """What the runner needs of a tokenizer (a HF tokenizer satisfies it)."""

    chat_template: Any

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


@runtime_checkable
class RunCallback(Protocol):
    """What the runner calls on every callback (see ``callbacks/``; a hook a callback does
    not need is a no-op there).

    ``meta`` carries ``output_dir`` (the run folder) so loggers can write from the start.
    ``on_run_end`` is always called, also when the run crashes (``summary["complete"]`` is
    then false), and one callback failing there does not stop the others.  ``on_round_end``
    is called after every round only for callbacks whose ``wants_rounds`` is true.
    """

    wants_rounds: bool

    def on_run_start(self, meta: dict[str, Any], num_requests: int) -> None: ...

    def on_request_start(self, request: Request) -> None: ...

    def on_round_end(self, request: Request, event: dict[str, int]) -> None:
        """After every round: ``round``, ``k``, ``drafted``, ``accepted``, ``committed``."""

    def on_request_end(self, record: dict[str, Any]) -> None: ...

    def on_run_end(self, summary: dict[str, Any], folder: Path) -> None: ...


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
        self.baseline = SpeculativePipeline(pipeline.target_verifier, StandardAcceptor(), name="ar")
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
        cache_root = Path(
            settings.cache_dir
            or os.environ.get("SPECFLOW_CACHE")
            or Path.home() / ".cache" / "specflow"
        )
        use_cache = settings.baseline_cache and settings.batch_size == 1
        self.baseline_cache = BaselineCache(cache_root / "baselines" if use_cache else None)
        self._batch: dict[str, Any] = {}  # the batch section of the summary, as measured

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
            gen = Generation(hit["tokens"], RoundStats(), StageTimes(), hit["total_s"], "cached")
            self._finish_turn(conv, TurnResult(prompt, gen, cached=True))
        return None

    def _baseline_key(self, prompt: list[int]) -> str:
        s = self.settings
        return self.baseline_cache.key(
            self.pipeline, prompt, s.max_new_tokens, self.sampling, s.seed
        )

    def _cached_baseline(self, prompt: list[int]) -> dict[str, Any] | None:
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
                    {"tokens": turn.generation.tokens, "total_s": turn.generation.total_s},
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
        """Untimed short generations so that first-call costs don't land in a measurement."""
        s = self.settings
        n = min(8, s.max_new_tokens)
        warm = [
            SeqRequest(
                build_prompt(self.tokenizer, [{"role": "user", "content": r.turns[0]}], s), n
            )
            for r in requests[: s.batch_size]
        ]
        for scheduler in schedulers:
            scheduler.generate(warm, self.sampling)

    def _record(
        self, request: Request, turns: list[TurnResult], base: list[TurnResult] | None
    ) -> dict[str, Any]:
        """The JSONL record of a request (method's turns, and the baseline's when run)."""
        gens = [t.generation for t in turns]
        texts = [self.tokenizer.decode(g.tokens, skip_special_tokens=True) for g in gens]
        metrics = generation_metrics(gens)
        metrics["latency_s"] = metrics["total_s"]
        metrics["queued_s"] = sum(t.queued_s for t in turns)
        base_text = ""
        if base is not None:
            b_gens = [t.generation for t in base]
            b_tokens = sum(len(g.tokens) for g in b_gens)
            b_s = sum(g.total_s for g in b_gens)
            base_text = self.tokenizer.decode(b_gens[-1].tokens, skip_special_tokens=True)
            matches = all(g.tokens == b.tokens for g, b in zip(gens, b_gens, strict=True))
            metrics.update(
                {
                    "baseline_tokens": b_tokens,
                    "baseline_s": b_s,
                    "baseline_tokens_per_s": b_tokens / b_s if b_s else 0.0,
                    "baseline_cached": all(t.cached for t in base),
                    "speedup": metrics["tokens_per_s"] / (b_tokens / b_s) if b_s else None,
                    "matches_baseline": matches if self.sampling.greedy else None,
                }
            )
        record = {
            "request_id": request.request_id,
            "category": request.category,
            "subcategory": request.subcategory,
            "output_text": texts[-1],
            "turns": [
                {
                    "prompt_tokens": len(t.prompt),
                    "output_text": text,
                    "output_tokens": t.generation.tokens,
                    "new_tokens": len(t.generation.tokens),
                    "total_s": t.generation.total_s,
                    "stop_reason": t.generation.stop_reason,
                }
                for t, text in zip(turns, texts, strict=True)
            ],
            "metrics": metrics,
            "task": task_scores(request, texts[-1]),
        }
        if base is not None:
            record["baseline_task"] = task_scores(request, base_text)
        return record

    # ---------------------------------------------------------------- the run
    def run(
        self, requests: list[Request], folder: RunFolder, meta: dict[str, Any]
    ) -> dict[str, Any]:
        """Decode every request not already in ``folder``; always writes ``summary.json``."""
        todo = [r for r in requests if r.request_id not in folder.done_ids]
        if len(todo) < len(requests):
            log.info(
                "resume: %d of %d requests already done", len(requests) - len(todo), len(requests)
            )
        meta = {
            **meta,
            "machine": machine_description(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "output_dir": str(folder.path.resolve()),
        }
        complete = False
        try:
            self._each(lambda cb: cb.on_run_start(meta, len(todo)))
            self.decode_requests(todo, folder)
            complete = True
        finally:
            wanted = {r.request_id for r in requests}
            records = [r for r in folder.records if r["request_id"] in wanted]
            summary = summarize(records, {**meta, "complete": complete})
            summary["batch"] = self._batch_summary(records)
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
        self._batch = {"batch_size": s.batch_size, "device": s.device}
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
        self._batch.update(
            {
                **method.kv.report(),
                "attention": pools[0].attention.name if pools else "contiguous",
                "block_size": pools[0].block_size if pools else None,
                "wall_s": method_wall,
                "new_tokens": method_tokens,
                "throughput_tokens_per_s": method_tokens / method_wall if method_wall else 0.0,
                "mean_active": method.stats.mean_batch,
            }
        )
        if base is not None and base_wall:
            base_tp = base_tokens / base_wall
            self._batch["baseline_wall_s"] = base_wall
            self._batch["baseline_throughput_tokens_per_s"] = base_tp
            if base_tp:
                self._batch["throughput_speedup"] = self._batch["throughput_tokens_per_s"] / base_tp

    def _check_drift(self, base: Scheduler, request: Request) -> None:
        """Re-time the cached baseline of the first request's first turn: a machine slower or
        faster than when the cache was filled would skew every cached speedup."""
        s = self.settings
        prompt = build_prompt(self.tokenizer, [{"role": "user", "content": request.turns[0]}], s)
        hit = self._cached_baseline(prompt)
        if hit is None or not hit["total_s"]:
            return
        (fresh,) = base.generate([SeqRequest(prompt, s.max_new_tokens, s.seed)], self.sampling)
        drift = fresh.generation.total_s / hit["total_s"]
        self._batch["baseline_drift"] = drift
        if abs(drift - 1.0) > DRIFT_WARN:
            log.warning(
                "the cached baseline of %s took %.2fs, now %.2fs (%.0f%% %s): cached speedups "
                "compare against another machine state; runner.baseline_cache=false measures "
                "side by side",
                request.request_id,
                hit["total_s"],
                fresh.generation.total_s,
                abs(drift - 1.0) * 100,
                "slower" if drift > 1 else "faster",
            )

    def _batch_summary(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        """``batch``: size, device, KV layout, throughput across the batch and latencies."""
        s = self.settings
        batch = dict(self._batch or {"batch_size": s.batch_size, "device": s.device})
        lat = [r["metrics"].get("latency_s", r["metrics"]["total_s"]) for r in records]
        batch.update(
            {
                "latency_s_mean": statistics.fmean(lat) if lat else None,
                "latency_s_p50": percentile(lat, 0.5),
                "latency_s_p90": percentile(lat, 0.9),
            }
        )
        return batch
