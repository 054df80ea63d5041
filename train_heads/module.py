"""The ``LightningModule``: frozen base (only its LM head is needed), trainable exit heads or
attention adapters (whole sequences: ``ExitHeadDistiller.batch_logits``).

For each exit ``L`` and cached position with hidden state ``h_L``, the student logits are
``z_L = W_lm · E_L(h_L)`` (``E_L`` an ``ExitHead``, ``W_lm`` the frozen shared LM head) and
the loss is

    loss = Σ_L [ kl_weight · KL_K(p_N ‖ softmax z_L) + ce_weight · CE(z_L, next token) ]

averaged over positions, with ``KL_K`` the top-k-plus-remainder KL of
``train_heads.losses`` against the final layer's distribution ``p_N`` (self-distillation).
The base model's layers never run here: their outputs are in the cache.  ``W_lm`` is a
non-persistent buffer, so it follows the module to the GPU but stays out of checkpoints
(which hold the heads only).  Logged per exit: ``{stage}/kl_L{L}``, ``{stage}/agree_L{L}``
(top-1 agreement with the teacher), and ``{stage}/loss``.
"""

from __future__ import annotations

import math

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

from specflow.models.adapter_head import AdapterHead
from specflow.models.exit_heads import ExitHead
from train_heads.losses import topk_kl


class ExitHeadDistiller(L.LightningModule):
    """Train ``heads`` (exit layer -> ``ExitHead``) by self-distillation (see module doc).

    Args:
        lm_head: the frozen LM head weight ``[V, H]``.
        heads: the heads to train (modified in place).
        kl_weight, ce_weight: loss weights.
        lr, weight_decay: AdamW settings.
        warmup_steps: linear warm-up, then cosine decay to 10 % of ``lr`` over the run.
    """

    def __init__(
        self,
        lm_head: torch.Tensor,
        heads: dict[int, ExitHead] | dict[int, AdapterHead],
        kl_weight: float = 1.0,
        ce_weight: float = 0.0,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        warmup_steps: int = 10,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["lm_head", "heads"])
        self.heads = nn.ModuleDict({str(layer): head for layer, head in heads.items()})
        self.register_buffer("lm_head", lm_head.detach(), persistent=False)
        self.layers = sorted(heads)

    def exit_heads(self) -> dict[int, nn.Module]:
        """The heads, keyed by exit layer."""
        return {int(k): v for k, v in self.heads.items()}

    def logits(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """``h_L [B, H] -> z_L [B, V]`` through the head and the frozen LM head."""
        x = self.heads[str(layer)](hidden.to(self.lm_head.dtype))
        return F.linear(x, self.lm_head)

    def batch_logits(self, layer: int, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Student logits ``[R, V]`` at exit ``layer`` for the batch's R loss rows.

        An exit head reads its rows ``h_L [R, H]``; an attention adapter reads a batch of padded
        whole sequences (``train_heads.datamodule.SequencesDataset``): it runs over every row
        (``AdapterHead.sequence``: causal attention over the rows before, padding masked out
        of the keys) and the loss rows are ``loss_mask``'s, ``z = W_lm · RMSNorm_g(a)``.
        """
        head = self.heads[str(layer)]
        if not isinstance(head, AdapterHead):
            return self.logits(layer, batch[f"h{layer}"])
        adapted = head.sequence(batch[f"h{layer}"].to(self.lm_head.dtype),
                                batch["key_valid"])  # [B, T, H]
        return F.linear(head(adapted[batch["loss_mask"]]), self.lm_head)  # [R, V]

    def _step(self, batch: dict[str, torch.Tensor], stage: str) -> torch.Tensor:
        hp = self.hparams
        total = torch.zeros((), device=self.lm_head.device)
        n = batch["next"].shape[0]
        for layer in self.layers:
            z = self.batch_logits(layer, batch)
            kl = topk_kl(z, batch["topk_logp"], batch["topk_ids"]).mean()
            loss = hp.kl_weight * kl
            if hp.ce_weight:
                loss = loss + hp.ce_weight * F.cross_entropy(z.float(), batch["next"])
            agree = (z.argmax(-1) == batch["topk_ids"][:, 0]).float().mean()
            self.log(f"{stage}/kl_L{layer}", kl, batch_size=n)
            self.log(f"{stage}/agree_L{layer}", agree, batch_size=n,
                     prog_bar=stage == "val")
            total = total + loss
        self.log(f"{stage}/loss", total, batch_size=n, prog_bar=True)
        return total

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._step(batch, "train")

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._step(batch, "val")

    def configure_optimizers(self):
        hp = self.hparams
        opt = torch.optim.AdamW(self.heads.parameters(), lr=hp.lr, weight_decay=hp.weight_decay)
        total = max(int(self.trainer.estimated_stepping_batches), 1)
        warm = min(hp.warmup_steps, max(total // 4, 1))

        def factor(step: int) -> float:
            if step < warm:
                return (step + 1) / warm
            t = (step - warm) / max(total - warm, 1)
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(t, 1.0)))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
