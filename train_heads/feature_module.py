"""Lightning pieces of the feature head: batches of whole sequences, and the distiller.

A sequence of ``L`` tokens ``t`` with target features ``f_0 .. f_{L-2}`` gives ``T = L - 2``
training rows; row ``p``:

    input   (f_p, t_{p+1})            -> f^_{p+1} = head(...)_p
    targets f_{p+1}                    (feature regression on x = RMSNorm_g(f))
            softmax(W_sub x_{p+1})     (the target's distribution of t_{p+2} on the draft
                                        vocabulary: distillation, KL)
    label   t_{p+2}                    (the target's greedy token on generated positions:
                                        agreement)

    loss = reg_weight * SmoothL1(x^_{p+1}, x_{p+1}) + kl_weight * KL(p || q)

(``x^ = RMSNorm_g(f^)``; a head of style ``eagle`` reads ``RMSNorm_g(f_p)`` and predicts
``x^`` itself: ``FeatureHead.features`` / ``lm_input``.)

averaged over rows past the shared chat-template prefix, and over ``depth`` drafting steps:
step ``s > 1`` feeds the head its own predictions as drafting does (``FeatureHead.forward``).
``feature_noise`` adds uniform noise of that relative size to the input features (EAGLE's
robustness to its own errors).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import lightning as L
import torch
import torch.nn.functional as F

from specflow.models.feature_head import FeatureHead
from train_heads.feature_data import FeatureSequences


@dataclass
class FeatureBatch:
    """A padded batch of ``B`` sequences, ``T`` rows each (module doc)."""

    feats: torch.Tensor  # [B, T, H]  f_p
    next_tokens: torch.Tensor  # [B, T]  t_{p+1}
    target_feats: torch.Tensor  # [B, T, H]  f_{p+1}
    labels: torch.Tensor  # [B, T]  t_{p+2}
    key_valid: torch.Tensor  # [B, T] bool: a real row
    loss_mask: torch.Tensor  # [B, T] bool: counted in the loss
    generated: torch.Tensor  # [B, T] bool: t_{p+2} is the target's greedy token


def collate(data: FeatureSequences, seq_ids: list[int], skip: int) -> FeatureBatch:
    items = [data.seq(i) for i in seq_ids]
    t_max = max(len(tok) - 2 for tok, _, _ in items)
    b, h = len(items), data.feats.shape[1]
    feats = torch.zeros(b, t_max, h)
    target = torch.zeros(b, t_max, h)
    nxt = torch.zeros(b, t_max, dtype=torch.long)
    labels = torch.zeros(b, t_max, dtype=torch.long)
    valid = torch.zeros(b, t_max, dtype=torch.bool)
    gen = torch.zeros(b, t_max, dtype=torch.bool)
    for r, (tok, f, plen) in enumerate(items):
        t = len(tok) - 2
        feats[r, :t] = f[:t]
        target[r, :t] = f[1 : t + 1]
        nxt[r, :t] = tok[1 : t + 1]
        labels[r, :t] = tok[2 : t + 2]
        valid[r, :t] = True
        gen[r, :t] = torch.arange(t) + 2 >= plen
    pos = torch.arange(t_max)[None]
    return FeatureBatch(feats, nxt, target, labels, valid, valid & (pos + 1 >= skip), gen)


def batches_by_rows(data: FeatureSequences, seq_ids: list[int], max_rows: int,
                    seed: int) -> list[list[int]]:
    """Sequences grouped by length into batches of at most ``max_rows`` padded rows, in a
    seeded random order."""
    order = sorted(seq_ids, key=lambda i: int(data.tok_offsets[i + 1] - data.tok_offsets[i]))
    out, cur, longest = [], [], 0
    for i in order:
        n = int(data.tok_offsets[i + 1] - data.tok_offsets[i]) - 2
        if cur and max(longest, n) * (len(cur) + 1) > max_rows:
            out.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    if cur:
        out.append(cur)
    random.Random(seed).shuffle(out)
    return out


class _Batches(torch.utils.data.Dataset):
    def __init__(self, data: FeatureSequences, batches: list[list[int]], skip: int) -> None:
        self.data, self.batches, self.skip = data, batches, skip

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: int) -> FeatureBatch:
        return collate(self.data, self.batches[i], self.skip)


class FeatureDataModule(L.LightningDataModule):
    """Training and held-out sequences as padded batches of at most ``max_rows`` rows."""

    def __init__(self, train: FeatureSequences, val: FeatureSequences, max_rows: int,
                 skip: int, seed: int = 0) -> None:
        super().__init__()
        self.train, self.val, self.max_rows, self.skip, self.seed = train, val, max_rows, skip, seed
        self.epoch = 0

    def train_dataloader(self):
        batches = batches_by_rows(self.train, list(range(self.train.num_seqs)), self.max_rows,
                                  self.seed + self.epoch)
        self.epoch += 1
        return torch.utils.data.DataLoader(_Batches(self.train, batches, self.skip),
                                           batch_size=None, shuffle=False)

    def val_dataloader(self):
        batches = batches_by_rows(self.val, list(range(self.val.num_seqs)), self.max_rows, 0)
        return torch.utils.data.DataLoader(_Batches(self.val, batches, self.skip),
                                           batch_size=None, shuffle=False)


def feature_losses(head: FeatureHead, batch: FeatureBatch, embed: torch.Tensor,
                   final_norm: torch.Tensor, sub_weight: torch.Tensor, eps: float,
                   reg_weight: float = 1.0, kl_weight: float = 0.1,
                   feature_noise: float = 0.0, depth: int = 1) -> dict[str, torch.Tensor]:
    """The loss and metrics of one batch (module doc), averaged over ``depth`` drafting
    steps (``FeatureHead.forward``); ``sub_weight [S, H]`` = ``W_sub``.  ``agree`` is
    step 1's agreement with the target's greedy tokens, ``agree_<s>`` step s's."""
    feats = batch.feats
    if feature_noise > 0:
        scale = feats.pow(2).mean(-1, keepdim=True).sqrt()
        feats = feats + (torch.rand_like(feats) * 2 - 1) * feature_noise * scale
    emb = F.embedding(batch.next_tokens, embed).float()
    preds = head(head.features(feats, final_norm, eps), emb, batch.key_valid, depth)
    h = feats.shape[-1]
    # the teacher in float32 even under bf16-mixed training (its targets stay exact)
    with torch.no_grad(), torch.autocast(feats.device.type, enabled=False):
        xt = F.rms_norm(batch.target_feats, (h,), final_norm, eps)
        teacher = F.log_softmax(xt @ sub_weight.t(), dim=-1)  # [B, T, S]
        teacher_p = teacher.exp()
    pos = torch.arange(feats.shape[1], device=feats.device)[None]
    out: dict[str, torch.Tensor] = {}
    total = feats.new_zeros(())
    for step, pred in enumerate(preds, start=1):
        m = batch.loss_mask & (pos >= step - 1)
        denom = m.sum().clamp(min=1)
        xs = head.lm_input(pred, final_norm, eps)  # what the LM head multiplies
        reg = (F.smooth_l1_loss(xs, xt, reduction="none").mean(-1) * m).sum() / denom
        student = F.log_softmax(xs @ sub_weight.t(), dim=-1)  # [B, T, S]
        kl = ((teacher_p * (teacher - student)).sum(-1) * m).sum() / denom
        total = total + (reg_weight * reg + kl_weight * kl) / len(preds)
        with torch.no_grad():
            g = batch.generated & m
            picked = head.vocab_ids[student.argmax(-1)]
            out[f"agree_{step}"] = ((picked == batch.labels) & g).sum() / g.sum().clamp(min=1)
        if step == 1:
            out["reg"], out["kl"], out["agree"] = reg, kl, out["agree_1"]
    out["loss"] = total
    return out


