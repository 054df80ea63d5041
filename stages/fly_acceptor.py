"""Acceptor ``fly``: training-free loosely speculative decoding (FLy).

Every draft position i first gets the standard verdict ``ok_i``: greedy, ``x_i`` equals the
target's argmax; sampling, the lossless test ``u_i < p_i(x_i) / q_i(x_i)``.  Scanning
i = 0..k-1, at a position with ``not ok_i`` (a mismatch):

0. **Zero-probability guard.**  If the target cannot produce ``x_i`` at all, reject at i.
   Greedy: ``x_i``'s probability under the target's temperature-1 softmax is 0 (its logit
   is -inf).  Sampling: ``p_i(x_i) = 0`` after temperature, top-k and top-p.  FLy never
   emits such a token, whatever the gate and the window say.
1. **Entropy gate.**  ``h_i`` = normalized entropy of the target's distribution at i
   (over its top-``entropy_top_k`` probabilities renormalized, divided by log(top_k); or
   over the whole vocabulary, divided by log(V)).  If ``h_i < theta`` the target is
   confident: reject at i, as the standard rule does.
2. **Deferral window.**  Otherwise look at positions i+1 .. i+W, which the target already
   scored in the same pass, conditioned on the draft's token at i.  If all of them are
   ok, the target went along with the draft's wording: accept token i loosely and go on.
   If another mismatch falls in the window, reject at i (retroactively).
3. **Boundary.**  If the window runs past the draft (i + W > k - 1), reject at i.

``window = None`` is vLLM's default W = min(6, k - 1), with k the configured draft length
(``drafter.k``, resolved when the pipeline is built); an explicit integer W must be < k.

On rejection at i the correction token is the target's (argmax, or a sample from
norm(max(0, p_i - q_i)) when sampling); after k kept tokens the bonus comes from p_k.
``theta = 1`` disables the gate (normalized entropy reaches 1 only for a uniform
distribution): FLy then equals the standard rule token for token.
Loosely accepted tokens are counted in the per-level stats as level ``fly_loose``.
"""

from __future__ import annotations

import math

import torch

from specflow.acceptance import correction_sample
from specflow.errors import ConfigError
from specflow.sampling import sample, warp
from specflow.state import Acceptance, DecodeState, Draft

VLLM_MAX_WINDOW = 6  # vLLM's default window: min(6, k - 1)


def normalized_entropy(probs: torch.Tensor, top_k: int | None) -> torch.Tensor:
    """``probs [T, V] -> [T]`` entropy / log(support), over the top-k renormalized or all V."""
    if top_k is not None and top_k < probs.shape[-1]:
        probs = torch.topk(probs, top_k, dim=-1).values
        probs = probs / probs.sum(-1, keepdim=True)
    support = probs.shape[-1]
    ent = -(probs * probs.clamp_min(1e-30).log()).sum(-1)
    return ent / math.log(support)


def fly_scan(
    ok: list[bool],
    entropy: list[float],
    theta: float,
    window: int,
    *,
    possible: list[bool] | None = None,
) -> tuple[int, int]:
    """Apply the FLy rule to standard verdicts; returns (num_accepted, num_loose).

    ``ok[i]``: the standard rule keeps draft token i.  ``entropy[i]``: the target's
    normalized entropy at i.  ``possible[i]``: the target gives draft token i a non-zero
    probability (default: all); a mismatch at an impossible token always rejects.
    """
    k = len(ok)
    loose = 0
    for i in range(k):
        if ok[i]:
            continue
        deferred = (
            window >= 1
            and (possible is None or possible[i])
            and theta < 1.0
            and entropy[i] >= theta
            and i + window <= k - 1
        )
        if deferred and all(ok[i + 1 : i + 1 + window]):
            loose += 1
            continue
        return i, loose
    return k, loose


def default_window(k: int) -> int:
    """vLLM's default window for draft length ``k``: min(6, k - 1)."""
    return min(VLLM_MAX_WINDOW, k - 1)


