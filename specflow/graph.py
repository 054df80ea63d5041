"""Build a pipeline from config: every stage is a ``_target_`` node, checked before use.

``instantiate_checked`` resolves a node's ``_target_`` and compares the node's keys with
the target's signature, so a misspelled stage or key fails with one message that names
the config group, the value and the valid choices, instead of a deep traceback. Each
value is also checked against its parameter's type annotation (``int``, ``float``,
``bool``, ``str``, ``None``/``Optional``, unions, ``Literal``, lists, mappings; an int is a
valid float, a bool is not an int); other annotations (``Any``, models, protocols) are
not checked.
"""

from __future__ import annotations

import inspect
import pathlib
import sys
import types
import typing
from collections.abc import Mapping, Sequence
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


_UNCHECKED = object()  # an annotation this module does not check


def _hints(obj: Any) -> dict[str, Any]:
    """The evaluated parameter annotations of a class's ``__init__`` or a function; an
    annotation that cannot be evaluated (a name imported only for type checkers) is left
    out, so it is not checked."""
    func = obj.__init__ if inspect.isclass(obj) else obj
    try:
        return typing.get_type_hints(func)
    except Exception:  # noqa: BLE001 - evaluate one by one below
        pass
    raw = getattr(func, "__annotations__", {}) or {}
    module = sys.modules.get(getattr(func, "__module__", ""), None)
    scope = dict(vars(module)) if module else {}
    out = {}
    for name, ann in raw.items():
        try:
            out[name] = eval(ann, scope) if isinstance(ann, str) else ann  # noqa: S307
        except Exception:  # noqa: BLE001
            continue
    return out


def _shown(ann: Any) -> str:
    """An annotation as written: ``int``, ``list[str] | None``."""
    if isinstance(ann, type) and not typing.get_args(ann):
        return ann.__name__
    return str(ann).replace("typing.", "").replace("NoneType", "None")


def _describe(ann: Any) -> str | object:
    """``"an int"``, ``"an int or null"``, ... or ``_UNCHECKED``."""
    origin = typing.get_origin(ann)
    if ann is type(None) or ann is None:
        return "null"
    if origin in (typing.Union, types.UnionType):
        parts = [_describe(a) for a in typing.get_args(ann)]
        if any(p is _UNCHECKED for p in parts):
            return _UNCHECKED
        return " or ".join(dict.fromkeys(str(p) for p in parts))
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(ann))
    base = origin or ann
    if base is bool:
        return "a bool (true/false)"
    if base is int:
        return "an int"
    if base is float:
        return "a float (or an int)"
    if base in (str, pathlib.Path):
        return "a string"
    if base in (list, tuple, Sequence, typing.Sequence, list):
        args = [a for a in typing.get_args(ann) if a is not Ellipsis]
        if len(args) != 1 or _describe(args[0]) is _UNCHECKED:
            return "a list"
        return f"a list of {_shown(args[0])}"
    if base in (dict, Mapping, typing.Mapping, dict):
        return "a mapping"
    return _UNCHECKED


def _fits(value: Any, ann: Any) -> bool:
    """Whether ``value`` (plain config data) can be passed for annotation ``ann``."""
    if _describe(ann) is _UNCHECKED:
        return True
    origin = typing.get_origin(ann)
    if ann is type(None) or ann is None:
        return value is None
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, a) for a in typing.get_args(ann))
    if origin is typing.Literal:
        return value in typing.get_args(ann)
    base = origin or ann
    if base is bool:
        return isinstance(value, bool)
    if base is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if base is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if base in (str, pathlib.Path):
        return isinstance(value, (str, pathlib.Path))
    if base in (list, tuple, Sequence, typing.Sequence, list):
        if not isinstance(value, (list, tuple)):
            return False
        args = [a for a in typing.get_args(ann) if a is not Ellipsis]
        return len(args) != 1 or all(_fits(v, args[0]) for v in value)
    if base in (dict, Mapping, typing.Mapping, dict):
        return isinstance(value, Mapping)
    return True


def _check_types(where: str, target: str, obj: Any, node: Mapping) -> None:
    hints = _hints(obj)
    for key, value in node.items():
        if key.startswith("_") or key not in hints:
            continue
        if value == "???" or (isinstance(value, Mapping) and "_target_" in value):
            continue  # missing (reported by Hydra) or a node instantiated on its own
        ann = hints[key]
        if _fits(value, ann):
            continue
        raise ConfigError(
            f"{where}.{key}={value!r} must be {_describe(ann)} ({target}({key}: {_shown(ann)}))"
            "; "
            f"got a {type(value).__name__}"
        )


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
    _check_types(where, target, obj, node)


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


def check_selector_used(cfg: Any) -> None:
    """A ``selector`` other than ``single`` only means something to a drafter that takes one
    (a pool); anywhere else it would be recorded in the results but never built."""
    selector = _plain(cfg.get("selector"))
    if not isinstance(selector, Mapping) or not selector.get("_target_"):
        return
    if selector["_target_"].rsplit(".", 1)[-1] == "SingleSelector":
        return
    drafter = _plain(cfg.get("drafter"))
    uses_it = isinstance(drafter, Mapping) and _mentions(drafter, selector)
    if not uses_it:
        name = selector["_target_"].rsplit(".", 1)[-1]
        raise ConfigError(
            f"selector={name} is set but drafter does not take a selector (only drafter=pool "
            f"does); drop the selector override or use drafter=pool"
        )


def _mentions(node: Any, wanted: Mapping) -> bool:
    """Whether ``wanted`` appears as a value anywhere inside ``node``."""
    if node == wanted:
        return True
    if isinstance(node, Mapping):
        return any(_mentions(v, wanted) for v in node.values())
    if isinstance(node, list):
        return any(_mentions(v, wanted) for v in node)
    return False


def build_pipeline(cfg: Any) -> SpeculativePipeline:
    """The pipeline a composed run config describes: ``method`` and its stages.

    Its rounds draft at most ``drafter.k`` tokens per request (the pipeline's
    ``max_draft_len``); ``draft_length`` chooses how many each round asks for within that.
    The pipeline's own ``k`` stays unset: only a pipeline nested as a drafter has one, set
    in its node (e.g. ``conf/drafter/pld_model.yaml``)."""
    check_selector_used(cfg)
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