class FeatureHeadDistiller(L.LightningModule):
    """Trains a ``FeatureHead`` against the frozen target's features and LM head."""

    def __init__(self, head: FeatureHead, embed: torch.Tensor, final_norm: torch.Tensor,
                 sub_weight: torch.Tensor, eps: float, lr: float = 5e-4,
                 weight_decay: float = 0.0, warmup_steps: int = 10, total_steps: int = 100,
                 reg_weight: float = 1.0, kl_weight: float = 0.1,
                 feature_noise: float = 0.0, depth: int = 1) -> None:
        super().__init__()
        self.head = head
        self.register_buffer("embed", embed.detach(), persistent=False)
        self.register_buffer("final_norm", final_norm.detach().float(), persistent=False)
        self.register_buffer("sub_weight", sub_weight.detach().float(), persistent=False)
        self.eps = eps
        self.lr, self.weight_decay = lr, weight_decay
        self.warmup_steps, self.total_steps = warmup_steps, max(total_steps, 1)
        self.reg_weight, self.kl_weight, self.feature_noise = reg_weight, kl_weight, feature_noise
        self.depth = depth
        self.seen = 0  # training positions (loss rows) seen so far
        self.curve: list[dict[str, float]] = []  # per validation: positions seen, metrics

    def _losses(self, batch: FeatureBatch, noise: float) -> dict[str, torch.Tensor]:
        return feature_losses(self.head, batch, self.embed, self.final_norm, self.sub_weight,
                              self.eps, self.reg_weight, self.kl_weight, noise, self.depth)

    def transfer_batch_to_device(self, batch, device, dataloader_idx):
        return FeatureBatch(**{k: v.to(device) for k, v in vars(batch).items()})

    def training_step(self, batch: FeatureBatch, batch_idx: int) -> torch.Tensor:
        out = self._losses(batch, self.feature_noise)
        self.seen += int(batch.loss_mask.sum())
        b = batch.feats.shape[0]
        for k in ("loss", "reg", "kl", "agree"):
            self.log(f"train/{k}", out[k], prog_bar=k in ("loss", "agree"), batch_size=b)
        return out["loss"]

    def validation_step(self, batch: FeatureBatch, batch_idx: int) -> None:
        out = self._losses(batch, 0.0)
        b = batch.feats.shape[0]
        for k in ("loss", "reg", "kl", *(f"agree_{s}" for s in range(1, self.depth + 1))):
            self.log(f"val/{k}", out[k], prog_bar=k == "agree_1", batch_size=b)

    def on_validation_epoch_end(self) -> None:
        """Record the learning curve: held-out metrics against training positions seen."""
        metrics = self.trainer.callback_metrics
        point = {"positions_seen": float(self.seen), "step": float(self.global_step)}
        point.update({k.removeprefix("val/"): float(v) for k, v in metrics.items()
                      if k.startswith("val/")})
        self.curve.append(point)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.head.parameters(), lr=self.lr,
                                weight_decay=self.weight_decay, betas=(0.9, 0.95))

        def schedule(step: int) -> float:  # linear warmup, cosine decay to 10 %
            if step < self.warmup_steps:
                return (step + 1) / self.warmup_steps
            span = max(1, self.total_steps - self.warmup_steps)
            frac = min(1.0, (step - self.warmup_steps) / span)
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
