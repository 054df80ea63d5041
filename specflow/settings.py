"""The runner's settings: the config group ``runner`` (its schema), declared once.

``conf/config.yaml``'s schema uses ``RunSettings`` itself for ``runner``; ``specflow.app``
turns the composed group into one (``OmegaConf.to_object``), which checks every value.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specflow.errors import ConfigError
from specflow.kv.kernels import BACKENDS
from specflow.kv.stores import LAYOUTS, KVLayout, as_dtype


@dataclass
class RunSettings:
    """How requests are decoded and measured: the config group ``runner`` (its schema, and
    the one place these settings are declared).

    Attributes:
        max_new_tokens: generation budget per turn.
        seed: each request's generator seed.
        warmup: untimed short generations first.
        baseline: also run plain decoding of the target (speedup, fidelity).
        baseline_cache: reuse plain-decoding results across runs on this machine (batch 1;
            an opt-in for sweeps: by default each request's baseline is measured right
            before it, side by side).  A cached baseline is re-timed on the run's first
            request and a drift above 10 % is reported.
        use_chat_template, system_prompt: how prompts are built.
        threads: torch threads (``None``: torch's choice).
        cache_dir: the cache root of prepared models, trained heads and cached baselines
            (``specflow.cache_root``; ``None``: ``$SPECFLOW_CACHE`` or ``~/.cache/specflow``).
        batch_size: requests decoded at once (continuous batching).
        device: ``cpu`` | ``cuda``: where the models run.
        dtype: run the models in ``float32`` | ``bfloat16`` | ``float16`` (``None``: as
            loaded, ``model.dtype``).
        kv_layout: ``auto`` (contiguous on CPU, paged on CUDA) | ``contiguous`` | ``paged``.
        attention: paged attention kernel: ``auto`` | ``sdpa`` | ``flash``.
        block_size: paged KV block size (``None``: 16, or 256 with flash).
        cuda_graphs: on CUDA with paged KV, replay decode/verify steps as CUDA graphs
            (captured per batch bucket and query length; ``specflow.kv.static``).
    """

    max_new_tokens: int = 128
    seed: int = 0
    warmup: bool = True
    baseline: bool = True
    baseline_cache: bool = False
    use_chat_template: bool = True
    system_prompt: str | None = None
    threads: int | None = None
    cache_dir: str | None = None
    batch_size: int = 1
    device: str = "cpu"
    dtype: str | None = None
    kv_layout: str = "auto"
    attention: str = "auto"
    block_size: int | None = None
    cuda_graphs: bool = True

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError(f"runner.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.batch_size < 1:
            raise ConfigError(f"runner.batch_size must be >= 1, got {self.batch_size}")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"runner.threads must be >= 1 or null, got {self.threads}")
        if self.device not in DEVICES:
            raise ConfigError(f"runner.device={self.device!r} is unknown; use one of {DEVICES}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError(
                "runner.device=cuda but torch sees no CUDA GPU (torch "
                f"{torch.__version__}); use runner.device=cpu, or install a CUDA build of torch"
            )
        if self.kv_layout not in ("auto", *LAYOUTS):
            raise ConfigError(
                f"runner.kv_layout={self.kv_layout!r} is unknown; use auto, contiguous or paged"
            )
        if self.attention not in BACKENDS:
            raise ConfigError(
                f"runner.attention={self.attention!r} is unknown; use one of {BACKENDS}"
            )
        as_dtype(self.dtype, torch.float32)  # a clear error for an unknown name

    def layout(self) -> KVLayout:
        """Where the keys/values live: contiguous on CPU, paged on CUDA unless set."""
        kind = self.kv_layout
        if kind == "auto":
            kind = "paged" if self.device == "cuda" else "contiguous"
        graphs = self.cuda_graphs and self.device == "cuda" and kind == "paged"
        return KVLayout(
            kind=kind,
            device=self.device,
            dtype=self.dtype,
            attention=self.attention,
            block_size=self.block_size,
            decode="graphs" if graphs else "eager",
        )


DEVICES = ("cpu", "cuda")


