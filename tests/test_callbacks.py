"""Run callbacks, the sweep summary and ``specflow.results.compare`` on synthetic records (fast)."""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from callbacks.console import ConsoleTable, format_report
from callbacks.csv_logger import CsvLogger
from callbacks.jsonl import JsonlLogger
from callbacks.plots import Plots
from callbacks.progress import ProgressBar
from callbacks.sweep import (
    PARETO_PNG,
    SUMMARY_CSV,
    SweepSummary,
    accuracy_metric,
    collect,
    objective,
    pareto_front,
    plot_pareto,
    point_labels,
)
from callbacks.sweep import main as sweep_main
from specflow.engine import SpeculativePipeline
from specflow.errors import ConfigError
from specflow.protocols import DraftPart
from specflow.results import compare
from specflow.results.metrics import flatten_record, flatten_summary
from specflow.results.records import (
    BaselineMetrics,
    PoolMetrics,
    RequestMetrics,
    RequestRecord,
    RunMeta,
    RunSummary,
    TurnRecord,
)
from specflow.results.run_folder import RunFolder, read_records, summarize, wilson_interval
from specflow.runner import Runner
from specflow.sampling import SamplingParams
from specflow.settings import RunSettings
from specflow.state import Draft
from specflow.workload import Request
from stages.acceptors.standard import StandardAcceptor
from stages.verifiers.full import FullVerifier
from tests.conftest import CharTokenizer, NoopCallback

ROOT = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def fake_record(i: int, category: str, task: dict[str, float] | None = None,
                arms: list[int] | None = None) -> RequestRecord:
    """A record shaped like ``Runner._record``'s (4 rounds, k=3)."""
    accepted = [1, 2, 3, i % 4]
    new_tokens = sum(accepted) + len(accepted)
    total_s = 0.5 + 0.1 * i
    pool = None
    if arms is not None:
        pool = PoolMetrics(arms=arms, arm_rewards=[0.5] * len(arms),
                           arm_counts=[arms.count(a) for a in range(max(arms) + 1)],
                           catchup_tokens=0, catchup_s=0.0)
    metrics = RequestMetrics(
        new_tokens=new_tokens,
        total_s=total_s,
        tokens_per_s=new_tokens / total_s,
        rounds=4,
        target_calls=4,
        drafted=12,
        accepted=sum(accepted),
        tau=1 + sum(accepted) / 4,
        acceptance_rate=sum(accepted) / 12,
        levels={"intermediate": [12, 9], "target": [12, sum(accepted)]},
        time_per_stage={"prefill_s": 0.05, "draft_s": 0.1, "intermediate_s": 0.05,
                        "verify_s": 0.2, "accept_s": 0.01, "other_s": total_s - 0.41},
        k_per_round=[3, 3, 3, 3],
        rounds_skipped=0,
        tree_rounds=0,
        parts={},
        drafted_per_round=[3, 3, 3, 3],
        accepted_per_round=accepted,
        pool=pool,
        latency_s=total_s,
        queued_s=0.0,
        baseline=BaselineMetrics(
            baseline_tokens=new_tokens,
            baseline_s=2 * total_s,
            baseline_tokens_per_s=new_tokens / (2 * total_s),
            baseline_cached=False,
            speedup=2.0,
            matches_baseline=i != 3,
        ),
    )
    return RequestRecord(
        request_id=f"r{i}",
        category=category,
        subcategory=None,
        output_text="answer",
        turns=[TurnRecord(prompt_tokens=5, output_text="answer", output_tokens=[1] * new_tokens,
                          new_tokens=new_tokens, total_s=total_s, stop_reason="length")],
        metrics=metrics,
        task=dict(task or {}),
        baseline_task=dict(task or {}),
    )


