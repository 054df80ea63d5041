"""The user documentation (README.md, docs/*.md, docs/records/*.md, train_heads/README.md)
names only what exists: every repository path in backticks or links, every ``scripts/``
script, every config group and option (``group=option``, ``+experiment=NAME``), every
``python -m MODULE``; each cheap fenced command (``run.py --cfg job ...``, ``--help``) runs;
"Adding a stage" lists exactly the members each protocol of ``specflow/protocols.py``
declares; every ``docs/`` file that code, configs and scripts point to exists; and no
document, config, script or source file speaks of how the project was made (issue or
session numbers, section signs into a lab notebook, paths outside the repository).  Fast:
no model is loaded."""

from __future__ import annotations

import ast
import importlib.util
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
        *sorted((ROOT / "docs" / "records").glob("*.md")), ROOT / "train_heads" / "README.md"]
# Top-level entries of the repository: a path is checked when it starts with one of them.
TOP = {p.name for p in ROOT.iterdir() if not p.name.startswith(".")} - {"outputs"}
CONF_DIRS = [ROOT / "conf", ROOT / "train_heads" / "conf"]
GROUPS = {p.name for d in CONF_DIRS for p in d.iterdir() if p.is_dir()}
PLACEHOLDER = re.compile(r"my_|<|\*|\{|\$|\.\.\.")

FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
INLINE = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
OPTION = re.compile(r"(?<![\w.\-/])\+?([a-z_]+)=([\w.\-|]+)")
MODULE = re.compile(r"python[\d.]* -m ([\w.]+)")


def _text(doc: Path) -> str:
    return doc.read_text()


def _code(doc: Path) -> list[str]:
    """Inline code spans and the lines of fenced blocks (comments dropped)."""
    text = _text(doc)
    lines = [line.split("  #")[0] for block in FENCE.findall(text)
             for line in block.splitlines()]
    return [*INLINE.findall(FENCE.sub("", text)), *lines]


def _words(doc: Path) -> list[str]:
    return [w.strip("'\",;:()[]") for span in _code(doc) for w in span.split()]


def _params(fn) -> list[tuple[str, str]]:
    return [pytest.param(doc, item, id=f"{doc.relative_to(ROOT)}:{item}")
            for doc in DOCS for item in sorted(set(fn(doc)))]


def _paths(doc: Path) -> list[str]:
    out = []
    for word in _words(doc):
        word = word.split("=")[-1].rstrip(".")
        head = word.split("/")[0]
        if ("/" in word or "." in word) and head in TOP and not PLACEHOLDER.search(word):
            out.append(word)
    return out


def _links(doc: Path) -> list[str]:
    return [t for t in LINK.findall(_text(doc))
            if not re.match(r"[a-z]+:", t) and not t.startswith("#")]


def _options(doc: Path) -> list[str]:
    out = []
    for span in _code(doc):
        for group, value in OPTION.findall(span):
            if group in GROUPS and not PLACEHOLDER.search(value) and not value.isupper():
                out += [f"{group}={v}" for v in value.split("|")]
    return out


def _modules(doc: Path) -> list[str]:
    return [m for span in _code(doc) for m in MODULE.findall(span)]


def _cheap_commands(doc: Path) -> list[str]:
    out = []
    for block in FENCE.findall(_text(doc)):
        for line in block.splitlines():
            line = line.split("  #")[0].strip()
            if "python" in line and ("--cfg job" in line or "--help" in line.split()):
                out.append(line)
    return out


def test_documents_are_found():
    names = {d.name for d in DOCS}
    assert {"README.md", "usage.md", "methods.md", "performance.md", "heads.md",
            "gpu.md"} <= names
    assert len(ROOT.joinpath("README.md").read_text().splitlines()) <= 200


@pytest.mark.parametrize("doc,path", _params(_paths))
def test_paths_exist(doc: Path, path: str):
    path, _, test = path.partition("::")  # a pytest node id: the file and its test
    assert (ROOT / path).exists(), f"{doc.name} names {path}, which does not exist"
    if test:
        assert f"def {test.split('::')[-1]}(" in (ROOT / path).read_text(), f"{doc.name}: {test}"


@pytest.mark.parametrize("doc,target", _params(_links))
def test_links_resolve(doc: Path, target: str):
    path = target.split("#")[0]
    assert (doc.parent / path).exists(), f"{doc.name} links {target}, which does not exist"


