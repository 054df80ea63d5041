"""Runs inside the sandbox, before the untrusted program (stdlib only; run as a script).

    python -I _sandbox_launcher.py MODE WORKDIR PROGRAM

``ns``: already inside fresh user, network, mount and PID namespaces (``unshare``): make
``WORKDIR`` a mount of its own, remount every other mount read-only, check that writing
outside ``WORKDIR`` fails and that there is no network interface but loopback, then exec
``python -I PROGRAM`` (it stays PID 1 of the namespace, so everything it starts dies with it).

``probe``: the ``ns`` setup with a temporary WORKDIR, then print ``ok`` and exit.

``prelude``: no namespaces on this platform: install Python-level guards (no sockets, no
writes outside ``WORKDIR``, no new sessions) and run PROGRAM in this interpreter. These
guards stop accidents and naive programs, not a determined one (``ctypes``, ``_socket``,
``_posixsubprocess``, a child process such as ``os.system`` all bypass them).
"""

from __future__ import annotations

import os
import sys

SETUP_FAILED = 121  # exit code: the sandbox could not be set up (nothing of PROGRAM ran)

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC = 32, 4096, 16384
MS_NOATIME, MS_NODIRATIME, MS_RELATIME, MS_STRICTATIME = 1024, 2048, 1 << 21, 1 << 24
_FLAG_OPTIONS = {
    "nosuid": MS_NOSUID,
    "nodev": MS_NODEV,
    "noexec": MS_NOEXEC,
    "noatime": MS_NOATIME,
    "nodiratime": MS_NODIRATIME,
    "relatime": MS_RELATIME,
    "strictatime": MS_STRICTATIME,
}


def _fail(message: str) -> None:
    sys.stderr.write(f"specflow-sandbox: setup failed: {message}\n")
    sys.stderr.flush()
    os._exit(SETUP_FAILED)


