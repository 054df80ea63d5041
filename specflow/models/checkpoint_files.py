"""A published draft checkpoint on disk: a folder with ``config.json`` and one weights file.

EAGLE-1/2, EAGLE-3 and Medusa heads are published as a folder (or a hub repository holding
one): ``config.json`` and ``model.safetensors`` / ``pytorch_model.bin`` (EAGLE) or
``medusa_lm_head.safetensors`` / ``medusa_lm_head.pt`` (Medusa).  Safetensors files are read
as they are; a pickled ``.bin`` / ``.pt`` only with ``torch.load(weights_only=True)`` (no
code runs).  Which format a folder holds follows from its keys (``detect_format``).

Every complaint is one ``ConfigError`` naming the file, the key and the fix
(``Checkpoint.tensor``, ``Checkpoint.problem``), raised while loading, before any decoding.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specflow.errors import ConfigError

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "medusa_lm_head.safetensors",
                "medusa_lm_head.pt")
FORMATS = ("eagle", "eagle3", "medusa")


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint folder read into memory.

    Attributes:
        folder: the folder.
        config: ``config.json``'s content.
        weights_file: the weights file read.
        tensors: its tensors by key, as stored (dtype unchanged).
    """

    folder: Path
    config: dict[str, Any]
    weights_file: Path
    tensors: dict[str, torch.Tensor]

    def problem(self, key: str, what: str, fix: str, in_config: bool = False) -> ConfigError:
        """The one error for a bad key: ``<file>: key '<key>' <what>; fix: <fix>``."""
        file = self.folder / "config.json" if in_config else self.weights_file
        return ConfigError(f"{file}: key {key!r} {what}; fix: {fix}")

    def setting(self, key: str, fix: str, default: Any = None) -> Any:
        """``config[key]`` (``default`` when absent and given; else the error)."""
        if key in self.config:
            return self.config[key]
        if default is not None:
            return default
        raise self.problem(key, "is missing from config.json", fix, in_config=True)

    def tensor(self, key: str, shape: Sequence[int], fix: str) -> torch.Tensor:
        """The tensor ``key`` as float32, checked to be ``shape``."""
        t = self.tensors.get(key)
        if t is None:
            raise self.problem(key, "is missing", fix)
        if tuple(t.shape) != tuple(shape):
            raise self.problem(key, f"has shape {list(t.shape)}, expected {list(shape)}", fix)
        return t.float()

    def optional(self, key: str, shape: Sequence[int], fix: str) -> torch.Tensor | None:
        """``tensor(key, shape)`` if the file holds ``key``, else ``None``."""
        return self.tensor(key, shape, fix) if key in self.tensors else None


def resolve_folder(path: str | Path) -> Path:
    """A local folder as it is; a hub id (``owner/name``, not a local path) downloaded with
    ``huggingface_hub.snapshot_download`` (config and weights files only)."""
    local = Path(path).expanduser()
    if local.exists():
        return local
    text = str(path)
    if text.count("/") == 1 and not text.startswith((".", "/", "~")):
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(text, allow_patterns=["config.json", *WEIGHT_FILES]))
        except Exception as err:  # offline, no such repository, no access
            raise ConfigError(
                f"{text}: no such local folder, and the hub repository could not be fetched "
                f"({type(err).__name__}: {err}); fix: download the checkpoint folder and pass "
                "its local path"
            ) from None
    raise ConfigError(f"{local}: no such checkpoint folder; fix: pass the folder holding "
                      f"config.json and one of {', '.join(WEIGHT_FILES)}")


def _load_weights(file: Path) -> dict[str, torch.Tensor]:
    if file.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(file))
    state = torch.load(str(file), map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor)
                                              for v in state.values()):
        raise ConfigError(f"{file}: not a state dict of tensors; fix: pass the checkpoint as "
                          "published (a flat dict of key -> tensor)")
    return dict(state)


def read_checkpoint(path: str | Path) -> Checkpoint:
    """``config.json`` and the first of ``WEIGHT_FILES`` present in the folder ``path``."""
    folder = resolve_folder(path)
    if not folder.is_dir():
        raise ConfigError(f"{folder}: not a checkpoint folder; fix: pass the folder holding "
                          f"config.json and one of {', '.join(WEIGHT_FILES)}")
    cfg_file = folder / "config.json"
    if not cfg_file.exists():
        raise ConfigError(f"{cfg_file}: missing; fix: copy the checkpoint's config.json "
                          "(as published beside its weights) into the folder")
    config = json.loads(cfg_file.read_text())
    for name in WEIGHT_FILES:
        if (folder / name).exists():
            return Checkpoint(folder, config, folder / name, _load_weights(folder / name))
    raise ConfigError(f"{folder}: no weights file; fix: put one of {', '.join(WEIGHT_FILES)} "
                      "(as published) beside config.json")


def detect_format(ckpt: Checkpoint) -> str:
    """``eagle`` (EAGLE-1/2), ``eagle3`` or ``medusa``, from the keys and config."""
    keys = ckpt.tensors.keys()
    if any(k.startswith("midlayer.") for k in keys) or "d2t" in keys:
        return "eagle3"
    if "fc.weight" in keys:
        return "eagle"
    if "medusa_num_heads" in ckpt.config or any(k.split(".")[0].isdigit() for k in keys):
        return "medusa"
    raise ckpt.problem(
        "fc.weight", "is missing, and no key of EAGLE-3 (midlayer.*) or Medusa (0.0.linear."
        "weight) either: this is not a draft checkpoint of a known format",
        f"pass a folder holding an EAGLE-1/2, EAGLE-3 or Medusa head ({', '.join(FORMATS)})")
