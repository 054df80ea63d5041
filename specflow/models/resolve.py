"""Turn what a config says about a model into a ``LayeredLM``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from specflow.models.base import LayeredLM


def as_layered_lm(spec: Any) -> LayeredLM:
    """Accept a ``LayeredLM``, a ``LoadedModel``, a name/path string, or a mapping of
    ``load_model`` keyword arguments (``{name: ..., dtype: ..., backend: ...}``)."""
    if isinstance(spec, LayeredLM):
        return spec
    if hasattr(spec, "lm") and isinstance(spec.lm, LayeredLM):
        return spec.lm
    from specflow.models.loading import load_model

    if isinstance(spec, str):
        return load_model(spec).lm
    if isinstance(spec, Mapping):
        kwargs = dict(spec)
        name = kwargs.pop("name", None) or kwargs.pop("name_or_path", None)
        heads = kwargs.pop("exit_heads", None)
        if not name:
            raise ValueError(
                f"a model config needs a 'name' (registry name, folder or hub id): {spec}"
            )
        lm = load_model(name, **kwargs).lm
        if heads:
            attach_exit_heads(lm, name, heads)
        return lm
    raise TypeError(f"cannot make a model out of {type(spec).__name__}: {spec!r}")


def attach_exit_heads(lm: LayeredLM, name: str, heads: str) -> None:
    """Attach trained exit heads (``train_heads/``) to ``lm``: a path, or ``default`` for
    ``<cache>/heads/<name>/heads.safetensors``.  Heads of another base model are refused."""
    from pathlib import Path

    from specflow.errors import ModelNotFoundError
    from specflow.models.exit_heads import default_heads_path, load_and_attach

    path = default_heads_path(name) if heads in ("default", "auto") else Path(heads)
    if not path.exists():
        raise ModelNotFoundError(
            f"model.exit_heads={heads}: no exit heads at {path}; train them with "
            f"`python -m train_heads.train model={name}` (see train_heads/README.md), or set "
            f"model.exit_heads=null to exit through the shared final norm + LM head"
        )
    from specflow.models.native import NativeLM

    if not isinstance(lm, NativeLM) or lm.exit_heads_path != str(path):
        load_and_attach(lm, path)
