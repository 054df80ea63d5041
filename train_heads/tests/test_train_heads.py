"""train_heads + specflow.models.exit_heads on tiny random models (seconds, CPU)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from specflow.errors import ConfigError  # noqa: E402
from specflow.kv.contiguous import layer_caches
from specflow.kv.session import ModelSession  # noqa: E402
from specflow.models.exit_heads import (  # noqa: E402
    ExitHead,
    attach_heads,
    load_and_attach,
    load_heads,
    read_heads_metadata,
    save_heads,
)
from specflow.models.loading import LoadedModel  # noqa: E402
from specflow.models.native import NativeLM  # noqa: E402
from specflow.models.tiny import tiny_hf_model, tiny_model_info  # noqa: E402
from train_heads.cache import HiddenCache, build_cache  # noqa: E402
from train_heads.datamodule import ExitDataModule, RowsDataset  # noqa: E402
from train_heads.evaluate import evaluate_exits, simulate_tau, tau_iid  # noqa: E402
from train_heads.generate import generate_with_hidden  # noqa: E402
from train_heads.losses import full_kl, teacher_topk, topk_kl  # noqa: E402
from train_heads.module import ExitHeadDistiller  # noqa: E402
from train_heads.prompts import random_prompts  # noqa: E402

LAYERS = [1, 2]


def _model(seed: int = 0, name: str | None = None) -> LoadedModel:
    hf = tiny_hf_model("qwen2", seed=seed, num_layers=4, vocab_size=128)
    info = tiny_model_info(hf, name or f"tiny-qwen2-{seed}")
    return LoadedModel(lm=NativeLM.from_hf(hf, info), tokenizer=None, hf_model=hf, info=info)


@pytest.fixture(scope="module")
def tiny():
    return _model(0)


@pytest.fixture(scope="module")
def cache(tiny):
    lm = tiny.lm
    prompts = random_prompts(16, 10, 128, eval_every=4, eval_offset=3, seed=1)
    gens = generate_with_hidden(lm, [p.ids for p in prompts], LAYERS, 10, batch_size=5,
                                progress=False)
    n = lm.info.num_layers
    return build_cache(gens, [p.split for p in prompts], lambda h: lm.head(h, n), n, 16)


def _session_greedy(lm, prompt, new):
    s = ModelSession(lm, len(prompt) + new + 1)
    s.set_tokens(list(prompt))
    out = []
    for _ in range(new):
        n = len(s.tokens)
        tok = int(s.logits(lm.info.num_layers, n - 1, n).argmax(-1))
        out.append(tok)
        s.extend([tok])
    return out


def test_batched_generation_matches_native_greedy_and_hidden_states(tiny):
    lm = tiny.lm
    prompts = [p.ids for p in random_prompts(5, 7, 128, seed=3)]
    prompts[1] = prompts[1][:4]  # ragged lengths in one batch
    gens = generate_with_hidden(lm, prompts, [2], 9, batch_size=3, progress=False)
    for prompt, g in zip(prompts, gens, strict=True):
        assert g.tokens[: len(prompt)] == prompt and g.prompt_len == len(prompt)
        assert g.tokens[len(prompt):] == _session_greedy(lm, prompt, 9)
        caches = layer_caches(lm, 64)
        h = lm.embed(torch.tensor(g.tokens[:-1]))
        for layer in range(lm.info.num_layers):
            h = lm.run_layer(layer, h, [(caches[layer], h.shape[0])], {})
            if layer + 1 in g.hidden:
                torch.testing.assert_close(g.hidden[layer + 1], h, rtol=1e-4, atol=1e-4)


def test_exit_states_by_teacher_forcing_equal_the_generation_path(tiny):
    """``train_heads.exit_data``: exit states recomputed over cached sequences (ragged
    batches, layers below the deepest exit only) equal those generation kept; h_N is the
    cache's; a position cap takes whole leading sequences."""
    from train_heads.exit_data import exit_states
    from train_heads.feature_data import FeatureSequences

    lm = tiny.lm
    n = lm.info.num_layers
    prompts = [p.ids for p in random_prompts(5, 7, 128, seed=4)]
    prompts[2] = prompts[2][:3]
    gens = generate_with_hidden(lm, prompts, [1, 2], 6, batch_size=5, progress=False)
    seqs = FeatureSequences.from_generated(gens, n)
    got = exit_states(lm, seqs, [1, 2], batch_rows=20)  # several ragged batches
    assert [g.tokens for g in got] == [g.tokens for g in gens]
    assert [g.prompt_len for g in got] == [g.prompt_len for g in gens]
    for want, have in zip(gens, got, strict=True):
        assert sorted(have.hidden) == [1, 2, n]
        assert torch.equal(have.hidden[n], want.hidden[n])
        for layer in (1, 2):
            torch.testing.assert_close(have.hidden[layer], want.hidden[layer],
                                       rtol=1e-4, atol=1e-4)
    rows = [len(g.tokens) - 1 for g in gens]
    capped = exit_states(lm, seqs, [2], max_positions=rows[0] + rows[1])
    assert len(capped) == 2 and sorted(capped[0].hidden) == [2, n]


