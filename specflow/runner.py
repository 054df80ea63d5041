"""Run a pipeline over a workload, next to plain decoding, and write the results.

For every request (conversation), turn by turn: build the prompt (chat template when the
tokenizer has one), decode it with plain decoding of the target (the *baseline*, cached
on disk per model + prompt + settings + machine so sweeps don't repeat it) and with the
method, compare the outputs (fidelity), score the task, and append the record to
``requests.jsonl`` before moving on.  Warm-up generations run first and are not timed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from specflow.acceptance import StandardAcceptor
from specflow.engine import Generation, SpeculativePipeline
from specflow.results import RunFolder, summarize
from specflow.state import SamplingParams
from specflow.workload import Request

log = logging.getLogger(__name__)


class Tokenizer(Protocol):
    """What the runner needs of a tokenizer (a HF tokenizer satisfies it)."""

    chat_template: Any

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class RunCallback(Protocol):
    """Hooks a callback may implement (all optional; see ``callbacks/``).

    ``meta`` carries ``output_dir`` (the run folder) so loggers can write from the start.
    ``on_run_end`` is always called, also when the run crashes (``summary["complete"]`` is
    then false), and one callback failing there does not stop the others.
    """

    def on_run_start(self, meta: dict[str, Any], num_requests: int) -> None: ...

    def on_request_start(self, request: Request) -> None: ...

    def on_round_end(self, request: Request, event: dict[str, int]) -> None:
        """After every round: ``round``, ``k``, ``drafted``, ``accepted``, ``committed``."""

    def on_request_end(self, record: dict[str, Any]) -> None: ...

    def on_run_end(self, summary: dict[str, Any], folder: Path) -> None: ...


@dataclass
class RunSettings:
    """How requests are decoded and measured (config group ``runner``)."""

    max_new_tokens: int = 128
    seed: int = 0
    warmup: bool = True
    baseline: bool = True
    baseline_cache: bool = True
    use_chat_template: bool = True
    system_prompt: str | None = None
    cache_dir: str | None = None


def machine_description() -> dict[str, Any]:
    """What the numbers were measured on."""
    return {
        "host": platform.node(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def build_prompt(
    tokenizer: Tokenizer, messages: list[dict[str, str]], settings: RunSettings
) -> list[int]:
    """Token ids of a conversation ending with a user turn, ready for the answer."""
    if settings.use_chat_template and getattr(tokenizer, "chat_template", None):
        msgs = messages
        if settings.system_prompt:
            msgs = [{"role": "system", "content": settings.system_prompt}, *messages]
        ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # BatchEncoding
            ids = ids["input_ids"]
        return list(ids)
    text = "\n\n".join(m["content"] for m in messages)
    return list(tokenizer.encode(text))


class BaselineCache:
    """Plain-decoding results on disk, keyed by everything that can change them."""

    def __init__(self, directory: Path | None) -> None:
        self.directory = directory
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)

    def key(
        self,
        pipeline: SpeculativePipeline,
        prompt: list[int],
        max_new: int,
        sampling: SamplingParams,
        seed: int,
    ) -> str:
        lm = pipeline.target_verifier.lm
        blob = json.dumps(
            {
                "model": repr(lm.info),
                "backend": type(lm).__name__,
                "prompt": prompt,
                "max_new": max_new,
                "sampling": repr(sampling),
                "seed": seed,
                "machine": machine_description(),
            },
            sort_keys=True,
        )
        return hashlib.sha256(blob.encode()).hexdigest()[:32]

    def get(self, key: str) -> dict[str, Any] | None:
        if self.directory is None:
            return None
        path = self.directory / f"{key}.json"
        return json.loads(path.read_text()) if path.exists() else None

    def put(self, key: str, value: dict[str, Any]) -> None:
        if self.directory is None:
            return
        path = self.directory / f"{key}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(value))
        tmp.replace(path)


def _score(request: Request, text: str) -> dict[str, float]:
    try:
        from specflow.tasks.scoring import score_request
    except ImportError:  # pragma: no cover - tasks are optional extras
        return {}
    return score_request(request.category, text, request.reference, request.extra.get("problem"))


def _generation_metrics(gens: list[Generation]) -> dict[str, Any]:
    rounds = sum(g.stats.rounds for g in gens)
    accepted = sum(g.stats.accepted for g in gens)
    drafted = sum(g.stats.drafted for g in gens)
    total_s = sum(g.total_s for g in gens)
    new_tokens = sum(len(g.tokens) for g in gens)
    times: dict[str, float] = {}
    for g in gens:
        for k, v in g.times.as_dict(g.total_s).items():
            times[k] = times.get(k, 0.0) + v
        for level, nested in g.nested_times.items():
            for k, v in vars(nested).items():
                key = f"nested/{level}/{k}"
                times[key] = times.get(key, 0.0) + v
    levels: dict[str, list[int]] = {}
    for g in gens:
        for level, d in g.stats.level_drafted.items():
            acc = levels.setdefault(level, [0, 0])
            acc[0] += d
            acc[1] += g.stats.level_accepted[level]
        for level, nested in g.nested_stats.items():
            acc = levels.setdefault(level, [0, 0])
            acc[0] += nested.drafted
            acc[1] += nested.accepted
    return {
        "new_tokens": new_tokens,
        "total_s": total_s,
        "tokens_per_s": new_tokens / total_s if total_s else 0.0,
        "rounds": rounds,
        "target_calls": sum(g.stats.target_calls for g in gens),
        "drafted": drafted,
        "accepted": accepted,
        "tau": 1.0 + accepted / rounds if rounds else 0.0,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "levels": levels,
        "time_per_stage": times,
        "k_per_round": [k for g in gens for k in g.stats.chosen_k],
        "rounds_skipped": sum(1 for g in gens for k in g.stats.chosen_k if k == 0),
        "drafted_per_round": [k for g in gens for k in g.stats.drafted_per_round],
        "accepted_per_round": [a for g in gens for a in g.stats.accepted_per_round],
        **_pool_metrics(gens),
    }


def _pool_metrics(gens: list[Generation]) -> dict[str, Any]:
    """A drafter pool's (MetaSD) per-round arms and rewards, arm counts and catch-up cost."""
    stats = [s for g in gens for s in (g.stats, *g.nested_stats.values())]
    arms = [a for s in stats for a in s.arms]
    if not arms:
        return {}
    return {
        "arms": arms,
        "arm_rewards": [r for s in stats for r in s.rewards],
        "arm_counts": [arms.count(i) for i in range(max(arms) + 1)],
        "catchup_tokens": sum(s.catchup_tokens for s in stats),
        "catchup_s": sum(s.catchup_s for s in stats),
    }


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
        self.callbacks = callbacks or []
        cache_root = Path(
            settings.cache_dir
            or os.environ.get("SPECFLOW_CACHE")
            or Path.home() / ".cache" / "specflow"
        )
        self.baseline_cache = BaselineCache(
            cache_root / "baselines" if settings.baseline_cache else None
        )

    def _round_hook(self, request: Request) -> Any:
        """``on_round_end(request, event)`` for the callbacks that define it (else None)."""
        hooks = [cb.on_round_end for cb in self.callbacks if hasattr(cb, "on_round_end")]
        if not hooks:
            return None
        return lambda event: [hook(request, event) for hook in hooks]

    def _emit(self, hook: str, *args: Any, safe: bool = False) -> None:
        """Call ``hook`` on every callback having it; ``safe``: log errors, call them all."""
        for cb in self.callbacks:
            fn = getattr(cb, hook, None)
            if fn is None:
                continue
            if not safe:
                fn(*args)
                continue
            try:
                fn(*args)
            except Exception:  # noqa: BLE001 - every logger must get to finish
                log.exception("callback %s.%s failed", type(cb).__name__, hook)

    def _baseline(self, prompt: list[int]) -> tuple[list[int], float, bool]:
        s = self.settings
        key = self.baseline_cache.key(
            self.pipeline, prompt, s.max_new_tokens, self.sampling, s.seed
        )
        hit = self.baseline_cache.get(key)
        if hit is not None:
            return hit["tokens"], hit["total_s"], True
        gen = self.baseline.generate(prompt, s.max_new_tokens, self.sampling, s.seed)
        self.baseline_cache.put(key, {"tokens": gen.tokens, "total_s": gen.total_s})
        return gen.tokens, gen.total_s, False

    def warmup(self, request: Request) -> None:
        """Untimed short generations so that first-call costs don't land in a measurement."""
        prompt = build_prompt(
            self.tokenizer, [{"role": "user", "content": request.turns[0]}], self.settings
        )
        n = min(8, self.settings.max_new_tokens)
        self.pipeline.generate(prompt, n, self.sampling, self.settings.seed)
        if self.settings.baseline:
            self.baseline.generate(prompt, n, self.sampling, self.settings.seed)

    def run_request(self, request: Request) -> dict[str, Any]:
        """Decode one conversation with the method and the baseline; the JSONL record."""
        s = self.settings
        method_msgs: list[dict[str, str]] = []
        base_msgs: list[dict[str, str]] = []
        gens: list[Generation] = []
        turns = []
        base_tokens = 0
        base_s = 0.0
        cached = True
        matches = True
        base_text = ""
        for turn in request.turns:
            method_msgs.append({"role": "user", "content": turn})
            prompt = build_prompt(self.tokenizer, method_msgs, s)
            if s.baseline:
                base_msgs.append({"role": "user", "content": turn})
                base_prompt = build_prompt(self.tokenizer, base_msgs, s)
                b_tokens, b_s, hit = self._baseline(base_prompt)
                cached &= hit
                base_tokens += len(b_tokens)
                base_s += b_s
                base_text = self.tokenizer.decode(b_tokens, skip_special_tokens=True)
                base_msgs.append({"role": "assistant", "content": base_text})
            hook = self._round_hook(request)
            extra = {"on_round": hook} if hook is not None else {}
            gen = self.pipeline.generate(prompt, s.max_new_tokens, self.sampling, s.seed, **extra)
            gens.append(gen)
            text = self.tokenizer.decode(gen.tokens, skip_special_tokens=True)
            method_msgs.append({"role": "assistant", "content": text})
            if s.baseline:
                matches &= gen.tokens == b_tokens
            turns.append(
                {
                    "prompt_tokens": len(prompt),
                    "output_text": text,
                    "output_tokens": gen.tokens,
                    "new_tokens": len(gen.tokens),
                    "total_s": gen.total_s,
                    "stop_reason": gen.stop_reason,
                }
            )
        metrics = _generation_metrics(gens)
        if s.baseline:
            metrics.update(
                {
                    "baseline_tokens": base_tokens,
                    "baseline_s": base_s,
                    "baseline_tokens_per_s": base_tokens / base_s if base_s else 0.0,
                    "baseline_cached": cached,
                    "speedup": (metrics["tokens_per_s"] / (base_tokens / base_s))
                    if base_s
                    else None,
                    "matches_baseline": matches if self.sampling.greedy else None,
                }
            )
        record = {
            "request_id": request.request_id,
            "category": request.category,
            "subcategory": request.subcategory,
            "output_text": turns[-1]["output_text"],
            "turns": turns,
            "metrics": metrics,
            "task": _score(request, turns[-1]["output_text"]),
        }
        if s.baseline:
            record["baseline_task"] = _score(request, base_text)
        return record

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
            self._emit("on_run_start", meta, len(todo))
            self.decode_requests(todo, folder)
            complete = True
        finally:
            wanted = {r.request_id for r in requests}
            records = [r for r in folder.records if r["request_id"] in wanted]
            summary = summarize(records, {**meta, "complete": complete})
            summary.update(self.summary_extra(records))
            folder.write_summary(summary)
            self._emit("on_run_end", summary, folder.path, safe=True)
        return summary

    def decode_requests(self, todo: list[Request], folder: RunFolder) -> None:
        """Warm up, then decode each request and append its record as soon as it is done."""
        if todo and self.settings.warmup:
            self.warmup(todo[0])
        for request in todo:
            self._emit("on_request_start", request)
            record = self.run_request(request)
            folder.append(record)
            self._emit("on_request_end", record)

    def summary_extra(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        """Keys a runner adds to the summary (none here; batching adds ``batch``)."""
        return {}
