"""The typed schema of a run config.

``conf/config.yaml`` starts from this schema (registered as ``specflow_schema``), so a
misspelled key or a wrong type in a fixed-shape group (``model``, ``runner``,
``sampling``) fails at composition, naming the key.  Each of these groups is declared once:

- ``model``: ``ModelConfig`` holds the types only; the values are in ``conf/model/*.yaml``
  (one file a model; a value none sets fails when read, naming it: ``Missing mandatory
  value: model.dtype``);
- ``runner``: ``specflow.settings.RunSettings`` itself (``conf/runner/default.yaml`` adds
  nothing);
- ``sampling``: ``specflow.sampling.SamplingParams`` itself, what the engine decodes with.

``specflow.app`` turns ``runner`` and ``sampling`` into those dataclasses when the run starts
(``OmegaConf.to_object``), which checks their values.  Stage groups (``drafter``,
``intermediate_verifier``, ``target_verifier``, ``acceptor``, ``selector``, ``workload``) are
``_target_`` nodes checked against the target's signature by ``specflow.graph``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from specflow.sampling import SamplingParams
from specflow.settings import RunSettings


@dataclass
class ModelConfig:
    """A model's config (``conf/model/*.yaml`` holds the values; these are the types).

    Attributes:
        name: a registry name (``qwen2.5-coder-1.5b``...), a local HF folder or a hub id.
        dtype: ``float32`` | ``bfloat16`` | ``float16`` | ``auto`` (bf16 where native on
            the CPU).
        backend: ``auto`` | ``native`` | ``hf``.
        trust_remote_code: passed to transformers.
        exit_heads: trained exit heads: a path, or ``default`` (train_heads/); null: none.
        packed_weights: oneDNN-packed matrices (native backend): null = wherever this CPU's
            oneDNN runs the dtype (specflow/cpu/detect.py; unpacked otherwise, logged); false
            saves the packed copy's memory (about the model's size) at the cost of slower
            multi-token matmuls.
        min_rows: packed matmuls of fewer rows (a decoding step: 1) run on this many, zero
            rows appended (``specflow.cpu.row_padding``): 1 = never padded; null = the
            fastest row count, probed once per model on this CPU.
        quantize: ``int8``: weight-only int8 copies of the matrices too, multiplied at the
            row counts where the row probe finds them faster (a draft model's steps); the
            outputs change slightly, so only draft models take it (the target is refused).
            With ``weights: gguf``: ``q4_0`` | ``q4_1``: the file's blocks of more bits a
            weight re-quantized to that type at load (``specflow.quant.requantize``; draft
            models only too).  null: none.
        weights: ``float``: the weights as float tensors (a GGUF file dequantized);
            ``gguf``: the GGUF file's quantized blocks as published, multiplied by the
            quantized rows kernel (``specflow.models.gguf_native``; ``conf/model/*-gguf.yaml``).
    """

    name: str = MISSING
    dtype: str = MISSING
    backend: str = MISSING
    trust_remote_code: bool = MISSING
    exit_heads: str | None = MISSING
    packed_weights: bool | None = MISSING
    min_rows: int | None = MISSING
    quantize: str | None = MISSING
    weights: str = MISSING


@dataclass
class ObjectiveConfig:
    """What ``run.py`` returns to a Hydra sweeper (``callbacks.sweep.objective``)."""

    metric: str = "throughput/speedup"  # a slash-named metric of specflow.results.metrics
    accuracy_floor: float | None = None  # quality/accuracy_ratio below this scores 0.0


@dataclass
class RunConfig:
    method: str = "ar"
    resume: bool = False
    model: ModelConfig = field(default_factory=ModelConfig)
    drafter: Any = None
    intermediate_verifier: Any = None
    draft_length: Any = None
    target_verifier: Any = None
    acceptor: Any = None
    selector: Any = None
    workload: Any = None
    callbacks: Any = field(default_factory=dict)
    runner: RunSettings = field(default_factory=RunSettings)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)


def register_configs() -> None:
    """Register the schema with Hydra's ConfigStore (idempotent)."""
    schema = OmegaConf.structured(RunConfig)
    # ``SamplingParams`` is frozen, which OmegaConf turns into a read-only node; the config
    # must still take conf/ and command-line values (sampling.temperature=0.7).  The frozen
    # instance is made, and checked, when the run starts (specflow.app).
    OmegaConf.set_readonly(schema.sampling, None)
    ConfigStore.instance().store(name="specflow_schema", node=schema)