def _unescape(path: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo
    out, i = [], 0
    while i < len(path):
        if path[i] == "\\" and len(path[i + 1 : i + 4]) == 3 and path[i + 1 : i + 4].isdigit():
            out.append(chr(int(path[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(path[i])
            i += 1
    return "".join(out)


def _mounts() -> list[tuple[str, int]]:
    """(mount point, flags to keep) of every mount, in mount order."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            point, options = _unescape(fields[4]), fields[5].split(",")
            flags = 0
            for opt in options:
                flags |= _FLAG_OPTIONS.get(opt, 0)
            out.append((point, flags))
    return out


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def setup_namespace(workdir: str) -> None:
    """Make everything but ``workdir`` read-only and check it (we are root in a new user and
    mount namespace); exits with SETUP_FAILED when something does not hold."""
    import ctypes
    import errno
    import socket

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_void_p]

    def mount(source: str | None, target: str, fstype: str | None, flags: int) -> int:
        enc = lambda s: s.encode() if s is not None else None
        if libc.mount(enc(source), enc(target), enc(fstype), flags, None) != 0:
            return ctypes.get_errno()
        return 0

    workdir = os.path.realpath(workdir)
    # Private propagation: nothing we do here leaks to the parent's mount namespace.
    err = mount(None, "/", None, MS_REC | (1 << 18))  # MS_PRIVATE
    if err:
        _fail(f"making mounts private: {os.strerror(err)}")
    err = mount(workdir, workdir, None, MS_BIND | MS_REC)
    if err:
        _fail(f"bind-mounting {workdir}: {os.strerror(err)}")
    failed = []
    for point, keep in _mounts():
        if _inside(point, workdir):
            continue
        err = mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | keep)
        if err and err not in (errno.ENOENT, errno.EACCES):  # ENOENT/EACCES: hidden mounts
            failed.append(f"{point} ({os.strerror(err)})")
    if failed:
        _fail(f"could not make read-only: {', '.join(failed[:5])}")
    os.chdir(workdir)  # the cwd must be the new (writable) mount, not the one below it
    outside = os.path.join(os.path.dirname(workdir), f".specflow-probe-{os.getpid()}")
    try:
        fd = os.open(outside, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        pass
    else:
        os.close(fd)
        os.unlink(outside)
        _fail(f"{outside} is still writable")
    try:
        fd = os.open(os.path.join(workdir, ".probe"), os.O_WRONLY | os.O_CREAT, 0o600)
        os.close(fd)
        os.unlink(os.path.join(workdir, ".probe"))
    except OSError as exc:
        _fail(f"{workdir} is not writable: {exc}")
    interfaces = {name for _, name in socket.if_nameindex()}
    if interfaces - {"lo"}:
        _fail(f"network interfaces {sorted(interfaces)} in the network namespace")


_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def install_prelude(workdir: str) -> None:
    """Python-level guards (see module doc): best effort, not a security boundary."""
    import builtins
    import io
    import socket

    root = os.path.realpath(workdir)
    allowed = {os.devnull}

    def check(path: object, what: str) -> None:
        if isinstance(path, int):
            return  # an already open descriptor
        real = os.path.realpath(os.fsdecode(path))  # type: ignore[arg-type]
        if real not in allowed and not _inside(real, root):
            raise PermissionError(f"sandbox: {what} outside the sandbox folder: {real}")

    real_open, real_os_open = builtins.open, os.open

    def guarded_open(file, mode="r", *args, **kwargs):  # noqa: ANN001, ANN202
        if any(c in str(mode) for c in "wax+"):
            check(file, "writing")
        return real_open(file, mode, *args, **kwargs)

    def guarded_os_open(path, flags, *args, **kwargs):  # noqa: ANN001, ANN202
        if flags & _WRITE_FLAGS:
            check(path, "writing")
        return real_os_open(path, flags, *args, **kwargs)

    builtins.open = io.open = guarded_open
    os.open = guarded_os_open

    def guard_paths(name: str, count: int) -> None:
        real = getattr(os, name, None)
        if real is None:
            return

        def guarded(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            for path in args[:count]:
                check(path, name)
            return real(*args, **kwargs)

        setattr(os, name, guarded)

    for name, count in (
        ("mkdir", 1), ("makedirs", 1), ("remove", 1), ("unlink", 1), ("rmdir", 1),
        ("removedirs", 1), ("rename", 2), ("renames", 2), ("replace", 2), ("link", 2),
        ("symlink", 2), ("chmod", 1), ("chown", 1), ("lchown", 1), ("truncate", 1),
        ("utime", 1), ("mkfifo", 1), ("mknod", 1),
    ):  # fmt: skip
        guard_paths(name, count)

    def refuse(*_args, **_kwargs):  # noqa: ANN002, ANN003, ANN202
        raise PermissionError("sandbox: no network and no new sessions")

    class NoSocket(socket.socket):
        def __init__(self, *args, **kwargs):  # noqa: ANN002, ANN003
            refuse()

    socket.socket = NoSocket  # type: ignore[misc]
    socket.create_connection = socket.create_server = refuse  # type: ignore[assignment]
    socket.socketpair = socket.fromfd = refuse  # type: ignore[assignment]
    os.setsid = os.setpgrp = os.setpgid = refuse  # type: ignore[assignment]


def main(argv: list[str]) -> None:
    mode, workdir = argv[1], argv[2]
    if mode == "probe":
        setup_namespace(workdir)
        print("ok", flush=True)
        return
    program = argv[3]
    if mode == "ns":
        setup_namespace(workdir)
        sys.stdout.flush()
        os.execv(sys.executable, [sys.executable, "-I", program])
    elif mode == "prelude":
        import runpy

        os.chdir(workdir)
        sys.argv = [program]
        sys.path.insert(0, os.path.dirname(program))
        install_prelude(workdir)
        runpy.run_path(program, run_name="__main__")
    else:
        _fail(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(sys.argv)