class FlyAcceptor:
    """FLy loose acceptance (see module doc).

    Args:
        theta: entropy threshold in [0, 1]; the gate opens when h >= theta.
        window: W, the number of following draft positions that must agree (>= 1, < k);
            ``None`` for vLLM's default min(6, k - 1), k = the configured draft length.
        entropy_top_k: compute the entropy over the target's top-k probabilities (vLLM's
            default 3); ``null``/0 for the full vocabulary.
    """

    lossless = False

    def __init__(
        self, theta: float = 0.3, window: int | None = None, entropy_top_k: int | None = 3
    ) -> None:
        if not 0.0 <= theta <= 1.0:
            raise ConfigError(f"acceptor.theta must be in [0, 1], got {theta}")
        if window is not None and window < 1:
            raise ConfigError(
                f"acceptor.window must be >= 1, got {window} (or null for min(6, k-1))"
            )
        if entropy_top_k is not None and entropy_top_k < 0:
            raise ConfigError(f"acceptor.entropy_top_k must be >= 2 or null, got {entropy_top_k}")
        self.theta = theta
        self.window = window
        self.entropy_top_k = entropy_top_k or None
        if self.entropy_top_k == 1:
            raise ConfigError("acceptor.entropy_top_k=1 makes the entropy always 0; use >= 2")
        # window=None: resolved from the configured draft length by check_draft_length.
        self._resolved_window: int | None = window

    def check(self, greedy: bool) -> None:
        pass

    def check_draft_length(self, k: int) -> None:
        """Refuse a window that could never close (every deferral would reject); resolve
        ``window=None`` to min(6, k - 1)."""
        if self.window is None:
            if k < 2:
                raise ConfigError(
                    f"FLy's default window min(6, k-1) is 0 for the draft length k={k}: no "
                    f"position could ever be deferred; raise drafter.k to >= 2"
                )
            self._resolved_window = default_window(k)
            return
        if self.window >= k:
            raise ConfigError(
                f"FLy window acceptor.window={self.window} must be < the draft length k={k} "
                f"(the window must fit after a mismatch); lower acceptor.window, set it to "
                f"null (min(6, k-1)) or raise drafter.k"
            )

    def window_for(self, k: int) -> int:
        """The window W used for a draft of ``k`` tokens (``window=None`` before a pipeline
        resolved it: min(6, k - 1) of this draft; W < 1 never defers)."""
        if self._resolved_window is not None:
            return self._resolved_window
        return default_window(k)

    def accept(self, state: DecodeState, draft: Draft, target_logits: torch.Tensor) -> Acceptance:
        k = draft.k
        greedy = state.sampling.greedy
        idx = torch.tensor(draft.tokens, dtype=torch.long)
        rows = torch.arange(k)
        if greedy:
            choice = target_logits.argmax(-1)  # [k+1]
            ok = [draft.tokens[i] == int(choice[i]) for i in range(k)]
            gate_probs = target_logits[:k].float().softmax(-1)  # [k, V], temperature 1
        else:
            p = warp(target_logits, state.sampling)  # [k+1, V]
            q_x = draft.probs[rows, idx] if draft.probs is not None else torch.ones(k)
            u = torch.rand(k, generator=state.generator)
            ok = (u * q_x < p[rows, idx]).tolist()
            gate_probs = p[:k]
        # The guard: the target must be able to produce the draft token (prob > 0).
        possible = (gate_probs[rows, idx] > 0).tolist() if k else []
        entropy = normalized_entropy(gate_probs, self.entropy_top_k).tolist() if k else []
        accepted, loose = fly_scan(
            ok, entropy, self.theta, self.window_for(k), possible=possible
        )
        if k:
            state.stats.record_level("fly_loose", k, loose)
        if greedy:
            return Acceptance(accepted, int(choice[accepted]))
        if accepted == k:
            return Acceptance(k, int(sample(p[k : k + 1], state.generator)[0]))
        q_row = draft.probs[accepted] if draft.probs is not None else None
        token = draft.tokens[accepted]
        return Acceptance(accepted, correction_sample(p[accepted], q_row, token, state.generator))
