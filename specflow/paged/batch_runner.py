"""``BatchRunner``: ``specflow.runner.Runner`` with batched decoding (``runner.batch_size``).

Same interface (``run(requests, folder, meta)``), same per-request records in
``requests.jsonl`` (``run_request``'s format) and the same callbacks, so ``app.py`` switches
with one ``if``.  Differences, all because requests now share time:

- The whole workload is decoded by ``BatchedPipeline`` with continuous batching; the turns
  of a conversation run in order (turn i+1 is queued, at the front, when turn i finishes).
- The baseline is plain decoding *at the same batch size* (a batched pass over the
  workload before the method's pass); it is not taken from the batch-1 baseline cache
  (its timings depend on the batch).
- A record's ``metrics.total_s`` is the request's *latency* (admission to finish, summed
  over turns; ``metrics.queued_s``: time waiting for a slot).  ``summary["batch"]`` has the
  batch-level numbers: throughput (new tokens / wall-clock seconds across the batch) of the
  method and of the baseline, their ratio, and latency mean / p50 / p90.
"""

from __future__ import annotations

import logging
import statistics
from typing import Any

from specflow.paged.batch_engine import BatchedPipeline, BatchResult, SeqRequest
from specflow.results import RunFolder
from specflow.runner import Runner, _generation_metrics, _score, build_prompt
from specflow.workload import Request

log = logging.getLogger(__name__)


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    vals = sorted(values)
    return vals[min(len(vals) - 1, round(q * (len(vals) - 1)))]


