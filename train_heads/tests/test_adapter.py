"""Attention adapters at early exits (``head=adapter``) on tiny random models (seconds, CPU):
whole-sequence batches, padding, training, evaluation, the job end to end, save/load."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from specflow.kv.contiguous import KVCache  # noqa: E402
from specflow.models.adapter_head import AdapterHead  # noqa: E402
from specflow.models.exit_heads import (  # noqa: E402
    attach_heads,
    load_heads,
    read_heads_metadata,
    save_heads,
)
from train_heads.cache import HiddenCache, build_cache  # noqa: E402
from train_heads.datamodule import (  # noqa: E402
    AdapterDataModule,
    ExitDataModule,
    SequencesDataset,
    pack_sequences,
)
from train_heads.evaluate import adapted_cache, evaluate_exits  # noqa: E402
from train_heads.generate import generate_with_hidden  # noqa: E402
from train_heads.losses import topk_kl  # noqa: E402
from train_heads.module import ExitHeadDistiller  # noqa: E402
from train_heads.prompts import random_prompts  # noqa: E402
from train_heads.tests.test_train_heads import _model  # noqa: E402

LAYERS = [1, 2]
SKIP = 3


@pytest.fixture(scope="module")
def tiny():
    return _model(0)


@pytest.fixture(scope="module")
def cache(tiny):
    lm = tiny.lm
    prompts = random_prompts(16, 10, 128, eval_every=4, eval_offset=3, seed=1)
    prompts[2].ids[:] = prompts[2].ids[:5]  # ragged sequence lengths
    gens = generate_with_hidden(lm, [p.ids for p in prompts], LAYERS, 10, batch_size=5,
                                progress=False)
    n = lm.info.num_layers
    return build_cache(gens, [p.split for p in prompts], lambda h: lm.head(h, n), n, 16)


def _perturbed(lm, layer: int, seed: int = 0, scale: float = 0.05) -> AdapterHead:
    """An adapter from the target's layer with every weight moved a little (not the identity
    of anything the model computes)."""
    head = AdapterHead.from_target(lm, layer)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))
    return head


def _seq(cache: HiddenCache, s: int, layer: int) -> torch.Tensor:
    return cache.hidden[layer][int(cache.offsets[s]) : int(cache.offsets[s + 1])]


def test_untrained_adapter_is_the_next_layer_of_the_target(tiny, cache):
    """From the target's layer 1, the adapter over h_1 of a cached sequence (rows = positions
    from 0) gives h_2 of the cache: the rows/positions layout the training batches rely on."""
    head = AdapterHead.from_target(tiny.lm, 1)
    for s in (0, 2, 5):
        h1 = _seq(cache, s, 1)
        a = head.sequence(h1[None], torch.ones(1, h1.shape[0], dtype=torch.bool))[0]
        torch.testing.assert_close(a, _seq(cache, s, 2), rtol=1e-4, atol=1e-4)


def test_padded_batch_equals_unpadded_sequences_and_the_inference_layer(tiny, cache):
    lm = tiny.lm
    head = _perturbed(lm, 2)
    seqs = [0, 2, 5, 9]  # sequence 2 is short: most of its batch row is padding
    lengths = [int(cache.offsets[s + 1] - cache.offsets[s]) for s in seqs]
    assert len(set(lengths)) > 1
    batch = SequencesDataset(cache, [2], cache.rows(0))[seqs]
    h, valid = batch["h2"].clone(), batch["key_valid"]
    assert valid.sum(1).tolist() == lengths and (h[~valid] == 0).all()
    h[~valid] = 1e3 * torch.randn(int((~valid).sum()), h.shape[-1])  # junk must not leak
    with torch.no_grad():
        padded = head.sequence(h, valid)
        for b, s in enumerate(seqs):
            one = _seq(cache, s, 2)
            alone = head.sequence(one[None], torch.ones(1, lengths[b], dtype=torch.bool))[0]
            torch.testing.assert_close(padded[b, : lengths[b]], alone, rtol=1e-5, atol=1e-5)
    # the inference path (the model's own decoder-layer function over the adapter's KV
    # cache) computes the same: teacher-forced evaluation measures what drafting sees
    attach_heads(lm, {2: copy.deepcopy(head)})
    try:
        one = _seq(cache, 2, 2)
        adapter = lm.exit_adapter(2)
        infer = adapter.run(one, [(KVCache(adapter.kv, 64), one.shape[0])], {})
    finally:
        lm.set_exit_heads({})
    with torch.no_grad():
        want = head.sequence(one[None], torch.ones(1, one.shape[0], dtype=torch.bool))[0]
    torch.testing.assert_close(infer, want, rtol=1e-4, atol=1e-4)


def test_sequence_batches_carry_the_exit_heads_rows(cache):
    """Loss rows are the ones ExitDataModule uses (train: after the prefix; val: generated
    after it), each batch's teacher rows line up with its loss mask, the prefix stays
    attention context, and the packing respects both budgets."""
    dm = AdapterDataModule(cache, LAYERS, batch_rows=40, batch_sequences=3, skip=SKIP,
                           val_max_rows=None, pool=4)
    ref = ExitDataModule(cache, LAYERS, skip=SKIP, val_max_rows=None)
    assert torch.equal(dm.train_rows, ref.train_rows) and torch.equal(dm.val_rows, ref.val_rows)
    lengths = cache.offsets[1:] - cache.offsets[:-1]
    assert sorted(s for b in dm.train_batches for s in b) == cache.sequences(0)
    assert sorted(s for b in dm.val_batches for s in b) == cache.sequences(1)
    for b in dm.train_batches:
        assert len(b) <= 3 and (len(b) == 1 or len(b) * int(lengths[b].max()) <= 40)
    seen = {"train": [], "val": []}
    for stage, loader in (("train", dm.train_dataloader()), ("val", dm.val_dataloader())):
        for batch in loader:
            loss, valid = batch["loss_mask"], batch["key_valid"]
            assert not (loss & ~valid).any() and not loss[:, :SKIP].any()
            assert valid[:, :SKIP].all()  # the prefix is context
            rows = []
            for b in range(loss.shape[0]):
                # recover the sequence of batch row b from its first hidden state
                h0 = batch["h1"][b, 0]
                s = int(((cache.hidden[1][cache.offsets[:-1]] - h0).abs().sum(1) == 0)
                        .nonzero()[0])
                rows += (int(cache.offsets[s]) + loss[b].nonzero().squeeze(1)).tolist()
            rows_t = torch.tensor(rows)
            assert torch.equal(batch["topk_ids"], cache.topk_ids[rows_t])
            assert torch.equal(batch["next"], cache.next_token[rows_t])
            seen[stage] += rows
    assert sorted(seen["train"]) == dm.train_rows.tolist()
    assert sorted(seen["val"]) == dm.val_rows.tolist()
    # a lone over-long sequence is a batch of its own; the row budget splits batches
    assert pack_sequences([0, 1, 2], [5, 50, 5], 20, 8) == [[0], [1], [2]]
    assert pack_sequences([0, 1, 2], [5, 5, 5], 20, 8) == [[0, 1, 2]]
    assert pack_sequences([0, 1, 2], [5, 5, 5], 20, 2) == [[0, 1], [2]]


def _loss(module: ExitHeadDistiller, batch) -> float:
    with torch.no_grad():
        return sum(float(topk_kl(module.batch_logits(layer, batch), batch["topk_logp"],
                                 batch["topk_ids"]).mean()) for layer in LAYERS)


def test_training_lowers_the_loss_on_a_fixed_batch(tiny, cache):
    import lightning as L

    lm = tiny.lm
    heads = {layer: _perturbed(lm, layer, seed=layer) for layer in LAYERS}
    module = ExitHeadDistiller(lm.lm_head, heads, lr=3e-3, warmup_steps=1)
    assert module.hparams.lr == 3e-3
    dm = AdapterDataModule(cache, LAYERS, batch_rows=64, batch_sequences=4, skip=SKIP,
                           val_max_rows=None)
    fixed = SequencesDataset(cache, LAYERS, dm.train_rows)[cache.sequences(0)]
    start = {k: v.clone() for k, v in module.state_dict().items()}
    loss0 = _loss(module, fixed)
    trainer = L.Trainer(max_steps=25, accelerator="cpu", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(module, dm)
    assert trainer.global_step == 25
    loss1 = _loss(module, fixed)
    assert loss1 < 0.8 * loss0, (loss0, loss1)
    assert trainer.callback_metrics["val/loss"] > 0
    assert "val/agree_L2" in trainer.callback_metrics
    # the LM head is frozen and not part of the checkpointed state
    assert "lm_head" not in module.state_dict() and torch.equal(module.lm_head, lm.lm_head)
    assert not all(torch.equal(start[k], v) for k, v in module.state_dict().items())


def test_adapted_evaluation_matches_a_direct_computation(tiny, cache):
    """``adapted_cache`` + ``evaluate_exits`` with attached adapters: the agreement equals
    lm_head(RMSNorm_g(adapter(h_L))) vs the teacher, on the held-out generated rows."""
    lm = tiny.lm
    n = lm.info.num_layers
    head = _perturbed(lm, 2, scale=0.2)
    sub = adapted_cache(cache, {2: head})
    assert sub.sequences(1) == list(range(len(cache.sequences(1))))
    attach_heads(lm, {2: _perturbed(lm, 2, scale=0.2)})
    try:
        got = evaluate_exits(lm.head, sub, [2], 4, SKIP)[2]
    finally:
        lm.set_exit_heads({})
    agree = []
    with torch.no_grad():
        for s in cache.sequences(1):
            h = _seq(cache, s, 2)
            a = head.sequence(h[None], torch.ones(1, h.shape[0], dtype=torch.bool))[0]
            z = head(a) @ lm.lm_head.T
            t = lm.head(_seq(cache, s, n), n).argmax(-1)
            gen = cache.generated[int(cache.offsets[s]) : int(cache.offsets[s + 1])].clone()
            gen[:SKIP] = False
            agree.append((z.argmax(-1) == t)[gen])
    want = torch.cat(agree).float()
    assert got.positions == want.numel() and abs(got.agree - float(want.mean())) < 1e-6
    cut = evaluate_exits(lm.head, cache, [2], 4, SKIP)[2]
    assert cut.positions == got.positions and cut.kl != got.kl


def test_save_load_round_trip_is_exact(tiny, tmp_path):
    lm, info = tiny.lm, tiny.info
    heads = {layer: _perturbed(lm, layer, seed=layer) for layer in (1, 3)}
    path = save_heads(tmp_path / "heads.safetensors", heads, info)
    meta = read_heads_metadata(path)
    assert meta["head_type"] == "adapter" and meta["layers"] == [1, 3]
    back = load_heads(path, info)
    for layer, head in heads.items():
        assert isinstance(back[layer], AdapterHead) and back[layer].config() == head.config()
        want = head.state_dict()
        got = back[layer].state_dict()
        assert want.keys() == got.keys()
        assert all(torch.equal(want[k], got[k]) for k in want)


def _compose(tmp_path: Path, *overrides: str):
    from hydra import compose, initialize_config_dir

    conf = Path(__file__).resolve().parents[1] / "conf"
    with initialize_config_dir(str(conf), version_base="1.3"):
        return compose("config", overrides=[
            "data=random", "trainer=smoke", "layers=explicit", "layers.exits=[1,2]",
            "head=adapter", "head.batch_rows=48", "head.batch_sequences=4",
            f"data.skip_prefix={SKIP}", "progress=false", f"output.dir={tmp_path / 'run'}",
            f"output.install_path={tmp_path / 'installed' / 'heads.safetensors'}",
            f"data.cache_dir={tmp_path / 'cache'}", "threads=null", *overrides,
        ])


def test_adapter_job_end_to_end(tmp_path):
    from train_heads.train import evaluate_adapters, run

    loaded = _model(7)
    lm, info = loaded.lm, loaded.info
    cfg = _compose(tmp_path)
    res = run(cfg, loaded)
    assert res["cache"]["built"] and res["train_steps"] == 6
    assert res["adapter"]["optim"]["lr"] == 2e-4  # head.optim over the exit heads' optim
    assert set(res["before"]) == set(res["after"]) == set(res["cut"]) == {"1", "2"}
    for layer in ("1", "2"):
        assert res["before"][layer]["positions"] == res["after"][layer]["positions"] > 0
        assert res["before"][layer]["kl"] != res["cut"][layer]["kl"]  # the adapter ran
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["after"] == res["after"] and metrics["head"]["head_type"] == "adapter"
    report = (tmp_path / "run" / "report.md").read_text()
    assert report.startswith("# Attention adapters") and "Without the adapter" in report
    assert list((tmp_path / "run" / "csv").rglob("metrics.csv"))
    assert lm.exit_heads == {} and lm.exit_adapters == {}  # the model is given back clean
    # installed like exit heads; the file loads as adapters and reproduces the metrics
    installed = Path(res["installed_path"])
    assert installed.is_file() and read_heads_metadata(installed)["head_type"] == "adapter"
    heads = load_heads(installed, info)
    assert set(heads) == {1, 2} and all(isinstance(h, AdapterHead) for h in heads.values())
    saved = load_heads(res["heads_path"], info)
    for layer in (1, 2):
        assert all(torch.equal(a, b) for a, b in zip(heads[layer].state_dict().values(),
                                                     saved[layer].state_dict().values(),
                                                     strict=True))
        untrained = AdapterHead.from_target(lm, layer).state_dict()
        assert not all(torch.equal(untrained[k], v) for k, v in heads[layer].state_dict()
                       .items())  # trained
    cache = HiddenCache.load(Path(res["cache"]["cache"]), [1, 2])
    again = evaluate_adapters(lm, heads, cache, cfg.eval_k, SKIP)
    for layer in (1, 2):
        assert again[layer].agree == res["after"][str(layer)]["agree"]
        assert abs(again[layer].kl - res["after"][str(layer)]["kl"]) < 1e-5
    # data.max_train_positions still selects the leading training sequences (cache reused)
    res2 = run(_compose(tmp_path, "+data.max_train_positions=100", "logger=none",
                        "checkpoint.enabled=false", "output.install=false"), loaded)
    assert not res2["cache"]["built"]
    assert 0 < res2["train_rows"] < res["train_rows"]
    assert res2["adapter"]["train_sequences"] < res["adapter"]["train_sequences"]
