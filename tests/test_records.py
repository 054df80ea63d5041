"""The result schema (``specflow.results.records``): the JSON it writes has today's keys, in today's
order; the run folders stored in the repository read back byte for byte; files written
before some keys existed still read (fast, tiny model)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from specflow.engine import SpeculativePipeline
from specflow.results.measure import generation_metrics
from specflow.results.metrics import SCALARS
from specflow.results.records import RequestRecord, RunMeta, RunSummary
from specflow.results.run_folder import CorruptRecordsError, RunFolder, read_records
from specflow.runner import Runner
from specflow.sampling import SamplingParams
from specflow.scheduler import Generation
from specflow.settings import RunSettings
from specflow.state import RoundStats, StageTimes
from specflow.workload import Request
from stages.acceptors.standard import StandardAcceptor
from stages.drafters.pld import PLDDrafter
from stages.verifiers.full import FullVerifier
from tests.conftest import CharTokenizer

ROOT = Path(__file__).resolve().parents[1]
STORED_RUNS = sorted(p.parent for p in ROOT.glob("docs/records/runs/*/summary.json"))

# The keys as the runner wrote them before the schema was typed.
RECORD_KEYS = ["request_id", "category", "subcategory", "output_text", "turns", "metrics",
               "task", "baseline_task"]
TURN_KEYS = ["prompt_tokens", "output_text", "output_tokens", "new_tokens", "total_s",
             "stop_reason", "ttft_s"]
METRIC_KEYS = ["new_tokens", "total_s", "tokens_per_s", "rounds", "target_calls", "drafted",
               "accepted", "tau", "acceptance_rate", "levels", "time_per_stage", "k_per_round",
               "rounds_skipped", "tree_rounds", "parts", "drafted_per_round",
               "accepted_per_round"]
POOL_KEYS = ["arms", "arm_rewards", "arm_counts", "catchup_tokens", "catchup_s"]
LATENCY_KEYS = ["latency_s", "queued_s"]
BASELINE_KEYS = ["baseline_tokens", "baseline_s", "baseline_tokens_per_s", "baseline_cached",
                 "speedup", "matches_baseline", "baseline_ttft_s", "baseline_decode_s",
                 "baseline_decode_tokens", "tpot_speedup"]
DECODE_KEYS = ["ttft_s", "decode_s", "decode_tokens", "tpot_s"]
# What records written before the TTFT keys read back with (a baseline's and the request's).
DECODE_DEFAULTS = {"baseline_ttft_s": None, "baseline_decode_s": None,
                   "baseline_decode_tokens": 0, "tpot_speedup": None, "ttft_s": None,
                   "decode_s": None, "decode_tokens": 0, "tpot_s": None}
META_KEYS = ["method", "target_model", "models", "config", "machine", "started", "output_dir"]
AGGREGATE_KEYS = ["num_requests", "new_tokens", "total_s", "tokens_per_s", "rounds",
                  "target_calls", "drafted", "accepted", "tree_rounds", "parts", "tau",
                  "acceptance_rate",
                  "acceptance_by_level", "accepted_by_level", "time_per_stage",
                  "baseline_tokens_per_s", "speedup", "speedup_median", "fidelity",
                  "ttft_s", "tpot_s", "baseline_ttft_s", "baseline_tpot_s", "tpot_speedup"]
TASK_KEYS = ["task/bleu", "task_ci95", "baseline_task/bleu", "baseline_task_ci95", "task_paired",
             "task/gsm8k_exact", "baseline_task/gsm8k_exact"]
LATENCY_SUMMARY_KEYS = ["latency_s_mean", "latency_s_p50", "latency_s_p90"]
BATCH_KEYS = ["batch_size", "device", "kv_layout", "kernels", "decode", "attention",
              "block_size", "wall_s", "new_tokens", "throughput_tokens_per_s", "mean_active",
              "baseline_wall_s", "baseline_throughput_tokens_per_s", "throughput_speedup",
              *LATENCY_SUMMARY_KEYS]
META = RunMeta(method="pld", target_model="tiny", models=["tiny"], config={"method": "pld"})


def _run(tmp_path: Path, lm: Any, requests: list[Request], **settings: Any) -> Path:
    pipe = SpeculativePipeline(FullVerifier(lm), StandardAcceptor(), drafter=PLDDrafter(k=4))
    runner = Runner(pipe, CharTokenizer(), RunSettings(max_new_tokens=4, warmup=False, **settings),
                    SamplingParams())
    runner.run(requests, RunFolder(tmp_path, resume=False), META)
    return tmp_path


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def written(tiny_target, tmp_path_factory) -> Path:
    """A run folder the runner wrote: side by side with plain decoding, two task scores."""
    requests = [
        Request("m", "math_reasoning", ("what is 1+2",), reference="... #### 3"),
        Request("t", "translation", ("hallo welt",), reference="hello world"),
    ]
    return _run(tmp_path_factory.mktemp("run"), tiny_target[1], requests)


def test_a_written_record_has_todays_keys(written):
    for data in _lines(written / "requests.jsonl"):
        assert list(data) == RECORD_KEYS
        assert [list(t) for t in data["turns"]] == [TURN_KEYS]
        assert list(data["metrics"]) == METRIC_KEYS + LATENCY_KEYS + BASELINE_KEYS + DECODE_KEYS
        assert len(data["task"]) == 1 and list(data["task"]) == list(data["baseline_task"])


def test_a_written_summary_has_todays_keys(written):
    data = json.loads((written / "summary.json").read_text())
    assert list(data) == [*META_KEYS, "complete", *AGGREGATE_KEYS, *TASK_KEYS, "by_category",
                          "batch"]
    by_cat = data["by_category"]
    assert list(by_cat) == ["math_reasoning", "translation"]
    assert list(by_cat["translation"]) == [*AGGREGATE_KEYS, *TASK_KEYS[:5]]
    assert list(data["batch"]) == BATCH_KEYS


def test_records_without_baseline_and_an_empty_run(tiny_target, tmp_path):
    folder = _run(tmp_path / "a", tiny_target[1], [Request("q", "qa", ("abcabc",))],
                  baseline=False)
    (data,) = _lines(folder / "requests.jsonl")
    assert list(data) == RECORD_KEYS[:-1]  # no baseline_task
    assert list(data["metrics"]) == METRIC_KEYS + LATENCY_KEYS + DECODE_KEYS
    summary = json.loads((folder / "summary.json").read_text())
    assert list(summary["batch"]) == [k for k in BATCH_KEYS if not k.startswith(
        ("baseline_", "throughput_speedup"))]
    empty = json.loads((_run(tmp_path / "b", tiny_target[1], []) / "summary.json").read_text())
    assert list(empty) == [*META_KEYS, "complete", "num_requests", "by_category", "batch"]
    assert empty["num_requests"] == 0 and empty["by_category"] == {}
    assert list(empty["batch"]) == ["batch_size", "device", *LATENCY_SUMMARY_KEYS]
    assert RunSummary.from_json(empty).to_json() == empty


def test_a_drafter_pools_metrics_are_written_inline():
    stats = RoundStats(rounds=2, drafted=3, accepted=1, level_drafted={"target": 3},
                       level_accepted={"target": 1}, asked_per_round=[3, 0],
                       drafted_per_round=[3, 0], accepted_per_round=[1, 0], arms=[1, 0, 1],
                       rewards=[0.5, 0.0, 1.0], catchup_tokens=4, catchup_s=0.25)
    gen = Generation([7, 8, 9], stats, StageTimes(draft_s=0.1), 1.0, "length")
    metrics = generation_metrics([gen], queued_s=0.5).to_json()
    assert list(metrics) == METRIC_KEYS + POOL_KEYS + LATENCY_KEYS + DECODE_KEYS
    assert metrics["arm_counts"] == [1, 2] and metrics["k_per_round"] == [3, 0]
    assert metrics["rounds_skipped"] == 1 and metrics["latency_s"] == 1.0
    assert metrics["queued_s"] == 0.5 and metrics["catchup_tokens"] == 4


def test_written_results_read_back_into_equal_objects(written):
    folder = RunFolder(written, resume=True)
    assert [r.to_json() for r in folder.records] == _lines(written / "requests.jsonl")
    data = json.loads((written / "summary.json").read_text())
    summary = RunSummary.from_json(data)
    assert summary.to_json() == data
    assert RunSummary.from_json(summary.to_json()) == summary
    assert summary.meta == RunMeta(**{k: data[k] for k in META_KEYS})
    assert summary.batch is not None and summary.batch.decoding.kv["kv_layout"] == "contiguous"


def test_every_metric_name_comes_from_a_written_key(written):
    """``specflow.results.metrics.SCALARS`` is keyed by the JSON keys: none may drift from them."""
    (record, *_) = _lines(written / "requests.jsonl")
    summary = json.loads((written / "summary.json").read_text())
    assert set(SCALARS) <= set(record["metrics"]) | set(summary)


def test_stored_run_folders_are_found():
    assert len(STORED_RUNS) >= 10, "docs/records/runs holds the stored FLy accuracy run folders"


@pytest.mark.parametrize("run", STORED_RUNS, ids=lambda p: str(p.relative_to(ROOT / "docs")))
def test_stored_run_folders_round_trip(run: Path):
    """Every record of a stored run folder is rewritten byte for byte (key order included),
    but for ``tree_rounds`` (0) and ``parts`` ({}) where it predates those keys; so is its
    summary, unless it predates ``accepted_by_level`` (then only that is added)."""
    for line in (run / "requests.jsonl").read_text().splitlines():
        data = json.loads(line)
        out = RequestRecord.from_json(data).to_json()
        for key, empty in (("tree_rounds", 0), ("parts", {}), *DECODE_DEFAULTS.items()):
            if key not in data["metrics"]:
                assert out["metrics"].pop(key, empty) == empty
        for turn, written in zip(out["turns"], data["turns"], strict=True):
            if "ttft_s" not in written:
                assert turn.pop("ttft_s") is None
        assert json.dumps(out) == line
    data = json.loads((run / "summary.json").read_text())
    out = RunSummary.from_json(data).to_json()
    for key, empty in (("tree_rounds", 0), ("parts", {}),
                       *dict.fromkeys(AGGREGATE_KEYS[-5:]).items()):
        if key not in data:
            for agg in (out, *out["by_category"].values()):
                assert agg.pop(key, empty) == empty
    if "accepted_by_level" in data:
        assert json.dumps(out) == json.dumps(data)
    else:
        assert out["accepted_by_level"] == {}
        del out["accepted_by_level"]
        for agg in out["by_category"].values():
            del agg["accepted_by_level"]
        assert out == data


OLD_METRICS = ("k_per_round", "rounds_skipped", "tree_rounds", "parts", "latency_s",
               "queued_s")
OLD_SUMMARY = ("accepted_by_level", "tree_rounds", "parts", "task_ci95", "baseline_task_ci95",
               "task_paired", "batch")


def test_old_format_files_still_read_and_resume(tmp_path):
    """Records and a summary as the first version wrote them (before the keys above)."""
    run = ROOT / "docs/records/runs/fly-gsm8k20-qwen0.5b-fly-theta0.3"
    old = []
    for data in _lines(run / "requests.jsonl")[:3]:
        for key in OLD_METRICS:
            data["metrics"].pop(key, None)  # the stored run predates some (tree_rounds)
        del data["baseline_task"]
        old.append(data)
    (tmp_path / "requests.jsonl").write_text("".join(json.dumps(d) + "\n" for d in old))
    folder = RunFolder(tmp_path, resume=True)
    assert folder.done_ids == {d["request_id"] for d in old}
    first, data = folder.records[0], old[0]
    assert first.metrics.latency_s == data["metrics"]["total_s"]
    assert first.metrics.queued_s == 0.0 and first.metrics.k_per_round == []
    assert first.metrics.tree_rounds == 0 and first.metrics.parts == {}
    assert first.baseline_task is None and first.task == data["task"]
    assert first.metrics.baseline is not None
    assert first.metrics.baseline.speedup == data["metrics"]["speedup"]

    summary = json.loads((run / "summary.json").read_text())
    for agg in (summary, *summary["by_category"].values()):
        for key in OLD_SUMMARY:
            agg.pop(key, None)
    typed = RunSummary.from_json(summary)
    assert typed.batch is None and typed.overall.task_paired == {}
    assert typed.overall.speedup == summary["speedup"] and typed.meta.method == "fly_self"
    assert typed.overall.task == {"task/gsm8k_exact": summary["task/gsm8k_exact"]}


def test_a_json_object_that_is_not_a_record_is_refused(tmp_path):
    path = tmp_path / "requests.jsonl"
    path.write_text(json.dumps({"request_id": "q0", "category": "qa"}) + "\n")
    with pytest.raises(CorruptRecordsError, match=r"requests\.jsonl: record 1 .*'q0'.*KeyError"):
        read_records(path)
    with pytest.raises(CorruptRecordsError, match="not a request record"):
        RunFolder(tmp_path, resume=True)
