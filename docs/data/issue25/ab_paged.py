"""Paged vs contiguous batch-1 plain decoding, median of 3, in whatever checkout is cwd."""
import os, statistics, sys, time
sys.path.insert(0, os.getcwd())
import torch
torch.set_num_threads(2)
from specflow.models.loading import load_model
try:
    from specflow.kv.stores import KVLayout
    from specflow.scheduler import Scheduler, SeqRequest
    from specflow.acceptance import StandardAcceptor as Acc
    kw = dict(dtype="float32", backend="auto", trust_remote_code=False, packed_weights=None)
except ImportError:
    from specflow.models.stores import KVLayout
    from specflow.scheduler import Scheduler, SeqRequest
    from stages.exact_acceptor import ExactAcceptor as Acc
    kw = {}
from specflow.engine import SpeculativePipeline
from stages.full_verifier import FullVerifier
loaded = load_model("smollm2-135m", **kw)
lm, tok = loaded.lm, loaded.tokenizer
prompts = [tok.encode(f"Write a short story about a {w} who learns to code.") for w in ("cat", "dog", "fox", "owl")]
pipe = SpeculativePipeline(FullVerifier(lm), Acc())
out = {}
for kind in ("paged", "contiguous", "paged", "contiguous", "paged", "contiguous"):
    sched = Scheduler(pipe, 1, KVLayout(kind=kind), max_context=256)
    t0 = time.perf_counter()
    res = sched.generate([SeqRequest(p, 32, stop_token_ids=()) for p in prompts])
    dt = time.perf_counter() - t0
    out.setdefault(kind, []).append(sum(len(r.generation.tokens) for r in res) / dt)
print(" ".join(f"{k} {statistics.median(v):.1f} tok/s" for k, v in out.items()))
