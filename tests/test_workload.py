"""Workloads: Spec-Bench selection (ids, categories, per-category) and HumanEval requests."""

from __future__ import annotations

import pytest

from specflow.errors import ConfigError
from specflow.workload import HumanEval, SpecBench


def test_specbench_ids_then_per_category_keeps_interleaved_order():
    held_out = ["101", "125", "149", "173", "197", "245", "269"]
    requests = SpecBench(ids=held_out, per_category=1).requests()
    assert [(r.request_id, r.category) for r in requests] == [
        ("245", "summarization"),
        ("173", "translation"),
        ("101", "mt_bench"),
    ]


def test_specbench_ids_accept_ints_and_unknown_ids_fail_clearly():
    assert [r.request_id for r in SpecBench(ids=[101]).requests()] == ["101"]
    with pytest.raises(ConfigError, match=r"workload.ids has unknown request ids \['nope'\]"):
        SpecBench(ids=["nope"]).requests()


def test_specbench_categories_and_max_turns():
    requests = SpecBench(categories=["mt_bench"], limit=2, max_turns=1).requests()
    assert [r.category for r in requests] == ["mt_bench", "mt_bench"]
    assert [len(r.turns) for r in requests] == [1, 1]


def test_humaneval_requests_carry_their_problem_for_scoring():
    requests = HumanEval(limit=2).requests()
    assert [r.request_id for r in requests] == ["HumanEval/0", "HumanEval/1"]
    assert requests[0].category == "humaneval"
    assert requests[0].extra["problem"]["entry_point"] == "has_close_elements"
    assert "def has_close_elements" in requests[0].turns[0]
    assert [r.request_id for r in HumanEval(ids=[7, "HumanEval/9"]).requests()] == [
        "HumanEval/7",
        "HumanEval/9",
    ]
