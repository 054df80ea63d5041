"""specflow's entry point: ``python run.py +experiment=NAME [overrides]`` (``-m`` sweeps).

``python run.py`` with no experiment runs ``+experiment=default`` (conf/experiment/default.yaml).

Composes the Hydra config, builds the stage graph, runs it over the workload next to plain
decoding, and writes ``requests.jsonl`` + ``summary.json`` into Hydra's run folder.
Returns ``cfg.objective`` (default: the speedup) so Hydra sweepers can optimise it.  In a
multirun a failed job is logged, its traceback written to ``error.txt`` in its folder and
``None`` returned (Optuna counts it as a failed trial), so the other jobs and the sweep
summary (``callbacks/sweep.py``) still happen.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback

os.environ.setdefault("MKL_CBWR", "AUTO")  # before torch loads (see specflow/__init__.py)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from specflow.config import register_configs  # noqa: E402

register_configs()
log = logging.getLogger("specflow")


def with_default_experiment(argv: list[str]) -> list[str]:
    """Add ``+experiment=default`` unless the command line picks an experiment.

    (Not in config.yaml's defaults list: there, ``+experiment=x`` fails with "Multiple
    values for experiment" on hydra-core 1.3.)
    """
    picks = any(a.lstrip("+~").startswith("experiment=") for a in argv[1:])
    helps = any(a in ("-h", "--help", "--hydra-help", "--info", "-i") for a in argv[1:])
    return argv if picks or helps else [*argv, "+experiment=default"]


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from callbacks.sweep import objective
    from specflow.app import output_dir, run_from_config

    try:
        summary = run_from_config(cfg)
    except (Exception, SystemExit) as exc:
        if HydraConfig.get().mode != RunMode.MULTIRUN:
            raise
        log.exception("job failed; the sweep goes on")
        # a SpecflowError reaches here as SystemExit(2) whose __context__ is the error
        cause = exc.__context__ if isinstance(exc, SystemExit) and exc.__context__ else exc
        (output_dir() / "error.txt").write_text("".join(traceback.format_exception(cause)))
        return None
    return objective(summary, cfg.objective.metric, cfg.objective.accuracy_floor)


if __name__ == "__main__":
    sys.argv = with_default_experiment(sys.argv)
    main()
