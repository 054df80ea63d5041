"""Run an untrusted Python program in a subprocess: no network, no writes outside a fresh
temporary folder, a process cap, a wall-clock timeout, and the whole process tree killed.

Two isolation levels; ``isolation()`` says which one this machine gets (probed once):

- ``"namespaces"`` (Linux with a working ``unshare`` for unprivileged user namespaces): the
  program runs in new user, network, mount and PID namespaces. The network namespace has
  only a loopback interface that is down: no connection to anything, the host's
  127.0.0.1 included. In the mount namespace every mount is remounted read-only except the
  program's temporary folder. The program is PID 1 of its PID namespace, so when it exits
  or is killed the kernel kills every process it started, ``setsid`` daemons included.
- ``"prelude"`` (no namespaces): Python-level guards installed before the program runs
  (``socket`` refused, ``open``/``os`` writes outside the folder refused, ``os.setsid``
  refused) and descendants tracked by polling ``/proc`` (parent links, session and process
  group). This stops accidents, not a determined program: ``ctypes``, ``_socket``, a shell
  started with ``os.system`` or a double fork between two polls get around it.

Both: cwd, ``HOME`` and ``TMPDIR`` are the temporary folder, ``python -I`` (no user site,
no ``PYTHON*`` variables), stdin closed, a minimal environment, rlimits (address space, CPU
seconds, file size, no core dumps, ``RLIMIT_NPROC``), a new session, and a watchdog that
kills the tree when it holds more than ``max_processes`` processes (``RLIMIT_NPROC`` is not
enforced for root, so the watchdog is the cap there).
"""

from __future__ import annotations

import functools
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

if os.name == "posix":
    import resource

LAUNCHER = Path(__file__).with_name("_sandbox_launcher.py")
SETUP_FAILED = 121  # keep in sync with _sandbox_launcher.SETUP_FAILED
MEMORY_LIMIT_BYTES = 2 * 1024**3
FILE_SIZE_LIMIT_BYTES = 16 * 1024**2
MAX_PROCESSES = 32
POLL_S = 0.005  # the watchdog's first poll interval, growing to MAX_POLL_S
MAX_POLL_S = 0.05
UNSHARE_ARGS = (
    "--user",
    "--map-root-user",
    "--net",
    "--mount",
    "--pid",
    "--fork",
    "--kill-child",
    "--mount-proc",
)


@dataclass(frozen=True)
class SandboxRun:
    """How a sandboxed program ended."""

    returncode: int | None  # None: killed (timeout or process limit)
    status: str  # "exited", "timeout" or "process_limit"
    stdout: str
    stderr: str
    isolation: str  # "namespaces" or "prelude"


@functools.lru_cache(maxsize=1)
def isolation() -> str:
    """``"namespaces"`` when a probe of the namespace sandbox succeeds here, else
    ``"prelude"``. Set ``SPECFLOW_SANDBOX=prelude`` to force the weaker one (tests)."""
    if os.environ.get("SPECFLOW_SANDBOX") == "prelude" or sys.platform != "linux":
        return "prelude"
    unshare = shutil.which("unshare")
    if unshare is None:
        return "prelude"
    with tempfile.TemporaryDirectory(prefix="specflow-sandbox-probe-") as base:
        work = Path(base, "work")
        work.mkdir()
        try:
            probe = subprocess.run(
                [unshare, *UNSHARE_ARGS, sys.executable, "-I", str(LAUNCHER), "probe", str(work)],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=30,
            )
        except (OSError, subprocess.TimeoutExpired):
            return "prelude"
    return "namespaces" if probe.returncode == 0 and probe.stdout.strip() == "ok" else "prelude"


def _rlimits(timeout_s: float, memory_bytes: int, nproc: int) -> list[tuple[int, int]]:
    """The (kind, value) resource limits, each capped at this process's hard limit."""
    wanted = [
        (resource.RLIMIT_AS, memory_bytes),
        (resource.RLIMIT_CPU, max(1, math.ceil(timeout_s))),
        (resource.RLIMIT_FSIZE, FILE_SIZE_LIMIT_BYTES),
        (resource.RLIMIT_CORE, 0),
        (resource.RLIMIT_NPROC, nproc),
    ]
    limits = []
    for kind, value in wanted:
        hard = resource.getrlimit(kind)[1]
        limits.append((kind, value if hard == resource.RLIM_INFINITY else min(value, hard)))
    return limits


def _apply_rlimits(limits: list[tuple[int, int]]) -> None:
    """``preexec_fn``: runs between fork and exec, so it only calls ``setrlimit``."""
    for kind, value in limits:
        resource.setrlimit(kind, (value, value))


