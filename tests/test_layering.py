"""Layering: the core (``specflow/``) never imports ``callbacks``, ``stages`` or ``train_heads``.

The core meets those packages only through config (``_target_`` strings) and protocols
(the README's "How it works").  Every ``.py`` under ``specflow/`` is parsed with ``ast`` (not
imported), so a forbidden import anywhere, even inside a function, fails here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "specflow"
FORBIDDEN = ("callbacks", "stages", "train_heads")


def forbidden_imports(source: str, filename: str = "<string>") -> list[str]:
    """``"line: module"`` for each import of a forbidden top-level package in ``source``.

    Covers ``import x``, ``from x import y`` and ``importlib.import_module("x...")`` /
    ``__import__("x...")`` with a literal name; relative imports stay inside the package.
    """
    found: list[str] = []
    for node in ast.walk(ast.parse(source, filename)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            arg = node.args[0]
            if called in ("import_module", "__import__") and isinstance(arg, ast.Constant) \
                    and isinstance(arg.value, str):
                names = [arg.value]
        found += [f"{node.lineno}: {n}" for n in names if n.split(".")[0] in FORBIDDEN]
    return found


def core_files() -> list[Path]:
    return sorted(p for p in CORE.rglob("*.py") if "__pycache__" not in p.parts)


def test_core_files_found():
    files = {p.relative_to(CORE).as_posix() for p in core_files()}
    assert {"__init__.py", "engine.py", "metrics.py", "compare.py"} <= files


@pytest.mark.parametrize("path", core_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_core_does_not_import_outer_packages(path: Path):
    bad = forbidden_imports(path.read_text(), str(path))
    assert not bad, f"{path.relative_to(ROOT)} imports {bad}; the core may not import {FORBIDDEN}"


@pytest.mark.parametrize(
    "source",
    [
        "import callbacks",
        "import stages.drafters as d",
        "from callbacks.plots import pyplot",
        "from train_heads import train",
        "def f():\n    from stages import x\n",
        "import importlib\nimportlib.import_module('callbacks.console')",
        "__import__('train_heads.train')",
    ],
)
def test_checker_catches_forbidden_imports(source: str):
    assert forbidden_imports(source)


@pytest.mark.parametrize(
    "source",
    [
        "import specflow.metrics",
        "from specflow import metrics as m",
        "from . import results",
        "from .callbacks import x",  # relative: inside specflow, not the top-level package
        "import stages_extra",
        "target = 'callbacks.console.ConsoleTable'",  # a config string, not an import
    ],
)
def test_checker_allows_core_imports(source: str):
    assert not forbidden_imports(source)
