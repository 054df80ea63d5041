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
        if not name:
            raise ValueError(
                f"a model config needs a 'name' (registry name, folder or hub id): {spec}"
            )
        return load_model(name, **kwargs).lm
    raise TypeError(f"cannot make a model out of {type(spec).__name__}: {spec!r}")
