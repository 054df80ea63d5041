"""``python -m train_heads.train head=medusa`` end to end on SmolLM2-135M (the integration
model): data generated and cached, heads trained and written in Medusa's published layout,
installed where ``drafter=medusa`` finds them, and drafting with them is lossless."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specflow.engine import SpeculativePipeline
from specflow.scheduler import generate
from stages.acceptors.standard import StandardAcceptor
from stages.drafters.medusa import MedusaDrafter
from stages.verifiers.full import FullVerifier
from train_heads.feature_data import FeatureSequences
from train_heads.medusa_job import medusa_rows

pytestmark = pytest.mark.slow


def test_medusa_rows_label_the_tokens_two_and_more_positions_on():
    """A sequence of 6 tokens (prompt 3) with features at positions 0..4: rows from the last
    prompt position (2) on, head j labelled with the token at p + j + 2, -100 past the end."""
    data = FeatureSequences(
        tokens=torch.tensor([10, 11, 12, 13, 14, 15]), tok_offsets=torch.tensor([0, 6]),
        feats=torch.arange(5.0).unsqueeze(1), feat_offsets=torch.tensor([0, 5]),
        prompt_len=torch.tensor([3]))
    feats, labels = medusa_rows(data, num_heads=2, skip=0)
    assert feats[:, 0].tolist() == [2.0, 3.0, 4.0]
    assert labels.tolist() == [[14, 15], [15, -100], [-100, -100]]


def _compose(tmp_path: Path, *overrides: str):
    from hydra import compose, initialize_config_dir

    conf = Path(__file__).resolve().parents[1] / "conf"
    with initialize_config_dir(str(conf), version_base="1.3"):
        return compose("config", overrides=[
            "model=smollm2-135m", "head=medusa", "head.num_heads=2", "head.data.num_prompts=12",
            "head.data.max_new_tokens=16", "head.data.chunk=6", "head.data.eval_every=40",
            "head.data.eval_max_new_tokens=16", "head.batch_rows=64", "trainer.max_epochs=4",
            "progress=false", "logger=none", f"output.dir={tmp_path / 'run'}",
            f"output.install_path={tmp_path / 'installed' / 'medusa'}",
            f"data.cache_dir={tmp_path / 'cache'}", "threads=null", *overrides,
        ])


def test_medusa_job_end_to_end(tmp_path):
    from specflow.models.loading import load_model
    from train_heads.train import run

    loaded = load_model("smollm2-135m", dtype="float32", backend="auto",
                        trust_remote_code=False, packed_weights=None)
    res = run(_compose(tmp_path), loaded)
    assert res["data"]["train_sequences"] == 12 and res["data"]["heldout_sequences"] == 3
    assert res["train_steps"] > 0
    # zero blocks: head 0 guesses t+2 with the target's t+1 guess; training moves it
    assert res["agreement_after"][0] > res["agreement_before"][0]
    installed = Path(res["installed_path"])
    config = json.loads((installed / "config.json").read_text())
    assert config["medusa_num_heads"] == 2 and config["medusa_num_layers"] == 1
    assert config["base_model_name_or_path"] == "smollm2-135m"
    from safetensors import safe_open

    with safe_open(str(installed / "medusa_lm_head.safetensors"), "pt") as f:
        assert sorted(f.keys()) == ["0.0.linear.bias", "0.0.linear.weight", "0.1.weight",
                                    "1.0.linear.bias", "1.0.linear.weight", "1.1.weight"]
    lm = loaded.lm
    plain = SpeculativePipeline(FullVerifier(lm), StandardAcceptor())
    prompt = loaded.tokenizer.encode("def fibonacci(n):")
    want = generate(plain, prompt, 16).tokens
    for top in ([1, 1], [2, 2]):  # chains, then Cartesian trees
        pipe = SpeculativePipeline(FullVerifier(lm), StandardAcceptor(),
                                   drafter=MedusaDrafter(lm, heads=str(installed), k=2,
                                                         top=top))
        gen = generate(pipe, prompt, 16)
        assert gen.tokens == want and gen.stats.drafted > 0
