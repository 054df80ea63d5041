"""Glue between a composed config and the runner (what ``run.py`` calls)."""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from specflow.cache_root import configured_cache_root
from specflow.cpu.detect import check_cpu_weights, probe_cpu
from specflow.errors import ConfigError, SpecflowError
from specflow.graph import build_pipeline, instantiate_checked
from specflow.results.records import RunMeta, RunSummary
from specflow.results.run_folder import RunFolder, results_fingerprint
from specflow.runner import Runner, set_aside_long_lived_objects
from specflow.sampling import SamplingParams
from specflow.settings import RunSettings
from specflow.workload import Request

log = logging.getLogger("specflow")


def output_dir() -> Path:
    """Hydra's run folder when running under Hydra, else ``outputs/manual``."""
    try:
        from hydra.core.hydra_config import HydraConfig

        return Path(HydraConfig.get().runtime.output_dir)
    except Exception:  # noqa: BLE001 - not under hydra
        return Path("outputs/manual")


def run_from_config(cfg: DictConfig, out: Path | None = None) -> RunSummary:
    """Build, run and report one experiment; a ``SpecflowError`` exits with its message."""
    try:
        return _run(cfg, out or output_dir())
    except SpecflowError as exc:
        log.error("%s", exc)
        print(f"specflow: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def model_configs(node: Any, path: str = "") -> list[tuple[str, dict[str, Any]]]:
    """Every model config in a composed config, with its path: the mappings that carry a
    model ``name`` and ``dtype`` (``model``, ``drafter.model``, a pool's arms...)."""
    if isinstance(node, DictConfig):
        node = OmegaConf.to_container(node, resolve=True)
    found: list[tuple[str, dict[str, Any]]] = []
    if isinstance(node, dict):
        if isinstance(node.get("name"), str) and isinstance(node.get("dtype"), str):
            found.append((path, node))
        for key, value in node.items():
            found += model_configs(value, f"{path}.{key}" if path else str(key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found += model_configs(value, f"{path}[{i}]")
    return found


def check_models_fit_cpu(cfg: DictConfig) -> None:
    """Refuse, before any model loads, a model config this CPU cannot run as asked
    (``specflow.cpu.detect.check_cpu_weights``: packing it cannot do, bf16 it cannot run)."""
    for path, model in model_configs(cfg):
        check_cpu_weights(model["name"], path, model["dtype"], model.get("packed_weights"))


@dataclass
class PreparedRun:
    """Everything one experiment needs to decode: its runner (pipeline, tokenizer,
    settings, callbacks), its workload's requests, its results folder and meta."""

    runner: Runner
    requests: list[Request]
    folder: RunFolder
    meta: RunMeta


def prepare_run(cfg: DictConfig, out: Path) -> PreparedRun:
    """Build an experiment from its composed config without decoding anything: check the
    settings, load the models, build the stage graph, open ``out`` (``cfg.resume``).

    Models are cached in-process (``load_model``), so several experiments prepared in one
    process share their target (``scripts/bench_interleaved.py``)."""
    settings: RunSettings = OmegaConf.to_object(cfg.runner)  # checks every runner value
    sampling: SamplingParams = OmegaConf.to_object(cfg.sampling)  # and every sampling value
    if settings.threads:
        torch.set_num_threads(settings.threads)
    if cfg.model.get("quantize") is not None:
        raise ConfigError(
            f"model.quantize={cfg.model.quantize}: the target's quantized copies or "
            f"re-quantized blocks would change its outputs, which plain decoding and every "
            f"lossless pipeline must "
            f"reproduce; set model.quantize=null and quantize a draft model instead "
            f"(drafter.model.quantize=int8, or q4_0 / q4_1 on GGUF weights; docs/usage.md)"
        )
    if settings.device == "cpu":
        check_models_fit_cpu(cfg)
    log.info("CPU: %s", probe_cpu().describe())
    from specflow.models.loading import load_model

    # runner.cache_dir is the cache root of every model, exit-head and feature-head path the
    # stages resolve while they are built (specflow.cache_root).
    with configured_cache_root(settings.cache_dir):
        pipeline = build_pipeline(cfg)
        target = load_model(
            cfg.model.name,
            dtype=cfg.model.dtype,
            backend=cfg.model.backend,
            trust_remote_code=cfg.model.trust_remote_code,
            packed_weights=cfg.model.packed_weights,
            cache_dir=settings.cache_dir,
            weights=cfg.model.weights,
        )
    workload = instantiate_checked("workload", cfg.workload)
    callbacks = [
        instantiate_checked(f"callbacks.{name}", node)
        for name, node in (cfg.get("callbacks") or {}).items()
        if node is not None
    ]
    runner = Runner(pipeline, target.tokenizer, settings, sampling, callbacks)
    config = OmegaConf.to_container(cfg, resolve=True)
    folder = RunFolder(out, resume=cfg.resume, fingerprint=results_fingerprint(config))
    from specflow.cpu.row_padding import run_row_padding

    models = [target.lm, *(use.lm for use in pipeline.uses())]
    if settings.device == "cpu":
        from specflow.cpu.whole_pass import check_float_rows

        check_float_rows(models)  # the float rows kernel only where a whole pass gains
    meta = RunMeta(
        method=cfg.method,
        target_model=pipeline.info.name,
        models=[info.name for info in pipeline.models()],
        config=config,
        row_padding=run_row_padding(models),
    )
    return PreparedRun(runner, list(workload.requests()), folder, meta)


def _run(cfg: DictConfig, out: Path) -> RunSummary:
    run = prepare_run(cfg, out)
    set_aside_long_lived_objects()  # the loaded models' objects, out of the collector's walks
    summary = run.runner.run(run.requests, run.folder, run.meta)  # callbacks.console prints
    print(f"results: {run.folder.path.resolve()}")
    return summary
