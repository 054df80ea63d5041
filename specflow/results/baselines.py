"""Plain-decoding baselines kept on disk (an opt-in for sweeps), and the machine they ran on."""

from __future__ import annotations

import hashlib
import json
import os
import platform
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from specflow.cpu.detect import probe_cpu
from specflow.engine import SpeculativePipeline
from specflow.sampling import SamplingParams


def machine_description() -> dict[str, Any]:
    """What the numbers were measured on: the host, torch, and the CPU's capabilities as
    probed once per process (``specflow.cpu.detect.probe_cpu``: model, ISA level, AVX-512/BF16/AMX/
    VNNI, oneDNN and whether it runs bf16)."""
    return {
        "host": platform.node(),
        "processor": platform.processor() or platform.machine(),
        "cpu": probe_cpu().as_dict(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }



@dataclass
class CachedBaseline:
    """Plain decoding of one prompt as cached (a ``<key>.json`` file): its tokens, seconds
    and time to first token (``None`` in files written before it was kept)."""

    tokens: list[int]
    total_s: float
    ttft_s: float | None = None


class BaselineCache:
    """Plain-decoding results on disk, keyed by everything that can change them."""

    def __init__(self, directory: Path | None) -> None:
        self.directory = directory
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)

    def key(
        self,
        pipeline: SpeculativePipeline,
        prompt: list[int],
        max_new: int,
        sampling: SamplingParams,
        seed: int,
    ) -> str:
        lm = pipeline.target_verifier.uses()[0].lm
        blob = json.dumps(
            {
                "model": repr(lm.info),
                "backend": type(lm).__name__,
                "prompt": prompt,
                "max_new": max_new,
                "sampling": repr(sampling),
                "seed": seed,
                "machine": machine_description(),
            },
            sort_keys=True,
        )
        return hashlib.sha256(blob.encode()).hexdigest()[:32]

    def get(self, key: str) -> CachedBaseline | None:
        if self.directory is None:
            return None
        path = self.directory / f"{key}.json"
        if not path.exists():
            return None
        data = json.loads(path.read_text())
        return CachedBaseline(tokens=data["tokens"], total_s=data["total_s"],
                              ttft_s=data.get("ttft_s"))

    def put(self, key: str, value: CachedBaseline) -> None:
        if self.directory is None:
            return
        path = self.directory / f"{key}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(value)))
        tmp.replace(path)
