"""pyproject.toml: the dependencies are requirements*.txt's pins, and every package is found."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]


def _pins(path: Path) -> set[str]:
    out = set()
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line and not line.startswith("-r"):
            out.add(line)
    return out


@pytest.fixture(scope="module")
def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_dependencies_are_the_requirements(project: dict) -> None:
    meta = project["project"]
    assert set(meta["dependencies"]) == _pins(ROOT / "requirements.txt") | {"torch==2.13.0"}
    extras = meta["optional-dependencies"]
    assert set(extras["dev"]) == _pins(ROOT / "requirements-dev.txt") | _pins(
        ROOT / "train_heads" / "requirements.txt"
    ) | _pins(ROOT / "requirements-cluster.txt")
    assert set(extras["cluster"]) == _pins(ROOT / "requirements-cluster.txt")
    assert set(extras["train"]) == _pins(ROOT / "train_heads" / "requirements.txt")
    assert set(extras["llamacpp"]) == _pins(ROOT / "requirements-llamacpp.txt")
    assert [d.split("==")[0] for d in extras["gpu"]] == ["flash-attn"]
    assert all("==" in d for group in [meta["dependencies"], *extras.values()] for d in group)


def test_package_discovery_finds_every_package(project: dict) -> None:
    from setuptools import find_namespace_packages

    find = project["tool"]["setuptools"]["packages"]["find"]
    assert find["namespaces"] is True
    found = set(
        find_namespace_packages(str(ROOT), include=find["include"], exclude=find["exclude"])
    )
    expected = {
        "specflow",
        "specflow.models",  # no __init__.py: needs namespaces = true
        "specflow.cpu",
        "specflow.kv",
        "specflow.tasks",
        "specflow.data",
        "stages",
        "callbacks",
        "train_heads",
    }
    assert expected <= found, expected - found
    assert not {p for p in found if p.startswith(("tests", "train_heads.tests", "conf"))}
    for path in ("specflow/data/specbench/question.dev.jsonl", "train_heads/conf/config.yaml",
                 "specflow/cpu/kernels/rows_linear.cpp"):
        package, rest = path.split("/", 1)
        patterns = project["tool"]["setuptools"]["package-data"][package]
        root = ROOT / package
        assert any((root / rest) in root.glob(p) for p in patterns), path
