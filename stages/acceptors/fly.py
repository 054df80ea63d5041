"""Acceptor ``fly``: training-free loosely speculative decoding (FLy).

Every draft position i first gets the standard verdict ``ok_i``: greedy, ``x_i`` equals the
target's argmax; sampling, the lossless test ``u_i < p_i(x_i) / q_i(x_i)``.  Scanning
i = 0..k-1, at a position with ``not ok_i`` (a mismatch):

0. **Zero-probability guard.**  If the target cannot produce ``x_i`` at all, reject at i.
   Greedy: ``x_i``'s probability under the target's temperature-1 softmax is 0 (its logit
   is -inf).  Sampling: ``p_i(x_i) = 0`` after temperature, top-k and top-p.  FLy never
   emits such a token, whatever the gate and the window say.
1. **Entropy gate.**  ``h_i`` = the entropy of the target's distribution at i (greedy: the
   temperature-1 softmax; sampling: the warped p).  If ``h_i < theta`` the target is
   confident: reject at i, as the standard rule does.  Two definitions (``entropy``):

   * ``normalized`` (default; the FLy paper's): over the top-``entropy_top_k``
     probabilities *renormalized* to sum 1, divided by log(top_k) (or over the whole
     vocabulary, divided by log V), so ``h`` is in [0, 1].  ``theta = 1`` shuts the gate
     (``h`` reaches 1 only for a uniform distribution): FLy then equals the standard rule.
   * ``vllm`` (vLLM's ``rejection_sample_method="fly"``): raw nats ``-sum p log p`` over the
     top-``entropy_top_k`` probabilities of the full distribution, *not* renormalized and
     *not* divided by log(top_k).  ``h`` lies in [0, log(top_k)] (top-3: up to
     log 3 = 1.0986), so ``theta = 1`` does not shut the gate: near-uniform top-3 rows still
     defer.  Use this mode to reproduce vLLM; its theta = 0.3 is a different gate from
     ``normalized``'s theta = 0.3.

2. **Deferral window.**  Otherwise look at positions i+1 .. i+W, which the target already
   scored in the same pass, conditioned on the draft's token at i.  If all of them are
   ok, the target went along with the draft's wording: accept token i loosely and go on.
   If another mismatch falls in the window, reject at i (retroactively).
3. **Boundary.**  If the window runs past the draft (i + W > k - 1), reject at i.

``window = None`` is vLLM's default W = min(6, k - 1), with k the configured draft length
(``drafter.k``, resolved when the pipeline is built); an explicit integer W must be < k.

On rejection at i the correction token is the target's (argmax, or a sample from
norm(max(0, p_i - q_i)) when sampling); after k kept tokens the bonus comes from p_k.
Loosely accepted tokens are counted in the per-level stats as level ``fly_loose``.
"""

from __future__ import annotations

import math

import torch

from specflow.acceptance import correction_sample
from specflow.errors import ConfigError
from specflow.sampling import sample, warp
from specflow.state import Acceptance, DecodeState, Draft

ENTROPY_MODES = ("normalized", "vllm")
VLLM_MAX_WINDOW = 6  # vLLM's default window: min(6, k - 1)


def _top_k(probs: torch.Tensor, top_k: int | None) -> torch.Tensor:
    if top_k is not None and top_k < probs.shape[-1]:
        return torch.topk(probs, top_k, dim=-1).values
    return probs


def _nats(probs: torch.Tensor) -> torch.Tensor:
    return -(probs * probs.clamp_min(1e-30).log()).sum(-1)


def normalized_entropy(probs: torch.Tensor, top_k: int | None) -> torch.Tensor:
    """``probs [T, V] -> [T]`` entropy / log(support), over the top-k renormalized or all V.

    The FLy paper's definition, in [0, 1]."""
    if top_k is not None and top_k < probs.shape[-1]:
        probs = _top_k(probs, top_k)
        probs = probs / probs.sum(-1, keepdim=True)
    return _nats(probs) / math.log(probs.shape[-1])


def vllm_entropy(probs: torch.Tensor, top_k: int | None) -> torch.Tensor:
    """``probs [T, V] -> [T]`` raw entropy in nats over the top-k probabilities as they are.

    vLLM's definition: the top-k values of the full distribution, not renormalized, not
    divided by log(top_k); in [0, log(top_k)] (or [0, log V] over all V)."""
    return _nats(_top_k(probs, top_k))


