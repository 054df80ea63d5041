"""Run folders: torn lines, corrupt lines, fingerprints and a durable summary."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from specflow.errors import ConfigError
from specflow.results import run_folder
from specflow.results.records import RequestRecord, RunMeta
from specflow.results.run_folder import (
    CorruptRecordsError,
    RunFolder,
    read_records,
    results_fingerprint,
    summarize,
)
from tests.test_callbacks import fake_record


def _rec(i: int) -> RequestRecord:
    record = fake_record(i, "qa")
    record.request_id = f"q{i}"
    return record


def _line(i: int) -> bytes:
    """``_rec(i)`` as written in requests.jsonl (without the newline)."""
    return json.dumps(_rec(i).to_json()).encode()


def _write_lines(path: Path, records: list[RequestRecord], tail: bytes = b"") -> bytes:
    data = b"".join((json.dumps(r.to_json()) + "\n").encode() for r in records) + tail
    path.write_bytes(data)
    return data


def test_resume_repairs_a_torn_last_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "requests.jsonl"
    torn = b'{"request_id": "q2", "category": "qa", "te'
    whole = _write_lines(path, [_rec(0), _rec(1)], torn)
    with caplog.at_level(logging.WARNING, logger="specflow.results.run_folder"):
        folder = RunFolder(tmp_path, resume=True)
    assert folder.done_ids == {"q0", "q1"}
    assert path.read_bytes() == whole[: -len(torn)]  # truncated to the last newline
    warning = " ".join(r.getMessage() for r in caplog.records)
    assert f"{len(torn)} bytes" in warning and "torn last line" in warning and "q2" in warning
    folder.append(_rec(3))
    assert [r.request_id for r in read_records(path)] == ["q0", "q1", "q3"]
    assert path.read_bytes().endswith(_line(3) + b"\n") and path.read_bytes().count(b"\n") == 3


def test_a_whole_last_record_without_newline_is_kept(tmp_path: Path) -> None:
    path = tmp_path / "requests.jsonl"
    _write_lines(path, [_rec(0)], _line(1))
    assert [r.request_id for r in read_records(path)] == ["q0", "q1"]
    folder = RunFolder(tmp_path, resume=True)
    assert folder.done_ids == {"q0", "q1"}
    assert path.read_bytes().endswith(b"\n")


def test_append_starts_a_new_line_after_a_torn_one(tmp_path: Path) -> None:
    folder = RunFolder(tmp_path, resume=False)
    folder.requests_path.write_bytes(_line(0) + b"\n" + b'{"request_id": "q')
    folder.append(_rec(1))
    lines = folder.requests_path.read_bytes().split(b"\n")
    assert lines == [
        _line(0),
        b'{"request_id": "q',
        _line(1),
        b"",
    ]
    # the broken line is now in the middle: reading it is an error, not a silent skip
    with pytest.raises(CorruptRecordsError, match=r"requests\.jsonl, line 2: not a JSON record"):
        read_records(folder.requests_path)


def test_a_broken_middle_line_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "requests.jsonl"
    path.write_text(_line(0).decode() + "\n\n" + "{oops\n" + _line(1).decode() + "\n")
    with pytest.raises(CorruptRecordsError) as info:
        read_records(path)
    assert str(path) in str(info.value) and "line 3" in str(info.value)
    assert "{oops" in str(info.value)
    with pytest.raises(CorruptRecordsError, match="line 3"):
        RunFolder(tmp_path, resume=True)
    path.write_text(_line(0).decode() + "\n[1, 2]\n")
    with pytest.raises(CorruptRecordsError, match="line 2: expected a JSON object, got list"):
        read_records(path)


CFG = {
    "method": "pld",
    "resume": False,
    "model": {"name": "smollm2-135m", "dtype": "float32"},
    "drafter": {"_target_": "stages.pld.PromptLookupDrafter", "k": 4},
    "intermediate_verifier": None,
    "draft_length": {"_target_": "stages.draft_length.Fixed"},
    "target_verifier": {"_target_": "stages.full.FullVerifier"},
    "acceptor": {"_target_": "stages.exact.Exact"},
    "selector": {"_target_": "stages.single.Single"},
    "sampling": {"temperature": 0.0, "top_k": 0, "top_p": 1.0},
    "workload": {"_target_": "specflow.workload.SpecBench", "limit": 2},
    "callbacks": {"console": {"_target_": "callbacks.console.Console"}},
    "runner": {
        "max_new_tokens": 128,
        "seed": 0,
        "warmup": True,
        "threads": 2,
        "cache_dir": "/tmp/x",
        "use_chat_template": True,
        "system_prompt": None,
        "batch_size": 1,
        "device": "cpu",
        "dtype": None,
    },
}


def test_results_fingerprint_keeps_what_determines_results() -> None:
    fp = results_fingerprint(CFG)
    assert set(fp) == {
        "method",
        "model",
        "drafter",
        "intermediate_verifier",
        "draft_length",
        "target_verifier",
        "acceptor",
        "selector",
        "sampling",
        "workload",
        "runner",
    }
    assert fp["runner"] == {
        "max_new_tokens": 128,
        "seed": 0,
        "use_chat_template": True,
        "system_prompt": None,
        "batch_size": 1,
        "device": "cpu",
        "dtype": None,
    }
    other = json.loads(json.dumps(CFG))
    other["runner"].update(warmup=False, threads=8, cache_dir="/elsewhere")
    other["callbacks"] = {}
    other["resume"] = True
    assert results_fingerprint(other) == fp


def test_resume_with_other_settings_is_refused(tmp_path: Path) -> None:
    fp = results_fingerprint(CFG)
    folder = RunFolder(tmp_path, resume=False, fingerprint=fp)
    assert json.loads((tmp_path / "fingerprint.json").read_text()) == fp
    folder.append(_rec(0))
    folder.write_summary(summarize([_rec(0)], RunMeta(method="pld"), complete=True))
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    changed = json.loads(json.dumps(CFG))
    changed["drafter"]["k"] = 8
    changed["runner"]["max_new_tokens"] = 64
    changed["runner"]["threads"] = 16  # does not matter
    with pytest.raises(ConfigError) as info:
        RunFolder(tmp_path, resume=True, fingerprint=results_fingerprint(changed))
    msg = str(info.value)
    assert "drafter.k: 4 -> 8" in msg and "runner.max_new_tokens: 128 -> 64" in msg
    assert "2 key(s)" in msg and "threads" not in msg
    assert "new output folder" in msg and "original settings" in msg
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # nothing rewritten

    same = json.loads(json.dumps(CFG))
    same["runner"]["warmup"] = False
    resumed = RunFolder(tmp_path, resume=True, fingerprint=results_fingerprint(same))
    assert resumed.done_ids == {"q0"}


def test_fingerprint_added_and_removed_keys(tmp_path: Path) -> None:
    RunFolder(tmp_path, resume=False, fingerprint={"a": {"b": 1}, "c": 2})
    with pytest.raises(ConfigError, match=r"a\.b: 1 -> '<unset>'; a\.d: '<unset>' -> 3"):
        RunFolder(tmp_path, resume=True, fingerprint={"a": {"d": 3}, "c": 2})


def test_fresh_run_keeps_the_old_fingerprint_aside(tmp_path: Path) -> None:
    old = RunFolder(tmp_path, resume=False, fingerprint={"method": "ar"})
    old.append(_rec(0))
    RunFolder(tmp_path, resume=False, fingerprint={"method": "pld"})
    assert json.loads((tmp_path / "fingerprint.json").read_text()) == {"method": "pld"}
    aside = sorted(p.name for p in tmp_path.glob("fingerprint.*.json"))
    assert len(aside) == 1 and json.loads((tmp_path / aside[0]).read_text()) == {"method": "ar"}
    assert len(list(tmp_path.glob("requests.*.jsonl"))) == 1


def test_resume_of_a_folder_without_fingerprint_stores_one(tmp_path: Path) -> None:
    RunFolder(tmp_path, resume=False).append(_rec(0))
    folder = RunFolder(tmp_path, resume=True, fingerprint={"method": "pld"})
    assert folder.done_ids == {"q0"}
    assert json.loads((tmp_path / "fingerprint.json").read_text()) == {"method": "pld"}


def test_write_summary_fsyncs_file_and_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = RunFolder(tmp_path, resume=False)
    synced: list[str] = []
    real_fsync = os.fsync

    def spy(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}") if os.path.exists("/proc/self") else "?")
        real_fsync(fd)

    monkeypatch.setattr(run_folder.os, "fsync", spy)
    summary = summarize([_rec(0), _rec(1), _rec(2)], RunMeta(method="pld"), complete=True)
    target = folder.write_summary(summary)
    assert json.loads(target.read_text()) == summary.to_json()
    assert not (tmp_path / "summary.json.tmp").exists()
    if os.path.exists("/proc/self"):
        assert synced == [str(tmp_path / "summary.json.tmp"), str(tmp_path)]
    else:  # pragma: no cover
        assert len(synced) == 2
