"""Paged KV cache and batched decoding (CPU): exactness, ragged batches, no block leaks.

The one engine (``specflow.engine`` + ``specflow.scheduler``) runs every batch size over
contiguous or paged KV; ``tests/test_one_engine.py`` checks every pipeline against HF.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from specflow.engine import SpeculativePipeline
from specflow.errors import ConfigError
from specflow.kv.base import KVSpec
from specflow.kv.kernels import AttnBatch, sdpa_paged, select_backend
from specflow.kv.paged import BlockAllocator, CacheFullError, PagedKVCache, paged_pool
from specflow.kv.session import ModelSession, forward_logits
from specflow.kv.stores import KVLayout
from specflow.results.records import RunMeta
from specflow.results.run_folder import RunFolder
from specflow.runner import Runner
from specflow.sampling import SamplingParams
from specflow.scheduler import Scheduler, SeqRequest, generate
from specflow.settings import RunSettings
from specflow.workload import Request
from stages.acceptors.standard import StandardAcceptor
from stages.drafters.pld import PLDDrafter
from stages.verifiers.full import FullVerifier
from tests.conftest import CharTokenizer, hf_greedy

MAX_NEW = 30


def _prompts(n: int, seed: int = 0, vocab: int = 127) -> list[list[int]]:
    rng = random.Random(seed)
    out = [[rng.randrange(vocab) for _ in range(rng.randrange(1, 25))] for _ in range(n)]
    out[1] = [3, 4, 5, 6, 7, 8, 3, 4, 5, 6]  # repetitive: PLD drafts get accepted
    return out


# ---------------------------------------------------------------------------- allocator


def test_allocator_many_requests_no_leaks():
    rng = random.Random(0)
    cache = PagedKVCache(KVSpec(2, 1, 4), num_blocks=40, block_size=4)
    live: dict[int, int] = {}
    for step in range(400):
        if live and (rng.random() < 0.4 or not cache.can_admit(30)):
            sid = rng.choice(sorted(live))
            cache.remove_sequence(sid)
            del live[sid]
            continue
        max_len = rng.randrange(1, 30)
        if not cache.can_admit(max_len):
            continue
        kvs = cache.add_sequence(step, max_len)
        live[step] = max_len
        for _ in range(3):  # grow, then roll back, like a verification round
            n = rng.randrange(0, max_len + 1)
            cache.reserve(step, n)
            for kv in kvs:
                cache.set_length(step, kv.layer, n)
            keep = rng.randrange(0, n + 1)
            for kv in kvs:
                kv.truncate(keep)
            assert len(cache.seqs[step].blocks) == cache.blocks_for(keep)
        used = sum(len(s.blocks) for s in cache.seqs.values())
        assert cache.allocator.num_used == used
    for sid in list(live):
        cache.remove_sequence(sid)
    cache.allocator.check_no_leaks()


def test_rollback_frees_blocks_and_double_free_fails():
    cache = PagedKVCache(KVSpec(3, 1, 4), num_blocks=10, block_size=4)
    kvs = cache.add_sequence(0, 40)
    cache.reserve(0, 17)
    assert cache.allocator.num_used == 5
    for kv in kvs:
        cache.set_length(0, kv.layer, 17 if kv.layer == 0 else 9)
    kvs[0].truncate(6)  # layers 1, 2 still hold 9 positions: 3 blocks stay
    assert cache.allocator.num_used == 3
    for kv in kvs[1:]:
        kv.truncate(4)
    assert cache.allocator.num_used == 2
    assert cache.allocator.available == 0  # the rest is still promised to the sequence
    with pytest.raises(CacheFullError):
        cache.add_sequence(1, 4)
    cache.remove_sequence(0)
    cache.allocator.check_no_leaks()
    alloc = BlockAllocator(2)
    b = alloc.allocate()
    alloc.free([b])
    with pytest.raises(RuntimeError):
        alloc.free([b])


# ---------------------------------------------------------------------------- attention


def test_sdpa_paged_is_lower_right_causal_on_ragged_queries():
    torch.manual_seed(0)
    nh, kh, d, bs = 4, 2, 8, 4
    q_lens, kv_lens = [3, 1, 5], [7, 4, 5]
    cache = PagedKVCache(KVSpec(1, kh, d), num_blocks=12, block_size=bs)
    keys, vals = [], []
    for i, n in enumerate(kv_lens):
        cache.add_sequence(i, n)
        cache.reserve(i, n)
        k, v = torch.randn(n, kh, d), torch.randn(n, kh, d)
        slots = torch.tensor(cache.slots(i, 0, n))
        cache.k[0].view(-1, kh, d)[slots] = k
        cache.v[0].view(-1, kh, d)[slots] = v
        keys.append(k)
        vals.append(v)
    q = torch.randn(sum(q_lens), nh, d)
    batch = AttnBatch.build(q_lens, kv_lens, cache.block_table([0, 1, 2], "cpu"), "cpu")
    out = sdpa_paged(q, cache.k[0], cache.v[0], batch, d**-0.5)
    row = 0
    for t, n, k, v in zip(q_lens, kv_lens, keys, vals, strict=True):
        qi = q[row : row + t].transpose(0, 1)  # [NH, t, D]
        kk = k.transpose(0, 1).repeat_interleave(nh // kh, 0)  # [NH, n, D]
        vv = v.transpose(0, 1).repeat_interleave(nh // kh, 0)
        mask = torch.ones(t, n, dtype=torch.bool).tril(diagonal=n - t)  # lower-right
        ref = F.scaled_dot_product_attention(qi, kk, vv, attn_mask=mask).transpose(0, 1)
        torch.testing.assert_close(out[row : row + t], ref, atol=1e-5, rtol=1e-5)
        row += t


def test_select_backend_on_cpu():
    assert select_backend("auto", "cpu", torch.float32)[0] == "sdpa"
    assert select_backend("sdpa", "cpu", torch.float32)[0] == "sdpa"
    with pytest.raises(ConfigError):
        select_backend("flash", "cpu", torch.bfloat16)
    with pytest.raises(ConfigError):
        select_backend("xformers", "cpu", torch.float32)


# ---------------------------------------------------------------------------- logits


@pytest.mark.parametrize("model", ["tiny_target", "tiny_qwen"])
def test_paged_and_contiguous_logits_identical(model, request):
    """Prefill, decode steps, a verification block and a rollback, 3 sequences batched."""
    _, lm = request.getfixturevalue(model)
    top = lm.info.num_layers
    cache = paged_pool(lm, num_blocks=64, block_size=4, attention="sdpa")
    seqs = _prompts(3, seed=5)
    refs = [ModelSession(lm, 64) for _ in seqs]
    paged = [
        ModelSession(lm, 64, cache.add_sequence(i, 64), lambda i=i: cache.remove_sequence(i))
        for i in range(len(seqs))
    ]
    rng = random.Random(1)

    def check(spans):
        want = []
        for sess, toks, (exit_layer, start, end) in zip(refs, seqs, spans, strict=True):
            sess.set_tokens(toks)
            want.append(sess.logits(exit_layer, start, end))
        for sess, toks in zip(paged, seqs, strict=True):
            sess.set_tokens(toks)
        got = forward_logits([(p, e, s, end) for p, (e, s, end) in zip(paged, spans, strict=True)])
        for w, g in zip(want, got, strict=True):
            torch.testing.assert_close(g, w, atol=5e-5, rtol=0)

    check([(top, 0, len(s)) for s in seqs])  # prefill: every position
    for _ in range(3):  # decode steps, an early exit first on every other step
        for s in seqs:
            s.append(rng.randrange(127))
        check([(top, len(s) - 1, len(s)) for s in seqs])
    drafts = [[rng.randrange(127) for _ in range(k)] for k in (4, 0, 2)]
    for s in seqs:  # the bonus token of the last step, not computed yet
        s.append(rng.randrange(127))
    committed = [len(s) for s in seqs]
    for s, d in zip(seqs, drafts, strict=True):
        s.extend(d)
    check([(top, c - 1, len(s)) for c, s in zip(committed, seqs, strict=True)])  # verify
    for s, c in zip(seqs, committed, strict=True):  # reject everything, take another token
        del s[c:]
        s.append(rng.randrange(127))
    check([(top - 2, len(s) - 1, len(s)) for s in seqs])  # an early exit after rollback
    check([(top, len(s) - 1, len(s)) for s in seqs])  # the deeper layers continue
    for p in paged:
        p.release()
    cache.allocator.check_no_leaks()


# ---------------------------------------------------------------------------- greedy


def test_continuous_batching_admits_and_retires(tiny_target):
    """7 requests through 3 slots: occupancy, token counts and no leaked blocks."""
    hf, target = tiny_target
    pipe = SpeculativePipeline(FullVerifier(target), StandardAcceptor(), drafter=PLDDrafter(k=5))
    prompts = _prompts(7)
    want = [generate(pipe, p, MAX_NEW).tokens for p in prompts]
    assert want[1] == hf_greedy(hf, prompts[1], MAX_NEW)
    sched = Scheduler(pipe, 3, KVLayout(kind="paged", block_size=4), max_context=64)
    results = sched.generate([SeqRequest(p, MAX_NEW, tag=i) for i, p in enumerate(prompts)])
    got = {r.request.tag: r.generation for r in results}
    assert [got[i].tokens for i in range(len(prompts))] == want
    assert max(sched.stats.occupancy) == 3 and sched.stats.new_tokens == sum(map(len, want))
    sched.kv.check_no_leaks()


def test_pool_too_small_waits_then_fails_clearly(tiny_target):
    _, target = tiny_target
    pipe = SpeculativePipeline(FullVerifier(target), StandardAcceptor())
    # Room for one sequence at a time (2 x 16 positions in blocks of 4): the second request
    # waits for the first's blocks.
    sched = Scheduler(pipe, 2, KVLayout(kind="paged", block_size=4), max_context=16)
    results = sched.generate([SeqRequest([1, 2, 3], 20), SeqRequest([4, 5], 20)])
    assert len(results) == 2 and max(sched.stats.occupancy) == 1
    with pytest.raises(CacheFullError):
        sched.generate([SeqRequest(list(range(1, 40)), 20)])
    sched.kv.check_no_leaks()


# ---------------------------------------------------------------------------- runner


@pytest.mark.parametrize("kv_layout", ["contiguous", "paged"])
def test_batch_runner_records_and_summary(tiny_target, tmp_path, kv_layout):
    _, target = tiny_target
    pipe = SpeculativePipeline(FullVerifier(target), StandardAcceptor(), drafter=PLDDrafter(k=4))
    settings = RunSettings(
        max_new_tokens=12, baseline_cache=False, batch_size=2, kv_layout=kv_layout
    )
    runner = Runner(pipe, CharTokenizer(), settings, SamplingParams())
    requests = [
        Request("a", "qa", ("abcabcabc",)),
        Request("b", "mt_bench", ("hello there", "and again")),
        Request("c", "qa", ("xyzxyz",)),
    ]
    folder = RunFolder(tmp_path, resume=False)
    summary = runner.run(requests, folder, RunMeta(method="pld")).to_json()  # as written
    assert summary["complete"] and summary["num_requests"] == 3
    assert summary["fidelity"] == 1.0
    batch = summary["batch"]
    assert batch["batch_size"] == 2 and batch["kv_layout"] == kv_layout
    assert batch["throughput_tokens_per_s"] > 0 and batch["mean_active"] > 1
    assert batch["baseline_throughput_tokens_per_s"] > 0 and batch["latency_s_p50"] > 0
    rec = {r.request_id: r.to_json() for r in RunFolder(tmp_path, resume=True).records}
    assert len(rec["b"]["turns"]) == 2
    # turn 2's prompt contains turn 1's answer
    assert rec["b"]["turns"][1]["prompt_tokens"] > rec["b"]["turns"][0]["prompt_tokens"] + 10