class BatchRunner(Runner):
    """Decodes a workload with a method and its baseline in batches (see module doc)."""

    def __init__(
        self,
        *args: Any,
        batch_size: int = 8,
        device: str = "cpu",
        attention: str = "auto",
        dtype: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.batch_size = batch_size
        self.device = device
        self.attention = attention
        self.dtype = dtype

    # ---------------------------------------------------------------- decoding passes
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

    def _batched(self, pipeline: Any, max_context: int) -> BatchedPipeline:
        return BatchedPipeline(
            pipeline,
            batch_size=self.batch_size,
            device=self.device,
            dtype=self.dtype,
            attention=self.attention,
            max_context=max_context,
        )

    def _decode(
        self, bp: BatchedPipeline, requests: list[Request], on_request: Any = None
    ) -> dict[str, list[tuple[list[int], BatchResult]]]:
        """Every conversation, turn by turn; ``request_id -> [(prompt, result)]`` per turn.

        ``on_request(request, turns)`` is called as soon as a conversation's last turn ends.
        """
        s = self.settings
        done: dict[str, list[tuple[list[int], BatchResult]]] = {}

        def first(req: Request) -> SeqRequest:
            msgs = [{"role": "user", "content": req.turns[0]}]
            prompt = build_prompt(self.tokenizer, msgs, s)
            return SeqRequest(prompt, s.max_new_tokens, s.seed, tag=(req, msgs))

        def finished(result: BatchResult) -> list[SeqRequest]:
            req, msgs = result.request.tag
            turns = done.setdefault(req.request_id, [])
            turns.append((result.request.prompt, result))
            text = self.tokenizer.decode(result.generation.tokens, skip_special_tokens=True)
            msgs = [*msgs, {"role": "assistant", "content": text}]
            if len(turns) < len(req.turns):
                msgs.append({"role": "user", "content": req.turns[len(turns)]})
                prompt = build_prompt(self.tokenizer, msgs, s)
                return [SeqRequest(prompt, s.max_new_tokens, s.seed, tag=(req, msgs))]
            if on_request is not None:
                on_request(req, turns)
            return []

        bp.generate([first(r) for r in requests], self.sampling, on_done=finished)
        return done

    def _record(
        self,
        request: Request,
        turns: list[tuple[list[int], BatchResult]],
        base: list[tuple[list[int], BatchResult]] | None,
    ) -> dict[str, Any]:
        """``Runner.run_request``'s record from batched results."""
        gens = [r.generation for _, r in turns]
        texts = [self.tokenizer.decode(g.tokens, skip_special_tokens=True) for g in gens]
        metrics = _generation_metrics(gens)
        metrics["latency_s"] = metrics["total_s"]
        metrics["queued_s"] = sum(r.queued_s for _, r in turns)
        base_text = ""
        if base is not None:
            b_gens = [r.generation for _, r in base]
            b_tokens = sum(len(g.tokens) for g in b_gens)
            b_s = sum(g.total_s for g in b_gens)
            base_text = self.tokenizer.decode(b_gens[-1].tokens, skip_special_tokens=True)
            matches = all(g.tokens == b.tokens for g, b in zip(gens, b_gens, strict=True))
            metrics.update(
                {
                    "baseline_tokens": b_tokens,
                    "baseline_s": b_s,
                    "baseline_tokens_per_s": b_tokens / b_s if b_s else 0.0,
                    "baseline_cached": False,
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
                    "prompt_tokens": len(prompt),
                    "output_text": text,
                    "output_tokens": g.tokens,
                    "new_tokens": len(g.tokens),
                    "total_s": g.total_s,
                    "stop_reason": g.stop_reason,
                }
                for (prompt, _), g, text in zip(turns, gens, texts, strict=True)
            ],
            "metrics": metrics,
            "task": _score(request, texts[-1]),
        }
        if base is not None:
            record["baseline_task"] = _score(request, base_text)
        return record

    # ---------------------------------------------------------------- the run
    def decode_requests(self, todo: list[Request], folder: RunFolder) -> None:
        """Decode ``todo`` in batches (records appended as each request finishes)."""
        self._batch_info: dict[str, Any] = {"batch_size": self.batch_size, "device": self.device}
        if todo:
            self._batch_info.update(self._run_batched(todo, folder))

    def summary_extra(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        """``batch``: size, device, backend, throughput across the batch and latencies."""
        batch = dict(
            getattr(self, "_batch_info", None)
            or {"batch_size": self.batch_size, "device": self.device}
        )
        lat = [r["metrics"].get("latency_s", r["metrics"]["total_s"]) for r in records]
        batch.update(
            {
                "latency_s_mean": statistics.fmean(lat) if lat else None,
                "latency_s_p50": _percentile(lat, 0.5),
                "latency_s_p90": _percentile(lat, 0.9),
            }
        )
        return {"batch": batch}

    def _run_batched(self, todo: list[Request], folder: RunFolder) -> dict[str, Any]:
        s = self.settings
        max_context = self._max_context(todo)
        method = self._batched(self.pipeline, max_context)
        base = self._batched(self.baseline, max_context) if s.baseline else None
        log.info(
            "batched decoding: batch_size=%d device=%s attention=%s",
            self.batch_size,
            self.device,
            method.attention,
        )
        if s.warmup:
            n = min(8, s.max_new_tokens)
            warm = [
                SeqRequest(
                    build_prompt(self.tokenizer, [{"role": "user", "content": r.turns[0]}], s), n
                )
                for r in todo[: self.batch_size]
            ]
            for bp in (method, base):
                if bp is not None:
                    bp.generate(warm, self.sampling)
        out: dict[str, Any] = {"attention": method.attention, "block_size": method.block_size}
        base_turns = None
        if base is not None:
            base_turns = self._decode(base, todo)
            out["baseline_wall_s"] = base.stats.wall_s
            out["baseline_throughput_tokens_per_s"] = base.stats.tokens_per_s

        def on_request(req: Request, turns: list[tuple[list[int], BatchResult]]) -> None:
            self._emit("on_request_start", req)
            record = self._record(req, turns, base_turns[req.request_id] if base_turns else None)
            folder.append(record)
            self._emit("on_request_end", record)

        self._decode(method, todo, on_request)
        out.update(
            {
                "wall_s": method.stats.wall_s,
                "new_tokens": method.stats.new_tokens,
                "throughput_tokens_per_s": method.stats.tokens_per_s,
                "mean_active": method.stats.mean_batch,
            }
        )
        if base is not None and out["baseline_throughput_tokens_per_s"]:
            out["throughput_speedup"] = (
                out["throughput_tokens_per_s"] / out["baseline_throughput_tokens_per_s"]
            )
        return out
