"""Turn what a config says about a model into a ``LayeredLM``."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from specflow.errors import ConfigError
from specflow.kv.base import LayeredLM


def as_layered_lm(spec: Any) -> LayeredLM:
    """Accept a ``LayeredLM``, a ``LoadedModel``, or a model config: a mapping of
    ``load_model`` keyword arguments and ``exit_heads`` (``conf/model/*.yaml``: ``{name,
    dtype, backend, trust_remote_code, packed_weights, exit_heads, min_rows}``)."""
    if isinstance(spec, LayeredLM):
        return spec
    if hasattr(spec, "lm") and isinstance(spec.lm, LayeredLM):
        return spec.lm
    from specflow.models.loading import load_model

    if isinstance(spec, str):
        spec = {"name": spec}  # a bare name lacks the settings: refused below, saying so
    if isinstance(spec, Mapping):
        kwargs = dict(spec)
        name = kwargs.pop("name", None) or kwargs.pop("name_or_path", None)
        heads = kwargs.pop("exit_heads", None)
        min_rows = kwargs.pop("min_rows", 1)
        if not name:
            raise ValueError(
                f"a model config needs a 'name' (registry name, folder or hub id): {spec}"
            )
        _check_settings(name, kwargs, load_model)
        lm = load_model(name, **kwargs).lm
        if heads:
            attach_exit_heads(lm, name, heads)
        from specflow.cpu.row_padding import apply_min_rows

        apply_min_rows(lm, min_rows)
        return lm
    raise TypeError(f"cannot make a model out of {type(spec).__name__}: {spec!r}")


def _check_settings(name: str, kwargs: Mapping[str, Any], load: Callable[..., Any]) -> None:
    """Refuse a model config without the settings ``load`` (``load_model``) requires, naming
    them."""
    required = [
        p.name for p in inspect.signature(load).parameters.values()
        if p.kind is p.KEYWORD_ONLY and p.default is p.empty
    ]
    missing = [key for key in required if key not in kwargs]
    if missing:
        raise ConfigError(
            f"model {name!r} is given without {', '.join(missing)}: give the whole model "
            f"config (`model: ${{model}}` for the target, or compose one from conf/model/: "
            f"`defaults: [/model@<key>: NAME]`), or set them"
        )


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
            f"`python -m train_heads.train model={name}` (see docs/heads.md), or set "
            f"model.exit_heads=null to exit through the shared final norm + LM head"
        )
    from specflow.models.native import NativeLM

    if not isinstance(lm, NativeLM) or lm.exit_heads_path != str(path):
        load_and_attach(lm, path)
