"""Data of the feature head: the target's own greedy answers and its last-layer features.

Phase ``data`` of ``head=feature`` (``train_heads.feature_job``):

- training prompts from local text (``train_heads.local_prompts``; none from Spec-Bench or
  HumanEval), in the chat template, each answered greedily by the target
  (``generate_with_hidden``: batched decoding, every position's ``h_N`` kept);
- held-out prompts: Spec-Bench dev questions (never trained on), answered the same way;
  their generated positions measure agreement;
- with ``head.data.specbench_train``, also the other Spec-Bench dev questions (the ones not
  held out), answered the same way and added to the training sequences.

Written in chunks (``train_<i>``, ``heldout_<i>``, ``specbench<N>_<i>.safetensors`` with
``N`` the answers' token budget, under a folder keyed by the model's weights and the data
config), so an interrupted run resumes at the next chunk and a rerun loads everything
without running the model.  A sequence of ``L`` tokens has ``L - 1`` feature
rows (the last token is never fed back).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

log = logging.getLogger("train_heads")


@dataclass
class FeatureSequences:
    """Sequences flattened: ``tokens [sum L_i]``, ``feats [sum (L_i - 1), H]`` float32."""

    tokens: torch.Tensor
    tok_offsets: torch.Tensor  # [S+1]
    feats: torch.Tensor
    feat_offsets: torch.Tensor  # [S+1]
    prompt_len: torch.Tensor  # [S]

    @property
    def num_seqs(self) -> int:
        return int(self.prompt_len.numel())

    @property
    def num_positions(self) -> int:
        return int(self.feats.shape[0])

    def seq(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """``(tokens [L], feats [L-1, H], prompt_len)`` of sequence ``i``."""
        t0, t1 = int(self.tok_offsets[i]), int(self.tok_offsets[i + 1])
        f0, f1 = int(self.feat_offsets[i]), int(self.feat_offsets[i + 1])
        return self.tokens[t0:t1], self.feats[f0:f1], int(self.prompt_len[i])

    @classmethod
    def empty(cls, hidden_size: int) -> FeatureSequences:
        """No sequences (features of width ``hidden_size``)."""
        zero = torch.zeros(1, dtype=torch.long)
        return cls(torch.zeros(0, dtype=torch.long), zero, torch.zeros(0, hidden_size), zero,
                   torch.zeros(0, dtype=torch.long))

    @classmethod
    def from_generated(cls, gens: list[Any], layer: int) -> FeatureSequences:
        toks = [torch.tensor(g.tokens, dtype=torch.long) for g in gens]
        feats = [g.hidden[layer].float() for g in gens]
        return cls(
            tokens=torch.cat(toks),
            tok_offsets=torch.tensor([0] + [len(t) for t in toks]).cumsum(0),
            feats=torch.cat(feats),
            feat_offsets=torch.tensor([0] + [f.shape[0] for f in feats]).cumsum(0),
            prompt_len=torch.tensor([g.prompt_len for g in gens]),
        )

    @classmethod
    def concat(cls, parts: list[FeatureSequences]) -> FeatureSequences:
        tok_off, feat_off = [torch.zeros(1, dtype=torch.long)], [torch.zeros(1, dtype=torch.long)]
        nt = nf = 0
        for p in parts:
            tok_off.append(p.tok_offsets[1:] + nt)
            feat_off.append(p.feat_offsets[1:] + nf)
            nt += int(p.tok_offsets[-1])
            nf += int(p.feat_offsets[-1])
        return cls(torch.cat([p.tokens for p in parts]), torch.cat(tok_off),
                   torch.cat([p.feats for p in parts]), torch.cat(feat_off),
                   torch.cat([p.prompt_len for p in parts]))

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        save_file({"tokens": self.tokens, "tok_offsets": self.tok_offsets,
                   "feats": self.feats.contiguous(), "feat_offsets": self.feat_offsets,
                   "prompt_len": self.prompt_len}, str(tmp))
        tmp.replace(path)  # a crash mid-write never leaves a half chunk

    @classmethod
    def load(cls, path: Path) -> FeatureSequences:
        t = load_file(str(path))
        return cls(t["tokens"], t["tok_offsets"], t["feats"], t["feat_offsets"], t["prompt_len"])


def generate_chunked(lm: Any, prompts: list[list[int]], directory: Path, name: str,
                     max_new_tokens: int, batch_size: int, chunk: int, eos: tuple[int, ...],
                     temperature: float = 0.0, seed: int = 0
                     ) -> tuple[FeatureSequences, dict[str, float]]:
    """Answer ``prompts`` with ``lm`` (greedily, or drawn at ``temperature`` with chunk ``i``
    seeded by ``seed * 1_000_003 + i``, so a resumed run draws what an uninterrupted one
    would), keeping ``h_N``; chunks of ``chunk`` prompts are saved as
    ``<directory>/<name>_<i>.safetensors`` and reused when present.  No prompts: empty
    sequences."""
    from train_heads.generate import generate_with_hidden

    n = lm.info.num_layers
    parts, built_s, built_pos = [], 0.0, 0
    num_chunks = (len(prompts) + chunk - 1) // chunk
    for c in range(num_chunks):
        path = directory / f"{name}_{c}.safetensors"
        if path.exists():
            parts.append(FeatureSequences.load(path))
            continue
        t0 = time.perf_counter()
        gens = generate_with_hidden(lm, prompts[c * chunk : (c + 1) * chunk], [], max_new_tokens,
                                    batch_size, eos, progress=False, temperature=temperature,
                                    seed=seed * 1_000_003 + c)
        part = FeatureSequences.from_generated(gens, n)
        part.save(path)
        spent = time.perf_counter() - t0
        built_s += spent
        built_pos += part.num_positions
        parts.append(part)
        done = sum(p.num_positions for p in parts)
        log.info("[data] %s chunk %d/%d: %d positions in %.0f s (%.1f ms/position); %d so far",
                 name, c + 1, num_chunks, part.num_positions, spent,
                 1000 * spent / max(part.num_positions, 1), done)
    seqs = FeatureSequences.concat(parts) if parts else FeatureSequences.empty(lm.info.hidden_size)
    return seqs, {f"{name}_built_s": built_s, f"{name}_built_positions": built_pos}


def draft_vocabulary(train: FeatureSequences, size: int, vocab_size: int,
                     always: tuple[int, ...] = ()) -> tuple[torch.Tensor, dict[str, float]]:
    """The ``size`` most frequent tokens of the training sequences (ties and any shortfall
    filled with the lowest ids: byte-level BPE numbers frequent tokens first) plus
    ``always``; ascending.  Also the share of training tokens it covers."""
    counts = torch.bincount(train.tokens, minlength=vocab_size).float()
    counts += torch.linspace(1e-3, 0.0, vocab_size)  # low ids win ties
    size = min(size, vocab_size)
    top = counts.topk(size).indices
    ids = torch.cat([top, torch.tensor(list(always), dtype=torch.long)]).unique()
    covered = float(counts[ids].sum() / counts.sum())
    return ids, {"draft_vocab_size": int(ids.numel()), "draft_vocab_train_coverage": covered}


def data_key(parts: dict[str, Any]) -> str:
    import hashlib

    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]
