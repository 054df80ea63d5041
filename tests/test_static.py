"""The static-shape (CUDA-graph) step path and the kernel choice, checked on the CPU.

On CUDA the static steps are captured and replayed as CUDA graphs; here the very same
fixed-shape code runs eagerly (``decode="static"``), so its padding, bucketing, block-table
and bookkeeping logic is exact-tested without a GPU.
"""

from __future__ import annotations

import random

import pytest
import torch

from specflow.engine import SpeculativePipeline
from specflow.errors import ConfigError
from specflow.kv.base import KVSpec
from specflow.kv.kernels import AttnBatch, causal_prefill, paged_sdpa, sdpa_paged
from specflow.kv.paged import PagedKVCache
from specflow.kv.static import bucket_for
from specflow.kv.stores import KVLayout
from specflow.scheduler import Scheduler, SeqRequest
from specflow.settings import RunSettings
from stages.acceptors.standard import StandardAcceptor
from stages.draft_length.adaptive import AdaptiveDraftLength
from stages.drafters.model import ModelDrafter
from stages.drafters.pld import PLDDrafter
from stages.verifiers.full import FullVerifier
from tests.conftest import hf_greedy
from tests.test_one_engine import PROMPTS

MAX_NEW = 24


def test_buckets():
    assert [bucket_for(n) for n in (1, 2, 3, 5, 8, 9, 17, 32)] == [1, 2, 4, 8, 8, 16, 32, 32]
    assert bucket_for(33) is None


def _filled_pool(kv_lens: list[int], kh: int = 2, d: int = 8, bs: int = 4, seed: int = 0):
    torch.manual_seed(seed)
    pool = PagedKVCache(KVSpec(1, kh, d), num_blocks=32, block_size=bs)
    for i, n in enumerate(kv_lens):
        pool.add_sequence(i, 24)
        pool.reserve(i, n)
        slots = torch.tensor(pool.slots(i, 0, n))
        pool.k[0].view(-1, kh, d)[slots] = torch.randn(n, kh, d)
        pool.v[0].view(-1, kh, d)[slots] = torch.randn(n, kh, d)
    return pool


def test_static_attention_equals_the_dynamic_kernel_with_padding():
    """Ragged queries padded to a fixed [B, T] with a fixed-width table: the real rows
    equal ``sdpa_paged`` (lower-right causal, per sequence): the one kernel, masked by
    position over the whole table as the static path calls it."""
    nh, d, bs = 4, 8, 4
    q_lens, kv_lens = [3, 1, 2], [7, 4, 5]
    pool = _filled_pool(kv_lens)
    q = torch.randn(sum(q_lens), nh, d)
    batch = AttnBatch.build(q_lens, kv_lens, pool.block_table([0, 1, 2], "cpu"), "cpu")
    want = sdpa_paged(q, pool.k[0], pool.v[0], batch, d**-0.5)
    big_b, t, width = 4, 3, 6  # bucket 4 (one padding sequence), 3 rows, 6 blocks per table
    qs = torch.zeros(big_b, t, nh, d)
    positions = torch.zeros(big_b, t, dtype=torch.long)
    table = torch.full((big_b, width), pool.null_block, dtype=torch.long)
    row = 0
    for b, (tq, n) in enumerate(zip(q_lens, kv_lens, strict=True)):
        qs[b, :tq] = q[row : row + tq]
        positions[b, :tq] = torch.arange(n - tq, n)
        blocks = pool.blocks_of(b)
        table[b, : len(blocks)] = torch.tensor(blocks)
        row += tq
    visible = torch.arange(width * bs)[None, None, :] <= positions[:, :, None]  # [B, T, W*BS]
    got = paged_sdpa(qs, pool.k[0], pool.v[0], table, visible, d**-0.5)
    row = 0
    for b, tq in enumerate(q_lens):
        torch.testing.assert_close(got[b, :tq], want[row : row + tq], atol=1e-5, rtol=1e-5)
        row += tq