def gate_entropy(probs: torch.Tensor, top_k: int | None, mode: str) -> torch.Tensor:
    """The gate's entropy of ``probs [T, V] -> [T]`` under ``mode`` (see ``ENTROPY_MODES``)."""
    if mode == "vllm":
        return vllm_entropy(probs, top_k)
    return normalized_entropy(probs, top_k)


def gate_open(entropy: float, theta: float, mode: str = "normalized") -> bool:
    """The entropy gate: defer when ``entropy >= theta``.

    ``normalized``: ``theta = 1`` shuts the gate.  ``vllm``: no special case (raw top-3
    entropy can exceed 1)."""
    if mode == "normalized" and theta >= 1.0:
        return False
    return entropy >= theta


def fly_scan(
    ok: list[bool],
    entropy: list[float],
    theta: float,
    window: int,
    *,
    mode: str = "normalized",
    possible: list[bool] | None = None,
) -> tuple[int, int]:
    """Apply the FLy rule to standard verdicts; returns (num_accepted, num_loose).

    ``ok[i]``: the standard rule keeps draft token i.  ``entropy[i]``: the target's gate
    entropy at i (``mode``'s definition).  ``possible[i]``: the target gives draft token i a
    non-zero probability (default: all); a mismatch at an impossible token always rejects.
    """
    k = len(ok)
    loose = 0
    for i in range(k):
        if ok[i]:
            continue
        deferred = (
            window >= 1
            and (possible is None or possible[i])
            and gate_open(entropy[i], theta, mode)
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
        theta: entropy threshold; the gate opens when h >= theta.  ``normalized``: in
            [0, 1], 1 shuts the gate.  ``vllm``: >= 0, raw nats (1 does not shut the gate).
        window: W, the number of following draft positions that must agree (>= 1, < k);
            ``None`` for vLLM's default min(6, k - 1), k = the configured draft length.
        entropy_top_k: compute the entropy over the target's top-k probabilities (3, as in
            vLLM); ``null``/0 for the full vocabulary.
        entropy: ``normalized`` (the paper's: top-k renormalized, divided by log(top_k)) or
            ``vllm`` (vLLM's: raw nats over the un-renormalized top-k).
    """

    lossless = False
    accepts_trees = False  # FLy's window reads a chain

    def __init__(
        self,
        theta: float = 0.3,
        window: int | None = None,
        entropy_top_k: int | None = 3,
        entropy: str = "normalized",
    ) -> None:
        if entropy not in ENTROPY_MODES:
            raise ConfigError(
                f"acceptor.entropy must be one of {', '.join(ENTROPY_MODES)}, got {entropy!r}"
            )
        if entropy == "normalized" and not 0.0 <= theta <= 1.0:
            raise ConfigError(
                f"acceptor.theta must be in [0, 1], got {theta} (acceptor.entropy=normalized; "
                f"acceptor.entropy=vllm takes raw nats >= 0)"
            )
        if entropy == "vllm" and not theta >= 0.0:
            raise ConfigError(
                f"acceptor.theta must be >= 0 with acceptor.entropy=vllm, got {theta}"
            )
        if window is not None and window < 1:
            raise ConfigError(
                f"acceptor.window must be >= 1, got {window} (or null for min(6, k-1))"
            )
        if entropy_top_k is not None and entropy_top_k < 0:
            raise ConfigError(f"acceptor.entropy_top_k must be >= 2 or null, got {entropy_top_k}")
        self.theta = theta
        self.window = window
        self.entropy = entropy
        self.entropy_top_k = entropy_top_k or None
        if self.entropy_top_k == 1 and entropy == "normalized":
            raise ConfigError(
                "acceptor.entropy_top_k=1 makes the normalized entropy always 0; use >= 2"
            )
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
        k = len(draft.tokens)  # the tokens drafted
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
        entropy = gate_entropy(gate_probs, self.entropy_top_k, self.entropy).tolist() if k else []
        accepted, loose = fly_scan(
            ok, entropy, self.theta, self.window_for(k), mode=self.entropy, possible=possible
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
