"""Train early-exit heads by self-distillation: ``python -m train_heads.train [overrides]``.

Steps (each timed and written to ``<run dir>/report.md`` and ``metrics.json``):

1. load the base model (``model``), resolve the exits (``layers``);
2. data: load the hidden-state cache for this model + data config, or build it: greedy
   self-generated continuations of the train and held-out prompts, with every exit's
   hidden states and the final layer's top-k (``train_heads.generate``/``cache``);
3. evaluate the untrained exits (final norm + LM head) on the held-out prompts;
4. fit the heads with Lightning (``trainer``, ``logger``, checkpoints, progress bar);
5. evaluate again with the trained heads attached through the inference path
   (``specflow.models.exit_heads.attach_heads`` + ``lm.head``);
6. save the heads (safetensors + metadata) to the run dir and, with ``output.install``, to
   ``~/.cache/specflow/heads/<model>/heads.safetensors`` where specflow finds them.

``head=adapter`` trains attention adapters (``specflow.models.adapter_head.AdapterHead``, one
decoder layer at each exit, initialised from the target's layer L) on the same cache, in
batches of whole sequences (``train_heads.datamodule.AdapterDataModule``); steps 3 and 5
run each adapter over every whole held-out sequence (``evaluate_adapters``), and step 3 also
reports the cut model at the exit (``cut``).

Several processes (``trainer=ddp_cpu``, or ``trainer.devices=8 trainer.strategy=ddp`` on a
GPU node, ``+launcher=slurm`` across nodes): Lightning starts one process per device, each
running this job with ``LOCAL_RANK``/``RANK`` set (under SLURM, one task per device).  Rank 0
builds the data cache (the others wait for its file, ``data.wait_for_cache_s``), evaluates,
and alone writes heads, checkpoints, logs and reports; every rank trains on its shard of
the batches (DistributedSampler) and the gradients are all-reduced (gloo on CPU, NCCL on
GPUs).  Each rank logs to its own file in the run dir (``train_ddp_process_<r>.log``).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import resource
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python train_heads/train.py`: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hydra  # noqa: E402
import torch  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

from specflow.errors import ConfigError  # noqa: E402
from specflow.models.adapter_head import AdapterHead  # noqa: E402
from specflow.models.exit_heads import (  # noqa: E402
    ExitHead,
    attach_heads,
    default_heads_path,
    save_heads,
)
from train_heads.cache import (  # noqa: E402
    HiddenCache,
    build_cache,
    cache_key,
    data_cache_dir,
    find_cached,
    layers_filename,
)
from train_heads.evaluate import (  # noqa: E402
    ExitMetrics,
    adapted_cache,
    as_dict,
    evaluate_exits,
    metrics_table,
)
from train_heads.exit_data import (  # noqa: E402
    exit_data_from_features,
    feature_data_dir,
    feature_prompts,
    train_chunk_names,
    trained_specbench_ids,
)
from train_heads.job_setup import make_logger, trainer_args  # noqa: E402
from train_heads.prompts import Prompt, random_prompts, shared_prefix, specbench_prompts  # noqa: E402,E501

log = logging.getLogger("train_heads")
CACHE_VERSION = 1


def resolve_layers(cfg: DictConfig, num_layers: int) -> list[int]:
    """``layers.exits`` if given, else ``round(f * N)`` for ``layers.fractions``."""
    if cfg.get("exits"):
        exits = [int(x) for x in cfg.exits]
    else:
        exits = [max(1, round(float(f) * num_layers)) for f in cfg.fractions]
    bad = [x for x in exits if not 1 <= x < num_layers]
    if bad:
        raise ConfigError(f"layers {bad} are not early exits of a {num_layers}-layer model "
                          f"(use 1..{num_layers - 1})")
    return sorted(set(exits))


def load_prompts(data: DictConfig, loaded: Any) -> list[Prompt]:
    if data.source == "specbench":
        if loaded.tokenizer is None:
            raise ConfigError("data.source=specbench needs a tokenizer; use data=random")
        return specbench_prompts(loaded.tokenizer, data.path, data.max_prompt_tokens,
                                 data.chat_template, data.eval_every, data.eval_offset,
                                 data.limit)
    if data.source == "random":
        return random_prompts(data.num_prompts, data.prompt_len, loaded.info.vocab_size,
                              data.eval_every, data.eval_offset, data.seed,
                              loaded.info.eos_token_ids)
    if data.source == "feature":  # the feature head's cached sequences (train_heads.exit_data)
        names = train_chunk_names(data)
        directory = feature_data_dir(
            data_cache_dir(data.cache_dir) / Path(loaded.info.name).name, data.feature_dir,
            names[0])
        return feature_prompts(directory, names, loaded.tokenizer)
    raise ConfigError(f"data.source={data.source!r} is unknown; use specbench, random or "
                      "feature")


def process_rank() -> int:
    """This process's global rank as the launcher set it (``RANK``, ``SLURM_PROCID``, or
    ``LOCAL_RANK`` with ``NODE_RANK`` = 0); 0 in a single-process job."""
    for var in ("RANK", "SLURM_PROCID"):
        if os.environ.get(var):
            return int(os.environ[var])
    return int(os.environ.get("LOCAL_RANK") or 0)


def _wait_for_cache(directory: Path, layers: list[int], timeout_s: float) -> Path:
    """A non-zero rank: wait for rank 0 to write the cache (polling every 2 s)."""
    deadline = time.monotonic() + timeout_s
    while (found := find_cached(directory, layers)) is None:
        if time.monotonic() > deadline:
            raise ConfigError(
                f"rank {process_rank()}: no hidden-state cache under {directory} after "
                f"{timeout_s:.0f} s (rank 0 builds it); raise data.wait_for_cache_s or build "
                "it first with a single-process run (trainer.devices=1)"
            )
        time.sleep(2.0)
    return found


def get_cache(cfg: DictConfig, loaded: Any, layers: list[int], prompts: list[Prompt]
              ) -> tuple[HiddenCache, dict[str, Any]]:
    """Load the cache for (model, data config) holding ``layers``, or build and save it
    (rank 0 only: the other ranks wait for it)."""
    lm, info = loaded.lm, loaded.info
    data = cfg.data
    key_parts = {
        "version": CACHE_VERSION, "model": info.name, "weights": info.weights_fingerprint,
        "dtype": str(getattr(lm, "dtype", "")),
        "data": OmegaConf.to_container(data, resolve=True),
    }
    for k in ("batch_size", "val_max_rows", "cache_dir", "gen_batch_size", "wait_for_cache_s",
              "max_train_positions"):  # training-time choices: one cache serves them all
        key_parts["data"].pop(k, None)
    # data=feature's training sources: at their defaults (local text only) they stay out of
    # the key, so the caches built before they existed keep their folder; any other choice
    # is in it (its own folder)
    if key_parts["data"].get("specbench") is None:
        key_parts["data"].pop("specbench", None)
    if key_parts["data"].get("local") is True:
        key_parts["data"].pop("local", None)
    if not key_parts["data"].get("chunks"):
        key_parts["data"].pop("chunks", None)
    directory = data_cache_dir(data.cache_dir) / Path(info.name).name / cache_key(key_parts)
    found = find_cached(directory, layers + [info.num_layers])
    if found is None and process_rank() != 0:
        log.info("rank %d: waiting for rank 0's hidden-state cache in %s", process_rank(),
                 directory)
        found = _wait_for_cache(directory, layers + [info.num_layers],
                                float(data.get("wait_for_cache_s", 3600)))
    if found is not None:
        log.info("loading cached hidden states %s", found)
        return HiddenCache.load(found, layers), {"cache": str(found), "built": False}
    from train_heads.generate import generate_with_hidden

    timings = {}
    n = info.num_layers
    if data.source == "feature":  # teacher-forced exit states over the cached sequences
        t0 = time.perf_counter()
        names = train_chunk_names(data)
        source = feature_data_dir(directory.parent, data.feature_dir, names[0])
        gens, splits = exit_data_from_features(lm, source, layers, names)
        timings["exit_states_s"] = time.perf_counter() - t0
        # train/<i>, specbench/<question id>, heldout/<i> (exit_data.feature_prompts)
        ids = [p.prompt_id for p in prompts]
        if [p.split for p in prompts] != splits:
            raise ConfigError(f"the feature data in {source} changed while it was read; rerun")
        meta = {"model": info.name, "weights_fingerprint": info.weights_fingerprint,
                "prompt_ids": ids, "key": key_parts, "feature_data": str(source)}
    else:
        parts = []
        for split, new in ((0, data.max_new_tokens), (1, data.eval_max_new_tokens)):
            ps = [p for p in prompts if p.split == split]
            t0 = time.perf_counter()
            parts.append((ps, generate_with_hidden(
                lm, [p.ids for p in ps], layers, new, data.gen_batch_size, info.eos_token_ids,
                progress=cfg.progress,
            )))
            timings[f"generate_{'train' if split == 0 else 'eval'}_s"] = (
                time.perf_counter() - t0)
        gens = [g for _, gs in parts for g in gs]
        splits = [p.split for ps, _ in parts for p in ps]
        meta = {
            "model": info.name, "weights_fingerprint": info.weights_fingerprint,
            "prompt_ids": [p.prompt_id for ps, _ in parts for p in ps], "key": key_parts,
        }
    t0 = time.perf_counter()
    cache = build_cache(gens, splits, lambda h: lm.head(h, n), n, data.topk, meta)
    timings["teacher_topk_s"] = time.perf_counter() - t0
    cache.meta["timings"] = timings
    path = directory / layers_filename(layers + [n])
    cache.save(path)
    (directory / "key.json").write_text(json.dumps(key_parts, indent=2, default=str))
    log.info("cached hidden states to %s (%s)", path, timings)
    return cache, {"cache": str(path), "built": True, **timings}


def evaluate_adapters(lm: Any, adapters: dict[int, AdapterHead], cache: HiddenCache, k: int,
                      skip: int) -> dict[int, ExitMetrics]:
    """``evaluate_exits`` for attention adapters: their outputs over every whole held-out
    sequence (``adapted_cache``), through ``lm.head`` with copies of them attached (the
    inference path's position-wise part; the adapters themselves stay float32 and
    unattached).  ``lm``'s exit heads are cleared afterwards."""
    attach_heads(lm, {layer: copy.deepcopy(h) for layer, h in adapters.items()})
    try:
        return evaluate_exits(lm.head, adapted_cache(cache, adapters), sorted(adapters), k, skip)
    finally:
        lm.set_exit_heads({})


