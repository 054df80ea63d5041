"""Sampled answers for the feature head's data (``head.data.specbench_samples``) and the
trainer's ``precision=auto`` (tiny random models; seconds, CPU)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from specflow.errors import ConfigError  # noqa: E402
from specflow.kv.contiguous import layer_caches  # noqa: E402
from train_heads.exit_data import chunk_paths  # noqa: E402
from train_heads.feature_job import sampled_chunk_name  # noqa: E402
from train_heads.generate import generate_with_hidden, pick_tokens  # noqa: E402
from train_heads.prompts import random_prompts  # noqa: E402
from train_heads.tests.test_feature_specbench import _compose, _tiny  # noqa: E402


def test_pick_tokens_is_argmax_at_zero_and_draws_the_tempered_distribution():
    logits = torch.tensor([[0.0, 10.0, 0.0], [5.0, 0.0, 0.0]])
    assert pick_tokens(logits, 0.0, None).tolist() == [1, 0]
    two = torch.log(torch.tensor([[0.2, 0.8]])).expand(8000, 2)
    g = torch.Generator().manual_seed(0)
    at_1 = pick_tokens(two, 1.0, g).float().mean().item()
    assert abs(at_1 - 0.8) < 0.03  # 5 standard deviations of 8000 draws: 0.022
    # T = 0.5 squares the odds: P(1) = 0.64 / (0.64 + 0.04)
    at_half = pick_tokens(two, 0.5, torch.Generator().manual_seed(1)).float().mean().item()
    assert abs(at_half - 0.64 / 0.68) < 0.014
    a = pick_tokens(two[:50], 1.0, torch.Generator().manual_seed(7))
    b = pick_tokens(two[:50], 1.0, torch.Generator().manual_seed(7))
    assert torch.equal(a, b)


def test_sampled_generation_is_seeded_and_keeps_the_sampled_sequences_states():
    lm = _tiny().lm
    prompts = [p.ids for p in random_prompts(4, 6, 120, seed=2)]
    greedy = generate_with_hidden(lm, prompts, [], 12, batch_size=3, progress=False)
    one = generate_with_hidden(lm, prompts, [], 12, batch_size=3, progress=False,
                               temperature=1.0, seed=5)
    again = generate_with_hidden(lm, prompts, [], 12, batch_size=3, progress=False,
                                 temperature=1.0, seed=5)
    other = generate_with_hidden(lm, prompts, [], 12, batch_size=3, progress=False,
                                 temperature=1.0, seed=6)
    assert [g.tokens for g in one] == [g.tokens for g in again]
    assert [g.tokens for g in one] != [g.tokens for g in other]
    assert [g.tokens for g in one] != [g.tokens for g in greedy]
    n = lm.info.num_layers
    for prompt, g in zip(prompts, one, strict=True):
        assert g.tokens[: len(prompt)] == prompt
        # the kept h_N are those of the sampled sequence itself (teacher-forced)
        caches = layer_caches(lm, 64)
        h = lm.embed(torch.tensor(g.tokens[:-1]))
        for layer in range(n):
            h = lm.run_layer(layer, h, [(caches[layer], h.shape[0])], {})
        torch.testing.assert_close(g.hidden[n], h, rtol=1e-4, atol=1e-4)


def test_specbench_samples_add_drawn_answers_in_their_own_chunks(tmp_path: Path):
    from train_heads.train import run

    loaded = _tiny()
    with pytest.raises(ConfigError, match="specbench_samples=-1: use 0"):
        run(_compose(tmp_path, "head.data.specbench_samples=-1"), loaded)
    with pytest.raises(ConfigError, match="specbench_samples=2 needs"):
        run(_compose(tmp_path, "head.data.specbench_samples=2",
                     "head.data.specbench_train=false", "head.data.num_prompts=1"), loaded)
    res = run(_compose(tmp_path, "head.data.specbench_samples=2",
                       "head.data.specbench_temperature=1.0", "trainer.precision=bf16-mixed"),
              loaded)
    data = res["data"]
    assert data["train_specbench_sequences"] == 100
    assert data["train_specbench_sampled_sequences"] == 200
    assert data["train_sequences"] == 300
    assert data["train_positions"] == (data["train_specbench_positions"]
                                       + data["train_specbench_sampled_positions"])
    assert data["specbench_sampled_built_positions"] == data["train_specbench_sampled_positions"]
    assert "2 more answers" in data["source"] and res["train_steps"] > 0
    cache = Path(data["cache"])
    assert sampled_chunk_name(3, 1.0, 1) == "specbench3-t1-s1"
    for draw in (1, 2):
        assert len(chunk_paths(cache, f"specbench3-t1-s{draw}")) == 3
    # the greedy answers' chunks are still exactly three: the drawn ones never match them
    assert [p.name for p in chunk_paths(cache, "specbench3")] == [
        "specbench3_0.safetensors", "specbench3_1.safetensors", "specbench3_2.safetensors"]
    # a rerun loads every chunk and builds nothing
    res2 = run(_compose(tmp_path, "head.data.specbench_samples=2",
                        "head.data.specbench_temperature=1.0", "trainer.max_epochs=0"), loaded)
    assert res2["data"]["specbench_sampled_built_positions"] == 0
    assert res2["data"]["train_positions"] == data["train_positions"]


def test_precision_auto_follows_the_cpus_bf16(monkeypatch):
    from specflow.cpu import detect as cpu
    from train_heads.job_setup import resolve_precision

    assert resolve_precision("32-true", "cpu") == "32-true"
    assert resolve_precision("bf16-mixed", "cpu") == "bf16-mixed"
    base = cpu.probe_cpu()
    native = dataclasses.replace(base, onednn_bf16=True, avx512_bf16=True, onednn_max_isa=None)
    avx2 = dataclasses.replace(base, onednn_bf16=False, avx512_bf16=False, amx_tile=False)
    assert native.native_bf16 and not avx2.native_bf16
    monkeypatch.setattr(cpu, "probe_cpu", lambda: native)
    assert resolve_precision("auto", "cpu") == "bf16-mixed"
    monkeypatch.setattr(cpu, "probe_cpu", lambda: avx2)
    assert resolve_precision("auto", "cpu") == "32-true"
