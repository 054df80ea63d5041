"""The lossless acceptance rule: pure functions (FLy builds on them) and ``LosslessAcceptor``,
the rule as an acceptor: plain decoding's and HiSpec's intermediate level's, and the base of
the acceptor stage of configs ``acceptor=exact`` and ``acceptor=rejection``
(``stages.acceptors.standard.StandardAcceptor``).

Below, k is the number of tokens drafted this round (``len(draft.tokens)``).

- ``greedy_accept``: keep the longest prefix of the draft equal to the target's argmax,
  then the target's argmax (lossless for greedy decoding).
- ``rejection_accept``: lossless speculative sampling (Leviathan et al. 2023; Chen et al.
  2023).  With target distributions p and draft distributions q (both warped by the same
  sampling params), for i = 0..k-1 accept draft token x_i with probability
  min(1, p_i(x_i) / q_i(x_i)); on the first rejection emit a token from
  norm(max(0, p_i - q_i)) and stop; if all k are accepted emit the bonus token from p_k.
  A deterministic drafter (PLD, greedy draft model) has one-hot q.  The emitted sequence
  is distributed exactly as sampling from the target.
- ``greedy_tree_accept``: for a tree draft (``Draft.parents``), walk from the root: at each
  node take the target's argmax there and follow the child with that token, if any; the
  kept path is the longest root-to-node path every token of which is the target's argmax,
  which is what greedy decoding would commit (lossless).  Trees are greedy-only here
  (multi-draft rejection sampling, SpecInfer's, is not implemented): a tree under sampling
  is refused.
"""

from __future__ import annotations

import torch

from specflow.sampling import greedy_tokens, sample, warp
from specflow.state import Acceptance, DecodeState, Draft


def greedy_accept(draft_tokens: list[int], target_logits: torch.Tensor) -> Acceptance:
    """``target_logits [k+1, V]`` -> longest matching prefix + the target's next token."""
    choice = greedy_tokens(target_logits)  # [k+1]
    accepted = 0
    for proposed, wanted in zip(draft_tokens, choice[:-1], strict=True):
        if proposed != wanted:
            break
        accepted += 1
    return Acceptance(accepted, choice[accepted])


def greedy_tree_accept(
    nodes: list[int], parents: list[int], target_logits: torch.Tensor
) -> Acceptance:
    """``target_logits [1 + len(nodes), V]`` (row 0: after the committed tokens, row i+1:
    after the path to node i) -> the kept path and the target's next token."""
    choice = greedy_tokens(target_logits)  # [1 + nodes]
    path: list[int] = []
    row = 0
    while True:
        wanted = choice[row]
        parent = row - 1
        child = next((i for i, p in enumerate(parents) if p == parent and nodes[i] == wanted),
                     None)
        if child is None:
            return Acceptance(len(path), wanted, path)
        path.append(child)
        row = child + 1


def rejection_accept(
    draft_tokens: list[int],
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator,
) -> Acceptance:
    """``target_probs [k+1, V]``, ``draft_probs [k, V]`` or None (one-hot) -> verdict."""
    k = len(draft_tokens)
    if k == 0:
        return Acceptance(0, int(sample(target_probs[:1], generator)[0]))
    idx = torch.tensor(draft_tokens)
    rows = torch.arange(k)
    p_x = target_probs[rows, idx]  # [k]
    q_x = draft_probs[rows, idx] if draft_probs is not None else torch.ones(k)  # [k]
    u = torch.rand(k, generator=generator)  # [k]
    # accept iff u < p/q  <=>  u * q < p   (q >= p: accept with prob p/q; q < p: always)
    rejected = (u * q_x >= p_x).nonzero()
    if rejected.numel() == 0:
        return Acceptance(k, int(sample(target_probs[k : k + 1], generator)[0]))
    j = int(rejected[0, 0])
    q_row = draft_probs[j] if draft_probs is not None else None
    return Acceptance(j, correction_sample(target_probs[j], q_row, draft_tokens[j], generator))


def correction_sample(
    p_row: torch.Tensor, q_row: torch.Tensor | None, token: int, generator: torch.Generator
) -> int:
    """The token emitted after rejecting ``token``: a sample of norm(max(0, p - q)).

    ``p_row, q_row [V]``; ``q_row=None`` is one-hot on ``token``.  When p == q the rejection
    had probability 0 and the residual is empty: fall back to p.
    """
    if q_row is None:
        residual = p_row.clone()
        residual[token] = 0.0
    else:
        residual = (p_row - q_row).clamp_min(0.0)
    if residual.sum() <= 0:
        residual = p_row
    return int(sample((residual / residual.sum()).unsqueeze(0), generator)[0])


class LosslessAcceptor:
    """The lossless rule: ``greedy_accept`` when the request is greedy (``greedy_tree_accept``
    for a tree draft), else ``rejection_accept`` on the warped target distributions
    ``p = warp(logits)`` and the draft's q (``Draft.probs``; one-hot when ``None``).

    The acceptor of plain decoding (no draft: the target's argmax or a sample from p) and of
    HiSpec's intermediate level; the acceptor stage ``acceptor=exact|rejection`` is this rule
    with a greedy-only option (``stages.acceptors.standard``).
    """

    lossless = True
    accepts_trees = True  # greedy requests (module doc)

    def check(self, greedy: bool) -> None:
        """Any sampling mode."""

    def check_draft_length(self, k: int) -> None:
        pass

    def accept(self, state: DecodeState, draft: Draft, target_logits: torch.Tensor) -> Acceptance:
        """``target_logits [drafted+1, V]`` -> the accepted prefix and the next token."""
        if draft.parents is not None:
            if not state.sampling.greedy:
                raise ValueError("a tree draft under sampling: tree drafters draft chains "
                                 "for sampled requests (specflow.acceptance module doc)")
            return greedy_tree_accept(draft.tokens, draft.parents, target_logits)
        if state.sampling.greedy:
            return greedy_accept(draft.tokens, target_logits)
        return rejection_accept(
            draft.tokens, draft.probs, warp(target_logits, state.sampling), state.generator
        )