def cut_table(cut: dict[int, ExitMetrics], num_layers: int, k: int) -> str:
    """The cut model at each exit (final norm + LM head, no adapter): a reference line."""
    return "Without the adapter (final norm + LM head at the exit): " + "; ".join(
        f"exit {layer}: agree {m.agree:.1%}, KL {m.kl:.3f}, τ@k={k} {m.tau:.2f}"
        for layer, m in sorted(cut.items()))


def _peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6


def run(cfg: DictConfig, loaded: Any = None) -> dict[str, Any]:
    """Run the whole job (see module doc); returns the metrics dict also written to disk."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint, TQDMProgressBar

    from train_heads.datamodule import AdapterDataModule, ExitDataModule
    from train_heads.module import ExitHeadDistiller

    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*GPU available but not used.*")
    if cfg.threads:
        torch.set_num_threads(int(cfg.threads))
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    out_dir = Path(cfg.output.dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    times: dict[str, float] = {}
    rank = process_rank()

    t0 = time.perf_counter()
    if loaded is None:
        from specflow.models.loading import load_model

        loaded = load_model(cfg.model.name, dtype=cfg.model.dtype, backend="native",
                            trust_remote_code=False, packed_weights=None)
    times["load_model_s"] = time.perf_counter() - t0
    lm, info = loaded.lm, loaded.info
    if not hasattr(lm, "lm_head"):
        raise ConfigError(f"{info.name}: exit heads need the native backend")
    if cfg.head.get("job"):  # another kind of head with its own job (head=feature)
        result = hydra.utils.get_method(cfg.head.job)(cfg, loaded, out_dir)
        result.setdefault("times_s", {})["load_model_s"] = times["load_model_s"]
        return result
    saved_heads, saved_path = dict(lm.exit_heads), lm.exit_heads_path
    lm.set_exit_heads({})
    try:
        layers = resolve_layers(cfg.layers, info.num_layers)
        prompts = load_prompts(cfg.data, loaded)
        skip = shared_prefix(prompts) if cfg.data.skip_prefix == "auto" else int(
            cfg.data.skip_prefix)
        t0 = time.perf_counter()
        cache, cache_info = get_cache(cfg, loaded, layers, prompts)
        if cfg.data.get("max_train_positions"):
            cache = cache.limit_train(int(cfg.data.max_train_positions))
        specbench_ids = None
        if cfg.data.source == "feature":  # the Spec-Bench questions trained on (data.specbench)
            specbench_ids = trained_specbench_ids(prompts, cache.split.tolist())
        times["data_s"] = time.perf_counter() - t0
        log.info("layers %s; %d rows (%d train rows), skip %d", layers, cache.num_rows,
                 int(cache.rows(0, skip=skip).numel()), skip)

        adapter = cfg.head.head_type == AdapterHead.head_type
        before = cut = None
        if adapter:  # attention adapters, initialised from the target's layers L (exit L+1)
            heads = {layer: AdapterHead.from_target(lm, layer) for layer in layers}
        if rank == 0:  # the other ranks only train
            t0 = time.perf_counter()
            cut = evaluate_exits(lm.head, cache, layers, cfg.eval_k, skip)
            before = evaluate_adapters(lm, heads, cache, cfg.eval_k, skip) if adapter else cut
            times["eval_before_s"] = time.perf_counter() - t0

        optim = OmegaConf.to_container(cfg.optim, resolve=True)
        if cfg.head.get("optim"):  # the head's own settings (head=adapter)
            optim.update(OmegaConf.to_container(cfg.head.optim, resolve=True))
        if adapter:
            module = ExitHeadDistiller(lm.lm_head, heads, **cfg.loss, **optim)
            dm = AdapterDataModule(cache, layers, int(cfg.head.batch_rows),
                                   int(cfg.head.batch_sequences), skip, cfg.data.val_max_rows,
                                   cfg.seed, int(cfg.head.get("pool") or 0))
        else:
            heads = {
                layer: ExitHead(info.hidden_size, cfg.head.head_type, cfg.head.rank, lm.eps,
                                lm.final_norm)
                for layer in layers
            }
            module = ExitHeadDistiller(lm.lm_head, heads, **cfg.loss, **optim)
            dm = ExitDataModule(cache, layers, cfg.data.batch_size, skip,
                                cfg.data.val_max_rows, cfg.seed)
        callbacks: list = [TQDMProgressBar(refresh_rate=1)] if cfg.progress else []
        ckpt = None
        if cfg.checkpoint.enabled:
            ckpt = ModelCheckpoint(dirpath=str(out_dir / "checkpoints"),
                                   monitor=cfg.checkpoint.monitor, mode="min",
                                   save_last=True, save_top_k=1)
            callbacks.append(ckpt)
        trainer = L.Trainer(
            **trainer_args(cfg.trainer),
            logger=make_logger(cfg.logger, out_dir),
            callbacks=callbacks,
            enable_progress_bar=bool(cfg.progress),
            enable_checkpointing=ckpt is not None,
            default_root_dir=str(out_dir),
        )
        t0 = time.perf_counter()
        trainer.fit(module, dm)
        times["train_s"] = time.perf_counter() - t0
        log.info("rank %d of %d: trained %d steps in %.1f s", trainer.global_rank,
                 trainer.world_size, trainer.global_step, times["train_s"])
        if not trainer.is_global_zero:
            log.info("rank %d: done; rank 0 writes heads, checkpoints and reports",
                     trainer.global_rank)
            return {"rank": trainer.global_rank, "world_size": trainer.world_size,
                    "train_steps": int(trainer.global_step), "times_s": times}
        if ckpt is not None and ckpt.best_model_path:
            state = torch.load(ckpt.best_model_path, map_location="cpu", weights_only=False)
            module.load_state_dict(state["state_dict"])
            log.info("restored best checkpoint %s", ckpt.best_model_path)
        heads = {k: v.cpu() for k, v in module.exit_heads().items()}

        t0 = time.perf_counter()
        if adapter:
            after = evaluate_adapters(lm, heads, cache, cfg.eval_k, skip)
        else:
            attach_heads(lm, heads)
            after = evaluate_exits(lm.head, cache, layers, cfg.eval_k, skip)
        times["eval_after_s"] = time.perf_counter() - t0

        table = metrics_table(before, after, info.num_layers, cfg.eval_k)
        if adapter:
            table += "\n\n" + cut_table(cut, info.num_layers, cfg.eval_k)
        result = {
            "model": info.name, "weights_fingerprint": info.weights_fingerprint,
            "layers": layers, "head": OmegaConf.to_container(cfg.head),
            "before": as_dict(before), "after": as_dict(after),
            "times_s": times, "cache": cache_info, "skip_prefix": skip,
            "train_rows": int(dm.train_rows.numel()), "val_rows": int(dm.val_rows.numel()),
            "eval_prompt_ids": [p.prompt_id for p in prompts if p.split == 1],
            **({} if specbench_ids is None else {"train_specbench_ids": specbench_ids}),
            "train_steps": int(trainer.global_step), "peak_rss_gb": _peak_rss_gb(),
            "threads": torch.get_num_threads(),
            "world_size": trainer.world_size, "strategy": type(trainer.strategy).__name__,
        }
        if adapter:  # the cut model at each exit (final norm + LM head), for reference
            result["cut"] = as_dict(cut)
            result["adapter"] = {
                "optim": optim, "train_sequences": sum(map(len, dm.train_batches)),
                "train_batches": len(dm.train_batches),
                "train_padded_rows": dm.padded_rows(dm.train_batches),
                "val_sequences": sum(map(len, dm.val_batches)),
                "train_s_per_step": times["train_s"] / max(int(trainer.global_step), 1),
            }
        extra = {k: result[k] for k in ("before", "after", "train_steps", "train_rows",
                                         "eval_prompt_ids", "train_specbench_ids", "times_s",
                                         "cut") if k in result}
        extra["config"] = OmegaConf.to_container(cfg, resolve=True)
        path = save_heads(out_dir / "heads.safetensors", heads, info, extra=extra)
        result["heads_path"] = str(path)
        if cfg.output.install:
            dest = Path(cfg.output.install_path or default_heads_path(info.name))
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, dest)
            shutil.copyfile(path.with_suffix(".json"), dest.with_suffix(".json"))
            result["installed_path"] = str(dest)
        (out_dir / "metrics.json").write_text(json.dumps(result, indent=2, default=str))
        title = "Attention adapters" if adapter else "Exit heads"
        (out_dir / "report.md").write_text(
            f"# {title} for {info.name}\n\n{table}\n\nTimes (s): "
            f"{json.dumps({k: round(v, 1) for k, v in times.items()})}\n"
        )
        log.info("\n%s\ntimes %s", table, {k: round(v, 1) for k, v in times.items()})
        print(table)
        return result
    finally:
        lm.set_exit_heads(saved_heads, saved_path)


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    run(cfg)


if __name__ == "__main__":
    main()
