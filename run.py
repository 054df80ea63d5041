"""specflow's entry point: ``python run.py +experiment=NAME [overrides]`` (``-m`` sweeps).

Composes the Hydra config, builds the stage graph, runs it over the workload next to plain
decoding, and writes ``requests.jsonl`` + ``summary.json`` into Hydra's run folder.
Returns the speedup so Hydra sweepers can optimise it.
"""

from __future__ import annotations

import os

os.environ.setdefault("MKL_CBWR", "AUTO")  # before torch loads (see specflow/__init__.py)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from specflow.config import register_configs  # noqa: E402

register_configs()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    from specflow.app import run_from_config

    summary = run_from_config(cfg)
    return summary.get("speedup")


if __name__ == "__main__":
    main()