def test_limit_train_keeps_the_leading_training_sequences(cache):
    train = cache.sequences(0)
    lengths = (cache.offsets[1:] - cache.offsets[:-1]).tolist()
    cap = lengths[train[0]] + lengths[train[1]]
    small = cache.limit_train(cap)
    assert small.sequences(0) == train[:2] and small.sequences(1) == cache.sequences(1)
    assert small.rows(0).numel() == cap
    assert cache.sequences(0) == train  # the original is untouched


def test_topk_kl_is_full_kl_at_full_k_and_a_lower_bound_below():
    gen = torch.Generator().manual_seed(0)
    t, s = torch.randn(6, 50, generator=gen) * 3, torch.randn(6, 50, generator=gen) * 3
    full = full_kl(t, s)
    logp, ids = teacher_topk(t, 50)
    torch.testing.assert_close(topk_kl(s, logp, ids), full, rtol=1e-4, atol=1e-5)
    logp, ids = teacher_topk(t, 5)
    part = topk_kl(s, logp, ids)
    assert (part <= full + 1e-5).all() and (part >= -1e-6).all()


def test_simulated_tau():
    assert simulate_tau([True] * 10, 4) == (10, 2)  # 4 accepted + bonus, twice
    assert simulate_tau([False] * 5, 4) == (5, 5)  # every round gives one token
    assert simulate_tau([True, True, False, True], 4) == (4, 2)
    assert tau_iid(0.0, 4) == 1.0 and tau_iid(1.0, 4) == 5.0


def test_untrained_head_is_the_cut_model(tiny):
    lm = tiny.lm
    h = torch.randn(5, lm.info.hidden_size)
    base = lm.head(h, 2)
    for kind in ("norm", "linear", "mlp"):
        attach_heads(lm, {2: ExitHead(lm.info.hidden_size, kind, 8, lm.eps, lm.final_norm)})
        torch.testing.assert_close(lm.head(h, 2), base, rtol=1e-5, atol=1e-5)
    lm.exit_heads = {}


def _train(cache, lm, steps: int, kind: str = "mlp"):
    import lightning as L

    torch.manual_seed(0)  # the heads' initialization (the result must not depend on test order)
    heads = {layer: ExitHead(lm.info.hidden_size, kind, 16, lm.eps, lm.final_norm)
             for layer in LAYERS}
    module = ExitHeadDistiller(lm.lm_head, heads, lr=1e-2, warmup_steps=1)
    dm = ExitDataModule(cache, LAYERS, batch_size=32, val_max_rows=None)
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(module, dm)
    return module, dm


def _kl(module, dm, rows: torch.Tensor) -> float:
    """Summed over exits: mean top-k KL on ``rows`` of the cache."""
    batch = RowsDataset(dm.cache, rows, LAYERS)[list(range(len(rows)))]
    with torch.no_grad():
        return sum(
            float(topk_kl(module.logits(layer, batch[f"h{layer}"]), batch["topk_logp"],
                          batch["topk_ids"]).mean())
            for layer in LAYERS
        )


def test_a_few_steps_reduce_the_distillation_loss(tiny, cache):
    lm = tiny.lm
    torch.manual_seed(0)  # the same initialization as the trained heads start from
    heads = {layer: ExitHead(lm.info.hidden_size, "mlp", 16, lm.eps, lm.final_norm)
             for layer in LAYERS}
    dm = ExitDataModule(cache, LAYERS, batch_size=32, val_max_rows=None)
    untrained = ExitHeadDistiller(lm.lm_head, heads)
    train0, val0 = _kl(untrained, dm, dm.train_rows), _kl(untrained, dm, dm.val_rows)
    module, dm = _train(cache, lm, 30)
    train1, val1 = _kl(module, dm, dm.train_rows), _kl(module, dm, dm.val_rows)
    assert train1 < 0.7 * train0, (train0, train1)
    assert val1 < val0, (val0, val1)  # held-out positions too (weakly: random tiny model)
    # also measured through the inference path on held-out generated positions
    m0 = evaluate_exits(lm.head, cache, LAYERS, 4)
    attach_heads(lm, module.exit_heads())
    m1 = evaluate_exits(lm.head, cache, LAYERS, 4)
    lm.exit_heads = {}
    assert sum(m1[k].kl for k in LAYERS) < sum(m0[k].kl for k in LAYERS)


def test_save_load_round_trip_gives_identical_logits(tiny, tmp_path):
    lm, info = tiny.lm, tiny.info
    torch.manual_seed(0)
    heads = {}
    for layer, kind in ((1, "mlp"), (2, "linear"), (3, "norm")):
        head = ExitHead(info.hidden_size, kind, 8, lm.eps, lm.final_norm)
        with torch.no_grad():
            for p in head.parameters():
                p.add_(0.1 * torch.randn_like(p))
        heads[layer] = head
    h = torch.randn(7, info.hidden_size)
    attach_heads(lm, heads)
    want = {layer: lm.head(h, layer) for layer in heads}
    path = save_heads(tmp_path / "h" / "heads.safetensors", heads, info, extra={"note": 1})
    lm.exit_heads = {}
    meta = read_heads_metadata(path)
    assert meta["base_model"] == info.name and meta["layers"] == [1, 2, 3]
    assert meta["weights_fingerprint"] == info.weights_fingerprint
    assert json.loads(path.with_suffix(".json").read_text())["extra"] == {"note": 1}
    load_and_attach(lm, path)
    for layer in heads:
        assert torch.equal(lm.head(h, layer), want[layer])
    lm.exit_heads = {}
    assert set(load_heads(path, info)) == {1, 2, 3}


