"""Turn a registry model (GGUF parts from PyPI) into a cached float32 safetensors folder.

    python -m specflow.models.prepare smollm2-135m qwen2.5-coder-0.5b
    python -m specflow.models.prepare --all

Steps (each skipped when its result is already there):

1. check the model's packages are installed (else: the exact ``pip install`` command);
2. assemble the GGUF from its parts into ``<cache>/gguf/`` (streamed, sha256 computed while
   copying) and refuse a sha256 mismatch; a single-file GGUF is verified in place;
3. load it with transformers (dequantized to float32: slow, one-off) and save a safetensors
   folder (model + tokenizer + generation config) to ``<cache>/models/<name>/`` atomically,
   with a marker file recording the GGUF's sha256.

Later calls find the marker and return the folder at once.  The cache is
``specflow.cache_root.cache_root``: ``--cache-dir`` / ``cache_dir``, else the run's
``runner.cache_dir``, ``$SPECFLOW_CACHE`` or ``~/.cache/specflow``.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path

from specflow.cache_root import cache_root
from specflow.errors import ModelNotFoundError, SpecflowError
from specflow.models.registry import REGISTRY, RegistryEntry, get_entry, pip_install_command

log = logging.getLogger(__name__)

MARKER_FILE = "specflow_prepared.json"
_CHUNK = 8 * 1024 * 1024


class ChecksumMismatchError(ModelNotFoundError):
    """An assembled GGUF whose sha256 is not the one the registry pins."""


class InsufficientDiskError(SpecflowError, OSError):
    """Not enough free disk in the cache for the conversion."""


def prepared_dir(name: str, cache_dir: str | Path | None = None) -> Path:
    """Where model ``name``'s safetensors folder lives (prepared or not), under
    ``cache_root(cache_dir)``."""
    return cache_root(cache_dir) / "models" / name


def is_prepared(name: str, cache_dir: str | Path | None = None) -> bool:
    """Whether ``name`` has a finished folder whose marker records the pinned sha256."""
    marker = prepared_dir(name, cache_dir) / MARKER_FILE
    try:
        return json.loads(marker.read_text())["gguf_sha256"] == get_entry(name).sha256
    except (OSError, ValueError, KeyError):
        return False


def check_installed(entry: RegistryEntry) -> None:
    """Raise ``ModelNotFoundError`` with the install command when packages are missing."""
    missing = entry.missing_modules()
    if missing:
        more = f" (+{len(missing) - 3} more)" if len(missing) > 3 else ""
        shown = ", ".join(missing[:3]) + more
        raise ModelNotFoundError(
            f"model {entry.name!r} is not installed (missing Python packages: {shown}). "
            f"Install it with:\n    {pip_install_command(entry.name)}\n"
            f"or run `bash scripts/setup.sh`, which installs and prepares every model."
        )


def _progress_bar(total: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(
        total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
        disable=not enabled, leave=False,
    )


def _mismatch(entry: RegistryEntry, got: str, path: Path) -> ChecksumMismatchError:
    return ChecksumMismatchError(
        f"the GGUF assembled for {entry.name!r} has sha256 {got}, expected {entry.sha256} "
        f"({path} was deleted). The installed packages are not the pinned ones or are "
        f"corrupt; reinstall them with:\n    {pip_install_command(entry.name)} "
        f"--force-reinstall"
    )


def sha256_file(path: Path, progress: bool = False) -> str:
    """The sha256 of a file, streamed."""
    digest = hashlib.sha256()
    with path.open("rb") as f, _progress_bar(path.stat().st_size, "verifying", progress) as bar:
        while block := f.read(_CHUNK):
            digest.update(block)
            bar.update(len(block))
    return digest.hexdigest()


def assemble_gguf(entry: RegistryEntry, dest: Path, progress: bool = True) -> Path:
    """Concatenate ``entry``'s parts into ``dest`` while hashing; verify the sha256.

    Writes to a temporary name and renames on success; a mismatch deletes the file and
    raises ``ChecksumMismatchError``.
    """
    parts = entry.source.part_paths()
    missing = [str(p) for p in parts if not p.is_file()]
    if missing:
        raise ModelNotFoundError(
            f"model {entry.name!r}: part files missing: {', '.join(missing)}; reinstall with:\n"
            f"    {pip_install_command(entry.name)} --force-reinstall"
        )
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.partial")
    total = sum(p.stat().st_size for p in parts)
    log.info("assembling %s from %d part(s) (%.2f GB) -> %s", entry.name, len(parts),
             total / 1e9, dest)
    digest = hashlib.sha256()
    try:
        with tmp.open("wb") as out, _progress_bar(total, "assembling", progress) as bar:
            for part in parts:
                with part.open("rb") as f:
                    while block := f.read(_CHUNK):
                        digest.update(block)
                        out.write(block)
                        bar.update(len(block))
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    got = digest.hexdigest()
    if got != entry.sha256:
        tmp.unlink(missing_ok=True)
        raise _mismatch(entry, got, dest)
    os.replace(tmp, dest)
    return dest


def _obtain_gguf(entry: RegistryEntry, cache: Path, progress: bool) -> tuple[Path, bool]:
    """The verified GGUF path, and whether it is our own copy (deletable)."""
    parts = entry.source.part_paths()
    if len(parts) == 1:  # a whole GGUF shipped in a package: verify it in place, no copy
        path = parts[0]
        if not path.is_file():
            raise ModelNotFoundError(
                f"model {entry.name!r}: {path} is missing; reinstall with:\n"
                f"    {pip_install_command(entry.name)} --force-reinstall"
            )
        log.info("verifying %s (%s)", entry.name, path)
        got = sha256_file(path, progress)
        if got != entry.sha256:
            raise ChecksumMismatchError(
                f"{path} (model {entry.name!r}) has sha256 {got}, expected {entry.sha256}; "
                f"reinstall with:\n    {pip_install_command(entry.name)} --force-reinstall"
            )
        return path, False
    dest = cache / "gguf" / entry.gguf_file
    if dest.is_file():
        log.info("verifying the kept GGUF %s", dest)
        got = sha256_file(dest, progress)
        if got == entry.sha256:
            return dest, True
        log.warning("%s has the wrong sha256 (%s); assembling it again", dest, got)
        dest.unlink()
    return assemble_gguf(entry, dest, progress), True


def convert_gguf(gguf: Path, out_dir: Path, marker: dict) -> None:
    """Load ``gguf`` dequantized to float32 and save a safetensors folder at ``out_dir``
    atomically (built in a temporary sibling folder, then renamed)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    # A GGUF load marks the model quantized; save_pretrained refuses that. The weights are
    # plain float32 tensors by now.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(f".{out_dir.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if not (tmp / "generation_config.json").exists():
            model.generation_config.save_pretrained(tmp)
        (tmp / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
        for f in tmp.iterdir():  # safetensors are written 0600; the cache may be shared
            f.chmod(0o644)
        if out_dir.exists():  # a stale or unfinished folder without a valid marker
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def prepare_model(
    name: str,
    cache_dir: str | Path | None = None,
    progress: bool = True,
    keep_gguf: bool = True,
) -> Path:
    """Return the safetensors folder of registry model ``name``, preparing it if needed.

    Args:
        name: a registry name (see ``specflow.models.registry.REGISTRY``).
        cache_dir: the cache root; default ``specflow.cache_root.cache_root()`` (the run's
            ``runner.cache_dir``, ``$SPECFLOW_CACHE`` or ``~/.cache/specflow``).
        progress: show tqdm progress bars while copying/hashing.
        keep_gguf: keep the assembled GGUF in ``<cache>/gguf/`` after conversion (the
            default: ``model.weights=gguf`` runs it as published); ``False`` deletes it to
            save disk (package files are never touched).

    Raises:
        ModelNotFoundError: the packages are not installed (the message has the command).
        ChecksumMismatchError: the assembled GGUF is not the pinned file.
    """
    entry = get_entry(name)
    cache = cache_root(cache_dir)
    out_dir = prepared_dir(name, cache)
    if is_prepared(name, cache):
        log.debug("%s already prepared at %s", name, out_dir)
        return out_dir
    check_installed(entry)
    with _lock(out_dir):  # another process may be preparing the same model
        if is_prepared(name, cache):
            return out_dir
        _check_disk(entry, cache)
        return _prepare_locked(entry, cache, out_dir, progress, keep_gguf)


def gguf_path(name: str, cache_dir: str | Path | None = None, progress: bool = True) -> Path:
    """The verified GGUF file of registry model ``name`` (``model.weights=gguf``): the
    package's own file, or the assembled one kept in ``<cache>/gguf/`` (assembled again,
    and verified, when missing).  A file is verified once: a ``.sha256`` note in
    ``<cache>/gguf/`` records the hash with the file's size, mtime and path (a line per path:
    two checkouts sharing one cache each keep theirs), and a file that still matches its
    line is not hashed again."""
    entry = get_entry(name)
    cache = cache_root(cache_dir)
    parts = [] if entry.missing_modules() else entry.source.part_paths()
    note = (cache / "gguf" / entry.gguf_file).with_suffix(".gguf.sha256")
    candidate = parts[0] if len(parts) == 1 else cache / "gguf" / entry.gguf_file
    stamps = note.read_text().splitlines() if note.is_file() else []
    if candidate.is_file() and _stamp(entry, candidate) in stamps:
        return candidate
    check_installed(entry)
    note.parent.mkdir(parents=True, exist_ok=True)
    with _lock(cache / "gguf" / entry.gguf_file):
        path, _ = _obtain_gguf(entry, cache, progress)
        stamp = _stamp(entry, path)
        kept = [line for line in stamps if not line.endswith(f" {path}")][-7:]
        note.write_text("\n".join([*kept, stamp]) + "\n")
    return path


def _stamp(entry: RegistryEntry, path: Path) -> str:
    """A verified file's line in its ``.sha256`` note: hash, size, mtime, path."""
    stat = path.stat()
    return f"{entry.sha256} {stat.st_size} {stat.st_mtime_ns} {path}"


@contextlib.contextmanager
def _lock(out_dir: Path):
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(out_dir.with_name(f".{out_dir.name}.lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _check_disk(entry: RegistryEntry, cache: Path) -> None:
    need = entry.fp32_size_gb * 1.1e9 + (entry.fp32_size_gb * 0.5e9)  # folder + GGUF, roughly
    free = shutil.disk_usage(cache).free
    if free < need:
        raise InsufficientDiskError(
            f"preparing {entry.name!r} needs about {need / 1e9:.1f} GB free in {cache} but "
            f"only {free / 1e9:.1f} GB is; free some space or set SPECFLOW_CACHE to another disk"
        )


def _prepare_locked(entry: RegistryEntry, cache: Path, out_dir: Path, progress: bool,
                    keep_gguf: bool) -> Path:
    name = entry.name
    t0 = time.perf_counter()
    gguf, owned = _obtain_gguf(entry, cache, progress)
    t1 = time.perf_counter()
    log.info("converting %s to float32 safetensors (one-off, ~1 min; %.1f GB on disk)",
             name, entry.fp32_size_gb)
    import transformers

    marker = {
        "name": name,
        "gguf_file": entry.gguf_file,
        "gguf_sha256": entry.sha256,
        "requirements": list(entry.requirements),
        "transformers": transformers.__version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    convert_gguf(gguf, out_dir, marker)
    t2 = time.perf_counter()
    if owned and not keep_gguf:
        gguf.unlink(missing_ok=True)
    log.info("%s ready at %s (gguf %.0f s, convert %.0f s)", name, out_dir, t1 - t0, t2 - t1)
    return out_dir


def install_packages(name: str) -> None:
    """pip-install model ``name``'s pinned packages into this interpreter when missing."""
    import shlex
    import subprocess

    entry = get_entry(name)
    if entry.is_installed():
        return
    cmd = [sys.executable, "-m", *shlex.split(pip_install_command(name)), "-q"]
    log.info("installing %s's packages: %s", name, " ".join(cmd[2:]))
    subprocess.run(cmd, check=True)
    import importlib

    importlib.invalidate_caches()


def main(argv: list[str] | None = None) -> int:
    """CLI: prepare the named registry models (or ``--all``)."""
    parser = argparse.ArgumentParser(
        prog="python -m specflow.models.prepare",
        description="Assemble, verify and convert pip-packaged models into the cache.",
    )
    parser.add_argument("names", nargs="*", metavar="NAME", help=", ".join(REGISTRY))
    parser.add_argument("--all", action="store_true", help="prepare every registry model")
    parser.add_argument("--cache-dir", default=None, help="default $SPECFLOW_CACHE or "
                        "~/.cache/specflow")
    parser.add_argument("--drop-gguf", action="store_true",
                        help="delete the assembled GGUF after conversion (model.weights=gguf "
                             "assembles it again when asked)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--install", action="store_true",
                        help="pip-install the model packages first when they are missing")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")

    names = list(REGISTRY) if args.all else args.names
    if not names:
        parser.error("name at least one model or pass --all")
    unknown = [n for n in names if n not in REGISTRY]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; known: {', '.join(REGISTRY)}")
    failed = []
    for name in names:
        if args.install:
            install_packages(name)
        try:
            path = prepare_model(name, args.cache_dir, progress=not args.no_progress,
                                 keep_gguf=not args.drop_gguf)
        except ModelNotFoundError as e:
            log.error("%s: %s", name, e)
            failed.append(name)
            continue
        print(f"{name}: {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