def test_causal_prefill_equals_the_paged_kernel():
    nh, kh, d = 4, 2, 8
    lens = [5, 1, 3]
    q, k, v = torch.randn(9, nh, d), torch.randn(9, kh, d), torch.randn(9, kh, d)
    pool = PagedKVCache(KVSpec(1, kh, d), num_blocks=16, block_size=4)
    for i, n in enumerate(lens):
        pool.add_sequence(i, 8)
        pool.reserve(i, n)
    slots = torch.tensor([s for i, n in enumerate(lens) for s in pool.slots(i, 0, n)])
    pool.k[0].view(-1, kh, d)[slots] = k
    pool.v[0].view(-1, kh, d)[slots] = v
    batch = AttnBatch.build(lens, lens, pool.block_table([0, 1, 2], "cpu"), "cpu")
    want = sdpa_paged(q, pool.k[0], pool.v[0], batch, d**-0.5)
    torch.testing.assert_close(causal_prefill(q, k, v, lens, d**-0.5), want, atol=1e-5, rtol=1e-5)


def _pipelines(lm, draft_lm):
    def p(drafter=None, **kw):
        return SpeculativePipeline(FullVerifier(lm), StandardAcceptor(), drafter=drafter, **kw)

    return {
        "ar": p(),
        "pld": p(PLDDrafter(k=5)),
        "pld_adaptive": p(PLDDrafter(k=5), draft_length=AdaptiveDraftLength()),
        "sps": p(ModelDrafter(draft_lm, k=3)),
        "self_spec": p(ModelDrafter(lm, k=3, exit_layer=2)),  # shares the target: eager
    }


@pytest.mark.parametrize("batch_size", [1, 3])
@pytest.mark.parametrize("method", ["ar", "pld", "pld_adaptive", "sps", "self_spec"])
def test_static_steps_keep_greedy_identity(method, batch_size, tiny_target, tiny_drafter):
    hf, lm = tiny_target
    pipe = _pipelines(lm, tiny_drafter[1])[method]
    layout = KVLayout(kind="paged", decode="static", block_size=4)
    sched = Scheduler(pipe, batch_size, layout, max_context=64)
    reqs = [SeqRequest(p, MAX_NEW, tag=i) for i, p in enumerate(PROMPTS)]
    got = {r.request.tag: r.generation.tokens for r in sched.generate(reqs)}
    assert [got[i] for i in range(len(PROMPTS))] == [hf_greedy(hf, p, MAX_NEW) for p in PROMPTS]
    report = sched.kv.report()
    sched.kv.check_no_leaks()
    target_pool = sched.kv.pools[0]
    assert target_pool.null_block == target_pool.allocator.num_blocks  # never handed out
    if method == "self_spec":  # the drafter's partial layers: its verify steps run eagerly
        assert report["eager_steps"] > report["static_steps"]  # static: the k = 0 last rounds
    else:
        assert report["static_steps"] > 0 and "static_sdpa" in report["kernels"]
    assert "sdpa_causal_prefill" in report["kernels"]  # prompts > 1 token prefill fresh
    assert report["decode"] == "static" and report["graphs_captured"] == 0


def test_kernel_choice(monkeypatch):
    """auto: flash on CUDA with fp16/bf16 when flash-attn imports, else SDPA; graphs only
    on CUDA with paged KV."""
    import specflow.kv.kernels as attention

    monkeypatch.setattr(attention, "flash_available", lambda: True)
    assert attention.select_backend("auto", "cuda", torch.bfloat16)[0] == "flash"
    assert attention.select_backend("auto", "cuda", torch.float32)[0] == "sdpa"
    assert attention.select_backend("auto", "cpu", torch.bfloat16)[0] == "sdpa"
    assert attention.select_backend("sdpa", "cuda", torch.bfloat16)[0] == "sdpa"
    monkeypatch.setattr(attention, "flash_available", lambda: False)
    assert attention.select_backend("auto", "cuda", torch.bfloat16)[0] == "sdpa"
    with pytest.raises(ConfigError, match="flash-attn is not installed"):
        attention.select_backend("flash", "cuda", torch.bfloat16)
    assert RunSettings(kv_layout="paged").layout().decode == "eager"  # graphs need CUDA
    with pytest.raises(ConfigError, match="CUDA graphs need runner.device=cuda"):
        KVLayout(kind="paged", decode="graphs")
    with pytest.raises(ConfigError, match="needs the paged KV layout"):
        KVLayout(kind="contiguous", decode="static")


