"""Layering: what the core's modules may import.

- The core (``specflow/``) never imports ``callbacks``, ``stages`` or ``train_heads``: it meets
  them only through config (``_target_`` strings) and protocols (the README's "How it
  works").
- No import circle inside ``specflow/``, nor inside ``train_heads/``: every import counts,
  type-only and lazy (in a function) ones included.
- ``specflow/models/`` imports nothing of ``specflow/kv/`` but ``kv/base`` (the protocols the
  models implement), and ``specflow/kv/`` never imports ``specflow/models/``.
- The stage protocols (``specflow.protocols``) reach nothing of ``specflow/models/``, even
  through other modules, and no model imports them.
- ``specflow/cpu/``: the detection and the kernels import nothing of ``specflow/models/``;
  the row probe and the whole-pass check, which measure a loaded native model, import
  ``specflow.models.native`` and nothing else of ``models/``.
- A stage (``stages/<role>/``) imports ``specflow`` and, of the repository's own packages,
  only its own role's package: never another role, ``callbacks``, ``train_heads`` or ``run``.

Every ``.py`` under ``specflow/`` and ``stages/`` is parsed with ``ast`` (not imported), so a
forbidden import anywhere, even inside a function or an ``if TYPE_CHECKING:`` block, fails
here.
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


def module_name(path: Path, root: Path = ROOT) -> str:
    """``specflow/kv/base.py`` -> ``specflow.kv.base`` (a package: its ``__init__``)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``source`` (module ``module``) imports, anywhere in it.

    ``from a.b import c`` counts as an import of ``a.b.c`` when that is a module, else of
    ``a.b``; relative imports are resolved against ``module``'s package; an import of a
    name below a known module (``a.b.C``) counts as ``a.b``.
    """
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                     for a in node.names]
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


def import_graph(root: Path = ROOT, package: str = "specflow") -> dict[str, set[str]]:
    """``module -> the modules of `package` it imports`` for every module under
    ``<root>/<package>/`` (its tests left out)."""
    files = {module_name(p, root): p for p in (root / package).rglob("*.py")
             if "__pycache__" not in p.parts and "tests" not in p.relative_to(root).parts}
    known = set(files)
    return {
        mod: imported_modules(path.read_text(), mod, path.name == "__init__.py", known)
        for mod, path in files.items()
    }


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), sorted: each is
    a set of modules that import each other, directly or around a circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(circles)


def test_no_import_circle_in_the_core():
    circles = import_circles(import_graph())
    assert circles == [], f"modules of specflow/ that import each other: {circles}"


def test_no_import_circle_in_train_heads():
    """The training jobs share their set-up through one module (``train_heads.job_setup``)
    instead of importing each other; lazy imports count."""
    circles = import_circles(import_graph(package="train_heads"))
    assert circles == [], f"modules of train_heads/ that import each other: {circles}"


def test_models_meet_kv_only_through_its_base():
    graph = import_graph()
    bad = sorted(
        f"{mod} -> {dep}"
        for mod, deps in graph.items()
        for dep in deps
        if (mod.startswith("specflow.models.") and dep.startswith("specflow.kv")
            and dep != "specflow.kv.base")
        or (mod.startswith("specflow.kv") and dep.startswith("specflow.models"))
    )
    assert bad == [], bad


def test_circle_finder_finds_the_circles_it_should(tmp_path: Path):
    """A type-only circle, a lazy one and a three-module one are found; a chain is not."""
    pkg = tmp_path / "specflow"
    (pkg / "kv").mkdir(parents=True)
    sources = {
        "a.py": "import typing\nif typing.TYPE_CHECKING:\n    from specflow.b import B\n",
        "b.py": "import specflow.a\n",
        "c.py": "def f():\n    from specflow import d\n",
        "d.py": "from specflow.c import f\n",
        "kv/__init__.py": "",
        "kv/x.py": "from .y import Y\n",
        "kv/y.py": "from specflow.kv import z\n",
        "kv/z.py": "from ..kv.x import X\n",
        "e.py": "from specflow.a import A\n",
    }
    for name, text in sources.items():
        (pkg / name).write_text(text)
    circles = import_circles(import_graph(tmp_path))
    assert circles == [
        ["specflow.a", "specflow.b"],
        ["specflow.c", "specflow.d"],
        ["specflow.kv.x", "specflow.kv.y", "specflow.kv.z"],
    ]


def test_core_files_found():
    files = {p.relative_to(CORE).as_posix() for p in core_files()}
    assert {"__init__.py", "engine.py", "results/metrics.py", "results/compare.py"} <= files


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
        "import specflow.results.metrics",
        "from specflow.results import metrics as m",
        "from . import results",
        "from .callbacks import x",  # relative: inside specflow, not the top-level package
        "import stages_extra",
        "target = 'callbacks.console.ConsoleTable'",  # a config string, not an import
    ],
)
def test_checker_allows_core_imports(source: str):
    assert not forbidden_imports(source)


# ------------------------------------------------------------ the stage protocols, the CPU
def _deps(graph: dict[str, set[str]], module: str) -> set[str]:
    """Every module of ``graph`` that ``module`` imports, directly or through others."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        for dep in graph[todo.pop()]:
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def test_models_do_not_import_the_stage_protocols():
    """``specflow.protocols`` declares the roles stages play; the models implement the
    ``kv.base`` protocols and never climb up to the stages' roles."""
    graph = import_graph()
    bad = sorted(f"{mod} -> {dep}" for mod, deps in graph.items() for dep in deps
                 if mod.startswith("specflow.models.") and dep == "specflow.protocols")
    assert bad == [], bad