@pytest.fixture
def records() -> list[RequestRecord]:
    return [
        fake_record(0, "math_reasoning", {"task/gsm8k_exact": 1.0}, arms=[0, 1, 1, 2]),
        fake_record(1, "math_reasoning", {"task/gsm8k_exact": 0.0}, arms=[1, 1, 2, 2]),
        fake_record(2, "translation", {"task/bleu": 30.0}),
        fake_record(3, "writing"),
    ]


@pytest.fixture
def summary(records) -> RunSummary:
    return summarize(records, RunMeta(method="sps", target_model="tiny"), complete=True)


def drive(callback: Any, records: list[RequestRecord], summary: RunSummary,
          folder: Path) -> Any:
    """Call the hooks the way ``Runner.run`` does."""
    meta = RunMeta(method="sps", target_model="tiny", models=["tiny"],
                   output_dir=str(folder), config={"method": "sps"})
    for hook, args in [("on_run_start", (meta, len(records)))]:
        if hasattr(callback, hook):
            getattr(callback, hook)(*args)
    for r in records:
        if hasattr(callback, "on_request_end"):
            callback.on_request_end(r)
    if hasattr(callback, "on_run_end"):
        callback.on_run_end(summary, folder)
    return callback


# --- metric names ----------------------------------------------------------------------------


def test_record_and_summary_share_slash_names(records, summary):
    rec = flatten_record(records[0])
    run = flatten_summary(summary)
    for name in ("throughput/tokens_per_s", "throughput/speedup", "accept/tau", "accept/rate",
                 "accept/rate/intermediate", "accept/rate/target", "time/draft_s",
                 "time/verify_s", "quality/fidelity", "task/gsm8k_exact",
                 "baseline_task/gsm8k_exact", "quality/accuracy_ratio"):
        assert name in rec, name
        assert name in run, name
    assert rec["accept/rate/intermediate"] == pytest.approx(0.75)
    assert rec["quality/fidelity"] == 1.0
    assert run["quality/fidelity"] == pytest.approx(0.75)
    assert run["count/requests"] == 4
    assert all("/" in k for k in run)


def test_objective_gates_on_accuracy_floor(summary):
    overall = summary.overall
    assert objective(summary) == pytest.approx(overall.speedup)
    assert objective(summary, accuracy_floor=0.9) == pytest.approx(overall.speedup)
    # baseline 0.5: ratio 0.4 (bleu 1.0)
    worse = replace(summary, overall=replace(overall, task={**overall.task,
                                                            "task/gsm8k_exact": 0.2}))
    assert flatten_summary(worse)["quality/accuracy_ratio"] == pytest.approx(0.7)
    assert objective(worse, accuracy_floor=0.9) == 0.0
    assert objective(worse, metric="accept/tau", accuracy_floor=0.5) == pytest.approx(
        overall.tau
    )
    assert objective(replace(summary, overall=replace(overall, speedup=None))) is None


# --- each callback writes what it should -------------------------------------------------------


def test_jsonl_logger(tmp_path, records, summary):
    drive(JsonlLogger(), records, summary, tmp_path)
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    events = [x["event"] for x in lines]
    assert events == ["run_start"] + ["request"] * 4 + ["category"] * 3 + ["summary"]
    assert lines[1]["request_id"] == "r0"
    assert lines[1]["accept/tau"] == pytest.approx(records[0].metrics.tau)
    assert lines[-1]["throughput/speedup"] == pytest.approx(summary.overall.speedup)
    assert lines[-1]["complete"] is True


def test_jsonl_logger_without_known_folder_writes_at_the_end(tmp_path, records, summary):
    cb = JsonlLogger()
    cb.on_run_start(RunMeta(method="sps"), 1)  # no output_dir, not under Hydra: buffered
    cb.on_request_end(records[0])
    assert not list(tmp_path.iterdir())
    cb.on_run_end(summary, tmp_path)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["event"] for x in lines][:2] == ["run_start", "request"]


