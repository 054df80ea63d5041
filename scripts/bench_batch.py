"""CPU throughput of the engine vs batch size (plain decoding and PLD), per KV layout.

Usage: python scripts/bench_batch.py [--model smollm2-135m] [--prompts 8] [--tokens 32]
                                     [--batches 1,2,4,8] [--repeats 3] [--threads N]
                                     [--prompt-tokens 96] [--kv contiguous,paged]

For each method (``ar``, ``pld``) and KV layout, decodes the first ``--prompts`` Spec-Bench
questions (first turns, chat template) ``--repeats`` times per batch size with the scheduler
and prints the median throughput (new tokens / wall seconds across the batch) and the
speedup over batch size 1 of the same method and layout.  ``engine`` rows are
``SpeculativePipeline.generate`` (a batch of one, one request after another) for reference.
EOS is ignored so every request makes ``--tokens``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("MKL_CBWR", "AUTO")

import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # the repo root

from specflow.engine import SpeculativePipeline  # noqa: E402
from specflow.kv.stores import KVLayout  # noqa: E402
from specflow.models.loading import load_model  # noqa: E402
from specflow.runner import build_prompt  # noqa: E402
from specflow.scheduler import Scheduler, SeqRequest, generate  # noqa: E402
from specflow.settings import RunSettings  # noqa: E402
from specflow.workload import SpecBench  # noqa: E402
from stages.acceptors.standard import StandardAcceptor  # noqa: E402
from stages.drafters.pld import PLDDrafter  # noqa: E402
from stages.verifiers.full import FullVerifier  # noqa: E402


def engine(pipe: SpeculativePipeline, prompts: list[list[int]], tokens: int) -> float:
    """Throughput of the batch-1 engine, one request after another."""
    t0 = time.perf_counter()
    for p in prompts:
        generate(pipe, p, tokens, stop_token_ids=())
    return len(prompts) * tokens / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--kv", default="contiguous,paged", help="KV layouts to measure")
    ap.add_argument(
        "--prompt-tokens", type=int, default=96, help="keep the last N prompt tokens (0: all)"
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(args.model, dtype="float32", backend="native", trust_remote_code=False,
                        packed_weights=None)
    lm = loaded.lm
    reqs = SpecBench(per_category=max(1, args.prompts // 6 + 1)).requests()[: args.prompts]
    settings = RunSettings()
    prompts = [
        build_prompt(loaded.tokenizer, [{"role": "user", "content": r.turns[0]}], settings)
        for r in reqs
    ]
    if args.prompt_tokens:  # decoding, not prefill, should dominate the measurement
        prompts = [p[-args.prompt_tokens :] for p in prompts]
    batches = [int(b) for b in args.batches.split(",")]
    mean_len = statistics.mean(map(len, prompts))
    print(
        f"model {lm.info.name}, {len(prompts)} prompts (mean {mean_len:.0f}"
        f" tokens), {args.tokens} new tokens each, torch threads {torch.get_num_threads()}, "
        f"load {os.getloadavg()[0]:.2f}"
    )
    print(f"{'method':<8}{'kv':<12}{'batch':>7}{'tok/s':>10}{'vs b1':>8}{'vs engine':>11}")
    for method in ("ar", "pld"):
        drafter = PLDDrafter(k=8) if method == "pld" else None
        pipe = SpeculativePipeline(FullVerifier(lm), StandardAcceptor(), drafter=drafter)
        engine(pipe, prompts, args.tokens)  # warm-up
        eng = statistics.median(engine(pipe, prompts, args.tokens) for _ in range(args.repeats))
        print(f"{method:<8}{'':<12}{'engine':>7}{eng:>10.1f}{'':>8}{1.0:>11.2f}")
        for kind in args.kv.split(","):
            base = None
            for b in batches:
                sched = Scheduler(
                    pipe, b, KVLayout(kind=kind), max_context=max(map(len, prompts)) + 64
                )
                reqs_b = [SeqRequest(p, args.tokens, stop_token_ids=()) for p in prompts]
                sched.generate(reqs_b[:b])  # warm-up
                runs = []
                for _ in range(args.repeats):
                    sched.generate(reqs_b)
                    runs.append(sched.stats.tokens_per_s)
                tps = statistics.median(runs)
                base = base or tps
                print(
                    f"{method:<8}{kind:<12}{b:>7}{tps:>10.1f}{tps / base:>8.2f}{tps / eng:>11.2f}"
                )


if __name__ == "__main__":
    main()
