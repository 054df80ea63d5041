"""Bad inputs fail early with one clear message: stage argument types (checked against the
target's annotations at build time) and workloads (malformed, empty, empty prompts)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import pytest
from hydra import compose, initialize_config_dir

from specflow.config import register_configs
from specflow.errors import ConfigError
from specflow.graph import check_node, instantiate_checked
from specflow.workload import PromptFile, SpecBench

CONF = Path(__file__).resolve().parents[1] / "conf"
register_configs()


def _compose(overrides: list[str]) -> Any:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


# --- stage argument types ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("drafter.k=abc",
         "drafter.k='abc' must be an int (stages.drafters.pld.PLDDrafter(k: int))"),
        ("drafter.k=2.5",
         "drafter.k=2.5 must be an int (stages.drafters.pld.PLDDrafter(k: int))"),
        ("drafter.k=true",
         "drafter.k=True must be an int (stages.drafters.pld.PLDDrafter(k: int))"),
        ("drafter.max_ngram=[3]", "drafter.max_ngram=[3] must be an int"),
    ],
)
def test_wrong_argument_type_from_the_command_line(override: str, message: str) -> None:
    cfg = _compose(["drafter=pld", override])
    with pytest.raises(ConfigError) as info:
        instantiate_checked("drafter", cfg.drafter)
    assert str(info.value).startswith(message)


def test_right_types_pass_and_int_is_a_float() -> None:
    cfg = _compose(
        ["drafter=pld", "drafter.k=3", "draft_length=adaptive", "draft_length.discount=1"]
    )
    assert instantiate_checked("drafter", cfg.drafter).k == 3
    assert instantiate_checked("draft_length", cfg.draft_length).discount == 1
    cfg = _compose(["draft_length=adaptive", "draft_length.discount=high"])
    with pytest.raises(
        ConfigError, match=r"draft_length\.discount='high' must be a float \(or an int\)"
    ):
        instantiate_checked("draft_length", cfg.draft_length)


def test_optional_and_list_arguments() -> None:
    node = {"_target_": "specflow.workload.SpecBench", "categories": ["qa"], "ids": [1, "2"]}
    check_node("workload", {**node, "limit": None, "max_turns": 2})
    with pytest.raises(ConfigError) as info:
        check_node("workload", {**node, "categories": "qa"})
    assert str(info.value) == (
        "workload.categories='qa' must be a list of str or null "
        "(specflow.workload.SpecBench(categories: list[str] | None)); got a str"
    )
    with pytest.raises(ConfigError, match=r"workload\.limit='3' must be an int or null"):
        check_node("workload", {**node, "limit": "3"})
    with pytest.raises(ConfigError, match=r"workload\.ids=\[1\.5\] must be a list of str \| int"):
        check_node("workload", {**node, "ids": [1.5]})


class Fake:
    """Annotations of every kind the check knows, and some it skips."""

    def __init__(
        self,
        flag: bool = False,
        name: str = "x",
        ratio: float = 0.5,
        options: Mapping[str, int] | None = None,
        mode: Literal["a", "b"] = "a",
        model: Any = None,
        other: Fake | None = None,
        unknown: NotImportedAnywhere = None,  # noqa: F821 - skipped: cannot be evaluated
    ) -> None:
        pass


TARGET = f"{__name__}.Fake"


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("flag", 1, "a bool (true/false)"),
        ("flag", "yes", "a bool (true/false)"),
        ("name", 3, "a string"),
        ("ratio", True, "a float (or an int)"),
        ("ratio", "0.5", "a float (or an int)"),
        ("options", [1], "a mapping or null"),
        ("mode", "c", "one of 'a', 'b'"),
    ],
)
def test_each_annotation_kind_is_checked(key: str, value: Any, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        check_node("stage", {"_target_": TARGET, key: value})
    assert str(info.value).startswith(f"stage.{key}={value!r} must be {expected} ({TARGET}({key}:")


def test_unchecked_annotations_are_skipped() -> None:
    check_node(
        "stage",
        {
            "_target_": TARGET,
            "flag": True,
            "name": "n",
            "ratio": 2,
            "options": {"a": 1},
            "mode": "b",
            "model": object(),
            "other": {"anything": 1},
            "unknown": 42,
        },
    )


# --- workloads ---------------------------------------------------------------------------


def test_malformed_jsonl_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "my.jsonl"
    path.write_text('{"turns": ["hi"]}\n\n{"prompt": "ok"}\n{"turns": ["a"],\n')
    with pytest.raises(ConfigError) as info:
        PromptFile(str(path)).requests()
    assert str(info.value).startswith(f"workload file {path}, line 4: not valid JSON")
    path.write_text('{"turns": ["hi"]}\n["a list"]\n')
    with pytest.raises(ConfigError, match=r"my\.jsonl, line 2: expected a JSON object, got list"):
        PromptFile(str(path)).requests()
    path.write_text('{"turns": ["hi"]}\n{"text": "no prompt"}\n')
    with pytest.raises(
        ConfigError, match=r"line 2: needs 'turns' or 'prompt' \(keys found: \['text'\]\)"
    ):
        PromptFile(str(path)).requests()
    path.write_text('{"turns": [1, 2]}\n')
    with pytest.raises(ConfigError, match=r"line 1: turns must be a string or a list of strings"):
        PromptFile(str(path)).requests()


def test_malformed_specbench_file_names_line(tmp_path: Path) -> None:
    path = tmp_path / "question.jsonl"
    good = {"question_id": 1, "category": "qa", "turns": ["What?"]}
    path.write_text(json.dumps(good) + "\n" + "not json\n")
    with pytest.raises(ConfigError, match=r"question\.jsonl, line 2: not valid JSON"):
        SpecBench(path=str(path)).requests()
    path.write_text(json.dumps(good) + "\n" + json.dumps({"question_id": 2, "turns": ["x"]}) + "\n")
    with pytest.raises(ConfigError, match=r"question\.jsonl, line 2: needs 'category'"):
        SpecBench(path=str(path)).requests()


@pytest.mark.parametrize("bad", ["", "   ", "\n\t "])
def test_empty_prompt_names_the_request(tmp_path: Path, bad: str) -> None:
    path = tmp_path / "p.jsonl"
    rows = [{"question_id": "a1", "turns": ["fine"]}, {"question_id": "b2", "turns": ["ok", bad]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ConfigError) as info:
        PromptFile(str(path)).requests()
    assert f"request 'b2' has an empty prompt (turn 2 of 2 is {bad!r})" in str(info.value)
    path.write_text(json.dumps({"question_id": "c3", "prompt": bad}) + "\n")
    with pytest.raises(ConfigError, match="request 'c3' has an empty prompt"):
        PromptFile(str(path)).requests()
    spec = tmp_path / "q.jsonl"
    spec.write_text(json.dumps({"question_id": 7, "category": "qa", "turns": [bad]}) + "\n")
    with pytest.raises(ConfigError, match="request '7' has an empty prompt"):
        SpecBench(path=str(spec)).requests()


def test_empty_workload_names_the_filters(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "hi", "category": "qa"}) + "\n")
    with pytest.raises(ConfigError) as info:
        PromptFile(str(path), limit=0).requests()
    assert str(info.value) == (
        f"workload {path}: no requests to decode (the source has 1; after the filters "
        "workload.limit=0); loosen the filters or check the file"
    )
    with pytest.raises(
        ConfigError, match=r"the source has 120; after the filters workload\.per_category=0"
    ):
        SpecBench(per_category=0).requests()
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    with pytest.raises(ConfigError, match=r"no requests to decode \(the source has 0\)"):
        PromptFile(str(empty)).requests()
    assert [r.request_id for r in PromptFile(str(path)).requests()] == ["0"]