def test_csv_logger(tmp_path, records, summary):
    drive(CsvLogger(), records, summary, tmp_path)
    with (tmp_path / "requests.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["request_id"] for r in rows] == ["r0", "r1", "r2", "r3"]
    assert {"category", "throughput/speedup", "accept/tau", "time/draft_s"} <= set(rows[0])
    assert rows[2]["task/bleu"] == "30.0" and rows[0]["task/bleu"] == ""
    with (tmp_path / "summary.csv").open() as f:
        cats = list(csv.DictReader(f))
    assert [c["category"] for c in cats] == ["math_reasoning", "translation", "writing", "ALL"]
    assert float(cats[-1]["throughput/speedup"]) == pytest.approx(summary.overall.speedup)


def test_console_table(tmp_path, records, summary):
    out = io.StringIO()
    drive(ConsoleTable(stream=out), records, summary, tmp_path)
    text = out.getvalue()
    for needle in ("sps on tiny", "math_reasoning", "translation", "ALL",
                   "accept/rate/intermediate", "time/verify_s", "task/gsm8k_exact"):
        assert needle in text, needle
    assert "by part" not in text and "tree_rounds" not in text
    parts = {"first": {"rounds": 3, "skipped": 1, "drafted": 9, "accepted": 5}}
    parted = replace(summary, overall=replace(summary.overall, parts=parts, tree_rounds=2))
    text = format_report(parted)
    assert "by part: part/first: 3 rounds (1 plain), 5/9 accepted" in text
    assert f"count/tree_rounds: 2 of {summary.overall.rounds} rounds verified a tree" in text


def test_plots(tmp_path, records, summary):
    cb = drive(Plots(), records, summary, tmp_path)
    names = {"speedup_by_category.png", "tau_hist.png", "time_per_stage.png", "arm_choices.png"}
    assert {p.name for p in cb.written} == names
    for name in names:
        assert (tmp_path / name).read_bytes()[:8] == PNG_MAGIC


def test_plots_without_arms_or_baseline(tmp_path, records):
    for r in records:
        r.metrics.pool = None
        r.metrics.baseline = None
    summary = summarize(records, RunMeta(method="pld"), complete=True)
    cb = drive(Plots(), records, summary, tmp_path)
    assert {p.name for p in cb.written} == {"tau_hist.png", "time_per_stage.png"}


def test_progress_bar_live_numbers(tmp_path, records, summary):
    cb = ProgressBar(disable=True)
    cb.on_run_start(RunMeta(method="sps"), len(records))
    for r in records:
        cb.on_request_end(r)
    post = cb.postfix()
    assert float(post["speedup"]) == pytest.approx(2.0, abs=0.01)
    assert float(post["tau"]) == pytest.approx(summary.overall.tau, abs=0.01)
    cb.on_run_end(summary, tmp_path)
    assert cb.bar is None


# --- wandb ------------------------------------------------------------------------------------


def test_wandb_offline_writes_run_files(tmp_path, monkeypatch, records, summary):
    pytest.importorskip("wandb")
    import wandb

    from callbacks.wandb_logger import WandbLogger

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    drive(WandbLogger(tags=["test"], console="off"), records, summary, tmp_path)
    assert wandb.run is None  # finished
    wandb.teardown()  # stop wandb's service process: it closes (flushes) the run file
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    blob = b"".join(p.read_bytes() for p in runs[0].glob("run-*.wandb"))
    for key in ("throughput/speedup", "throughput/tokens_per_s", "accept/tau",
                "accept/rate/intermediate", "time/draft_s", "task/gsm8k_exact",
                "quality/fidelity", "tables/by_category", "plots/tau_hist"):
        assert key.encode() in blob, key
    media = {p.name.split("_")[0] for p in (runs[0] / "files" / "media").rglob("*.*")}
    assert {"speedup", "tau", "time", "arm", "by"} <= media


class _FakeRun:
    def __init__(self) -> None:
        self.summary: dict[str, Any] = {}
        self.finished: int | None = None

    def log(self, data: dict[str, Any], step: int | None = None) -> None:
        if "tables/by_category" in data:
            raise RuntimeError("logging failed")

    def finish(self, exit_code: int = 0) -> None:
        self.finished = exit_code


def test_wandb_finishes_even_when_logging_fails(tmp_path, monkeypatch, records, summary):
    pytest.importorskip("wandb")
    import wandb

    from callbacks.wandb_logger import WandbLogger

    fake = _FakeRun()
    monkeypatch.setattr(wandb, "init", lambda **kw: fake)
    cb = WandbLogger()
    cb.on_run_start(RunMeta(method="sps", output_dir=str(tmp_path)), 2)
    cb.on_request_end(records[0])
    with pytest.raises(RuntimeError, match="logging failed"):
        cb.on_run_end(replace(summary, complete=False), tmp_path)
    assert fake.finished == 1  # marked failed, but finished


# --- a crashing run ---------------------------------------------------------------------------


class _CrashingDrafter:
    """Drafts nothing useful for the first request; raises on the second one's first round."""

    name = "crashing"
    branches = 1
    k = 2

    def __init__(self) -> None:
        self.requests = 0

    def begin(self, states) -> None:
        self.requests += len(states)

    def next_part(self, state):
        return DraftPart("", self.k, self.k)

    def propose(self, states, ks):
        if self.requests == 2:
            raise RuntimeError("boom")
        return [Draft([0] * k) for k in ks]

    def observe(self, states, drafts, target_logits, verdicts) -> None:
        pass

    def models(self) -> list:
        return []

    def uses(self) -> list:
        return []


def _crashing_pipeline(lm) -> SpeculativePipeline:
    return SpeculativePipeline(FullVerifier(lm), StandardAcceptor(), drafter=_CrashingDrafter())


class _Recorder(NoopCallback):
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.summary: RunSummary | None = None

    def on_run_start(self, meta, num_requests) -> None:
        self.calls.append("start")

    def on_request_end(self, record) -> None:
        self.calls.append(record.request_id)

    def on_run_end(self, summary, folder) -> None:
        self.calls.append("end")
        self.summary = summary


def test_crashing_run_finishes_loggers_and_keeps_requests(tmp_path, tiny_target):
    recorder, jsonl, csv_cb = _Recorder(), JsonlLogger(), CsvLogger()
    settings = RunSettings(max_new_tokens=3, warmup=False, baseline=False,
                           baseline_cache=False, cache_dir=str(tmp_path / "cache"))
    runner = Runner(_crashing_pipeline(tiny_target[1]), CharTokenizer(), settings,
                    SamplingParams(0.0, 0, 1.0), [recorder, jsonl, csv_cb])
    requests = [Request(f"q{i}", "writing", (f"prompt {i}",)) for i in range(3)]
    folder = RunFolder(tmp_path / "run", resume=False)
    with pytest.raises(RuntimeError, match="boom"):
        runner.run(requests, folder, RunMeta(method="stub", output_dir=str(folder.path)))
    assert recorder.calls == ["start", "q0", "end"]
    assert recorder.summary.complete is False
    assert [r.request_id for r in read_records(folder.path / "requests.jsonl")] == ["q0"]
    assert json.loads((folder.path / "summary.json").read_text())["num_requests"] == 1
    events = [json.loads(x)["event"] for x in (folder.path / "metrics.jsonl").open()]
    assert events[-1] == "summary"
    assert (folder.path / "requests.csv").exists()


# --- sweeps -----------------------------------------------------------------------------------


def _summary_json(**top: Any) -> dict[str, Any]:
    """A complete ``summary.json`` (one fake request, no task scores, no categories) with
    the top-level values ``top``."""
    data = summarize([fake_record(0, "qa")], RunMeta(method="fly"), complete=True).to_json()
    return {**data, "by_category": {}, **top}


def _fake_job(sweep: Path, name: str, overrides: list[str], speedup: float,
              accuracy: float = 0.5) -> None:
    job = sweep / name
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    summary = _summary_json(
        method="fly", complete=True, num_requests=2, tokens_per_s=10 * speedup,
        baseline_tokens_per_s=10.0, speedup=speedup, tau=2.0,
        task_ci95={"task/gsm8k_exact": [accuracy / 2, (1 + accuracy) / 2]},
        **{"task/gsm8k_exact": accuracy, "baseline_task/gsm8k_exact": 0.5},
    )
    (job / "summary.json").write_text(json.dumps(summary))


def test_sweep_summary_collects_every_job(tmp_path, capsys):
    _fake_job(tmp_path, "0_acceptor.theta=0.3", ["+experiment=fly", "acceptor.theta=0.3"], 1.5)
    _fake_job(tmp_path, "1_acceptor.theta=0.7", ["+experiment=fly", "acceptor.theta=0.7"], 1.9)
    (tmp_path / "2_failed" / ".hydra").mkdir(parents=True)  # a crashed job: no summary
    (tmp_path / "2_failed" / ".hydra" / "overrides.yaml").write_text("- acceptor.theta=0.9\n")
    (tmp_path / "2_failed" / "error.txt").write_text("Traceback...\nRuntimeError: boom\n")
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}})
    SweepSummary().on_multirun_end(config=config)
    with (tmp_path / SUMMARY_CSV).open() as f:
        rows = list(csv.DictReader(f))
    assert [r["acceptor.theta"] for r in rows] == ["0.3", "0.7", "0.9"]
    assert [r["experiment"] for r in rows] == ["fly", "fly", ""]
    assert [r["throughput/speedup"] for r in rows] == ["1.5", "1.9", ""]
    assert rows[0]["quality/accuracy_ratio"] == "1.0"
    assert [r["error"] for r in rows] == ["", "", "RuntimeError: boom"]
    out = capsys.readouterr().out
    assert "+experiment=fly acceptor.theta=0.7" in out and "FAILED: RuntimeError: boom" in out
    assert (tmp_path / "sweep_summary.txt").exists()


