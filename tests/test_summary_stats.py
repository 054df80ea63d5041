"""The summary's accuracy statistics: Wilson intervals, paired counts, McNemar (fast)."""

from __future__ import annotations

import pytest

from specflow.results.records import PairedCounts, RunMeta
from specflow.results.run_folder import paired_counts, summarize, wilson_interval
from tests.test_callbacks import fake_record


def test_wilson_interval_hand_computed() -> None:
    # 7/20: p = 0.35, z = 1.959964: centre (0.35 + 0.096039) / 1.192079, half-width
    # 1.959964 * sqrt(0.011375 + 0.002401) / 1.192079
    lo, hi = wilson_interval(7, 20)
    assert lo == pytest.approx(0.181192, abs=1e-6)
    assert hi == pytest.approx(0.567146, abs=1e-6)
    assert wilson_interval(0, 20) == [0.0, pytest.approx(0.161125, abs=1e-6)]
    assert wilson_interval(20, 20) == [pytest.approx(0.838875, abs=1e-6), 1.0]
    with pytest.raises(ValueError, match="n >= 1"):
        wilson_interval(0, 0)


def test_paired_counts_and_exact_mcnemar() -> None:
    # 6 plain-only, 0 method-only: p = 2 * 0.5**6
    pairs = [(0, 1)] * 6 + [(1, 1)] + [(0, 0)] * 13
    assert paired_counts(pairs) == PairedCounts(
        both=1, method_only=0, plain_only=6, neither=13, mcnemar_p=0.03125,
    )
    # 3 vs 1 discordant: 2 * P[Bin(4, 1/2) <= 1] = 2 * 5/16
    assert paired_counts([(1, 0)] * 3 + [(0, 1)]).mcnemar_p == 0.625
    assert paired_counts([(1, 1), (0, 0)]).mcnemar_p == 1.0


def test_summary_carries_intervals_pairs_and_loose_counts() -> None:
    records = [
        fake_record(i, "code", task={"task/pass@1": float(i % 2)}) for i in range(4)
    ]
    for i, r in enumerate(records):
        r.baseline_task = {"task/pass@1": 1.0 if i < 3 else 0.0}
        r.metrics.levels["fly_loose"] = [12, i]
    s = summarize(records, RunMeta(method="m"), complete=True).to_json()
    assert s["task/pass@1"] == 0.5 and s["baseline_task/pass@1"] == 0.75
    assert s["task_ci95"]["task/pass@1"] == wilson_interval(2, 4)
    assert s["baseline_task_ci95"]["task/pass@1"] == wilson_interval(3, 4)
    # records 1 and 3 pass with the method, 0-2 with plain decoding
    assert s["task_paired"]["task/pass@1"] == {
        "both": 1, "method_only": 1, "plain_only": 2, "neither": 0, "mcnemar_p": 1.0,
    }
    assert s["accepted_by_level"]["fly_loose"] == 0 + 1 + 2 + 3
    assert s["by_category"]["code"]["task_paired"]["task/pass@1"]["plain_only"] == 2


def test_non_binary_scores_get_no_interval() -> None:
    records = [fake_record(i, "summ", task={"task/rouge_l": 0.25 * i}) for i in range(3)]
    s = summarize(records, RunMeta(), complete=True).to_json()
    assert "task_ci95" not in s and "task_paired" not in s