def test_stage_protocols_reach_no_model():
    """``specflow.protocols`` (and all it imports) imports nothing of ``specflow/models/``
    (nor the row probe): it types what it needs against ``kv.base`` and ``specflow.costs``."""
    graph = import_graph()
    bad = sorted(d for d in _deps(graph, "specflow.protocols")
                 if d.startswith("specflow.models") or d == "specflow.cpu.row_padding")
    assert bad == [], f"specflow.protocols reaches {bad}"


def test_results_sit_below_the_runner():
    """``specflow/results/`` (records, the run folder, metrics, comparisons) is what the
    runner and the app write through: nothing in it imports the runner, the app or the
    config composition."""
    graph = import_graph()
    above = {"specflow.runner", "specflow.app", "specflow.config"}
    bad = sorted(f"{mod} -> {dep}" for mod, deps in graph.items() for dep in deps
                 if mod.startswith("specflow.results") and dep in above)
    assert bad == [], bad
    assert any(mod.startswith("specflow.results.") for mod in graph)


def test_cpu_package_reaches_models_only_to_measure_a_native_model():
    """``specflow/cpu/``: the detection and the kernels import nothing of ``specflow/models/``;
    the row probe and the whole-pass check measure a loaded native model and import
    ``specflow.models.native``, nothing else of ``models/`` (the package doc)."""
    graph = import_graph()
    measuring = {"specflow.cpu.row_padding", "specflow.cpu.whole_pass"}
    bad = sorted(
        f"{mod} -> {dep}"
        for mod, deps in graph.items() if mod == "specflow.cpu" or mod.startswith("specflow.cpu.")
        for dep in deps if dep.startswith("specflow.models")
        and not (mod in measuring and dep == "specflow.models.native")
    )
    assert bad == [], bad


STAGES = ROOT / "stages"


def stage_files() -> list[Path]:
    return sorted(p for p in STAGES.rglob("*.py") if "__pycache__" not in p.parts)


def _top_level_imports(source: str) -> list[tuple[int, str]]:
    """``(line, module)`` of every absolute import in ``source`` (anywhere in it)."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.ImportFrom) and node.level:
            found.append((node.lineno, "." * node.level + (node.module or "")))
    return found


# The repository's own top-level packages and modules, besides ``specflow``.
OWN = ("stages", "callbacks", "train_heads", "tests", "run", "scripts", "conf")


@pytest.mark.parametrize("path", stage_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_stages_import_only_the_core_and_their_own_role(path: Path):
    """A stage imports ``specflow`` and, of ``stages``, only its own role's package
    (``stages/drafters/`` its drafter helpers, ``stages/drafters/token_tree/`` its tables):
    never another role's package, ``callbacks``, ``train_heads`` or ``run``."""
    rel = path.relative_to(STAGES).parts
    role = f"stages.{rel[0]}" if len(rel) > 1 else None
    bad = []
    for line, name in _top_level_imports(path.read_text()):
        top = name.split(".")[0]
        if name.startswith("."):
            bad.append(f"{line}: {name} (relative)")
        elif top in OWN and not (role and (name == role or name.startswith(role + "."))):
            bad.append(f"{line}: {name}")
    assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_stage_files_found():
    roles = {p.relative_to(STAGES).parts[0] for p in stage_files() if p.parent != STAGES}
    assert roles == {"acceptors", "drafters", "draft_length", "selectors", "verifiers"}
