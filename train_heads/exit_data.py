"""Exit-head training data from the feature head's data phase: one data phase for both heads.

The feature data phase (``train_heads.feature_data``, ``head=feature``) caches the target's
greedy answers to local-text prompts (train) and to held-out Spec-Bench questions, with the
last layer's output ``h_N`` of every position, in chunks under
``<cache root>/train_heads/<model>/feature-<key>/``.  Exit heads need ``h_L`` at their exits
and the teacher's top-k (from ``h_N``).  Both are recomputed here by *teacher forcing* over
the cached token sequences: one prefill per sequence through layers ``0 .. max(exits) - 1``
only (a batch of sequences per ``run_layer`` call, ragged), and ``h_N`` comes from the cache,
so the deep half of the model never runs again.  The result is the ``Generated`` list the
exit-head job caches as usual (``train_heads.cache.build_cache``).

Invariant: for a sequence of ``L`` tokens, rows ``p = 0 .. L-2`` hold ``h_exit`` of position
``p`` and ``h_N`` of position ``p`` (whose argmax is token ``p+1`` on the generated part), as
``train_heads.generate`` makes them.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from safetensors import safe_open

from specflow.errors import ConfigError
from specflow.kv.base import LayeredLM
from specflow.kv.contiguous import layer_caches
from train_heads.feature_data import FeatureSequences
from train_heads.generate import Generated
from train_heads.prompts import Prompt

log = logging.getLogger("train_heads")


def feature_data_dir(model_dir: Path, configured: str | None) -> Path:
    """The feature data cache to read: ``configured`` (a ``feature-<key>`` folder), else
    the only ``feature-*`` folder under ``model_dir`` (``ConfigError`` when there are none or
    several: name one with ``data.feature_dir``)."""
    if configured:
        path = Path(configured).expanduser()
        if not (path / "train_0.safetensors").exists():
            raise ConfigError(f"data.feature_dir={configured}: no feature data there "
                              "(train_0.safetensors); run `python -m train_heads.train "
                              "head=feature` first, or point it at its feature-<key> folder")
        return path
    found = sorted(p for p in model_dir.glob("feature-*") if (p / "train_0.safetensors").exists())
    if len(found) != 1:
        what = "none" if not found else ", ".join(p.name for p in found)
        raise ConfigError(f"data=feature needs one feature data cache under {model_dir} "
                          f"(found {what}); run `python -m train_heads.train head=feature` "
                          "first, or name one with data.feature_dir=<folder>")
    return found[0]


def chunk_paths(directory: Path, name: str) -> list[Path]:
    """The ``<name>_<i>.safetensors`` chunks of a feature data cache, in order."""
    paths = sorted(directory.glob(f"{name}_*.safetensors"),
                   key=lambda p: int(p.stem.rsplit("_", 1)[1]))
    if not paths:
        raise ConfigError(f"no {name}_*.safetensors chunks in {directory}")
    return paths


def load_chunks(directory: Path, name: str) -> FeatureSequences:
    """Every ``<name>_<i>.safetensors`` chunk of a feature data cache, in order."""
    return FeatureSequences.concat([FeatureSequences.load(p) for p in chunk_paths(directory, name)])


def feature_prompts(directory: Path) -> list[Prompt]:
    """The prompts of a feature data cache (``train/<i>`` split 0, ``heldout/<i>`` split 1):
    their token ids (what the shared-prefix skip is computed from).  Reads the chunks' token
    tensors only, not their features."""
    prompts = []
    for split, name in ((0, "train"), (1, "heldout")):
        i = 0
        for path in chunk_paths(directory, name):
            with safe_open(str(path), framework="pt") as f:
                tokens, offsets = f.get_tensor("tokens"), f.get_tensor("tok_offsets")
                prompt_len = f.get_tensor("prompt_len")
            for start, length in zip(offsets[:-1].tolist(), prompt_len.tolist(), strict=True):
                prompts.append(Prompt(f"{name}/{i}", "", tokens[start : start + length].tolist(),
                                      split))
                i += 1
    return prompts


@torch.inference_mode()
def exit_states(lm: LayeredLM, seqs: FeatureSequences, exits: list[int],
                max_positions: int | None = None, batch_rows: int = 2048) -> list[Generated]:
    """``Generated`` per sequence (the first ones, up to ``max_positions`` rows in all) with
    ``h_L`` for ``exits`` recomputed by teacher forcing and ``h_N`` from ``seqs``.

    Sequences run in ragged batches of about ``batch_rows`` positions: one ``run_layer`` per
    layer for the batch, layers ``0 .. max(exits) - 1`` only.
    """
    n = lm.info.num_layers
    rows = (seqs.feat_offsets[1:] - seqs.feat_offsets[:-1]).tolist()  # positions per sequence
    take, total = 0, 0
    while take < len(rows) and (max_positions is None or total + rows[take] <= max_positions):
        total += rows[take]
        take += 1
    out: list[Generated] = []
    start, done = 0, 0
    t0 = time.perf_counter()
    while start < take:
        batch, size = [], 0
        while start < take and (not batch or size < batch_rows):
            batch.append(start)
            size += rows[start]
            start += 1
        parts = [seqs.seq(i) for i in batch]
        caches = [layer_caches(lm, f.shape[0]) for _, f, _ in parts]
        h = lm.embed(torch.cat([t[: f.shape[0]] for t, f, _ in parts]))  # [R, H]
        kept: dict[int, torch.Tensor] = {}
        memo: dict = {}
        for layer in range(max(exits)):
            h = lm.run_layer(layer, h, [(c[layer], f.shape[0])
                                        for c, (_, f, _) in zip(caches, parts, strict=True)],
                             memo)
            if layer + 1 in exits:
                kept[layer + 1] = h.float().clone()
        row = 0
        for tokens, feats, prompt_len in parts:
            r = feats.shape[0]
            hidden = {layer: h_l[row : row + r] for layer, h_l in kept.items()}
            hidden[n] = feats.float()
            out.append(Generated(tokens.tolist(), prompt_len, hidden))
            row += r
        done += size
        log.info("[data] exit states: %d/%d sequences, %d positions, %.1f ms/position",
                 len(out), take, done, 1000 * (time.perf_counter() - t0) / done)
    return out


def exit_data_from_features(lm: LayeredLM, directory: Path, exits: list[int]
                            ) -> tuple[list[Generated], list[int]]:
    """Training (split 0: the ``train`` chunks) and held-out (split 1: the ``heldout``
    chunks) sequences with exit states (module doc)."""
    train = exit_states(lm, load_chunks(directory, "train"), exits)
    held = exit_states(lm, load_chunks(directory, "heldout"), exits)
    return train + held, [0] * len(train) + [1] * len(held)
