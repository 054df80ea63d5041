"""Runner settings that used to be ignored are refused; side-by-side baselines; the table."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from omegaconf import OmegaConf

from specflow.engine import SpeculativePipeline
from specflow.errors import ConfigError, PromptTooLongError
from specflow.graph import build_pipeline
from specflow.results.records import RunMeta
from specflow.results.run_folder import RunFolder, format_table, summarize
from specflow.runner import Runner
from specflow.sampling import SamplingParams
from specflow.settings import RunSettings
from specflow.workload import Request
from stages.acceptors.standard import StandardAcceptor
from stages.drafters.pld import PLDDrafter
from stages.verifiers.full import FullVerifier
from tests.conftest import CharTokenizer, NoopCallback
from tests.test_configs import (  # noqa: F401 - fixtures
    _compose,
    deep_tiny,
    deep_tiny_feature_head,
    deep_tiny_medusa,
    tiny_models,
)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("batch_size", 0, "runner.batch_size must be >= 1, got 0"),
        ("batch_size", -3, "runner.batch_size must be >= 1, got -3"),
        ("attention", "bogus", "runner.attention='bogus' is unknown"),
        ("device", "tpu", "runner.device='tpu' is unknown; use one of"),
        ("kv_layout", "ring", "runner.kv_layout='ring' is unknown"),
        ("dtype", "float8", "dtype='float8' is not supported"),
        ("max_new_tokens", 0, "runner.max_new_tokens must be >= 1, got 0"),
        ("threads", 0, "runner.threads must be >= 1 or null, got 0"),
    ],
)
def test_bad_runner_settings_are_refused(key, value, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        RunSettings(**{key: value})


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_a_gpu_is_a_clear_error():
    with pytest.raises(ConfigError, match="runner.device=cuda but torch sees no CUDA GPU"):
        RunSettings(device="cuda")


def test_composed_runner_values_are_checked():
    cfg = _compose(["runner.batch_size=0"])
    with pytest.raises(ConfigError, match="runner.batch_size must be >= 1, got 0"):
        OmegaConf.to_object(cfg.runner)
    settings = OmegaConf.to_object(_compose(["runner.batch_size=4"]).runner)
    assert isinstance(settings, RunSettings) and settings.batch_size == 4
    assert settings.layout().kind == "contiguous"  # auto on CPU


def test_a_selector_without_a_pool_is_refused(tiny_models):  # noqa: F811
    with pytest.raises(ConfigError, match="selector=UCBSelector is set but drafter does not"):
        build_pipeline(_compose(["drafter=pld", "selector=ucb"]))
    assert build_pipeline(_compose(["drafter=pool", "selector=ucb"])) is not None
    assert build_pipeline(_compose(["drafter=pld"])) is not None  # the default `single`


def test_table_header_cells_are_separated():
    summary = summarize([], RunMeta(), complete=True)
    head = format_table(summary).splitlines()[0]
    assert head == (
        "category           n           tokens/s  baseline_tokens/s            speedup"
        "            ttft_ms            tpot_ms       tpot_speedup"
        "                tau    acceptance_rate           fidelity"
    )


def _pld(lm) -> SpeculativePipeline:
    return SpeculativePipeline(FullVerifier(lm), StandardAcceptor(), drafter=PLDDrafter(k=4))


def test_a_prompt_too_long_names_the_real_budget(tiny_target, tmp_path):
    _, lm = tiny_target  # 512 positions
    runner = Runner(_pld(lm), CharTokenizer(), RunSettings(max_new_tokens=100), SamplingParams())
    request = Request("long", "qa", ("x" * 450,))
    with pytest.raises(PromptTooLongError, match=r"request long: .*max_new_tokens=100 .*<= 62"):
        runner.run([request], RunFolder(tmp_path, resume=False), RunMeta(method="pld"))


def test_the_baseline_is_side_by_side_by_default(tiny_target, tmp_path):
    _, lm = tiny_target
    settings = RunSettings(max_new_tokens=8, warmup=False, cache_dir=str(tmp_path / "cache"))
    assert settings.baseline_cache is False
    runner = Runner(_pld(lm), CharTokenizer(), settings, SamplingParams())
    summary = runner.run(
        [Request("a", "qa", ("abcabc",))], RunFolder(tmp_path / "run", False), RunMeta(method="p")
    )
    (record,) = RunFolder(tmp_path / "run", resume=True).records
    assert record.metrics.baseline.baseline_cached is False
    assert not (tmp_path / "cache" / "baselines").exists()
    assert "baseline_drift" not in summary.batch.to_json()


def test_a_cached_baseline_is_re_timed_and_drift_reported(tiny_target, tmp_path, caplog):
    _, lm = tiny_target
    settings = RunSettings(
        max_new_tokens=8, warmup=False, baseline_cache=True, cache_dir=str(tmp_path / "cache")
    )
    requests = [Request("a", "qa", ("abcabc",))]
    Runner(_pld(lm), CharTokenizer(), settings, SamplingParams()).run(
        requests, RunFolder(tmp_path / "r1", False), RunMeta(method="p")
    )
    (entry,) = (tmp_path / "cache" / "baselines").glob("*.json")
    cached = json.loads(entry.read_text())
    cached["total_s"] *= 1000.0  # as if the cache was filled on a far slower machine
    entry.write_text(json.dumps(cached))
    with caplog.at_level(logging.WARNING, logger="specflow.runner"):
        summary = Runner(_pld(lm), CharTokenizer(), settings, SamplingParams()).run(
            requests, RunFolder(tmp_path / "r2", False), RunMeta(method="p")
        )
    assert summary.batch.baseline_drift < 0.01
    assert "cached baseline of a took" in caplog.text and "faster" in caplog.text
    (record,) = RunFolder(tmp_path / "r2", resume=True).records
    assert record.metrics.baseline.baseline_cached is True


class _Ends(NoopCallback):
    def __init__(self) -> None:
        self.ended = 0

    def on_run_end(self, summary, folder) -> None:
        self.ended += 1


def test_on_run_end_runs_even_when_writing_the_summary_fails(tiny_target, tmp_path, monkeypatch):
    _, lm = tiny_target
    ends = _Ends()
    settings = RunSettings(max_new_tokens=4, warmup=False, baseline=False)
    runner = Runner(_pld(lm), CharTokenizer(), settings, SamplingParams(), [ends])
    folder = RunFolder(tmp_path, resume=False)

    def disk_full(summary):
        raise OSError("No space left on device")

    monkeypatch.setattr(folder, "write_summary", disk_full)
    with pytest.raises(OSError, match="No space left"):
        runner.run([Request("a", "qa", ("abc",))], folder, RunMeta(method="p"))
    assert ends.ended == 1
    assert [r.request_id for r in RunFolder(tmp_path, resume=True).records] == ["a"]

def test_objects_alive_after_loading_are_set_aside_from_the_collector_once():
    """``set_aside_long_lived_objects``: gc.freeze once per process (a fresh interpreter,
    so this test's own objects stay collectable)."""
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import gc\n"
        "from specflow.runner import set_aside_long_lived_objects as aside\n"
        "assert gc.get_freeze_count() == 0\n"
        "aside(); n = gc.get_freeze_count(); assert n > 1000, n\n"
        "kept = [[] for _ in range(100)]\n"
        "aside(); assert gc.get_freeze_count() == n\n"
        "print('ok')\n"
    )
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=root)
    assert done.stdout.strip() == "ok", done.stderr[-2000:]
