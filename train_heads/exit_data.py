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

Training sequences (split 0), in this order: the local-text answers (``train_<i>`` chunks;
left out with ``data.local=false``), then, with ``data.specbench=N``, the target's answers to
the Spec-Bench dev questions that are not held out (``specbench<N>_<i>`` chunks, made by
``head=feature head.data.specbench_train=true``), then the chunk sets ``data.chunks`` names
(e.g. the answers to the prompts the target wrote itself, ``train_heads.magpie``); held out
(split 1): the ``heldout_<i>`` chunks.  ``data.max_train_positions`` takes the leading
training sequences of that order.

Invariant: for a sequence of ``L`` tokens, rows ``p = 0 .. L-2`` hold ``h_exit`` of position
``p`` and ``h_N`` of position ``p`` (whose argmax is token ``p+1`` on the generated part), as
``train_heads.generate`` makes them.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from specflow.errors import ConfigError
from specflow.kv.base import LayeredLM
from specflow.kv.contiguous import layer_caches
from train_heads.feature_data import FeatureSequences
from train_heads.generate import Generated
from train_heads.job_setup import check_disjoint
from train_heads.prompts import Prompt, specbench_split

log = logging.getLogger("train_heads")


def train_chunk_names(data: Any) -> list[str]:
    """The chunk names of the training sequences ``data`` (a ``data=feature`` config) reads,
    in order: ``train`` (local text) unless ``data.local`` is false, then ``specbench<N>``
    with ``data.specbench=N``, then the names in ``data.chunks`` (other chunk sets of the
    same cache, e.g. the ``magpie<N>-<hash>`` answers of ``head.data.magpie_prompts``)."""
    local, n = data.get("local", True), data.get("specbench")
    extra = list(data.get("chunks") or [])
    for name in extra:
        if (not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name)
                or name == "heldout" or extra.count(name) > 1):
            raise ConfigError(f"data.chunks={extra!r}: {name!r} is not a training chunk set; "
                              "name each <name> of the cache's <name>_<i>.safetensors once "
                              "(not heldout), e.g. the magpie<N>-<hash> one the feature job "
                              "logged")
    if not isinstance(local, bool):
        raise ConfigError(f"data.local={local!r}: use true or false")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n <= 0):
        raise ConfigError(f"data.specbench={n!r}: use null or the answers' length N of the "
                          "specbench<N>_*.safetensors chunks (head.data.specbench_max_new_tokens"
                          " of the feature job, 192 by default)")
    names = (["train"] if local else []) + ([f"specbench{n}"] if n is not None else []) + extra
    if len(set(names)) < len(names):
        raise ConfigError(f"data.chunks={extra!r} repeats a chunk set data.local / "
                          f"data.specbench already train on ({names}); name each once")
    if not names:
        raise ConfigError("data.local=false with data.specbench=null and no data.chunks "
                          "leaves nothing to train on; set data.specbench=<N> (e.g. 192), "
                          "data.chunks=[<name>] or data.local=true")
    return names


def specbench_hint(name: str) -> str:
    """How to make the ``specbench<N>_*`` chunks of a feature data cache."""
    n = name.removeprefix("specbench")
    return (f"make them with `python -m train_heads.train head=feature "
            f"head.data.specbench_train=true head.data.specbench_max_new_tokens={n} "
            "trainer.max_epochs=0 output.install=false` (same model= and head.data as the "
            "folder's; max_epochs=0 answers the questions and trains no feature head)")


def feature_data_dir(model_dir: Path, configured: str | None, first: str = "train") -> Path:
    """The feature data cache to read: ``configured`` (a ``feature-<key>`` folder), else
    the only ``feature-*`` folder under ``model_dir`` holding ``<first>_0.safetensors`` (the
    first training chunk; ``ConfigError`` when there are none or several: name one with
    ``data.feature_dir``)."""
    chunk = f"{first}_0.safetensors"
    hint = ("; " + specbench_hint(first)) if first.startswith("specbench") else (
        "" if first == "train" else
        " (data.chunks names a chunk set the feature job made, e.g. the magpie<N>-<hash> "
        "answers of head.data.magpie_prompts; its log names it)")
    if configured:
        path = Path(configured).expanduser()
        if not (path / chunk).exists():
            if hint:
                raise ConfigError(f"data.feature_dir={configured}: no {first}_*.safetensors "
                                  f"chunks there{hint}")
            raise ConfigError(f"data.feature_dir={configured}: no feature data there "
                              f"({chunk}); run `python -m train_heads.train "
                              "head=feature` first, or point it at its feature-<key> folder")
        return path
    found = sorted(p for p in model_dir.glob("feature-*") if (p / chunk).exists())
    if len(found) != 1:
        what = "none" if not found else ", ".join(p.name for p in found)
        if hint and not found:
            raise ConfigError(f"data=feature: no feature data cache under {model_dir} has "
                              f"{first}_*.safetensors chunks{hint}")
        raise ConfigError(f"data=feature needs one feature data cache under {model_dir} "
                          f"(found {what}); run `python -m train_heads.train head=feature` "
                          "first, or name one with data.feature_dir=<folder>")
    return found[0]


