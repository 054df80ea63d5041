"""Build a pipeline from config: every stage is a ``_target_`` node, checked before use.

``instantiate_checked`` resolves a node's ``_target_`` and compares the node's keys with
the target's signature, so a misspelled stage or key fails with one message that names
the config group, the value and the valid choices, instead of a deep traceback.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from hydra.errors import InstantiationException
from hydra.utils import get_object, instantiate
from omegaconf import DictConfig, OmegaConf

from specflow.engine import SpeculativePipeline
from specflow.errors import ConfigError, SpecflowError


def _plain(node: Any) -> Any:
    if isinstance(node, DictConfig):
        return OmegaConf.to_container(node, resolve=True)
    return node


def check_node(where: str, node: Any) -> None:
    """Validate one ``_target_`` node (and nested ones) against the target's signature."""
    node = _plain(node)
    if not isinstance(node, Mapping):
        return
    for key, value in node.items():
        if isinstance(value, Mapping):
            check_node(f"{where}.{key}", value)
    target = node.get("_target_")
    if target is None:
        return
    try:
        obj = get_object(target)
    except Exception as exc:  # noqa: BLE001 - hydra raises several types here
        raise ConfigError(
            f"{where}: unknown stage _target_ '{target}' ({exc}); pick one of the files in "
            f"conf/{where.split('.')[0]}/ or give an importable class"
        ) from None
    params = inspect.signature(obj).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    valid = [n for n in params if n != "self"]
    for key in node:
        if key.startswith("_"):
            continue
        if key not in valid:
            raise ConfigError(
                f"{where}: '{key}' is not an argument of {target}; valid keys: {valid}"
            )
    missing = [
        n
        for n, p in params.items()
        if p.default is inspect.Parameter.empty
        and n not in node
        and p.kind not in (inspect.Parameter.VAR_POSITIONAL,)
    ]
    if missing:
        raise ConfigError(f"{where}: {target} needs {missing}; set {where}.{missing[0]}=...")


def instantiate_checked(where: str, node: Any, **kwargs: Any) -> Any:
    """``hydra.utils.instantiate`` after ``check_node``; ``None``/empty nodes give ``None``."""
    if node is None or (isinstance(node, (Mapping, DictConfig)) and not node):
        return None
    check_node(where, node)
    try:
        return instantiate(node, _convert_="all", **kwargs)
    except InstantiationException as exc:
        cause = exc.__cause__
        while isinstance(cause, InstantiationException) and cause.__cause__ is not None:
            cause = cause.__cause__
        if isinstance(cause, SpecflowError):
            raise cause from None  # our own message is the clear one
        raise


def build_pipeline(cfg: Any) -> SpeculativePipeline:
    """The pipeline a composed run config describes (``method``, stages, ``k``)."""
    drafter = instantiate_checked("drafter", cfg.get("drafter"))
    intermediate = instantiate_checked("intermediate_verifier", cfg.get("intermediate_verifier"))
    target = instantiate_checked("target_verifier", cfg.target_verifier)
    draft_length = instantiate_checked("draft_length", cfg.get("draft_length"))
    acceptor = instantiate_checked("acceptor", cfg.acceptor)
    if target is None or acceptor is None:
        raise ConfigError(
            "a pipeline needs target_verifier and acceptor (e.g. target_verifier=full)"
        )
    return SpeculativePipeline(
        target_verifier=target,
        acceptor=acceptor,
        drafter=drafter,
        intermediate_verifier=intermediate,
        name=cfg.method,
        draft_length=draft_length,
    )
