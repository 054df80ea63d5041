"""``python -m train_heads.train head=feature`` end to end on SmolLM2-135M (the integration
model; about 30 s): data cached in chunks and reused, a head installed that the drafter
loads and drafts with, the learning curve and report written."""

from __future__ import annotations

from pathlib import Path

import pytest

from specflow.engine import SpeculativePipeline
from specflow.models.feature_head import read_feature_head_metadata
from specflow.scheduler import generate
from stages.acceptors.standard import StandardAcceptor
from stages.drafters.feature import FeatureDrafter
from stages.verifiers.full import FullVerifier

pytestmark = pytest.mark.slow


def _compose(tmp_path: Path, *overrides: str):
    from hydra import compose, initialize_config_dir

    conf = Path(__file__).resolve().parents[1] / "conf"
    with initialize_config_dir(str(conf), version_base="1.3"):
        return compose("config", overrides=[
            "model=smollm2-135m", "head=feature", "head.data.num_prompts=8",
            "head.data.max_new_tokens=8", "head.data.chunk=4", "head.data.eval_every=40",
            "head.data.eval_max_new_tokens=8", "head.batch_rows=256", "trainer.max_epochs=1",
            "progress=false", "logger=none", f"output.dir={tmp_path / 'run'}",
            f"output.install_path={tmp_path / 'installed' / 'feature_head.safetensors'}",
            f"data.cache_dir={tmp_path / 'cache'}", "threads=null", *overrides,
        ])


def test_feature_job_end_to_end(tmp_path):
    from specflow.models.loading import load_model
    from train_heads.train import run

    loaded = load_model("smollm2-135m", dtype="float32", backend="auto",
                        trust_remote_code=False, packed_weights=None)
    res = run(_compose(tmp_path), loaded)
    data = res["data"]
    assert data["train_sequences"] == 8 and data["heldout_sequences"] == 3
    assert data["train_built_positions"] == data["train_positions"] > 8 * 8
    assert len(list(Path(data["cache"]).glob("train_*.safetensors"))) == 2  # two chunks
    assert res["train_steps"] > 0 and res["curve"] and "agree_2" in res["curve"][-1]
    assert {"agreement", "kl", "tau", "accept_by_step"} <= set(res["after"])
    assert (tmp_path / "run" / "agreement_vs_positions.png").is_file()
    assert (tmp_path / "run" / "report.md").read_text().startswith("# Feature head")
    installed = Path(res["installed_path"])
    meta = read_feature_head_metadata(installed)
    assert meta["base_model"] == "smollm2-135m"
    assert len(meta["extra"]["heldout_prompt_ids"]) == 3
    # the drafter loads the installed head and drafts; the output is plain greedy decoding
    lm = loaded.lm
    plain = SpeculativePipeline(FullVerifier(lm), StandardAcceptor())
    pipe = SpeculativePipeline(FullVerifier(lm), StandardAcceptor(),
                               drafter=FeatureDrafter(lm, head=str(installed), k=3))
    prompt = loaded.tokenizer.encode("def fibonacci(n):")
    gen = generate(pipe, prompt, 16)
    assert gen.tokens == generate(plain, prompt, 16).tokens and gen.stats.drafted > 0
    # a rerun skips the data phase: every chunk is loaded, none is built
    res2 = run(_compose(tmp_path, "output.install=false"), loaded)
    assert res2["data"]["train_built_positions"] == 0
    assert res2["data"]["heldout_built_positions"] == 0
    # exit heads on the same data phase (data=feature): every cached position, no generation
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(str(Path(__file__).resolve().parents[1] / "conf"),
                               version_base="1.3"):
        exit_cfg = compose("config", overrides=[
            "model=smollm2-135m", "head=mlp", "head.rank=16", "data=feature",
            f"data.cache_dir={tmp_path / 'cache'}", "layers=explicit", "layers.exits=[3,15]",
            "trainer.max_epochs=1", "progress=false", "logger=none", "output.install=false",
            f"output.dir={tmp_path / 'exit_run'}", "threads=null",
        ])
    res3 = run(exit_cfg, loaded)
    assert res3["cache"]["built"] and "exit_states_s" in res3["cache"]
    assert 0 < res3["train_rows"] < data["train_positions"]  # the shared prefix left out
    assert sorted(res3["after"]) == ["15", "3"] and res3["train_steps"] > 0
    assert len(res3["eval_prompt_ids"]) == 3  # the feature data's held-out questions


def test_feature_job_exports_an_eagle_folder(tmp_path):
    """``head.style=eagle output.format=eagle``: the job also writes and installs the head as
    an EAGLE-1/2 folder, which the drafter loads through the published-head path and drafts
    with exactly as from the project's own file; without the style the format is refused
    before any data is built."""
    import json

    from specflow.errors import ConfigError
    from specflow.kv.stores import KVStores
    from specflow.models.loading import load_model
    from specflow.state import DecodeState
    from train_heads.train import run

    loaded = load_model("smollm2-135m", dtype="float32", backend="auto",
                        trust_remote_code=False, packed_weights=None)
    with pytest.raises(ConfigError, match="fix: add head.style=eagle"):
        run(_compose(tmp_path, "output.format=eagle"), loaded)
    assert not (tmp_path / "cache").exists()
    res = run(_compose(tmp_path, "head.style=eagle", "output.format=eagle"), loaded)
    folder = Path(res["installed_eagle_path"])
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 1 and cfg["vocab_size"] == loaded.info.vocab_size
    assert res["vocab"]["draft_vocab_size"] == loaded.info.vocab_size
    lm = loaded.lm
    prompt = loaded.tokenizer.encode("def fibonacci(n):")
    drafts = []
    for head in (res["installed_path"], str(folder)):
        st = DecodeState(tokens=list(prompt), prompt_len=len(prompt), max_len=64,
                         kv=KVStores())
        drafter = FeatureDrafter(lm, head=head, k=4)
        FullVerifier(lm).begin([st])
        drafter.begin([st])
        drafts.append(drafter.propose([st], [4])[0].tokens)
    assert drafts[0] == drafts[1] and len(drafts[0]) == 4