def test_pareto_front_keeps_the_undominated_points():
    points = [(1.0, 0.5), (1.5, 0.4), (1.2, 0.5), (2.0, 0.1), (1.5, 0.3), (1.2, 0.5)]
    # (1.0, 0.5) loses to (1.2, 0.5); (1.5, 0.3) to (1.5, 0.4); the two equal points stay
    assert pareto_front(points) == [2, 5, 1, 3]
    assert pareto_front([]) == []


def test_sweep_cli_adds_runs_and_draws_the_pareto_plot(tmp_path, capsys):
    sweep = tmp_path / "sweep"
    _fake_job(sweep, "0_acceptor.theta=0.3", ["+experiment=fly", "acceptor.theta=0.3"], 1.5, 0.25)
    _fake_job(sweep, "1_acceptor.theta=0.9", ["+experiment=fly", "acceptor.theta=0.9"], 1.2, 0.5)
    _fake_job(tmp_path, "exact", ["+experiment=pld"], 1.1, 0.5)
    sweep_main([str(sweep), str(tmp_path / "exact")])
    with (sweep / SUMMARY_CSV).open() as f:
        rows = list(csv.DictReader(f))
    assert [r["job"] for r in rows] == ["0_acceptor.theta=0.3", "1_acceptor.theta=0.9",
                                        str(tmp_path / "exact")]
    assert [r["task_hi/gsm8k_exact"] for r in rows] == ["0.625", "0.75", "0.75"]
    assert accuracy_metric(collect(sweep)) == "task/gsm8k_exact"
    assert (sweep / PARETO_PNG).read_bytes().startswith(PNG_MAGIC)
    assert "pareto plot:" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="not a folder"):
        sweep_main([str(sweep), str(tmp_path / "missing")])