def test_static_rows_follow_the_pipelines_draft_length(tiny_target):
    """A static step takes up to ``max_draft_len + 1`` rows, derived from the pipeline: with
    k = 20 (beyond a fixed 16-row cap) every verify step still runs statically."""
    hf, lm = tiny_target
    pipe = SpeculativePipeline(FullVerifier(lm), StandardAcceptor(), drafter=PLDDrafter(k=20))
    layout = KVLayout(kind="paged", decode="static", block_size=4)
    sched = Scheduler(pipe, 1, layout, max_context=96)
    prompt = PROMPTS[1] * 3  # repeats: prompt lookup drafts long
    (res,) = sched.generate([SeqRequest(prompt, MAX_NEW)])
    assert res.generation.tokens == hf_greedy(hf, prompt, MAX_NEW)
    report = sched.kv.report()
    assert pipe.max_draft_len == 20
    assert report["eager_steps"] == 0 and report["static_steps"] > 0
    assert max(res.generation.stats.asked_per_round) > 15


def test_steps_outside_the_buckets_run_eagerly(tiny_target):
    """More sequences than the largest batch bucket (32): eager steps, same tokens."""
    hf, lm = tiny_target
    pipe = SpeculativePipeline(FullVerifier(lm), StandardAcceptor(), drafter=PLDDrafter(k=4))
    layout = KVLayout(kind="paged", decode="static", block_size=4)
    sched = Scheduler(pipe, 33, layout, max_context=48)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(33)]
    res = sched.generate([SeqRequest(p, 8, tag=i) for i, p in enumerate(prompts)])
    want = [hf_greedy(hf, p, 8) for p in PROMPTS]
    assert all(r.generation.tokens == want[r.request.tag % len(PROMPTS)] for r in res)
    assert sched.kv.report()["eager_steps"] > 0


def test_random_batches_static_equals_eager(tiny_qwen):
    """Qwen2 (biases, GQA 2:1 in the tiny config), random prompts through 4 slots."""
    _, lm = tiny_qwen
    rng = random.Random(3)
    prompts = [[rng.randrange(1, 120) for _ in range(rng.randrange(1, 20))] for _ in range(6)]
    pipe = SpeculativePipeline(FullVerifier(lm), StandardAcceptor(), drafter=PLDDrafter(k=4))
    outs = []
    for decode in ("eager", "static"):
        layout = KVLayout(kind="paged", decode=decode, block_size=4)
        sched = Scheduler(pipe, 4, layout, max_context=64)
        res = sched.generate([SeqRequest(p, 20, tag=i) for i, p in enumerate(prompts)])
        outs.append({r.request.tag: r.generation.tokens for r in res})
    assert outs[0] == outs[1]


@pytest.mark.parametrize(
    "module",
    ["models/native.py", "kv/contiguous.py", "kv/kernels.py", "kv/paged.py", "kv/static.py"],
)
def test_no_host_sync_inside_the_model(module):
    """The decoder layer and its attention backends never read a device value back on the
    host (``.item()``, ``.tolist()``, ``.cpu()``, ``.numpy()``): a step is launched, not waited on;
    the one device-to-host copy of a step is ``forward_logits``' copy of the logits."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "specflow"
    tree = ast.parse((root / module).read_text())
    calls = [
        node.func.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in ("item", "tolist", "cpu", "numpy")
    ]
    assert calls == []
