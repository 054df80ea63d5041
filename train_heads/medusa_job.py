"""``python -m train_heads.train head=medusa``: train Medusa heads for the target.

Head ``j`` reads the target's normed last hidden state ``a_p = RMSNorm_g(h_N,p)`` and predicts
the token ``j + 2`` positions on (``specflow.models.medusa_head``):

    x^{l+1} = x^l + silu(W_{j,l} x^l + b_{j,l}),  x^0 = a_p         (residual blocks)
    q_j     = softmax(U x^L)                                        (t_{p+j+2})

``W`` starts at zero (each head starts as the target's own next-token guess) and is the only
thing trained; ``U`` is the target's LM head, frozen and copied into each head (Medusa-1 with
a frozen LM head: the heads' optimiser state is ``H x H`` per block, not ``V x H``).  Loss:
sum over heads of ``decay^j`` times the cross-entropy against the target's greedy token
``t_{p+j+2}`` at every answer position (Medusa's weighting).

Phases, each timed into ``metrics.json``:

1. data: the target answers the local-text prompts and the held-out Spec-Bench questions
   greedily, keeping ``h_N`` (``train_heads.feature_data.generate_chunked``; chunked cache in
   ``<data cache>/<model>/medusa-<key>``: a rerun loads it, an interrupted run resumes);
2. held-out top-1 agreement of each head with the target's greedy token, before;
3. fit with Lightning (``MedusaDistiller``);
4. agreement after; the heads written as a Medusa folder (``config.json`` +
   ``medusa_lm_head.safetensors``, ``save_medusa_folder``) to ``<run>/medusa/`` and, with
   ``output.install``, to ``<cache>/heads/<model>/medusa/``, where ``drafter=medusa`` finds
   them (``heads: default``).
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf

from specflow.errors import ConfigError
from specflow.models.medusa_head import MedusaHeads, default_medusa_path, save_medusa_folder
from train_heads.cache import data_cache_dir
from train_heads.feature_data import FeatureSequences
from train_heads.feature_job import feature_data_key, train_and_heldout
from train_heads.job_setup import make_logger, trainer_args
from train_heads.local_prompts import local_prompts
from train_heads.prompts import chat_ids, shared_prefix, specbench_split

log = logging.getLogger(__name__)


def medusa_rows(data: FeatureSequences, num_heads: int, skip: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Training rows of ``data``: ``(h_N [R, H], labels [R, num_heads])`` with
    ``labels[r, j] = t_{p+j+2}`` for row ``r`` at position ``p`` (-100 past the sequence's
    end).  Rows: the positions from the end of the prompt on (the last prompt position
    predicts the answer's first token), after ``skip`` shared template tokens."""
    feats, labels = [], []
    for i in range(data.num_seqs):
        tokens, hidden, prompt_len = data.seq(i)  # [L], [L-1, H]
        start = max(prompt_len - 1, skip)
        n = hidden.shape[0]
        if n <= start:
            continue
        pos = torch.arange(start, n)  # positions p with h_N,p known
        lab = torch.full((n - start, num_heads), -100, dtype=torch.long)
        for j in range(num_heads):
            target = pos + j + 2
            ok = target < tokens.numel()
            lab[ok, j] = tokens[target[ok]]
        feats.append(hidden[start:n])
        labels.append(lab)
    if not feats:
        return torch.zeros(0, data.feats.shape[1]), torch.zeros(0, num_heads, dtype=torch.long)
    return torch.cat(feats), torch.cat(labels)


class MedusaBlocks(torch.nn.Module):
    """The trainable part: ``num_layers`` residual blocks per head, zero-initialised."""

    def __init__(self, num_heads: int, num_layers: int, hidden: int) -> None:
        super().__init__()
        self.heads = torch.nn.ModuleList(
            torch.nn.ModuleList(torch.nn.Linear(hidden, hidden) for _ in range(num_layers))
            for _ in range(num_heads))
        for block in self.parameters():
            torch.nn.init.zeros_(block)

    def forward(self, a: torch.Tensor) -> list[torch.Tensor]:
        """``a [R, H]`` -> each head's ``x^L [R, H]``."""
        out = []
        for head in self.heads:
            x = a
            for lin in head:
                x = x + F.silu(lin(x))
            out.append(x)
        return out


