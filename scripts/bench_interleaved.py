"""Run several experiments over one workload in one process, interleaved request by request.

    python scripts/bench_interleaved.py --out outputs/bench/table \
        --common "model=qwen2.5-coder-1.5b workload.ids=[101,125] runner.max_new_tokens=128" \
        --method plain "+experiment=ar" \
        --method pld "+experiment=pld" \
        --method eagle "+experiment=eagle draft_length=adaptive drafter.k=6"

Why: on a small, noisy CPU a speed ratio is only worth something when both sides were timed
side by side.  ``run.py -m`` runs experiments one after the other (minutes or hours apart),
and ``runner.baseline_cache=false`` re-decodes plain decoding next to every request of every
experiment (twice the work).  Here each experiment is composed exactly as ``run.py`` would
compose ``<common> <its overrides>`` (its own results folder ``OUT/NAME``, the usual
``requests.jsonl`` and ``summary.json``), the models are loaded once and shared (the
in-process model cache), and the requests are decoded in rounds: request ``i`` by every
experiment, in an order rotated by one per request (so drift and cache effects spread over
all), before request ``i + 1``.  Each experiment warms up once, on its first request.

The first ``--method`` is the reference (plain decoding, ``+experiment=ar``, unless you
choose otherwise): every ratio is the reference's seconds over the method's seconds on the
same requests, and fidelity is the share of requests whose tokens equal the reference's.
The report (``OUT/report.md``, ``OUT/report.json``, also printed) has, per experiment:
pooled tokens/s, speedup pooled and the median of the per-request speedups, τ, acceptance
per level, time per stage, fidelity, and the speedup (τ) per category.  ``resume=true`` in
``--common`` continues an interrupted bench (each folder skips the requests it has).

Every experiment must agree on each model's exit heads: they attach to the one shared model
(give ``model.exit_heads=FILE`` in ``--common``; one file can hold heads of several exits).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

os.environ.setdefault("MKL_CBWR", "AUTO")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from specflow.app import PreparedRun, model_configs, prepare_run  # noqa: E402
from specflow.config import register_configs  # noqa: E402
from specflow.errors import ConfigError, SpecflowError  # noqa: E402
from specflow.paired import paired_markdown, paired_report  # noqa: E402
from specflow.results import REQUESTS_FILE, read_records  # noqa: E402


@dataclass
class Experiment:
    """One ``--method``: its name (results folder), overrides and composed config."""

    name: str
    overrides: list[str]
    cfg: DictConfig


def compose_experiments(common: list[str], methods: list[tuple[str, str]]) -> list[Experiment]:
    """Compose ``common + overrides`` of each method as ``run.py`` would; no decoding."""
    register_configs()
    given = {o.lstrip("+~").split("=")[0] for o in common}
    # the reference decodes plainly; callbacks (console tables per request) only add noise
    extra = [o for o in ("callbacks=none", "runner.baseline=false") if o.split("=")[0] not in given]
    out = []
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        for name, text in methods:
            overrides = [*common, *shlex.split(text), *extra]
            out.append(Experiment(name, overrides, compose("config", overrides=overrides)))
    return out


def check_shared_models(experiments: list[Experiment]) -> None:
    """Refuse experiments that give one model different exit heads or ``min_rows``: the
    heads and the row padding attach to the one model object every experiment shares, so
    the last attached would serve them all.
    An experiment that gives none (``exit_heads: null``) runs with whatever the others
    attached: plain decoding and model drafters never read them, but an early exit through
    the shared head would (give it the same file, or bench it apart)."""
    seen: dict[str, tuple[str, Any]] = {}
    rows_seen: dict[str, tuple[str, Any]] = {}
    for exp in experiments:
        for _, model in model_configs(exp.cfg):
            heads = model.get("exit_heads")
            name = model["name"]
            if name in seen and seen[name][1] != heads and heads is not None:
                raise ConfigError(
                    f"experiments {seen[name][0]!r} and {exp.name!r} give model {name!r} "
                    f"different exit heads ({seen[name][1]} vs {heads}); they share one model: "
                    f"put both exits in one heads file and pass model.exit_heads=FILE in --common"
                )
            if heads is not None or name not in seen:
                seen[name] = (exp.name, heads)
            rows = model.get("min_rows", 1)
            if rows_seen.setdefault(name, (exp.name, rows))[1] != rows:
                raise ConfigError(
                    f"experiments {rows_seen[name][0]!r} and {exp.name!r} give model {name!r} "
                    f"different min_rows ({rows_seen[name][1]} vs {rows}); they share one "
                    f"model: pass model.min_rows in --common"
                )


def run_interleaved(runs: dict[str, PreparedRun]) -> None:
    """Decode request ``i`` with every run (order rotated by ``i``), then request ``i + 1``."""
    names = list(runs)
    requests = runs[names[0]].requests
    for name, run in runs.items():
        ids = [r.request_id for r in run.requests]
        if ids != [r.request_id for r in requests]:
            raise ConfigError(
                f"{name!r} has other requests than {names[0]!r}: put the workload in --common"
            )
    for i, request in enumerate(requests):
        order = names[i % len(names):] + names[: i % len(names)]
        for name in order:
            run = runs[name]
            if request.request_id in run.folder.done_ids:
                continue
            print(f"[{i + 1}/{len(requests)}] {request.request_id} ({request.category}): {name}",
                  flush=True)
            run.runner.run([request], run.folder, run.meta)
            # warm once: later requests find the kernels and buffers the first one made
            run.runner.settings = replace(run.runner.settings, warmup=False)


def bench(args: argparse.Namespace) -> None:
    names = [n for n, _ in args.method]
    if len(set(names)) != len(names):
        raise SystemExit(f"bench_interleaved: method names repeat: {names}")
    out = Path(args.out)
    common = shlex.split(args.common)
    if args.report_only:  # the folders as they are: no model is loaded
        missing = [n for n in names if not (out / n / REQUESTS_FILE).exists()]
        if missing:
            raise SystemExit(f"bench_interleaved: no {REQUESTS_FILE} for {missing} under {out}")
        records = {name: read_records(out / name / REQUESTS_FILE) for name in names}
    else:
        experiments = compose_experiments(common, args.method)
        check_shared_models(experiments)
        runs = {e.name: prepare_run(e.cfg, out / e.name) for e in experiments}
        run_interleaved(runs)
        records = {name: run.folder.records for name, run in runs.items()}
    rep = paired_report(records, names[0])
    order = [(r.request_id, r.category) for r in records[names[0]]]
    text = paired_markdown(rep, order, dict(args.method))
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(rep, indent=2))
    (out / "report.md").write_text(text)
    print(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", required=True, help="one results folder per experiment in here")
    ap.add_argument("--common", default="", help="overrides every experiment gets (one string)")
    ap.add_argument("--method", nargs=2, action="append", required=True,
                    metavar=("NAME", "OVERRIDES"), help="an experiment; the first is the reference")
    ap.add_argument("--report-only", action="store_true", help="report the folders; decode nothing")
    try:
        bench(ap.parse_args())
    except SpecflowError as exc:
        print(f"bench_interleaved: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