def _proc_table() -> dict[tuple[int, int], tuple[int, int, int]]:
    """(pid, start time) -> (ppid, process group, session) of every live (not zombie)
    process in /proc; the start time tells a reused pid from the process once seen."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2 :].split()
        if fields[0] in (b"Z", b"X"):
            continue
        table[(int(name), int(fields[19]))] = (int(fields[1]), int(fields[2]), int(fields[3]))
    return table


def _user_tasks() -> int:
    """Tasks (threads) of this real uid: what ``RLIMIT_NPROC`` counts (0 off Linux)."""
    if not os.path.isdir("/proc"):
        return 0
    uid, count = os.getuid(), 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.stat(f"/proc/{name}").st_uid == uid:
                    count += len(os.listdir(f"/proc/{name}/task"))
            except OSError:
                continue
    return count


class _Tree:
    """The processes of one sandbox: descendants of ``root`` (and anything in its session or
    process group), remembered once seen so that orphans stay tracked."""

    def __init__(self, root: int) -> None:
        self.root = root
        self.known: set[tuple[int, int]] = set()

    def scan(self) -> set[int]:
        """The pids of the tree's live processes (the root included while alive)."""
        table = _proc_table()
        alive = {key for key in table if key in self.known or key[0] == self.root}
        pids = {pid for pid, _ in alive}
        changed = True
        while changed:
            changed = False
            for key, (ppid, pgid, sid) in table.items():
                if key not in alive and (ppid in pids or self.root in (pgid, sid)):
                    alive.add(key)
                    pids.add(key[0])
                    changed = True
        self.known |= alive
        return pids

    def kill(self) -> None:
        """SIGKILL the process group and every tracked process until none is left."""
        for _ in range(100):  # forks can race a scan: repeat until the tree is empty
            try:
                os.killpg(self.root, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            alive = self.scan() if os.path.isdir("/proc") else set()
            alive.discard(self.root)  # the Popen child: killed above, reaped by wait()
            if not alive:
                return
            for pid in alive:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            time.sleep(POLL_S)


def run_sandboxed(
    program: str,
    timeout_s: float = 5.0,
    memory_bytes: int = MEMORY_LIMIT_BYTES,
    max_processes: int = MAX_PROCESSES,
) -> SandboxRun:
    """Run ``program`` (Python source) as described in the module doc."""
    posix = os.name == "posix"
    mode = isolation() if posix else "prelude"
    linux = os.path.isdir("/proc")
    with tempfile.TemporaryDirectory(prefix="specflow-sandbox-") as base:
        workdir = Path(base, "work")
        workdir.mkdir()
        script = workdir / "program.py"
        script.write_text(program, encoding="utf-8")
        stdout_path, stderr_path = Path(base, "stdout.txt"), Path(base, "stderr.txt")
        env = {
            "PATH": os.environ.get("PATH", os.defpath),
            "HOME": str(workdir),
            "TMPDIR": str(workdir),
            "LANG": "C.UTF-8",
            "PYTHONHASHSEED": "0",
        }
        launch = [sys.executable, "-I", str(LAUNCHER), "ns" if mode == "namespaces" else mode]
        command = [*launch, str(workdir), str(script)]
        if mode == "namespaces":
            command = [shutil.which("unshare") or "unshare", *UNSHARE_ARGS, *command]
        limits = []
        if posix:
            limits = _rlimits(timeout_s, memory_bytes, _user_tasks() + max_processes)
        with open(stdout_path, "wb") as stdout, open(stderr_path, "wb") as stderr:
            process = subprocess.Popen(
                command,
                cwd=workdir,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=stdout,
                stderr=stderr,
                start_new_session=posix,
                preexec_fn=(lambda: _apply_rlimits(limits)) if posix else None,  # noqa: PLW1509
            )
            tree = _Tree(process.pid)
            deadline = time.monotonic() + timeout_s
            status, returncode = "exited", None
            poll = POLL_S
            try:
                while True:
                    try:
                        returncode = process.wait(timeout=poll)
                        break
                    except subprocess.TimeoutExpired:
                        poll = min(poll * 1.5, MAX_POLL_S)
                    if linux and len(tree.scan()) > max_processes + 2:  # + unshare, launcher
                        status = "process_limit"
                        break
                    if time.monotonic() > deadline:
                        status = "timeout"
                        break
            finally:
                if posix:
                    tree.kill()
                else:  # pragma: no cover - not exercised on POSIX
                    process.kill()
                process.wait()
            if status != "exited":
                returncode = None
        out = stdout_path.read_bytes().decode("utf-8", errors="replace")
        err = stderr_path.read_bytes()[-4000:].decode("utf-8", errors="replace")
    if returncode == SETUP_FAILED and "specflow-sandbox: setup failed" in err:
        raise RuntimeError(f"the {mode} sandbox could not be set up: {err.strip()[-500:]}")
    return SandboxRun(returncode, status, out, err, mode)
