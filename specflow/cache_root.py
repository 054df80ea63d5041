"""The specflow cache root, declared once: where prepared registry models
(``<root>/models/``), trained heads (``<root>/heads/``) and cached baselines
(``<root>/baselines/``) live.

The root is, first to last: an explicit ``cache_dir`` argument; the run's ``runner.cache_dir``
(``specflow.app`` sets it for the run with ``configured_cache_root``, so that every model,
exit-head and feature-head path resolved while the stages are built lands under it);
``$SPECFLOW_CACHE``; ``~/.cache/specflow``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path

ENV_VAR = "SPECFLOW_CACHE"

_CONFIGURED: ContextVar[str | Path | None] = ContextVar("specflow_cache_root", default=None)


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """The cache root: ``cache_dir`` when given, else the configured one
    (``configured_cache_root``), else ``$SPECFLOW_CACHE``, else ``~/.cache/specflow``."""
    chosen = cache_dir or _CONFIGURED.get() or os.environ.get(ENV_VAR)
    return Path(chosen).expanduser() if chosen else Path.home() / ".cache" / "specflow"


@contextmanager
def configured_cache_root(cache_dir: str | Path | None) -> Iterator[Path]:
    """Within the block, ``cache_root()`` is ``cache_dir`` (``None``: left as it is); yields
    the root in force."""
    token = _CONFIGURED.set(cache_dir or _CONFIGURED.get())
    try:
        yield cache_root()
    finally:
        _CONFIGURED.reset(token)