def test_point_labels_name_the_method_and_what_varies():
    rows = [
        {"job": "0", "method": "fly_self",
         "overrides": "+experiment=fly_self acceptor.theta=0.3 runner.baseline_cache=True"},
        {"job": "1", "method": "fly_self",
         "overrides": "+experiment=fly_self acceptor.theta=0.9 runner.baseline_cache=True"},
        {"job": "2", "method": "pld", "overrides": "+experiment=pld runner.baseline_cache=true"},
    ]
    assert point_labels(rows) == ["fly_self theta=0.3", "fly_self theta=0.9", "pld"]


def test_no_pareto_plot_without_task_scores(tmp_path):
    job = tmp_path / "0_x=1"
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text("- x=1\n")
    (job / "summary.json").write_text(json.dumps(_summary_json(speedup=1.3)))
    assert plot_pareto(collect(tmp_path), tmp_path / PARETO_PNG) is None
    assert not (tmp_path / PARETO_PNG).exists()


APP = """
import json, sys
from pathlib import Path
import hydra
from hydra.core.hydra_config import HydraConfig

@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg):
    out = Path(HydraConfig.get().runtime.output_dir)
    summary = {**json.loads(SUMMARY), "speedup": float(cfg.x)}
    (out / "summary.json").write_text(json.dumps(summary))
    return cfg.x

main()
"""


