"""``prepare.gguf_path`` hashes a GGUF file once per path: its ``.sha256`` note keeps a line
per path, so two checkouts sharing one cache (each with its own package copy) do not hash
again and again in turn, and a changed file is hashed again."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from specflow.models import prepare


def fake_entry(file: Path) -> SimpleNamespace:
    source = SimpleNamespace(part_paths=lambda: [file])
    return SimpleNamespace(name="tiny", gguf_file="tiny.gguf", source=source,
                           sha256=hashlib.sha256(file.read_bytes()).hexdigest(),
                           missing_modules=lambda: [])


def test_each_path_is_hashed_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = tmp_path / "a" / "tiny.gguf", tmp_path / "b" / "tiny.gguf"
    for f in (a, b):
        f.parent.mkdir()
        f.write_bytes(b"GGUF tiny")
    entries = {"a": fake_entry(a), "b": fake_entry(b)}
    hashed: list[Path] = []
    real_hash = prepare.sha256_file
    monkeypatch.setattr(prepare, "check_installed", lambda entry: None)
    monkeypatch.setattr(prepare, "sha256_file",
                        lambda path, progress: hashed.append(path) or real_hash(path, False))
    cache = tmp_path / "cache"
    for name in ("a", "b", "a", "b", "a"):
        monkeypatch.setattr(prepare, "get_entry", lambda _, n=name: entries[n])
        assert prepare.gguf_path("tiny", cache, progress=False) == (a if name == "a" else b)
    assert hashed == [a, b]
    note = (cache / "gguf" / "tiny.gguf.sha256").read_text().splitlines()
    assert [line.split()[-1] for line in note] == [str(a), str(b)]
    os.utime(b, ns=(1, 1))  # touched (another mtime): hashed again, its line replaced
    monkeypatch.setattr(prepare, "get_entry", lambda _: entries["b"])
    assert prepare.gguf_path("tiny", cache, progress=False) == b
    assert hashed == [a, b, b]
    assert len((cache / "gguf" / "tiny.gguf.sha256").read_text().splitlines()) == 2
