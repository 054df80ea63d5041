"""Paged vs contiguous plain decoding at batch 1 (median of 3 each, interleaved), SmolLM2-135M.

Run with the checkout to measure as the working directory (it runs the code before and after
#25, whose imports differ): ``cd <checkout> && python /path/to/ab_paged.py``.
"""

import os
import statistics
import sys
import time

sys.path.insert(0, os.getcwd())

import torch  # noqa: E402

from specflow.engine import SpeculativePipeline  # noqa: E402
from specflow.models.loading import load_model  # noqa: E402
from specflow.scheduler import Scheduler, SeqRequest  # noqa: E402
from stages.full_verifier import FullVerifier  # noqa: E402

try:  # after #25
    from specflow.acceptance import StandardAcceptor as Acceptor
    from specflow.kv.stores import KVLayout

    MODEL_ARGS = {"dtype": "float32", "backend": "auto", "trust_remote_code": False,
                  "packed_weights": None}
except ImportError:  # before
    from specflow.models.stores import KVLayout
    from stages.exact_acceptor import ExactAcceptor as Acceptor

    MODEL_ARGS = {}


def main() -> None:
    torch.set_num_threads(2)
    loaded = load_model("smollm2-135m", **MODEL_ARGS)
    words = ("cat", "dog", "fox", "owl")
    prompts = [loaded.tokenizer.encode(f"Write a short story about a {w} who learns to code.")
               for w in words]
    pipe = SpeculativePipeline(FullVerifier(loaded.lm), Acceptor())
    out: dict[str, list[float]] = {}
    for kind in ("paged", "contiguous") * 3:
        sched = Scheduler(pipe, 1, KVLayout(kind=kind), max_context=256)
        t0 = time.perf_counter()
        res = sched.generate([SeqRequest(p, 32, stop_token_ids=()) for p in prompts])
        spent = time.perf_counter() - t0
        out.setdefault(kind, []).append(sum(len(r.generation.tokens) for r in res) / spent)
    print(" ".join(f"{k} {statistics.median(v):.1f} tok/s" for k, v in out.items()))


if __name__ == "__main__":
    main()
