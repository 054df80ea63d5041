"""The typed schema of a run config.

``conf/config.yaml`` starts from this schema (registered as ``specflow_schema``), so a
misspelled key or a wrong type in a fixed-shape group (``model``, ``runner``,
``sampling``) fails at composition, naming the key.  The ``runner`` group's schema is
``specflow.settings.RunSettings`` itself (declared once; ``conf/runner/default.yaml`` adds
nothing), and its values are checked when the run starts.  Stage groups (``drafter``,
``intermediate_verifier``, ``target_verifier``, ``acceptor``, ``selector``, ``workload``) are
``_target_`` nodes checked against the target's signature by ``specflow.graph``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore

from specflow.settings import RunSettings


@dataclass
class ModelConfig:
    """A model: a registry name (``qwen2.5-coder-1.5b``...), a local HF folder or a hub id."""

    name: str = "smollm2-135m"
    dtype: str = "float32"  # float32 | bfloat16 | float16 | auto (bf16 where native on the CPU)
    backend: str = "auto"  # auto | native | hf
    trust_remote_code: bool = False
    exit_heads: str | None = None  # trained exit heads: a path, or "default" (train_heads/)
    # oneDNN-packed matrices (native backend): null = wherever this CPU's oneDNN runs the dtype
    # (specflow/cpu.py; unpacked otherwise, logged); false saves the packed copy's memory
    # (about the model's size) at the cost of slower multi-token matmuls.
    packed_weights: bool | None = None


@dataclass
class SamplingConfig:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0
    top_p: float = 1.0


@dataclass
class ObjectiveConfig:
    """What ``run.py`` returns to a Hydra sweeper (``callbacks.sweep.objective``)."""

    metric: str = "throughput/speedup"  # a slash-named metric of specflow.metrics
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
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)


def register_configs() -> None:
    """Register the schema with Hydra's ConfigStore (idempotent)."""
    cs = ConfigStore.instance()
    cs.store(name="specflow_schema", node=RunConfig)
