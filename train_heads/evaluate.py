"""Held-out evaluation of exits: top-1 agreement, full-vocabulary KL and simulated τ.

On the eval sequences (prompts never trained on, continued greedily by the target), for
every exit ``L`` and position ``p`` predicting a generated token, with teacher
``p_N = softmax(head_N(h_N))`` and exit ``q_L = softmax(head_L(h_L))`` computed by the
model's own ``head`` (so attached ``ExitHead``s are exercised exactly as at inference):

    agree_L = mean_p [argmax q_L(p) == argmax p_N(p)]
    KL_L    = mean_p KL(p_N(p) ‖ q_L(p))            (full 151936-token vocabulary)

Simulated τ of greedy self-speculation with draft length k (exact, not an i.i.d. estimate):
with greedy verification a draft token is accepted iff it equals the target's greedy
token, and a draft token is only looked at when every earlier one was accepted, i.e. when
the drafter's context *is* the target's sequence.  So along the target's greedy output the
accepted length of a round starting at position ``i`` is the number of leading matches
``m_i, m_{i+1}, ...`` (at most k), where ``m_p = [argmax q_L(p) == argmax p_N(p)]`` is
computed teacher-forced; the round yields ``a + 1`` tokens (accepted + the target's
correction or bonus token) and the next round starts at ``i + a + 1``.

    τ = (tokens produced) / (rounds)    over all eval sequences (ratio of sums)

Also reported: ``tau_iid = (1 - α^{k+1}) / (1 - α)`` from the agreement α alone.

Attention adapters (``AdapterHead``): ``adapted_cache`` runs each adapter over every whole
held-out sequence (from position 0: the prefix is context) and puts its outputs ``a_L`` in
place of ``h_L``; ``evaluate_exits`` on that cache, with the adapters' position-wise part
(``RMSNorm_g``, what ``lm.head`` applies at an attached adapter's exit), gives the same
metrics on the same rows.  Teacher-forced evaluation is exact for an adapter too: drafting
along the target's sequence feeds it the true ``h_L`` of every earlier token.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace

import torch

from specflow.models.adapter_head import AdapterHead
from train_heads.cache import HiddenCache
from train_heads.losses import full_kl


@dataclass
class ExitMetrics:
    """Metrics of one exit on the held-out generated positions."""

    layer: int
    positions: int
    agree: float
    kl: float
    tau: float
    tau_iid: float
    mean_accepted: float
    agree_all: float  # agreement over every held-out position (prompt positions too)


def simulate_tau(matches: list[bool], k: int) -> tuple[int, int]:
    """(tokens produced, rounds) of greedy speculation along one target sequence, where
    ``matches[p]`` says whether the draft at position ``p`` equals the target's token."""
    n, i, tokens, rounds = len(matches), 0, 0, 0
    while i < n:
        a = 0
        while a < k and i + a < n and matches[i + a]:
            a += 1
        gained = min(a + 1, n - i)
        tokens += gained
        rounds += 1
        i += gained
    return tokens, rounds


