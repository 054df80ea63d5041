"""Distillation losses on a top-k teacher: KL over the teacher's top-k tokens + a remainder.

The teacher is the model's final layer, ``p = softmax(z_N)``; storing ``p`` over a 152k
vocabulary per token is too big, so the cache keeps its top-k log-probs ``log p_i`` and ids
``i ∈ K`` (k = 64 by default).  The student (an exit head) produces full logits ``z`` and
``q = softmax(z)``.  Both are coarsened to the k+1 buckets ``K ∪ {rest}``:

    p_rest = 1 - Σ_{i∈K} p_i        q_rest = Σ_{j∉K} q_j = exp(logsumexp_{j∉K} z_j - logsumexp z)
    KL_K(p‖q) = Σ_{i∈K} p_i (log p_i - log q_i) + p_rest (log p_rest - log q_rest)

``KL_K`` ≤ ``KL(p‖q)`` (coarsening never increases a KL divergence) and equals it when
``q`` restricted to the rest is proportional to ``p`` there; it is exact on everything that
decides a greedy draft (the teacher's top tokens).  Reported evaluation KLs use full
logits (``full_kl``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def teacher_topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits [T, V] -> (log p of the top-k [T, k] float32, their ids [T, k] int64)``,
    sorted by decreasing probability (column 0 is the teacher's greedy token)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    values, ids = logp.topk(k, dim=-1)
    return values, ids


def topk_kl(
    student_logits: torch.Tensor, teacher_logp: torch.Tensor, teacher_ids: torch.Tensor
) -> torch.Tensor:
    """Per-token ``KL_K(p‖q)`` [T] (see module doc); differentiable in ``student_logits``."""
    z = student_logits.float()
    log_z = torch.logsumexp(z, dim=-1)  # [T]
    log_q_k = z.gather(-1, teacher_ids) - log_z[:, None]  # [T, k]
    p_k = teacher_logp.exp()
    kl_k = (p_k * (teacher_logp - log_q_k)).sum(-1)
    if teacher_ids.shape[-1] >= z.shape[-1]:  # k = V: no remainder bucket
        return kl_k
    rest = z.scatter(-1, teacher_ids, float("-inf"))
    log_q_rest = torch.logsumexp(rest, dim=-1) - log_z  # [T]
    p_rest = (1.0 - p_k.sum(-1)).clamp_min(0.0)
    return kl_k + torch.xlogy(p_rest, p_rest) - p_rest * log_q_rest


def full_kl(teacher_logits: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """Per-token ``KL(p‖q) = Σ_v p_v (log p_v - log q_v)`` over the full vocabulary [T]."""
    logp = torch.log_softmax(teacher_logits.float(), dim=-1)
    logq = torch.log_softmax(student_logits.float(), dim=-1)
    return F.kl_div(logq, logp, log_target=True, reduction="none").sum(-1)
