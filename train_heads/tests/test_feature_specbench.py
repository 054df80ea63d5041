"""``head.data.specbench_train`` of the feature job: the Spec-Bench dev questions that are not
held out, added to the training sequences (tiny random model, a character tokenizer with a
chat template; seconds, CPU)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from specflow.errors import ConfigError  # noqa: E402
from specflow.models.feature_head import read_feature_head_metadata  # noqa: E402
from specflow.models.loading import LoadedModel  # noqa: E402
from specflow.models.native import NativeLM  # noqa: E402
from specflow.models.tiny import tiny_hf_model, tiny_model_info  # noqa: E402
from specflow.workload import DATA_DIR  # noqa: E402
from train_heads.feature_data import FeatureSequences  # noqa: E402
from train_heads.feature_job import feature_data_key
from train_heads.job_setup import check_disjoint  # noqa: E402
from train_heads.prompts import specbench_prompts, specbench_split  # noqa: E402

CONF = Path(__file__).resolve().parents[1] / "conf"
VOCAB = 128  # the tiny model's; eos = 127


class ChatCharTokenizer:
    """One id per character (1 .. 120), and a chat template of fixed ids around the turn."""

    chat_template = "user/assistant"
    PREFIX, SUFFIX = [121, 122, 123, 1, 2, 3], [124, 125]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % 120 + 1 for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i + 31) for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt: bool = True,
                            tokenize: bool = True) -> list[int]:
        return self.PREFIX + self.encode(messages[0]["content"]) + self.SUFFIX


def _default_data() -> dict:
    return OmegaConf.to_container(OmegaConf.load(CONF / "head" / "feature.yaml").data,
                                  resolve=True)


def test_split_is_disjoint_and_covers_every_question():
    tok = ChatCharTokenizer()
    train, held = specbench_split(tok, 64, 6, 5)
    lines = [ln for ln in (DATA_DIR / "specbench" / "question.dev.jsonl").read_text()
             .splitlines() if ln.strip()]
    all_ids = [str(json.loads(ln)["question_id"]) for ln in lines]
    train_ids, held_ids = [p.prompt_id for p in train], [p.prompt_id for p in held]
    assert len(all_ids) == 120 and len(held_ids) == 20 and len(train_ids) == 100
    assert not set(train_ids) & set(held_ids)
    assert sorted(train_ids + held_ids) == sorted(all_ids)
    # the held-out set is the job's old rule, and both are built exactly as specbench_prompts
    every = specbench_prompts(tok, None, 64)
    assert held == [p for i, p in enumerate(every) if i % 6 == 5]
    assert train == [p for i, p in enumerate(every) if i % 6 != 5]
    assert all(p.ids[:6] == tok.PREFIX and len(p.ids) <= 6 + 64 + 2 for p in train)
    check_disjoint(train, held)
    with pytest.raises(ConfigError, match="both trained on and held out"):
        check_disjoint(train + held[:1], held)


def test_cache_key_of_existing_configs_is_unchanged():
    data = _default_data()
    assert data["specbench_train"] is False and data["specbench_max_new_tokens"] == 192
    # the folder of the cached Qwen2.5-Coder-1.5B data (640 prompts, 98,738 positions),
    # computed before specbench_train existed
    key = feature_data_key("qwen2.5-coder-1.5b", "d72a16204d5bbf14", "torch.float32", data)
    assert key == "525d9ede62db9702"
    for change in ({"specbench_train": True}, {"specbench_max_new_tokens": 64},
                   {"num_prompts": 0}):
        assert feature_data_key("qwen2.5-coder-1.5b", "d72a16204d5bbf14", "torch.float32",
                                {**data, **change}) == key
    assert feature_data_key("qwen2.5-coder-1.5b", "d72a16204d5bbf14", "torch.float32",
                            {**data, "eval_every": 5}) != key


def test_empty_sequences_concatenate():
    e = FeatureSequences.empty(8)
    assert e.num_seqs == 0 and e.num_positions == 0
    seqs = FeatureSequences(torch.arange(5), torch.tensor([0, 5]), torch.randn(4, 8),
                            torch.tensor([0, 4]), torch.tensor([2]))
    both = FeatureSequences.concat([e, seqs, e])
    assert both.num_seqs == 1 and both.num_positions == 4
    assert torch.equal(both.seq(0)[0], seqs.seq(0)[0])


def _compose(tmp_path: Path, *overrides: str):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(str(CONF), version_base="1.3"):
        return compose("config", overrides=[
            "head=feature", "head.data.num_prompts=0", "head.data.specbench_train=true",
            "head.data.specbench_max_new_tokens=3", "head.data.eval_prompt_tokens=8",
            "head.data.eval_max_new_tokens=3", "head.data.chunk=40", "head.vocab_size=64",
            "head.batch_rows=512", "head.loss.depth=1", "trainer.max_epochs=1",
            "trainer.accelerator=cpu", "progress=false", "logger=none", "eval_k=2",
            f"output.dir={tmp_path / 'run'}", "output.install=false",
            f"data.cache_dir={tmp_path / 'cache'}", "threads=null", *overrides,
        ])


def _tiny() -> LoadedModel:
    hf = tiny_hf_model("qwen2", seed=0, num_layers=2, vocab_size=VOCAB, hidden_size=32)
    info = tiny_model_info(hf, "tiny-qwen2-feature")
    return LoadedModel(lm=NativeLM.from_hf(hf, info), tokenizer=ChatCharTokenizer(),
                       hf_model=hf, info=info)


def test_num_prompts_0_trains_on_the_specbench_questions_alone(tmp_path):
    from train_heads.train import run

    loaded = _tiny()
    with pytest.raises(ConfigError, match="nothing to train on"):
        run(_compose(tmp_path, "head.data.specbench_train=false"), loaded)
    res = run(_compose(tmp_path), loaded)
    data = res["data"]
    assert data["train_local_sequences"] == data["train_local_positions"] == 0
    assert data["train_specbench_sequences"] == data["train_sequences"] == 100
    assert data["train_specbench_positions"] == data["train_positions"] > 0
    assert data["specbench_built_positions"] == data["train_positions"]
    assert data["heldout_sequences"] == 20 and res["train_steps"] > 0
    cache = Path(data["cache"])
    data_cfg = OmegaConf.to_container(_compose(tmp_path).head.data, resolve=True)
    key = feature_data_key(loaded.info.name, loaded.info.weights_fingerprint, "torch.float32",
                           {**data_cfg, "specbench_train": False, "num_prompts": 640})
    assert cache.name == f"feature-{key}"  # the folder the local-text data would use
    assert sorted(p.name for p in cache.glob("*.safetensors")) == [
        "heldout_0.safetensors", "specbench3_0.safetensors", "specbench3_1.safetensors",
        "specbench3_2.safetensors"]
    ids = res["train_specbench_ids"]
    assert len(ids) == 100 and not set(ids) & set(res["heldout_prompt_ids"])
    meta = read_feature_head_metadata(Path(res["head_path"]))
    assert meta["extra"]["train_specbench_ids"] == ids
    assert meta["extra"]["data"]["train_specbench_positions"] == data["train_positions"]
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["train_specbench_ids"] == ids
    assert metrics["data"]["train_local_positions"] == 0


def test_local_and_specbench_sequences_are_combined_and_the_folder_is_shared(tmp_path,
                                                                             monkeypatch):
    import train_heads.feature_job as job
    from train_heads.local_prompts import LocalPrompt
    from train_heads.train import run

    def fake_local(n: int, seed: int = 0):  # the stdlib scan takes ~10 s; four short prompts
        return [LocalPrompt(f"local/{i}", "qa", f"Question number {i}?", "test")
                for i in range(n)]

    monkeypatch.setattr(job, "local_prompts", fake_local)
    loaded = _tiny()
    res = run(_compose(tmp_path, "head.data.num_prompts=4"), loaded)
    data = res["data"]
    assert data["train_local_sequences"] == 4 and data["train_specbench_sequences"] == 100
    assert data["train_sequences"] == 104
    assert data["train_positions"] == (data["train_local_positions"]
                                       + data["train_specbench_positions"])
    assert "4 local-text prompts" in data["source"] and "100 Spec-Bench" in data["source"]
    cache = Path(data["cache"])
    assert (cache / "train_0.safetensors").is_file()
    assert (cache / "specbench3_0.safetensors").is_file()
    # the default (specbench_train=false) reuses the same folder and loads every chunk
    res2 = run(_compose(tmp_path, "head.data.num_prompts=4", "head.data.specbench_train=false"),
               loaded)
    d2 = res2["data"]
    assert d2["cache"] == data["cache"]
    assert d2["train_built_positions"] == d2["heldout_built_positions"] == 0
    assert d2["train_sequences"] == 4 and d2["train_specbench_sequences"] == 0
    assert d2["train_positions"] == data["train_local_positions"]
    assert res2["train_specbench_ids"] == [] and d2["specbench_chunks"] is None


def test_prompt_files_train_beside_the_specbench_questions(tmp_path):
    """``head.data.prompt_files``: the kept prompts of a JSONL file are answered, trained on
    with the Spec-Bench questions, counted in the metrics; the data folder is unchanged, a
    rerun loads them; a prompt sharing 8 tokens with a held-out question is dropped."""
    from train_heads.prompt_files import template_bounds
    from train_heads.train import run

    loaded = _tiny()
    assert template_bounds(loaded.tokenizer) == (6, 2)
    tok = ChatCharTokenizer()
    _, held = specbench_split(tok, 0, 6, 5)
    # the text whose ids are 12 content ids of a held-out question (encode's inverse)
    overlapping = "Tell me: " + "".join(chr(i - 1 if i > 32 else i + 119)
                                        for i in held[0].ids[6:18])
    assert tok.encode(overlapping)[9:] == held[0].ids[6:18]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in (
        "Qqq zzz xxx jjj!", None, overlapping, "Kkk vvv www?")))
    files = f"head.data.prompt_files=[{prompts}]"
    res = run(_compose(tmp_path, files), loaded)
    data = res["data"]
    assert (data["files_read"], data["files_kept"], data["files_heldout_overlap"]) == (3, 2, 1)
    assert data["train_files_sequences"] == 2
    assert data["train_sequences"] == 102 and data["train_positions"] == (
        data["train_specbench_positions"] + data["train_files_positions"])
    assert data["files_built_positions"] == data["train_files_positions"] > 0
    assert f"2 prompts from {prompts}" in data["source"]
    base = run(_compose(tmp_path), loaded)["data"]
    assert base["cache"] == data["cache"] and base["train_files_sequences"] == 0
    again = run(_compose(tmp_path, files), loaded)["data"]
    assert again["files_built_positions"] == 0
    assert again["train_files_positions"] == data["train_files_positions"]
    with pytest.raises(ConfigError, match="prompt_files='x.jsonl': use a list"):
        run(_compose(tmp_path, "head.data.prompt_files=x.jsonl"), loaded)