def chunk_paths(directory: Path, name: str) -> list[Path]:
    """The ``<name>_<i>.safetensors`` chunks of a feature data cache, in order."""
    pattern = re.compile(re.escape(name) + r"_(\d+)")
    numbered = [(int(m.group(1)), p) for p in directory.glob(f"{name}_*.safetensors")
                if (m := pattern.fullmatch(p.stem))]
    paths = [p for _, p in sorted(numbered)]
    if not paths:
        hint = ("; " + specbench_hint(name)) if name.startswith("specbench") else ""
        raise ConfigError(f"no {name}_*.safetensors chunks in {directory}{hint}")
    return paths


def load_chunks(directory: Path, name: str) -> FeatureSequences:
    """Every ``<name>_<i>.safetensors`` chunk of a feature data cache, in order."""
    return FeatureSequences.concat([FeatureSequences.load(p) for p in chunk_paths(directory, name)])


def feature_prompts(directory: Path, train_names: Sequence[str] = ("train",),
                    tokenizer: Any = None) -> list[Prompt]:
    """The prompts of a feature data cache, one per sequence in the order ``exit_data_from_
    features`` gives them (the ``train_names`` chunks split 0, ``heldout`` split 1): their
    token ids (what the shared-prefix skip is computed from).  Ids: ``<name>/<i>``, except
    the Spec-Bench training answers' (``specbench<N>`` chunks): ``specbench/<question id>``
    (``name_specbench``, which needs the tokenizer).  Reads the chunks' token tensors only,
    not their features."""
    prompts = []
    for split, names in ((0, train_names), (1, ["heldout"])):
        for name in names:
            i = 0
            for path in chunk_paths(directory, name):
                with safe_open(str(path), framework="pt") as f:
                    tokens, offsets = f.get_tensor("tokens"), f.get_tensor("tok_offsets")
                    prompt_len = f.get_tensor("prompt_len")
                for start, length in zip(offsets[:-1].tolist(), prompt_len.tolist(),
                                         strict=True):
                    prompts.append(Prompt(f"{name}/{i}", "", tokens[start : start + length]
                                          .tolist(), split))
                    i += 1
    sb = [n for n in train_names if n.startswith("specbench")]
    return name_specbench(directory, prompts, sb[0], tokenizer) if sb else prompts


def name_specbench(directory: Path, prompts: list[Prompt], name: str, tokenizer: Any
                   ) -> list[Prompt]:
    """``prompts`` with the ``<name>/<i>`` ones (a ``specbench<N>`` chunk's) named
    ``specbench/<question id>``: the feature job answered the Spec-Bench dev questions that
    are not held out (``train_heads.prompts.specbench_split`` with the folder's
    ``eval_prompt_tokens``, ``eval_every``, ``eval_offset`` from its ``key.json``), in order.
    ``ConfigError`` unless the cached prompts are exactly those questions (all of them) and
    the ``heldout`` ones exactly the held-out questions, or if a question is in both."""
    if tokenizer is None:
        raise ConfigError("data.specbench needs the model's tokenizer (to match the cached "
                          "Spec-Bench answers to their questions)")
    try:
        settings = json.loads((directory / "key.json").read_text())
        sb_train, held = specbench_split(tokenizer, int(settings["eval_prompt_tokens"]),
                                         int(settings["eval_every"]),
                                         int(settings["eval_offset"]))
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"{directory}/key.json: cannot read the feature job's held-out "
                          f"settings ({e!r}); rerun the feature job to rewrite it") from None
    check_disjoint(sb_train, held)
    cached = [p for p in prompts if p.prompt_id.startswith(f"{name}/")]
    if [p.ids for p in cached] != [p.ids for p in sb_train]:
        raise ConfigError(
            f"the {name}_*.safetensors chunks in {directory} hold {len(cached)} prompts, not "
            f"the {len(sb_train)} Spec-Bench dev questions that are not held out (an "
            f"interrupted run, or other settings); {specbench_hint(name)}")
    if [p.ids for p in prompts if p.split == 1] != [p.ids for p in held]:
        raise ConfigError(f"the heldout_*.safetensors chunks in {directory} are not the "
                          f"{len(held)} held-out Spec-Bench questions of its key.json")
    ids = {p.prompt_id: f"specbench/{q.prompt_id}" for p, q in zip(cached, sb_train,
                                                                   strict=True)}
    return [Prompt(ids[p.prompt_id], "specbench", p.ids, p.split) if p.prompt_id in ids
            else p for p in prompts]


def trained_specbench_ids(prompts: list[Prompt], splits: list[int]) -> list[str]:
    """The Spec-Bench question ids of the sequences in split 0 (``splits``: one per prompt,
    a cache's after ``limit_train``), in order."""
    if len(splits) != len(prompts):
        raise ConfigError(f"the cached exit data has {len(splits)} sequences, the feature data "
                          f"{len(prompts)}: delete the stale hidden_L*.safetensors cache")
    return [p.prompt_id.removeprefix("specbench/") for p, s in zip(prompts, splits, strict=True)
            if s == 0 and p.prompt_id.startswith("specbench/")]


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


def exit_data_from_features(lm: LayeredLM, directory: Path, exits: list[int],
                            train_names: Sequence[str] = ("train",)
                            ) -> tuple[list[Generated], list[int]]:
    """Training (split 0: the ``train_names`` chunks, in order; ``train_chunk_names``) and
    held-out (split 1: the ``heldout`` chunks) sequences with exit states (module doc)."""
    train = exit_states(lm, FeatureSequences.concat(
        [load_chunks(directory, name) for name in train_names]), exits)
    held = exit_states(lm, load_chunks(directory, "heldout"), exits)
    return train + held, [0] * len(train) + [1] * len(held)
