"""Head training on 2 CPU processes (DDP over gloo) through the real command.

``python -m train_heads.train trainer=ddp_cpu`` on SmolLM2-135M with random prompts: Lightning
starts a second process (rank 1), both train, rank 0 alone writes heads, checkpoints and
reports, each rank logs to its own file, and the heads load and draft losslessly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODEL = "smollm2-135m"


@pytest.mark.slow
def test_ddp_on_two_cpu_processes_trains_and_only_rank_zero_writes(tmp_path):
    from specflow.models.prepare import is_prepared

    if not is_prepared(MODEL):
        pytest.skip(f"{MODEL} is not prepared (bash scripts/setup.sh)")
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "train_heads.train", f"model={MODEL}", "data=random",
        "layers=explicit", "layers.exits=[4,8]", "head=linear",
        "trainer=ddp_cpu", "logger=csv", "progress=false", "threads=1",
        "output.install=false", f"data.cache_dir={tmp_path / 'cache'}",
        f"hydra.run.dir={run_dir}",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]

    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["strategy"] == "DDPStrategy"
    assert metrics["train_steps"] == 6 and set(metrics["after"]) == {"4", "8"}
    # rank 0's log (the Hydra job's) and rank 1's own file, each saying what it did
    rank0 = (run_dir / "train.log").read_text()
    rank1 = (run_dir / "train_ddp_process_1.log").read_text()
    assert "rank 0 of 2: trained 6 steps" in rank0
    assert "rank 1 of 2: trained 6 steps" in rank1
    assert "rank 1: done; rank 0 writes heads, checkpoints and reports" in rank1
    # one set of outputs, written once (rank 1 wrote no heads, reports or logs)
    assert sorted(p.name for p in run_dir.glob("heads.*")) == ["heads.json", "heads.safetensors"]
    assert [p.name for p in run_dir.glob("report.md")] == ["report.md"]
    assert len(list((run_dir / "csv").rglob("metrics.csv"))) == 1
    assert "rank 1" not in (run_dir / "report.md").read_text()

    # the heads load onto the model and draft like any others: lossless self-speculation
    from specflow.engine import SpeculativePipeline
    from specflow.models.exit_heads import load_and_attach
    from specflow.models.loading import load_model
    from specflow.scheduler import generate
    from stages.acceptors.standard import StandardAcceptor
    from stages.drafters.model import ModelDrafter
    from stages.verifiers.full import FullVerifier

    loaded = load_model(MODEL, dtype="float32", backend="auto", trust_remote_code=False,
                        packed_weights=None)
    plain = SpeculativePipeline(FullVerifier(loaded.lm), StandardAcceptor())
    prompt = loaded.tokenizer("def fibonacci(n):")["input_ids"]
    expected = generate(plain, prompt, 16).tokens
    saved = dict(loaded.lm.exit_heads), loaded.lm.exit_heads_path
    try:
        heads = load_and_attach(loaded.lm, run_dir / "heads.safetensors")
        assert set(heads) == {4, 8}
        pipe = SpeculativePipeline(FullVerifier(loaded.lm), StandardAcceptor(),
                                   drafter=ModelDrafter(loaded.lm, k=3, exit_layer=8))
        gen = generate(pipe, prompt, 16)
        assert gen.tokens == expected and gen.stats.drafted > 0
    finally:
        loaded.lm.set_exit_heads(*saved)
