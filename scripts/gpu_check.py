"""Short CUDA benchmark of batched decoding: SDPA vs flash, plain decoding vs PLD.

Usage: python scripts/gpu_check.py [--tokens 64] [--batches 1,8,32] [--budget 200]

Models: a random tiny Llama (8 layers, hidden 512, vocab 32000: no download) and, when it
loads offline, smollm2-135m.  Prints tokens/s across the batch (new tokens / wall seconds)
per (model, attention, method, batch size) and the speedup over batch 1.  Stops adding
rows once ``--budget`` seconds are spent.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # the repo root

from specflow.engine import SpeculativePipeline  # noqa: E402
from specflow.models.native import NativeLM  # noqa: E402
from specflow.models.stores import KVLayout  # noqa: E402
from specflow.models.tiny import tiny_hf_model, tiny_model_info  # noqa: E402
from specflow.paged.attention import flash_available  # noqa: E402
from specflow.scheduler import Scheduler, SeqRequest  # noqa: E402
from stages.exact_acceptor import ExactAcceptor  # noqa: E402
from stages.full_verifier import FullVerifier  # noqa: E402
from stages.pld_drafter import PLDDrafter  # noqa: E402


def models() -> list[tuple[str, NativeLM]]:
    hf = tiny_hf_model(
        "llama", num_layers=8, hidden_size=512, vocab_size=32000, max_position_embeddings=2048
    )
    out = [("tiny-512x8", NativeLM.from_hf(hf, tiny_model_info(hf, "tiny-512x8")))]
    try:
        from specflow.models.loading import load_model

        out.append(("smollm2-135m", load_model("smollm2-135m", backend="native").lm))
    except Exception as exc:  # noqa: BLE001 - optional
        print(f"smollm2-135m not available offline ({type(exc).__name__}); tiny model only")
    return out


def prompts(n: int, vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    out = []
    for _ in range(n):
        base = [rng.randrange(3, vocab - 1) for _ in range(24)]
        out.append(base + base[:12] + [rng.randrange(3, vocab - 1) for _ in range(28)])
    return out


def run(lm, method: str, attention: str, batch: int, tokens: int) -> float:
    drafter = PLDDrafter(k=6) if method == "pld" else None
    pipe = SpeculativePipeline(FullVerifier(lm), ExactAcceptor(), drafter=drafter)
    layout = KVLayout(kind="paged", device="cuda", dtype="bfloat16", attention=attention)
    sched = Scheduler(pipe, batch, layout, max_context=512)
    reqs = [SeqRequest(p, tokens, stop_token_ids=()) for p in prompts(max(batch, 4), 32000)]
    sched.generate(reqs[:batch])  # warm-up
    torch.cuda.synchronize()
    sched.generate(reqs)
    torch.cuda.synchronize()
    sched.kv.check_no_leaks()
    return sched.stats.tokens_per_s


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--budget", type=float, default=200.0)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device")
    batches = [int(b) for b in args.batches.split(",")]
    backends = ["sdpa"] + (["flash"] if flash_available() else [])
    start = time.perf_counter()
    print(f"{'model':<14}{'attn':<7}{'method':<7}{'batch':>6}{'tok/s':>10}{'vs b1':>8}")
    for name, lm in models():
        for attention in backends:
            for method in ("ar", "pld"):
                base = None
                for b in batches:
                    if time.perf_counter() - start > args.budget:
                        print("time budget spent; stopping")
                        return
                    tps = run(lm, method, attention, b, args.tokens)
                    base = base or tps
                    print(
                        f"{name:<14}{attention:<7}{method:<7}{b:>6}{tps:>10.1f}{tps / base:>8.2f}"
                    )


if __name__ == "__main__":
    main()