def test_two_job_multirun_writes_sweep_summary(tmp_path):
    """A real Hydra multirun (a stub task, no models) with conf/hydra/callbacks/sweep_summary."""
    (tmp_path / "conf" / "hydra" / "callbacks").mkdir(parents=True)
    shutil.copy(ROOT / "conf" / "hydra" / "callbacks" / "sweep_summary.yaml",
                tmp_path / "conf" / "hydra" / "callbacks")
    (tmp_path / "conf" / "config.yaml").write_text(textwrap.dedent("""
        defaults:
          - override hydra/callbacks: sweep_summary
          - _self_
        x: 0
        hydra:
          sweep:
            dir: sweep
            subdir: ${hydra.job.num}_${hydra.job.override_dirname}
        """))
    stub = json.dumps(_summary_json(method="stub", tau=1.5))
    (tmp_path / "app.py").write_text(APP.replace("SUMMARY", repr(stub), 1))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HYDRA_FULL_ERROR": "1"}
    proc = subprocess.run([sys.executable, "app.py", "-m", "x=2,3"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    with (tmp_path / "sweep" / SUMMARY_CSV).open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["x"], r["throughput/speedup"]) for r in rows] == [("2", "2.0"), ("3", "3.0")]
    assert "sweep summary:" in proc.stdout


def test_launcher_configs_compose():
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher")
    from hydra import compose, initialize_config_dir

    from specflow.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["+launcher=local"],
                      return_hydra_config=True)
    assert cfg.hydra.launcher._target_.endswith("JoblibLauncher")
    assert cfg.hydra.launcher.n_jobs == 2


# --- compare ----------------------------------------------------------------------------------


def test_compare_prints_runs_side_by_side(tmp_path, records, summary, capsys):
    a, b = tmp_path / "sps", tmp_path / "pld"
    a.mkdir()
    (a / "summary.json").write_text(json.dumps(summary.to_json()))
    b.mkdir()  # a run that died before summary.json: recomputed from requests.jsonl
    (b / "requests.jsonl").write_text(
        "".join(json.dumps(r.to_json()) + "\n" for r in records[:2])
    )
    rc = compare.main([str(a), str(b), "--plot", str(tmp_path / "cmp.png"),
                       "--csv", str(tmp_path / "cmp.csv")])
    assert rc == 0
    out = capsys.readouterr().out
    assert "sps" in out and "pld" in out
    for needle in ("throughput/speedup", "accept/tau", "quality/fidelity", "task/gsm8k_exact",
                   "translation: throughput/speedup"):
        assert needle in out, needle
    assert (tmp_path / "cmp.png").read_bytes()[:8] == PNG_MAGIC
    rows = list(csv.reader((tmp_path / "cmp.csv").open()))
    assert rows[0] == ["metric", "sps", "pld"]