@pytest.mark.parametrize("doc,option", _params(_options))
def test_config_options_exist(doc: Path, option: str):
    group, value = option.split("=")
    if value in ("null", "none") and not any((d / group / "none.yaml").exists()
                                             for d in CONF_DIRS):
        return
    found = [d / group / f"{value}.yaml" for d in CONF_DIRS if (d / group).is_dir()]
    assert any(p.exists() for p in found), f"{doc.name}: no config {option} ({found})"


def test_every_config_group_is_documented():
    readme = (ROOT / "README.md").read_text()
    for group in sorted(p.name for p in (ROOT / "conf").iterdir() if p.is_dir()):
        assert f"`conf/{group}/`" in readme, f"README.md does not list conf/{group}/"


@pytest.mark.parametrize("doc,module", _params(_modules))
def test_modules_exist(doc: Path, module: str):
    rel = Path(*module.split("."))
    if (ROOT / rel.parts[0]).exists():
        assert any((ROOT / p).exists() for p in
                   (rel.with_suffix(".py"), rel / "__main__.py")), f"{doc.name}: {module}"
    else:
        assert importlib.util.find_spec(rel.parts[0]) is not None, f"{doc.name}: {module}"


@pytest.mark.parametrize("doc,command", _params(_cheap_commands))
def test_cheap_commands_run(doc: Path, command: str):
    argv = shlex.split(command)
    assert argv[0].endswith("python"), command
    done = subprocess.run([sys.executable, *argv[1:]], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, f"{doc.name}: {command}\n{done.stderr[-2000:]}"


def _protocol_members() -> dict[str, list[str]]:
    tree = ast.parse((ROOT / "specflow" / "protocols.py").read_text())
    classes = {c.name: c for c in tree.body if isinstance(c, ast.ClassDef)}

    def bases(c: ast.ClassDef) -> list[str]:
        return [b.id for b in c.bases if isinstance(b, ast.Name)]

    def members(c: ast.ClassDef) -> list[str]:
        out = [m for b in bases(c) if b in classes for m in members(classes[b])]
        for node in c.body:
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                out.append(node.target.id)
            elif isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                out.append(node.name)
        return out

    return {name: sorted(set(members(c))) for name, c in classes.items()
            if "Protocol" in bases(c)}


def test_adding_a_stage_lists_every_protocol_member():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Adding a stage", 1)[1].split("\n## ", 1)[0]
    listed = {}
    for row in re.findall(r"^\s*\|\s*`(\w+)`[^|]*\|(.*)\|\s*$", section, re.M):
        listed[row[0]] = sorted({re.match(r"\w+", m).group(0) for m in INLINE.findall(row[1])})
    protocols = _protocol_members()
    assert protocols, "no protocol found in specflow/protocols.py"
    assert listed == protocols


# Text files of the product: every document, config, script and source file.
SOURCES = sorted(
    p for top in ("conf", "specflow", "stages", "callbacks", "scripts", "train_heads", "tests",
                  "docs", ".ci")
    for p in (ROOT / top).rglob("*")
    if p.is_file() and p.suffix in {".py", ".yaml", ".md", ".sh", ".txt", ""}
    and "__pycache__" not in p.parts
) + [ROOT / "README.md", ROOT / "run.py", ROOT / "pyproject.toml"]
# How the project was made: issue and session numbers, section signs (a lab notebook's
# sections), paths into a folder outside the repository.
LAB = re.compile(r"session [0-9]|(first|second|third|[a-z]+th) session|#[0-9]{1,3}\b"
                 r"|issue ?#?[0-9]|\u00a7|\.\./shared", re.I)
DOCS_PATH = re.compile(r"(?<![\w/.])docs/[\w./-]*[\w/]")


def _lab_lines(path: Path) -> list[str]:
    return [f"{path.relative_to(ROOT)}:{i}: {line.strip()}"
            for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
            if LAB.search(line)]


def test_nothing_speaks_of_how_the_project_was_made():
    found = [hit for p in SOURCES for hit in _lab_lines(p)]
    assert not found, "\n".join(found)


def test_docs_paths_named_in_code_and_configs_exist():
    missing = []
    for p in SOURCES:
        if p.suffix not in {".py", ".yaml", ".sh"} or p == Path(__file__).resolve():
            continue
        for path in DOCS_PATH.findall(p.read_text()):
            if not (ROOT / path.rstrip(".")).exists():
                missing.append(f"{p.relative_to(ROOT)}: {path}")
    assert not missing, "\n".join(missing)
