"""FLy acceptor: exact tables for the entropy gate, the window and the boundary."""

from __future__ import annotations

import math

import pytest
import torch

from specflow.engine import SpeculativePipeline
from specflow.errors import ConfigError
from specflow.state import DecodeState, Draft
from stages.exact_acceptor import ExactAcceptor
from stages.fly_acceptor import FlyAcceptor, fly_scan, normalized_entropy
from stages.full_verifier import FullVerifier
from stages.model_drafter import ModelDrafter

V = 8
CONFIDENT = 0  # logits row with one dominant token: normalized top-3 entropy ~ 0
UNSURE = 1  # logits row with three equal top tokens: normalized top-3 entropy = 1


def row(top: int, kind: int) -> torch.Tensor:
    out = torch.full((V,), -20.0)
    if kind == CONFIDENT:
        out[top] = 10.0
    else:  # top token first, two others tied just below (argmax stays `top`)
        out[top] = 2.0
        out[(top + 1) % V] = 2.0 - 1e-4
        out[(top + 2) % V] = 2.0 - 1e-4
    return out


def logits(tops: list[int], kinds: list[int]) -> torch.Tensor:
    return torch.stack([row(t, k) for t, k in zip(tops, kinds, strict=True)])  # [k+1, V]


def verdict(draft: list[int], tops: list[int], kinds: list[int], theta=0.3, window=2):
    state = DecodeState(tokens=[0], prompt_len=1, max_len=32)
    out = FlyAcceptor(theta=theta, window=window).accept(state, Draft(draft), logits(tops, kinds))
    return out.num_accepted, out.next_token, state.stats.level_accepted.get("fly_loose", 0)


C, U = CONFIDENT, UNSURE


def test_low_entropy_mismatch_rejects():
    # position 1 mismatches (draft 5, target 2) and the target is confident there
    assert verdict([1, 5, 3, 4, 6], [1, 2, 3, 4, 6, 7], [C, C, C, C, C, C]) == (1, 2, 0)


def test_high_entropy_mismatch_with_clean_window_accepts():
    # mismatch at 1 with an unsure target; positions 2, 3 (W = 2) agree -> accept all 5
    assert verdict([1, 5, 3, 4, 6], [1, 2, 3, 4, 6, 7], [C, U, C, C, C, C]) == (5, 7, 1)


def test_second_mismatch_in_window_rejects_retroactively():
    # mismatch at 1 (unsure) and again at 3 inside the window [2, 3] -> reject at 1
    assert verdict([1, 5, 3, 0, 6], [1, 2, 3, 4, 6, 7], [C, U, C, C, C, C]) == (1, 2, 0)


def test_window_past_the_draft_end_rejects():
    # mismatch at 3 (unsure) with W = 2: window [4, 5] runs past k - 1 = 4 -> reject at 3
    assert verdict([1, 2, 3, 0, 6], [1, 2, 3, 4, 6, 7], [C, C, C, U, C, C]) == (3, 4, 0)


def test_two_separate_loose_acceptances():
    tops = [1, 2, 3, 4, 5, 6, 7, 1]
    kinds = [U, C, C, U, C, C, C, C]
    assert verdict([0, 2, 3, 0, 5, 6, 7], tops, kinds) == (7, 1, 2)


def test_fly_scan_table():
    assert fly_scan([True, True], [0.0, 0.0], 0.3, 1) == (2, 0)
    assert fly_scan([False, True, True], [0.9, 0, 0], 0.3, 2) == (3, 1)
    assert fly_scan([False, True, True], [0.2, 0, 0], 0.3, 2) == (0, 0)
    assert fly_scan([False, True, True], [0.9, 0, 0], 1.0, 2) == (0, 0)  # theta=1: gate shut


def test_top_k_entropy_equals_full_entropy_when_k_covers_vocab():
    probs = torch.softmax(torch.randn(5, V, generator=torch.Generator().manual_seed(0)), -1)
    assert torch.allclose(normalized_entropy(probs, V), normalized_entropy(probs, None))
    uniform = torch.full((1, V), 1.0 / V)
    assert normalized_entropy(uniform, None).item() == pytest.approx(1.0)
    two = torch.tensor([[0.5, 0.5, 0.0, 0.0]])
    assert normalized_entropy(two, None).item() == pytest.approx(math.log(2) / math.log(4))


def test_invalid_configs_fail_with_the_value():
    with pytest.raises(ConfigError, match="theta must be in \\[0, 1\\], got 1.5"):
        FlyAcceptor(theta=1.5)
    with pytest.raises(ConfigError, match="window must be >= 1, got 0"):
        FlyAcceptor(window=0)


def test_window_not_shorter_than_k_is_refused(tiny_target, tiny_drafter):
    _, lm = tiny_target
    _, d = tiny_drafter
    with pytest.raises(ConfigError, match="window=4 must be < the draft length k=4"):
        SpeculativePipeline(FullVerifier(lm), FlyAcceptor(window=4), drafter=ModelDrafter(d, k=4))


def test_theta_one_equals_exact_acceptance(tiny_target, tiny_drafter):
    _, lm = tiny_target
    _, d = tiny_drafter
    exact = SpeculativePipeline(FullVerifier(lm), ExactAcceptor(), drafter=ModelDrafter(d, k=5))
    fly = SpeculativePipeline(
        FullVerifier(lm), FlyAcceptor(theta=1.0, window=2), drafter=ModelDrafter(d, k=5)
    )
    for prompt in ([1, 5, 9, 17], [3, 4, 5, 6, 7]):
        a = exact.generate(prompt, 40)
        b = fly.generate(prompt, 40)
        assert a.tokens == b.tokens
        assert a.stats.accepted_per_round == b.stats.accepted_per_round


def test_low_theta_accepts_more_than_exact(tiny_target, tiny_drafter):
    _, lm = tiny_target
    _, d = tiny_drafter
    exact = SpeculativePipeline(FullVerifier(lm), ExactAcceptor(), drafter=ModelDrafter(d, k=6))
    fly = SpeculativePipeline(
        FullVerifier(lm), FlyAcceptor(theta=0.0, window=1), drafter=ModelDrafter(d, k=6)
    )
    prompt = [1, 5, 9, 17]
    assert fly.generate(prompt, 60).stats.tau > exact.generate(prompt, 60).stats.tau