def test_compare_recompute_adds_the_intervals_to_an_old_summary(tmp_path, records, capsys):
    old = summarize(records[:2], RunMeta(method="fly"), complete=True).to_json()
    old.pop("task_ci95")  # as written before the intervals existed
    (tmp_path / "summary.json").write_text(json.dumps(old))
    (tmp_path / "requests.jsonl").write_text(
        "".join(json.dumps(r.to_json()) + "\n" for r in records[:2])
    )
    assert "task_ci95" not in compare.load_summary(tmp_path).to_json()
    fresh = compare.load_summary(tmp_path, recompute=True)
    assert fresh.meta.method == "fly"
    assert fresh.overall.task_ci95["task/gsm8k_exact"] == wilson_interval(1, 2)
    assert compare.main([str(tmp_path), "--recompute"]) == 0
    out = capsys.readouterr().out
    assert "task_lo/gsm8k_exact" in out and "task_paired/gsm8k_exact/both" in out


def test_compare_rejects_a_non_run_folder(tmp_path, capsys):
    assert compare.main([str(tmp_path)]) == 2
    assert "not a run folder" in capsys.readouterr().err


class _Broken(NoopCallback):
    def on_run_end(self, summary, folder) -> None:
        raise RuntimeError("logger bug")


def test_a_failing_logger_does_not_stop_the_others(tmp_path, tiny_target):
    recorder = _Recorder()
    settings = RunSettings(max_new_tokens=3, warmup=False, baseline=False,
                           baseline_cache=False, cache_dir=str(tmp_path / "cache"))
    runner = Runner(_crashing_pipeline(tiny_target[1]), CharTokenizer(), settings,
                    SamplingParams(0.0, 0, 1.0), [_Broken(), recorder])
    folder = RunFolder(tmp_path / "run", resume=False)
    summary = runner.run([Request("q0", "writing", ("hi",))], folder, RunMeta(method="stub"))
    assert summary.complete is True
    assert recorder.calls == ["start", "q0", "end"]
    assert summary.meta.output_dir == str(folder.path.resolve())


class _Rounds(NoopCallback):
    wants_rounds = True

    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, int]]] = []

    def on_round_end(self, request, event) -> None:
        self.events.append((request.request_id, event))


def test_round_hooks_reach_callbacks_that_want_them(tmp_path, tiny_target):
    rounds, recorder = _Rounds(), _Recorder()
    pipe = SpeculativePipeline(FullVerifier(tiny_target[1]), StandardAcceptor())
    settings = RunSettings(max_new_tokens=5, warmup=False, baseline=False)
    runner = Runner(pipe, CharTokenizer(), settings, SamplingParams(), [rounds, recorder])
    runner.run([Request("q0", "qa", ("hi",))], RunFolder(tmp_path, resume=False),
               RunMeta(method="a"))
    record = RunFolder(tmp_path, resume=True).records[0]
    assert [e["round"] for _, e in rounds.events] == list(range(1, record.metrics.rounds + 1))
    assert {rid for rid, _ in rounds.events} == {"q0"} and sum(
        e["committed"] for _, e in rounds.events
    ) >= record.turns[0].new_tokens


def test_an_object_that_is_not_a_callback_is_refused(tiny_target):
    pipe = SpeculativePipeline(FullVerifier(tiny_target[1]), StandardAcceptor())
    with pytest.raises(ConfigError, match="callback object is not a run callback"):
        Runner(pipe, CharTokenizer(), RunSettings(), SamplingParams(), [object()])


