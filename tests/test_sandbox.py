"""The HumanEval sandbox: nothing escapes (files, network, processes) and only a program that
ran to its end passes. Each case runs under both isolation levels where this machine has
them: ``namespaces`` (unshare) and the weaker ``prelude``."""

from __future__ import annotations

import os
import shutil
import socket
import sys
import time
import uuid
from pathlib import Path

import pytest

from specflow.tasks import humaneval, sandbox

LINUX = sys.platform == "linux"


def _namespaces_available() -> bool:
    sandbox.isolation.cache_clear()
    try:
        return sandbox.isolation() == "namespaces"
    finally:
        sandbox.isolation.cache_clear()


HAVE_NS = LINUX and shutil.which("unshare") is not None and _namespaces_available()


@pytest.fixture(params=["namespaces", "prelude"])
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "namespaces":
        if not HAVE_NS:
            pytest.skip("no working `unshare` for user+net+mount+pid namespaces here")
        monkeypatch.delenv("SPECFLOW_SANDBOX", raising=False)
    else:
        monkeypatch.setenv("SPECFLOW_SANDBOX", "prelude")
    sandbox.isolation.cache_clear()
    yield request.param
    sandbox.isolation.cache_clear()


def _processes_with(marker: str) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                cmdline = Path(f"/proc/{name}/cmdline").read_bytes()
                state = Path(f"/proc/{name}/stat").read_bytes().rsplit(b")", 1)[1].split()[0]
            except OSError:
                continue
            if marker.encode() in cmdline and state not in (b"Z", b"X"):
                found.append(int(name))
    return found


@pytest.fixture(scope="module")
def problem0() -> dict:
    return humaneval.load_problems(limit=1)[0]


def test_isolation_level_is_reported(mode: str) -> None:
    result = humaneval.run_program("print('hi')\n")
    assert result.passed and result.status == "passed" and result.isolation == mode


def test_correct_solution_passes(mode: str, problem0: dict) -> None:
    code = humaneval.extract_code(problem0, problem0["canonical_solution"])
    result = humaneval.run_program(humaneval.build_program(problem0, code))
    assert (result.passed, result.status, result.returncode) == (True, "passed", 0)


def test_early_exit_zero_is_not_a_pass(mode: str, problem0: dict) -> None:
    for body in ("    import os\n    os._exit(0)\n", "    import sys\n    sys.exit(0)\n"):
        code = humaneval.extract_code(problem0, body)
        result = humaneval.run_program(humaneval.build_program(problem0, code))
        assert (result.passed, result.status, result.returncode) == (False, "incomplete", 0)
    # exiting at import time, before `check` is even defined
    early = "import os\nos._exit(0)\n" + problem0["prompt"] + problem0["canonical_solution"]
    result = humaneval.run_program(humaneval.build_program(problem0, early))
    assert (result.passed, result.status) == (False, "incomplete")
    assert not humaneval.check_correctness(problem0, "import os\nos._exit(0)\n")


def test_no_write_outside_the_temporary_folder(mode: str, tmp_path: Path) -> None:
    target = tmp_path / "escaped.txt"
    program = (
        "import os, sys\n"
        f"target = {str(target)!r}\n"
        "open('inside.txt', 'w').write('ok')\n"  # its own folder stays writable
        "assert open('inside.txt').read() == 'ok'\n"
        "try:\n"
        "    open(target, 'w').write('x')\n"
        "except OSError as exc:\n"
        "    print('refused:', type(exc).__name__, file=sys.stderr)\n"
        "else:\n"
        "    raise SystemExit('escaped')\n"
    )
    result = humaneval.run_program(program)
    assert result.passed, result.stderr_tail
    assert "refused: " in result.stderr_tail and not target.exists()


@pytest.mark.skipif(not HAVE_NS, reason="needs the namespace sandbox")
def test_no_write_outside_even_from_a_shell(tmp_path: Path) -> None:
    sandbox.isolation.cache_clear()
    target = tmp_path / "from_shell.txt"
    home = Path.home() / f".specflow-sandbox-test-{uuid.uuid4().hex}"
    program = (
        "import os\n"
        f"os.system('echo x > {target}; echo x > {home}; echo x > /tmp/specflow-escape-{uuid.uuid4().hex}')\n"  # noqa: E501
        f"os.system('echo x > {tmp_path}/../sibling-{target.name}')\n"
    )
    result = humaneval.run_program(program)
    assert result.passed and result.isolation == "namespaces"
    assert "Read-only file system" in result.stderr_tail
    assert not target.exists() and not home.exists()
    assert not (tmp_path.parent / f"sibling-{target.name}").exists()


