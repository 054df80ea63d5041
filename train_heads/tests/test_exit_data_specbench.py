"""``data=feature data.specbench=N``: exit heads (and adapters) also trained on the Spec-Bench
answers the feature job cached (``specbench<N>_*.safetensors``), after the local-text ones;
``data.local=false`` leaves those out.  The default config keeps its exit-data cache (tiny
random model, a character tokenizer; seconds, CPU)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from specflow.errors import ConfigError  # noqa: E402
from specflow.models.exit_heads import read_heads_metadata  # noqa: E402
from train_heads.cache import HiddenCache, build_cache  # noqa: E402
from train_heads.exit_data import load_chunks  # noqa: E402
from train_heads.generate import Generated  # noqa: E402
from train_heads.prompts import specbench_split  # noqa: E402
from train_heads.tests.test_feature_specbench import CONF, ChatCharTokenizer, _tiny  # noqa: E402


def _exit_cfg(tmp_path: Path, name: str, *overrides: str):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(str(CONF), version_base="1.3"):
        return compose("config", overrides=[
            "data=feature", f"data.cache_dir={tmp_path / 'cache'}", "layers=explicit",
            "layers.exits=[1]", "head=mlp", "head.rank=8", "trainer.max_epochs=1",
            "trainer.accelerator=cpu", "checkpoint.enabled=false", "progress=false",
            "logger=none", "output.install=false", f"output.dir={tmp_path / name}",
            "threads=null", *overrides,
        ])


@pytest.fixture(scope="module")
def feature_data(tmp_path_factory):
    """A feature data folder as `head=feature head.data.specbench_train=true
    trainer.max_epochs=0` leaves it: 4 local-text answers (train_0), the 20 held-out and the
    100 other Spec-Bench questions (specbench3_*), 3-token answers."""
    import train_heads.feature_job as job
    from train_heads.local_prompts import LocalPrompt
    from train_heads.tests.test_feature_specbench import _compose
    from train_heads.train import run

    tmp = tmp_path_factory.mktemp("exit_specbench")
    loaded = _tiny()
    mp = pytest.MonkeyPatch()
    mp.setattr(job, "local_prompts", lambda n, seed=0: [  # not the ~10 s stdlib scan
        LocalPrompt(f"local/{i}", "qa", f"Question number {i}?", "test") for i in range(n)])
    try:  # max_epochs=0 (the command ConfigError names): the data phase, no training
        res = run(_compose(tmp, "head.data.num_prompts=4", "trainer.max_epochs=0"), loaded)
    finally:
        mp.undo()
    assert res["train_steps"] == 0 and res["data"]["train_specbench_sequences"] == 100
    return tmp, loaded, Path(res["data"]["cache"]), res


def _seqs(cache: HiddenCache, split: int) -> list[list[int]]:
    """Tokens of the sequences of ``split`` (all but each one's last token)."""
    o = cache.offsets.tolist()
    return [cache.tokens[o[s] : o[s + 1]].tolist() for s in cache.sequences(split)]


def _chunk_seqs(folder: Path, name: str) -> list[list[int]]:
    seqs = load_chunks(folder, name)
    return [seqs.seq(i)[0][:-1].tolist() for i in range(seqs.num_seqs)]


def test_default_config_keeps_its_exit_data_cache(tmp_path):
    """data=feature at its defaults (local true, specbench null) finds the cache the 1.5B
    built before these options existed: e0a6a3768ee9/hidden_L7-28.safetensors."""
    from train_heads.train import get_cache

    info = SimpleNamespace(name="qwen2.5-coder-1.5b", weights_fingerprint="d72a16204d5bbf14",
                           num_layers=28)
    loaded = SimpleNamespace(lm=SimpleNamespace(dtype=torch.float32), info=info)
    h = {7: torch.zeros(3, 4), 28: torch.zeros(3, 4)}
    tiny = build_cache([Generated([1, 2, 3, 4], 2, h)], [0], lambda x: torch.zeros(3, 8), 28, 2)
    want = tmp_path / "cache" / "qwen2.5-coder-1.5b" / "e0a6a3768ee9" / "hidden_L7-28.safetensors"
    tiny.save(want)
    cfg = _exit_cfg(tmp_path, "run", "model=qwen2.5-coder-1.5b", "layers.exits=[7]")
    assert cfg.data.local is True and cfg.data.specbench is None
    cache, info_ = get_cache(cfg, loaded, [7], [])
    assert info_ == {"cache": str(want), "built": False} and cache.num_rows == 3
    # any other choice is another folder: it does not reuse that file (here it goes on to
    # build, and finds no feature data)
    for other in ("data.specbench=192", "data.local=false"):
        cfg = _exit_cfg(tmp_path, "run", "model=qwen2.5-coder-1.5b", "layers.exits=[7]", other)
        with pytest.raises(ConfigError, match="feature data cache|nothing to train on"):
            get_cache(cfg, loaded, [7], [])


def test_specbench_sequences_train_after_the_local_ones(feature_data):
    from train_heads.train import run

    tmp, loaded, folder, fres = feature_data
    local, sb = _chunk_seqs(folder, "train"), _chunk_seqs(folder, "specbench3")
    held = _chunk_seqs(folder, "heldout")
    assert len(local) == 4 and len(sb) == 100 and len(held) == 20
    base = run(_exit_cfg(tmp, "base"), loaded)
    assert base["cache"]["built"] and base["train_specbench_ids"] == []
    both = run(_exit_cfg(tmp, "both", "data.specbench=3"), loaded)
    assert both["cache"]["built"]
    assert Path(both["cache"]["cache"]).name == Path(base["cache"]["cache"]).name \
        == "hidden_L1-2.safetensors"
    assert Path(both["cache"]["cache"]).parent != Path(base["cache"]["cache"]).parent
    c0, c1 = (HiddenCache.load(Path(r["cache"]["cache"])) for r in (base, both))
    assert _seqs(c0, 0) == local and _seqs(c1, 0) == local + sb  # split 0: local, then these
    assert _seqs(c0, 1) == _seqs(c1, 1) == held  # held-out rows unchanged
    assert torch.equal(c0.hidden[2][c0.rows(1)], c1.hidden[2][c1.rows(1)])
    assert both["train_rows"] > base["train_rows"] and both["val_rows"] == base["val_rows"]
    # the question ids: the Spec-Bench dev questions not held out, as the feature job recorded
    train_q, held_q = specbench_split(ChatCharTokenizer(), 8, 6, 5)
    ids = [p.prompt_id for p in train_q]
    assert both["train_specbench_ids"] == ids == fres["train_specbench_ids"]
    assert not set(ids) & set(fres["heldout_prompt_ids"])
    assert c1.meta["prompt_ids"][4:104] == [f"specbench/{i}" for i in ids]
    assert read_heads_metadata(both["heads_path"])["extra"]["train_specbench_ids"] == ids
    assert json.loads((tmp / "both" / "metrics.json").read_text())["train_specbench_ids"] == ids
    assert both["eval_prompt_ids"] == base["eval_prompt_ids"]
    # max_train_positions takes the leading sequences: the local ones, then the first question
    cap = sum(len(s) for s in local) + len(sb[0])
    capped = run(_exit_cfg(tmp, "capped", "data.specbench=3", f"data.max_train_positions={cap}"),
                 loaded)
    assert not capped["cache"]["built"] and capped["train_specbench_ids"] == ids[:1]
    # data.local=false: the Spec-Bench sequences alone, a third cache
    alone = run(_exit_cfg(tmp, "alone", "data.specbench=3", "data.local=false"), loaded)
    c2 = HiddenCache.load(Path(alone["cache"]["cache"]))
    assert alone["cache"]["built"] and _seqs(c2, 0) == sb and _seqs(c2, 1) == held
    assert len({Path(r["cache"]["cache"]).parent for r in (base, both, alone)}) == 3
    assert alone["train_specbench_ids"] == ids


def test_missing_or_incomplete_chunks_name_the_command(feature_data, tmp_path):
    from train_heads.train import run

    tmp, loaded, folder, _ = feature_data
    for over in (["data.specbench=192"], ["data.specbench=192", "data.local=false"],
                 [f"data.feature_dir={folder}", "data.specbench=192", "data.local=false"]):
        with pytest.raises(ConfigError, match=r"specbench192_\*\.safetensors chunks.*"
                           r"head=feature head\.data\.specbench_train=true "
                           r"head\.data\.specbench_max_new_tokens=192 trainer\.max_epochs=0"):
            run(_exit_cfg(tmp, "missing", *over), loaded)
    with pytest.raises(ConfigError, match="leaves nothing to train on"):
        run(_exit_cfg(tmp, "none", "data.local=false"), loaded)
    # an interrupted feature job (one chunk of two): incomplete, the same command resumes it
    part = tmp_path / "feature-part"
    part.mkdir()
    for f in ("key.json", "train_0.safetensors", "heldout_0.safetensors",
              "specbench3_0.safetensors"):
        (part / f).write_bytes((folder / f).read_bytes())
    with pytest.raises(ConfigError, match="hold 40 prompts, not the 100 .*specbench_train=true"):
        run(_exit_cfg(tmp, "part", f"data.feature_dir={part}", "data.specbench=3"), loaded)
    no_tok = SimpleNamespace(**{**vars(loaded), "tokenizer": None})
    with pytest.raises(ConfigError, match="needs the model's tokenizer"):
        run(_exit_cfg(tmp, "notok", "data.specbench=3"), no_tok)


def test_named_chunk_sets_train_after_the_others(feature_data):
    """``data.chunks=[<name>]``: another chunk set of the cache (the feature job's
    ``magpie<N>-<hash>`` answers, here a copy of the local ones) trains after the others."""
    import shutil

    from train_heads.train import run

    tmp, loaded, folder, _ = feature_data
    shutil.copyfile(folder / "train_0.safetensors", folder / "magpie3-0123abcd_0.safetensors")
    local, sb = _chunk_seqs(folder, "train"), _chunk_seqs(folder, "specbench3")
    extra = _chunk_seqs(folder, "magpie3-0123abcd")
    assert extra == local
    res = run(_exit_cfg(tmp, "named", "data.specbench=3", "data.local=false",
                        "data.chunks=[magpie3-0123abcd]"), loaded)
    cache = HiddenCache.load(Path(res["cache"]["cache"]))
    assert res["cache"]["built"] and _seqs(cache, 0) == sb + extra
    assert cache.meta["prompt_ids"][100:104] == [f"magpie3-0123abcd/{i}" for i in range(4)]
    only = run(_exit_cfg(tmp, "only", "data.local=false", "data.chunks=[magpie3-0123abcd]"),
               loaded)
    assert _seqs(HiddenCache.load(Path(only["cache"]["cache"])), 0) == extra
    for bad in ("[heldout]", "[magpie3-0123abcd,magpie3-0123abcd]", "['../x']"):
        with pytest.raises(ConfigError, match=r"data.chunks=.*not a training chunk set"):
            run(_exit_cfg(tmp, "bad", "data.local=false", f"data.chunks={bad}"), loaded)
    for dup in (["data.chunks=[train]"], ["data.specbench=3", "data.chunks=[specbench3]"]):
        with pytest.raises(ConfigError, match=r"repeats a chunk set .* name each once"):
            run(_exit_cfg(tmp, "dup", *dup), loaded)
    with pytest.raises(ConfigError, match=r"no feature data cache under .* has nothere_\*\."
                       r"safetensors chunks \(data.chunks names a chunk set"):
        run(_exit_cfg(tmp, "missing", "data.local=false", "data.chunks=[nothere]"), loaded)
    with pytest.raises(ConfigError, match=r"no nothere_\*\.safetensors chunks in "):
        run(_exit_cfg(tmp, "missing2", "data.specbench=3", "data.local=false",
                      "data.chunks=[nothere]"), loaded)
