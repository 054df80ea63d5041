"""What a token-tree drafter learnt, kept on disk across runs of the same target.

The recycling table, the suffix index's sequences and the acceptance calibration all start
empty in a new process; a run's first requests then draft from little.  Kept in a folder,
the next run of the same target starts where the last one stopped (a server that has been
up a while).  One file, ``tables.safetensors``:

    recycling.ids    [V, w] int32     recycling.probs [V, w] float16
    suffix.tokens    [T] int32        suffix.offsets  [S+1] int64   (oldest sequence first)
    metadata: model, weights_fingerprint, vocab_size, width, calibration (JSON)

written to a temporary name and renamed, so a crash mid-write leaves the previous file.
A file made for other weights (another fingerprint or vocabulary) is refused, naming both.
Greedy outputs do not depend on it (the target verifies every draft); speed does.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from specflow.cache_root import cache_root
from specflow.errors import ConfigError
from stages.drafters.token_tree.recycling import RecyclingTable
from stages.drafters.token_tree.suffix_index import SuffixIndex
from stages.drafters.token_tree.tree_plan import AcceptanceCalibration

log = logging.getLogger(__name__)

FILE = "tables.safetensors"


def default_tables_dir(model_name: str, fingerprint: str) -> Path:
    """``<cache>/token_trees/<model>/<weights fingerprint>/``."""
    return cache_root() / "token_trees" / Path(model_name).name / fingerprint


@dataclass(frozen=True)
class TargetKey:
    """Which target the tables belong to."""

    model: str
    weights_fingerprint: str
    vocab_size: int


def save_tables(folder: Path, key: TargetKey, recycling: RecyclingTable | None,
                suffix: SuffixIndex | None, calibration: AcceptanceCalibration) -> Path:
    """Write the drafter's tables to ``folder / FILE`` (module doc); returns the path."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    if recycling is not None and recycling.ids is not None and recycling.probs is not None:
        tensors["recycling.ids"] = recycling.ids.contiguous()
        tensors["recycling.probs"] = recycling.probs.contiguous()
    if suffix is not None:
        seqs = suffix.sequences()
        flat = [t for s in seqs for t in s]
        tensors["suffix.tokens"] = torch.tensor(flat, dtype=torch.int32)
        tensors["suffix.offsets"] = torch.tensor([0] + [len(s) for s in seqs],
                                                 dtype=torch.int64).cumsum(0)
    calib = [[list(k) if isinstance(k, tuple) else k, v] for k, v in calibration.counts.items()]
    meta = {"model": key.model, "weights_fingerprint": key.weights_fingerprint,
            "vocab_size": str(key.vocab_size),
            "width": str(recycling.width if recycling is not None else 0),
            "calibration": json.dumps(calib)}
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / FILE
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata=meta)
    tmp.replace(path)
    return path


def load_tables(folder: Path, key: TargetKey, recycling: RecyclingTable | None,
                suffix: SuffixIndex | None, calibration: AcceptanceCalibration) -> int:
    """Fill the drafter's empty tables from ``folder / FILE``; returns the suffix tokens
    read (0 and nothing changed where no file is there yet)."""
    from safetensors import safe_open

    path = folder / FILE
    if not path.is_file():
        return 0
    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
        names = set(f.keys())
        tensors = {n: f.get_tensor(n) for n in names}
    made_for = (meta.get("model"), meta.get("weights_fingerprint"), meta.get("vocab_size"))
    if made_for != (key.model, key.weights_fingerprint, str(key.vocab_size)):
        raise ConfigError(
            f"{path}: token-tree tables made for model {made_for[0]!r} (weights "
            f"{made_for[1]}, vocabulary {made_for[2]}), not for {key.model!r} (weights "
            f"{key.weights_fingerprint}, vocabulary {key.vocab_size}); fix: point "
            "drafter.keep at another folder, or use drafter.keep=default (one folder per "
            "model and weights)")
    if recycling is not None and "recycling.ids" in names:
        ids, probs = tensors["recycling.ids"], tensors["recycling.probs"]
        if ids.shape[1] != recycling.width:
            raise ConfigError(
                f"{path}: recycling table of width {ids.shape[1]}, the drafter's is "
                f"{recycling.width}; fix: set drafter.recycling.width={ids.shape[1]} or point "
                "drafter.keep at another folder")
        recycling.ids, recycling.probs = ids.clone(), probs.clone()
    read = 0
    if suffix is not None and "suffix.tokens" in names:
        flat = tensors["suffix.tokens"].tolist()
        offsets = tensors["suffix.offsets"].tolist()
        for a, b in zip(offsets, offsets[1:], strict=False):
            suffix.add(flat[a:b])
        read = len(flat)
    for k, v in json.loads(meta.get("calibration", "[]")):
        calibration.counts[tuple(k) if isinstance(k, list) else k] = list(v)
    log.info("token-tree tables read from %s: %d suffix tokens, recycling %s, %d "
             "calibration bins", path, read, "yes" if "recycling.ids" in names else "no",
             len(calibration.counts))
    return read