def test_no_network(mode: str) -> None:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    program = (
        "import socket, sys\n"
        "try:\n"
        f"    socket.create_connection(('127.0.0.1', {port}), timeout=2).sendall(b'hi')\n"
        "except OSError as exc:\n"
        "    print('refused:', type(exc).__name__, exc, file=sys.stderr)\n"
        "else:\n"
        "    raise SystemExit('connected')\n"
    )
    try:
        result = humaneval.run_program(program)
        with pytest.raises(socket.timeout):  # nobody connected
            listener.accept()
    finally:
        listener.close()
    assert result.passed, result.stderr_tail
    assert "refused: " in result.stderr_tail


@pytest.mark.skipif(not LINUX, reason="/proc")
def test_setsid_grandchild_is_killed(mode: str, tmp_path: Path) -> None:
    marker = f"specflow-grandchild-{uuid.uuid4().hex}"
    late = tmp_path / "late.txt"
    program = (
        "import os, sys, time\n"
        "if os.fork() == 0:\n"
        "    try:\n"
        "        os.setsid()\n"
        "    except OSError:\n"
        "        pass\n"
        "    if os.fork() == 0:\n"
        '        code = \'import sys, time; time.sleep(2); open(sys.argv[1], "w").write("x")\'\n'
        f"        os.execv(sys.executable, [sys.executable, '-c', code, {str(late)!r}, {marker!r}])\n"  # noqa: E501
        "    os._exit(0)\n"
        "time.sleep(0.5)\n"  # the grandchild is running, reparented, in its own session
    )
    start = time.monotonic()
    result = humaneval.run_program(program, timeout_s=3.0)
    assert time.monotonic() - start < 8.0
    assert result.status == "passed"  # the program itself ended normally
    assert _processes_with(marker) == []
    time.sleep(2.5)  # longer than the grandchild's sleep
    assert not late.exists() and _processes_with(marker) == []


@pytest.mark.skipif(not LINUX, reason="/proc")
def test_setsid_grandchild_is_killed_on_timeout(mode: str) -> None:
    marker = f"specflow-daemon-{uuid.uuid4().hex}"
    program = (
        "import subprocess, sys, time\n"
        f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)', {marker!r}],"
        " start_new_session=True)\n"
        "time.sleep(60)\n"
    )
    start = time.monotonic()
    result = humaneval.run_program(program, timeout_s=1.0)
    assert time.monotonic() - start < 6.0
    assert (result.passed, result.status, result.returncode) == (False, "timeout", None)
    assert _processes_with(marker) == []


@pytest.mark.skipif(not LINUX, reason="/proc")
def test_fork_storm_is_contained(mode: str) -> None:
    marker = f"specflow-storm-{uuid.uuid4().hex}"
    program = (
        f"# {marker}\n"
        "import os, sys, time\n"
        f"os.execv(sys.executable, [sys.executable, '-c', '''\n"
        "import os, time\n"
        "while True:\n"
        "    try:\n"
        "        os.fork()\n"
        "    except OSError:\n"
        "        time.sleep(0.01)\n"
        f"''', {marker!r}])\n"
    )
    start = time.monotonic()
    result = humaneval.run_program(program, timeout_s=3.0)
    elapsed = time.monotonic() - start
    assert elapsed < 10.0
    assert not result.passed and result.status in ("process_limit", "timeout")
    # the watchdog ended it before the 3 s timeout (the status says which); the reaping after
    # it is not timed, as a loaded machine slows it
    assert result.status == "process_limit"
    time.sleep(0.2)
    assert _processes_with(marker) == []


def test_memory_and_cpu_limits_still_apply(mode: str) -> None:
    result = humaneval.run_program("x = bytearray(8 * 1024**3)\n", timeout_s=5.0)
    assert not result.passed and result.status == "failed"
    assert "MemoryError" in result.stderr_tail