def head_logits(blocks: MedusaBlocks, feats: torch.Tensor, norm: torch.Tensor,
                lm_head: torch.Tensor, eps: float) -> list[torch.Tensor]:
    """``h_N [R, H]`` -> each head's logits ``[R, V]``."""
    a = F.rms_norm(feats, (feats.shape[-1],), norm, eps)
    return [x @ lm_head.t() for x in blocks(a)]


class MedusaDistiller(L.LightningModule):
    """Cross-entropy of every head against the target's greedy tokens (module doc)."""

    def __init__(self, blocks: MedusaBlocks, norm: torch.Tensor, lm_head: torch.Tensor,
                 eps: float, lr: float, weight_decay: float, decay: float) -> None:
        super().__init__()
        self.blocks = blocks
        self.register_buffer("norm", norm.detach().float().clone(), persistent=False)
        self.register_buffer("lm_head", lm_head.detach().float().clone(), persistent=False)
        self.eps, self.lr, self.weight_decay, self.decay = eps, lr, weight_decay, decay

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        feats, labels = batch
        logits = head_logits(self.blocks, feats, self.norm, self.lm_head, self.eps)
        return sum(self.decay ** j * F.cross_entropy(lg, labels[:, j], ignore_index=-100)
                   for j, lg in enumerate(logits) if (labels[:, j] >= 0).any())

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        loss = self._loss(batch)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        loss = self._loss(batch)
        self.log("val/loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):  # noqa: ANN201
        return torch.optim.AdamW(self.blocks.parameters(), lr=self.lr,
                                 weight_decay=self.weight_decay)


@torch.no_grad()
def agreement(blocks: MedusaBlocks, feats: torch.Tensor, labels: torch.Tensor, lm: Any,
              batch: int = 256) -> list[float]:
    """Per head: the share of held-out rows whose top-1 token is the target's greedy one."""
    hits = torch.zeros(labels.shape[1])
    counts = (labels >= 0).sum(0).float()
    for s in range(0, feats.shape[0], batch):
        logits = head_logits(blocks, feats[s:s + batch].float(), lm.final_norm.float(),
                             lm.lm_head.float(), lm.eps)
        lab = labels[s:s + batch]
        for j, lg in enumerate(logits):
            ok = lab[:, j] >= 0
            hits[j] += float((lg.argmax(-1)[ok] == lab[ok, j]).sum())
    return [round(float(h / max(c, 1)), 4) for h, c in zip(hits, counts, strict=True)]


def as_medusa_heads(blocks: MedusaBlocks, lm: Any, source: str) -> MedusaHeads:
    """The trained blocks with the target's LM head copied into each head."""
    return MedusaHeads(
        source, lm.info.name,
        [[(lin.weight.detach().float().clone(), lin.bias.detach().float().clone())
          for lin in head] for head in blocks.heads],
        [lm.lm_head.detach().float().clone() for _ in blocks.heads])


def run_medusa(cfg: DictConfig, loaded: Any, out_dir: Path) -> dict[str, Any]:
    """The ``head=medusa`` job (module doc); returns the metrics also written to disk."""
    lm, info, tok = loaded.lm, loaded.info, loaded.tokenizer
    hc = cfg.head
    num_heads, num_layers = int(hc.num_heads), int(hc.num_layers)
    if num_heads < 1 or num_layers < 1:
        raise ConfigError(f"head.num_heads={num_heads}, head.num_layers={num_layers}: both "
                          "must be >= 1 (Medusa's defaults: 3 heads of 1 block)")
    if int(hc.data.num_prompts) < 1:
        raise ConfigError(f"head.data.num_prompts={hc.data.num_prompts}: Medusa heads train "
                          "on the target's answers to local-text prompts; use >= 1")
    times: dict[str, float] = {}
    # ---------------------------------------------------------------- 1. data
    t0 = time.perf_counter()
    prompts = local_prompts(int(hc.data.num_prompts), seed=int(hc.data.seed))
    train_ids = [ids for ids in (chat_ids(tok, p.content) for p in prompts)
                 if len(ids) <= int(hc.data.max_prompt_tokens)]
    _, held = specbench_split(tok, int(hc.data.eval_prompt_tokens), int(hc.data.eval_every),
                              int(hc.data.eval_offset))
    if not held:
        raise ConfigError(f"no held-out Spec-Bench question (head.data.eval_every="
                          f"{hc.data.eval_every}, eval_offset={hc.data.eval_offset})")
    key = feature_data_key(info.name, info.weights_fingerprint, str(lm.dtype),
                           OmegaConf.to_container(hc.data, resolve=True))
    directory = data_cache_dir(cfg.data.cache_dir) / Path(info.name).name / f"medusa-{key}"
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "key.json").write_text(json.dumps(OmegaConf.to_container(hc.data), indent=2))
    train, t_train, val, t_val = train_and_heldout(lm, train_ids, held, directory, hc.data)
    skip = shared_prefix(held)
    train_x, train_y = medusa_rows(train, num_heads, skip)
    val_x, val_y = medusa_rows(val, num_heads, skip)
    if train_x.shape[0] == 0:
        raise ConfigError("no training rows: every local prompt is longer than "
                          "head.data.max_prompt_tokens, or the answers are empty")
    times["data_s"] = time.perf_counter() - t0
    log.info("data: %d training rows, %d held-out rows; %s", train_x.shape[0],
             val_x.shape[0], {**t_train, **t_val})
    # ---------------------------------------------------------------- 2. before
    torch.manual_seed(int(cfg.seed))
    blocks = MedusaBlocks(num_heads, num_layers, info.hidden_size)
    before = agreement(blocks, val_x, val_y, lm)
    # ---------------------------------------------------------------- 3. fit
    rows = int(hc.batch_rows)
    gen = torch.Generator().manual_seed(int(cfg.seed))
    train_dl = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(train_x, train_y), batch_size=rows, shuffle=True,
        generator=gen)
    val_dl = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(val_x, val_y),
                                         batch_size=rows)
    module = MedusaDistiller(blocks, lm.final_norm, lm.lm_head, float(lm.eps),
                             float(hc.optim.lr), float(hc.optim.weight_decay),
                             float(hc.loss.decay))
    trainer = L.Trainer(**trainer_args(cfg.trainer), logger=make_logger(cfg.logger, out_dir),
                        enable_progress_bar=bool(cfg.progress), enable_checkpointing=False,
                        default_root_dir=str(out_dir))
    t0 = time.perf_counter()
    trainer.fit(module, train_dl, val_dl)
    times["train_s"] = time.perf_counter() - t0
    blocks = module.blocks.cpu().eval()
    # ---------------------------------------------------------------- 4. after + save
    after = agreement(blocks, val_x, val_y, lm)
    folder = save_medusa_folder(out_dir / "medusa", as_medusa_heads(blocks, lm, str(out_dir)),
                                info)
    result: dict[str, Any] = {
        "model": info.name, "weights_fingerprint": info.weights_fingerprint,
        "head": OmegaConf.to_container(hc, resolve=True),
        "agreement_before": before, "agreement_after": after, "times_s": times,
        "data": {**t_train, **t_val, "cache": str(directory), "train_rows": train_x.shape[0],
                 "heldout_rows": val_x.shape[0], "train_sequences": train.num_seqs,
                 "heldout_sequences": val.num_seqs},
        "heldout_prompt_ids": [p.prompt_id for p in held],
        "train_steps": int(trainer.global_step), "medusa_path": str(folder),
    }
    if cfg.output.install:
        dest = Path(cfg.output.install_path or default_medusa_path(info.name))
        shutil.copytree(folder, dest, dirs_exist_ok=True)
        result["installed_path"] = str(dest)
    (out_dir / "metrics.json").write_text(json.dumps(result, indent=2, default=str))
    (out_dir / "report.md").write_text(
        f"# Medusa heads: {info.name}\n\n{num_heads} heads of {num_layers} block(s), "
        f"{train_x.shape[0]} training rows, {int(trainer.global_step)} steps, "
        f"{times['data_s']:.0f} s data + {times['train_s']:.0f} s training.\n\n"
        "| head (predicts) | held-out top-1 agreement before | after |\n|---|---|---|\n"
        + "".join(f"| {j} (t+{j + 2}) | {b:.3f} | {a:.3f} |\n"
                  for j, (b, a) in enumerate(zip(before, after, strict=True))))
    log.info("medusa heads: agreement before %s, after %s; written to %s", before, after,
             folder)
    return result