def tau_iid(alpha: float, k: int) -> float:
    """Expected tokens per round if each draft token is accepted independently w.p. α."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1 - alpha ** (k + 1)) / (1 - alpha)


@torch.inference_mode()
def evaluate_exits(
    head_fn, cache: HiddenCache, layers: list[int], k: int = 4, skip: int = 0, chunk: int = 256
) -> dict[int, ExitMetrics]:
    """Metrics per exit in ``layers`` (see module doc).

    ``head_fn(hidden, layer) -> logits`` is the model's ``head`` (e.g. ``lm.head``), with or
    without exit heads attached.
    """
    n = int(cache.meta["num_layers"])
    seqs = cache.sequences(1)
    out: dict[int, ExitMetrics] = {}
    stats = {layer: {"agree": [], "kl": [], "agree_all": []} for layer in layers}
    matches: dict[int, list[list[bool]]] = {layer: [] for layer in layers}
    for s in seqs:
        start, end = int(cache.offsets[s]) + skip, int(cache.offsets[s + 1])
        gen = cache.generated[start:end]
        t_argmax, t_logits = [], []
        for a in range(start, end, chunk):
            lg = head_fn(cache.hidden[n][a : min(a + chunk, end)], n)
            t_logits.append(lg)
            t_argmax.append(lg.argmax(-1))
        teacher = torch.cat(t_argmax)
        # The greedy target sequence is only exact while the cached teacher agrees with the
        # generated tokens (batched decoding may break a near-tie differently).
        greedy_ok = (teacher == cache.next_token[start:end]) | ~gen
        bad = (~greedy_ok).nonzero()
        valid_end = int(bad[0]) if bad.numel() else end - start
        for layer in layers:
            agree, kls = [], []
            for j, a in enumerate(range(start, end, chunk)):
                lg = head_fn(cache.hidden[layer][a : min(a + chunk, end)], layer)
                agree.append(lg.argmax(-1) == t_argmax[j])
                kls.append(full_kl(t_logits[j], lg))
            agree_t, kl_t = torch.cat(agree), torch.cat(kls)
            stats[layer]["agree"].append(agree_t[gen])
            stats[layer]["kl"].append(kl_t[gen])
            stats[layer]["agree_all"].append(agree_t)
            matches[layer].append(agree_t[:valid_end][gen[:valid_end]].tolist())
    for layer in layers:
        a = torch.cat(stats[layer]["agree"]).float()
        sim = [simulate_tau(m, k) for m in matches[layer]]
        tokens = sum(t for t, _ in sim)
        rounds = sum(r for _, r in sim)
        alpha = float(a.mean()) if a.numel() else float("nan")
        out[layer] = ExitMetrics(
            layer=layer,
            positions=int(a.numel()),
            agree=alpha,
            kl=float(torch.cat(stats[layer]["kl"]).mean()),
            tau=tokens / max(rounds, 1),
            tau_iid=tau_iid(alpha, k),
            mean_accepted=tokens / max(rounds, 1) - 1,
            agree_all=float(torch.cat(stats[layer]["agree_all"]).float().mean()),
        )
    return out


@torch.no_grad()
def adapted_cache(cache: HiddenCache, adapters: Mapping[int, AdapterHead], split: int = 1
                  ) -> HiddenCache:
    """The sequences of ``split`` alone (in order, as split 1 of a smaller cache), with
    ``hidden[L]`` the adapter's output ``a_L`` for every ``L`` in ``adapters``: each sequence
    one unpadded batch, float32 (the other cached layers are kept as they are)."""
    seqs = cache.sequences(split)
    starts, ends = cache.offsets[seqs], cache.offsets[[s + 1 for s in seqs]]
    lengths = ends - starts
    rows = torch.cat([torch.arange(int(a), int(b)) for a, b in zip(starts, ends, strict=True)])
    hidden = {layer: h[rows] for layer, h in cache.hidden.items()}
    for layer, head in adapters.items():
        was = head.training
        head.eval()
        hidden[layer] = torch.cat([
            head.sequence(cache.hidden[layer][int(a) : int(b)].float()[None],
                          torch.ones(1, int(b - a), dtype=torch.bool))[0]
            for a, b in zip(starts, ends, strict=True)
        ])
        head.train(was)
    return replace(
        cache, tokens=cache.tokens[rows], next_token=cache.next_token[rows],
        seq_id=torch.repeat_interleave(torch.arange(len(seqs)), lengths),
        generated=cache.generated[rows],
        offsets=torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(lengths, 0)]),
        split=torch.ones(len(seqs), dtype=torch.long), prompt_len=cache.prompt_len[seqs],
        hidden=hidden, topk_logp=cache.topk_logp[rows], topk_ids=cache.topk_ids[rows],
    )


def metrics_table(
    before: dict[int, ExitMetrics], after: dict[int, ExitMetrics], num_layers: int, k: int
) -> str:
    """A markdown table: per exit, agreement / KL / τ before and after training."""
    lines = [
        f"| exit (of {num_layers}) | positions | top-1 agree before | after | "
        f"KL before | after | τ@k={k} before | after | τ iid-est. after |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for layer in sorted(after):
        b, a = before[layer], after[layer]
        lines.append(
            f"| {layer} ({layer / num_layers:.2f}) | {a.positions} | {b.agree:.1%} | "
            f"{a.agree:.1%} | {b.kl:.3f} | {a.kl:.3f} | {b.tau:.2f} | {a.tau:.2f} | "
            f"{a.tau_iid:.2f} |"
        )
    return "\n".join(lines)


def as_dict(metrics: dict[int, ExitMetrics]) -> dict[str, dict]:
    return {str(layer): asdict(m) for layer, m in metrics.items()}
