"""The hidden-state cache: generate once, store every exit's states and the teacher's top-k.

A ``HiddenCache`` holds ``S`` sequences flattened into ``R`` rows (one per position that has
hidden states, see ``train_heads.generate``):

    tokens      [R] int64   the token at each position
    next_token  [R] int64   the token that follows (the teacher's greedy choice on generated
                            positions; the prompt's own next token otherwise)
    seq_id      [R] int64   sequence index; ``offsets [S+1]`` delimits each sequence's rows
    generated   [R] bool    the row's prediction is a generated token (row >= P-1)
    hidden_L    [R, H] float32 for every cached exit ``L`` and for ``N`` (the final layer)
    topk_logp, topk_ids [R, k]  the final layer's top-k log-probs and ids (training targets)

plus per sequence ``split`` (0 train, 1 eval).  Files: ``<dir>/hidden_L<a>-<b>-...``
``.safetensors`` under a directory keyed by the model's weights fingerprint and the data
config, so a rerun (or a run that needs a subset of the layers) loads instead of recomputing.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from specflow.cache_root import cache_root
from train_heads.generate import Generated
from train_heads.losses import teacher_topk

log = logging.getLogger(__name__)


@dataclass
class HiddenCache:
    """Flattened per-position data of the train and eval sequences (see module doc)."""

    tokens: torch.Tensor
    next_token: torch.Tensor
    seq_id: torch.Tensor
    generated: torch.Tensor
    offsets: torch.Tensor
    split: torch.Tensor
    prompt_len: torch.Tensor
    hidden: dict[int, torch.Tensor]
    topk_logp: torch.Tensor
    topk_ids: torch.Tensor
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def layers(self) -> list[int]:
        """Cached exits (including the final layer N)."""
        return sorted(self.hidden)

    @property
    def num_rows(self) -> int:
        return int(self.tokens.shape[0])

    def rows(self, split: int, generated_only: bool = False, skip: int = 0) -> torch.Tensor:
        """Row indices of sequences in ``split`` (0 train / 1 eval), leaving out each
        sequence's first ``skip`` positions (the chat template's shared system prefix) and,
        with ``generated_only``, every row that does not predict a generated token."""
        pos = torch.arange(self.num_rows) - self.offsets[self.seq_id]
        keep = (self.split[self.seq_id] == split) & (pos >= skip)
        if generated_only:
            keep &= self.generated
        return keep.nonzero().squeeze(1)

    def limit_train(self, max_positions: int) -> HiddenCache:
        """This cache with only its first training sequences, up to ``max_positions`` rows
        in all (the later ones move to split 2, which nothing reads): a data-size
        experiment on one cached data phase."""
        lengths = self.offsets[1:] - self.offsets[:-1]  # [S]
        train = self.split == 0
        seen = torch.cumsum(torch.where(train, lengths, 0), 0)
        split = torch.where(train & (seen > max_positions), 2, self.split)
        return replace(self, split=split)

    def sequences(self, split: int) -> list[int]:
        """Indices of the sequences of ``split``."""
        return (self.split == split).nonzero().squeeze(1).tolist()

    # ------------------------------------------------------------------ files
    def save(self, path: Path) -> None:
        tensors = {
            "tokens": self.tokens, "next_token": self.next_token, "seq_id": self.seq_id,
            "generated": self.generated.to(torch.uint8), "offsets": self.offsets,
            "split": self.split, "prompt_len": self.prompt_len,
            "topk_logp": self.topk_logp, "topk_ids": self.topk_ids,
            **{f"hidden_{k}": v.contiguous() for k, v in self.hidden.items()},
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        save_file(tensors, str(tmp), metadata={"meta": json.dumps(self.meta)})
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path, layers: list[int] | None = None) -> HiddenCache:
        """Load a cache file, keeping only ``layers`` (+ N) when given."""
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {}).get("meta", "{}"))
        t = load_file(str(path))
        n = int(meta["num_layers"])
        hidden = {int(k[7:]): v for k, v in t.items() if k.startswith("hidden_")}
        if layers is not None:
            hidden = {k: v for k, v in hidden.items() if k in layers or k == n}
        return cls(
            tokens=t["tokens"], next_token=t["next_token"], seq_id=t["seq_id"],
            generated=t["generated"].bool(), offsets=t["offsets"], split=t["split"],
            prompt_len=t["prompt_len"], hidden=hidden, topk_logp=t["topk_logp"],
            topk_ids=t["topk_ids"], meta=meta,
        )


@torch.inference_mode()
def build_cache(
    gens: list[Generated],
    splits: list[int],
    lm_head_fn,
    num_layers: int,
    topk: int,
    meta: dict[str, Any] | None = None,
    chunk: int = 512,
) -> HiddenCache:
    """Flatten generated sequences into a ``HiddenCache``.

    ``lm_head_fn(h_N) -> logits`` is the model's own final head (``lm.head(h, N)``); the
    teacher's top-k is computed from it in chunks of ``chunk`` rows.
    """
    tokens, nxt, seq, gen, offsets, plen = [], [], [], [], [0], []
    for s, g in enumerate(gens):
        rows = len(g.tokens) - 1
        tokens += g.tokens[:rows]
        nxt += g.tokens[1:]
        seq += [s] * rows
        gen += [p >= g.prompt_len - 1 for p in range(rows)]
        offsets.append(offsets[-1] + rows)
        plen.append(g.prompt_len)
    layers = sorted(gens[0].hidden)
    hidden = {layer: torch.cat([g.hidden[layer] for g in gens]).float() for layer in layers}
    final = hidden[num_layers]
    logps, ids = [], []
    for i in range(0, final.shape[0], chunk):
        v, k = teacher_topk(lm_head_fn(final[i : i + chunk]), topk)
        logps.append(v)
        ids.append(k)
    return HiddenCache(
        tokens=torch.tensor(tokens, dtype=torch.long),
        next_token=torch.tensor(nxt, dtype=torch.long),
        seq_id=torch.tensor(seq, dtype=torch.long),
        generated=torch.tensor(gen, dtype=torch.bool),
        offsets=torch.tensor(offsets, dtype=torch.long),
        split=torch.tensor(splits, dtype=torch.long),
        prompt_len=torch.tensor(plen, dtype=torch.long),
        hidden={k: v.clone() for k, v in hidden.items()},
        topk_logp=torch.cat(logps).clone(),
        topk_ids=torch.cat(ids).clone(),
        meta={**(meta or {}), "num_layers": num_layers, "topk": topk},
    )


def cache_key(parts: dict[str, Any]) -> str:
    """A short stable hash of a JSON-able dict (the data config + model fingerprint)."""
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def layers_filename(layers: list[int]) -> str:
    return "hidden_L" + "-".join(str(x) for x in sorted(layers)) + ".safetensors"


def find_cached(directory: Path, layers: list[int]) -> Path | None:
    """A cache file in ``directory`` holding at least ``layers``, if there is one."""
    for path in sorted(directory.glob("hidden_L*.safetensors")):
        have = {int(x) for x in path.stem[len("hidden_L"):].split("-") if x}
        if set(layers) <= have:
            return path
    return None


def data_cache_dir(configured: str | None) -> Path:
    """Where training data is cached: ``data.cache_dir``, or ``<cache root>/train_heads``
    (the one cache root of ``specflow.cache_root``: ``$SPECFLOW_CACHE`` or
    ``~/.cache/specflow``)."""
    return Path(configured).expanduser() if configured else cache_root() / "train_heads"
