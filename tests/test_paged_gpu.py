"""Batched decoding on CUDA: SDPA and FlashAttention paths (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch

from specflow.engine import SpeculativePipeline
from specflow.kv.kernels import flash_available
from specflow.kv.paged import paged_pool
from specflow.kv.session import ModelSession, forward_logits
from specflow.kv.stores import KVLayout, as_dtype
from specflow.scheduler import Scheduler, SeqRequest, generate
from stages.acceptors.standard import StandardAcceptor
from stages.drafters.model import ModelDrafter
from stages.drafters.pld import PLDDrafter
from stages.verifiers.full import FullVerifier
from tests.conftest import make_pair

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
needs_flash = pytest.mark.skipif(not flash_available(), reason="needs flash-attn")

PROMPTS = [[1, 5, 9, 17, 33, 5, 9], [3, 4, 5, 6, 7, 8, 3, 4, 5, 6], [2], list(range(1, 60))]


@pytest.fixture(scope="module")
def gpu_pair():
    """head_dim 64 (flash kernels' common size); CPU weights, moved to CUDA by ``to``."""
    return make_pair("llama", seed=0, num_layers=4, hidden_size=256)


@pytest.fixture(scope="module")
def gpu_drafter():
    return make_pair("llama", seed=1, num_layers=2, hidden_size=256)


def _logits(lm, attention: str, dtype, seqs, device: str = "cuda", block_size: int = 256):
    """Logits of every position: a batched prefill of all but 3 tokens, then 3-token blocks."""
    placed = lm.to(torch.device(device), as_dtype(dtype, lm.dtype))
    cache = paged_pool(placed, len(seqs) * (256 // block_size), block_size, attention)
    sessions = [
        ModelSession(placed, 256, cache.add_sequence(i, 256), lambda i=i: cache.remove_sequence(i))
        for i in range(len(seqs))
    ]
    out = []
    for cut in (3, 0):
        reqs = []
        for sess, s in zip(sessions, seqs, strict=True):
            sess.set_tokens(s[: len(s) - cut])
            reqs.append((sess, 4, 0 if cut else len(s) - 3, len(s) - cut))
        out.append(torch.cat(forward_logits(reqs)).float().cpu())
    for sess in sessions:
        sess.release()
    cache.allocator.check_no_leaks()
    return out


def test_sdpa_cuda_fp32_matches_cpu(gpu_pair):
    _, lm = gpu_pair
    seqs = [p + [7, 8, 9] for p in PROMPTS]
    cpu = _logits(lm, "sdpa", torch.float32, seqs, device="cpu")
    gpu = _logits(lm, "sdpa", torch.float32, seqs)
    for c, g in zip(cpu, gpu, strict=True):
        torch.testing.assert_close(g, c, atol=2e-3, rtol=0)


@needs_flash
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flash_matches_sdpa(gpu_pair, dtype):
    _, lm = gpu_pair
    seqs = [p + [7, 8, 9] for p in PROMPTS]
    sdpa = _logits(lm, "sdpa", dtype, seqs)
    flash = _logits(lm, "flash", dtype, seqs)
    for s, f in zip(sdpa, flash, strict=True):
        scale = s.abs().max().item()
        assert (f - s).abs().max().item() <= 0.03 * scale
        agree = (f.argmax(-1) == s.argmax(-1)).float().mean().item()
        assert agree >= 0.9


@pytest.mark.parametrize("method", ["ar", "pld", "sps"])
def test_batched_greedy_on_cuda_equals_batch_one(gpu_pair, gpu_drafter, method):
    _, lm = gpu_pair
    drafter = {
        "ar": None,
        "pld": PLDDrafter(k=5),
        "sps": ModelDrafter(gpu_drafter[1], k=3),
    }[method]
    pipe = SpeculativePipeline(FullVerifier(lm), StandardAcceptor(), drafter=drafter)
    want = [generate(pipe, p, 24).tokens for p in PROMPTS]
    layout = KVLayout(kind="paged", device="cuda", attention="sdpa")
    sched = Scheduler(pipe, 3, layout, max_context=128)
    res = sched.generate([SeqRequest(p, 24, tag=i) for i, p in enumerate(PROMPTS)])
    got = {r.request.tag: r.generation.tokens for r in res}
    same = sum(got[i] == want[i] for i in range(len(PROMPTS)))
    assert same >= len(PROMPTS) - 1  # fp32 on GPU: a near-tie may flip one late token
    sched.kv.check_no_leaks()


@needs_flash
def test_batched_flash_runs_and_frees(gpu_pair):
    _, lm = gpu_pair
    pipe = SpeculativePipeline(FullVerifier(lm), StandardAcceptor(), drafter=PLDDrafter(k=5))
    layout = KVLayout(kind="paged", device="cuda", dtype="bfloat16", attention="flash")
    sched = Scheduler(pipe, 3, layout, max_context=256)
    pool = sched.kv.pools[0]
    assert pool.attention.name == "flash" and pool.block_size % 256 == 0
    res = sched.generate([SeqRequest(p, 24) for p in PROMPTS])
    assert len(res) == len(PROMPTS) and all(r.generation.tokens for r in res)
    sched.kv.check_no_leaks()


@pytest.mark.parametrize("method", ["ar", "pld"])
def test_cuda_graphs_replay_equals_eager(gpu_pair, method):
    """The graph path (static shapes, captured per bucket) gives the eager path's tokens
    (fp32; a near-tie may flip one late token), and its graphs were captured and replayed."""
    _, lm = gpu_pair
    drafter = PLDDrafter(k=5) if method == "pld" else None
    pipe = SpeculativePipeline(FullVerifier(lm), StandardAcceptor(), drafter=drafter)
    outs, reports = [], []
    for decode in ("eager", "graphs"):
        layout = KVLayout(kind="paged", device="cuda", attention="sdpa", decode=decode)
        sched = Scheduler(pipe, 3, layout, max_context=128)
        res = sched.generate([SeqRequest(p, 24, tag=i) for i, p in enumerate(PROMPTS)])
        outs.append({r.request.tag: r.generation.tokens for r in res})
        reports.append(sched.kv.report())
        sched.kv.check_no_leaks()
    same = sum(outs[0][i] == outs[1][i] for i in range(len(PROMPTS)))
    assert same >= len(PROMPTS) - 1
    assert reports[1]["graphs_captured"] > 0 and reports[1]["static_steps"] > 0