def test_paired_report_against_the_reference():
    """specflow.results.paired: ratios of the reference's seconds, fidelity by tokens, levels
    summed."""
    from dataclasses import replace as dc_replace

    from specflow.results.paired import paired_markdown, paired_report

    plain = [fake_record(0, "math_reasoning"), fake_record(1, "qa")]  # 0.5 s, 0.6 s
    fast = dc_replace(plain[0], metrics=dc_replace(plain[0].metrics, total_s=0.25))
    other = dc_replace(plain[1], turns=[dc_replace(plain[1].turns[0], output_tokens=[2] * 11)])
    extra = fake_record(7, "qa")  # the reference never decoded it: left out
    rep = paired_report({"plain": plain, "m": [fast, other, extra]}, "plain")
    m = rep["methods"]["m"]
    assert m["requests"] == 2
    assert m["speedup"] == pytest.approx(1.1 / 0.85)
    assert m["speedup_median"] == pytest.approx(1.5)
    assert m["tau"] == pytest.approx(1 + 13 / 8)
    assert m["levels"]["target"] == {"drafted": 24, "accepted": 13, "rate": 13 / 24}
    assert m["levels"]["intermediate"]["accepted"] == 18
    assert m["fidelity"] == 0.5
    assert m["by_category"]["math_reasoning"] == {"speedup": 2.0, "tau": 2.5}
    assert m["time_per_stage_s"]["verify_s"] == pytest.approx(0.4)
    assert rep["methods"]["plain"]["speedup"] == 1.0
    assert (m["rounds"], m["tree_rounds"]) == (8, 0)
    text = paired_markdown(rep, [("r0", "math_reasoning")], {"m": "+experiment=x"})
    assert "verified a tree" not in text
    treed = dc_replace(fast, metrics=dc_replace(fast.metrics, tree_rounds=3))
    tree_text = paired_markdown(paired_report({"plain": plain, "t": [treed]}, "plain"), [], {})
    assert "t: 3 of 4 rounds verified a tree" in tree_text
    assert "by part" not in text
    # A drafter of parts (a fallback): each part's rounds, plain rounds and tokens, summed.
    lookup = {"first": {"rounds": 2, "skipped": 0, "drafted": 8, "accepted": 6}}
    both = {**lookup, "then": {"rounds": 2, "skipped": 1, "drafted": 4, "accepted": 1}}
    parted = [dc_replace(fast, metrics=dc_replace(fast.metrics, parts=both)),
              dc_replace(other, metrics=dc_replace(other.metrics, parts=lookup))]
    rep = paired_report({"plain": plain, "p": parted}, "plain")
    assert rep["methods"]["p"]["parts"] == {
        "first": {"rounds": 4, "skipped": 0, "drafted": 16, "accepted": 12},
        "then": {"rounds": 2, "skipped": 1, "drafted": 4, "accepted": 1},
    }
    assert ("p by part: first 4 rounds (0 plain), 12/16 accepted; then 2 rounds (1 plain), "
            "1/4 accepted") in paired_markdown(rep, [], {})
    flat = flatten_record(parted[0])
    assert (flat["part/first/rounds"], flat["part/then/skipped"]) == (2, 1)
    assert flat["part/first/rate"] == 0.75 and flat["part/then/rate"] == 0.25
    # Rounds per pool arm: a request's arm_counts stop at the highest arm it chose, so a
    # shorter list adds as if padded with zeros, whatever the order.
    from specflow.results.paired import add_padded
    from specflow.results.records import PoolMetrics

    def pooled(counts: list[int]):
        rec = fake_record(0, "math_reasoning")
        pool = PoolMetrics(arms=[], arm_rewards=[], arm_counts=counts, catchup_tokens=0,
                           catchup_s=0.0)
        return dc_replace(rec, metrics=dc_replace(rec.metrics, pool=pool))

    assert add_padded([1, 2, 3, 4], [5, 6]) == [6, 8, 3, 4]
    rep = paired_report({"plain": plain, "m": [pooled([3, 1, 0, 2]), pooled([4, 5])]}, "plain")
    assert rep["methods"]["m"]["arm_rounds"] == [7, 6, 0, 2]
    assert "| m | " in text and "r0 (math_reasoning)" in text and "`+experiment=x`" in text
