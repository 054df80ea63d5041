"""``python -m train_heads.merge``'s argument parsing (merging itself:
tests/test_adapter_head.py::test_merge_heads_takes_each_exit_from_its_file)."""

from __future__ import annotations

import pytest

from train_heads.merge import main, parse_source


def test_parse_source():
    assert parse_source("a/heads.safetensors:4,14") == ("a/heads.safetensors", [4, 14])
    assert parse_source("a/heads.safetensors:7") == ("a/heads.safetensors", [7])
    assert parse_source("a/heads.safetensors") == ("a/heads.safetensors", None)
    assert parse_source("C:/x/heads.safetensors") == ("C:/x/heads.safetensors", None)


def test_a_missing_file_is_one_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="does not exist"):
        main([str(tmp_path / "out.safetensors"), str(tmp_path / "none.safetensors:4")])
