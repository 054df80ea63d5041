"""Past one machine, exercised here: sweeps through submitit's local executor and a
persistent Optuna search, each through the real ``run.py`` on SmolLM2-135M.

- submitit: Hydra's ``submitit_local`` launcher runs the same pickling, job folders, logs and
  result collection as ``+launcher=slurm``, with local processes instead of SLURM jobs;
- Optuna: 3 trials of ``+hparams_search=fly_optuna`` with a SQLite study; a search killed
  after its first trial continues the same study when run again.

(Multi-process head training: ``train_heads/tests/test_ddp.py``.)
"""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m"
# One math question, a few tokens, no warm-up, no row probe (model.min_rows given): each job
# takes seconds.
TINY_RUN = [
    f"model={MODEL}", "workload.categories=[math_reasoning]", "workload.limit=1",
    "workload.max_turns=1", "runner.max_new_tokens=8", "runner.warmup=false",
    "runner.threads=1", "callbacks=none", "model.min_rows=1",
]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def model_prepared():
    from specflow.models.prepare import is_prepared

    if not is_prepared(MODEL):
        pytest.skip(f"{MODEL} is not prepared (bash scripts/setup.sh)")


def _env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "1"}


def _run_py(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "run.py", *args], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=timeout)


def test_submitit_local_sweep_collects_every_job_and_reports_the_failed_one(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    sweep = tmp_path / "sweep"
    # two jobs, each its own process: k = 2 runs; k = 0 fails inside its job
    proc = _run_py("-m", "+launcher=submitit_local", "+experiment=pld", *TINY_RUN,
                   "drafter.k=2,0", f"hydra.sweep.dir={sweep}")
    assert proc.returncode == 0, proc.stderr[-3000:]

    jobs = sorted(p.name for p in sweep.iterdir() if p.is_dir() and not p.name.startswith("."))
    assert [j.split("_", 1)[0] for j in jobs] == ["0", "1"]
    assert ["drafter.k=2" in jobs[0], "drafter.k=0" in jobs[1]] == [True, True]
    ok = jobs[0]
    assert (sweep / ok / "summary.json").is_file() and (sweep / ok / "requests.jsonl").is_file()
    assert not (sweep / jobs[1] / "summary.json").exists()
    error = (sweep / jobs[1] / "error.txt").read_text()
    assert "drafter.k must be >= 1, got 0" in error
    # submitit's own job folders: one per job, with its pickled result and logs
    submitit_dirs = [p for p in (sweep / ".submitit").iterdir() if p.name.isdigit()]
    assert len(submitit_dirs) == 2
    for d in submitit_dirs:
        names = {p.name for p in d.iterdir()}
        assert any(n.endswith("_result.pkl") for n in names), names
        assert any(n.endswith("_log.out") for n in names), names

    with (sweep / "sweep_summary.csv").open() as f:
        rows = {r["job"]: r for r in csv.DictReader(f)}
    assert set(rows) == set(jobs)
    assert rows[ok]["complete"] == "True" and float(rows[ok]["throughput/speedup"]) > 0
    assert rows[ok]["quality/fidelity"] == "1.0"
    assert rows[ok]["error"] == ""
    assert "drafter.k must be >= 1, got 0" in rows[jobs[1]]["error"]
    assert "FAILED: " in (sweep / "sweep_summary.txt").read_text()
    assert (sweep / "sweep_pareto.png").stat().st_size > 0


def _optuna_args(storage: str, sweep: Path, n_trials: int) -> list[str]:
    return [
        "+experiment=fly_self", "+hparams_search=fly_optuna", *TINY_RUN,
        f"hydra.sweeper.storage={storage}", "hydra.sweeper.study_name=test_study",
        f"hydra.sweeper.n_trials={n_trials}", "hydra.sweeper.sampler.n_startup_trials=2",
        f"hydra.sweep.dir={sweep}",
    ]


def _complete_trials(storage: str) -> list:
    import optuna

    study = optuna.load_study(study_name="test_study", storage=storage)
    return [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]


def _completed_count_read_only(db: Path) -> int:
    """How many trials another process's study has completed, read without writing: a
    read-only SQLite connection, so this test never races the running search while it
    creates the schema (``optuna.load_study`` would insert the schema's version row itself,
    and the search could then fail on its own insert).  Unreadable (the file or its tables
    not yet there, or locked) counts as none yet."""
    import sqlite3
    from contextlib import closing

    query = "SELECT COUNT(*) FROM trials WHERE state = 'COMPLETE'"
    try:
        with closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1.0)) as conn:
            return conn.execute(query).fetchone()[0]
    except sqlite3.Error:
        return 0


def _finished_trials(storage: str) -> list:
    import optuna

    study = optuna.load_study(study_name="test_study", storage=storage)
    states = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL)
    return [t for t in study.trials if t.state in states]


def test_optuna_search_persists_and_resumes_after_a_kill(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    optuna = pytest.importorskip("optuna")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    db = tmp_path / "studies" / "test.db"  # its folder does not exist yet
    storage = f"sqlite:///{db}"

    # 1. a search of 3 trials, killed (SIGKILL) once its first trial is in the study
    log = tmp_path / "first.log"
    with log.open("w") as err:
        first = subprocess.Popen(
            [sys.executable, "run.py", *_optuna_args(storage, tmp_path / "a", 3)], cwd=ROOT,
            env=_env(), stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline and first.poll() is None:
            if _completed_count_read_only(db):
                break
            time.sleep(0.5)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    assert first.returncode == -signal.SIGKILL, (
        f"the search ended by itself (exit {first.returncode}) before it could be killed:\n"
        + log.read_text()[-3000:])
    done = _complete_trials(storage)
    assert 1 <= len(done) < 3, "the search finished before it could be killed"

    # 2. the same command again continues the same study: 2 more trials, best over all
    proc = _run_py(*_optuna_args(storage, tmp_path / "b", 2))
    assert proc.returncode == 0, proc.stderr[-3000:]
    trials = _complete_trials(storage)
    finished = _finished_trials(storage)  # COMPLETE or FAIL (a trial whose run failed)
    assert len(finished) >= len(done) + 2 and len(trials) > len(done)
    assert {t.number for t in done} <= {t.number for t in trials}  # the killed run's trials kept
    best = max(trials, key=lambda t: t.value)
    results = yaml.safe_load((tmp_path / "b" / "optimization_results.yaml").read_text())
    assert results["best_value"] == pytest.approx(best.value)
    assert results["best_params"] == best.params
    assert set(best.params) == {"acceptor.theta", "acceptor.window"}
    with (tmp_path / "b" / "sweep_summary.csv").open() as f:
        assert len(list(csv.DictReader(f))) == 2