def test_heads_for_another_base_model_are_refused(tiny, tmp_path):
    info = tiny.info
    path = save_heads(tmp_path / "heads.safetensors",
                      {1: ExitHead(info.hidden_size, "norm")}, info)
    other = _model(seed=5).info
    with pytest.raises(ConfigError) as err:
        load_heads(path, other)
    msg = str(err.value)
    for s in (info.name, info.weights_fingerprint, other.name, other.weights_fingerprint,
              "train_heads.train"):
        assert s in msg
    # same weights under another name: refused by default, allowed on request
    import dataclasses

    renamed = dataclasses.replace(info, name="/some/local/path")
    with pytest.raises(ConfigError, match="check_name=False"):
        load_heads(path, renamed)
    assert set(load_heads(path, renamed, check_name=False)) == {1}
    with pytest.raises(ConfigError, match="does not exist"):
        load_heads(tmp_path / "nope.safetensors", info)


def test_cache_file_round_trip(cache, tmp_path):
    path = tmp_path / "c.safetensors"
    cache.save(path)
    back = HiddenCache.load(path, [2])
    assert back.layers == [2, 4]
    torch.testing.assert_close(back.hidden[2], cache.hidden[2])
    assert torch.equal(back.topk_ids, cache.topk_ids)
    assert torch.equal(back.generated, cache.generated)


def _compose(tmp_path: Path, *overrides: str):
    from hydra import compose, initialize_config_dir

    conf = Path(__file__).resolve().parents[1] / "conf"
    with initialize_config_dir(str(conf), version_base="1.3"):
        return compose("config", overrides=[
            "data=random", "trainer=smoke", "layers=explicit", "layers.exits=[1,2]",
            "head.rank=16", "progress=false", f"output.dir={tmp_path / 'run'}",
            f"output.install_path={tmp_path / 'installed' / 'heads.safetensors'}",
            f"data.cache_dir={tmp_path / 'cache'}", "threads=null", *overrides,
        ])


def test_hydra_job_end_to_end(tmp_path):
    from train_heads.train import run

    loaded = _model(7)
    cfg = _compose(tmp_path)
    res = run(cfg, loaded)
    assert res["cache"]["built"] and res["train_steps"] == 6
    assert set(res["after"]) == {"1", "2"}
    installed = Path(res["installed_path"])
    assert installed.is_file() and installed.with_suffix(".json").is_file()
    assert (tmp_path / "run" / "report.md").is_file()
    assert list((tmp_path / "run" / "csv").rglob("metrics.csv"))
    assert list((tmp_path / "run" / "checkpoints").glob("*.ckpt"))
    heads = load_heads(installed, loaded.info)
    assert set(heads) == {1, 2} and loaded.lm.exit_heads == {}
    # the second run reuses the cached generations and hidden states
    res2 = run(_compose(tmp_path, "layers.exits=[2]", "logger=none"), loaded)
    assert not res2["cache"]["built"] and set(res2["after"]) == {"2"}


def test_the_job_gives_the_model_its_heads_back_through_set_exit_heads(tmp_path):
    """Training replaces the model's heads only for the job; afterwards the heads it had
    are back with their path, and a copy placed elsewhere carries them (not the job's)."""
    from train_heads.train import run

    loaded = _model(9)
    lm = loaded.lm
    mine = {1: ExitHead(lm.info.hidden_size, "linear", 0, lm.eps, lm.final_norm)}
    torch.nn.init.normal_(mine[1].proj.weight, std=0.02, generator=torch.Generator().manual_seed(0))
    attach_heads(lm, mine, path="mine.safetensors")
    run(_compose(tmp_path, "logger=none", "checkpoint.enabled=false"), loaded)
    assert lm.exit_heads_path == "mine.safetensors"
    assert set(lm.exit_heads) == {1} and lm.exit_heads[1] is mine[1]
    placed = lm.to("cpu", torch.float64)
    assert set(placed.exit_heads) == {1}
    for a, b in zip(placed.exit_heads[1].parameters(), mine[1].parameters(), strict=True):
        assert torch.equal(a, b.to(torch.float64))


def test_unknown_logger_and_missing_wandb_are_clear(tmp_path):
    from train_heads.job_setup import make_logger

    cfg = _compose(tmp_path, "logger=wandb")
    try:
        import wandb  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigError, match="pip install wandb"):
            make_logger(cfg.logger, tmp_path)
    cfg.logger.kind = "tensorboardx"
    with pytest.raises(ConfigError, match="unknown"):
        make_logger(cfg.logger, tmp_path)
