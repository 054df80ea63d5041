"""FLy acceptor: exact tables for the entropy gate (both definitions), the window, the
boundary and the zero-probability guard."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from specflow.engine import SpeculativePipeline
from specflow.errors import ConfigError
from specflow.sampling import SamplingParams
from specflow.scheduler import generate
from specflow.state import DecodeState, Draft
from stages.acceptors.fly import (
    FlyAcceptor,
    fly_scan,
    gate_entropy,
    normalized_entropy,
    vllm_entropy,
)
from stages.acceptors.standard import StandardAcceptor
from stages.drafters.model import ModelDrafter
from stages.verifiers.full import FullVerifier

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


def verdict(draft: list[int], tops: list[int], kinds: list[int], theta=0.3, window=2, **kw):
    return verdict_on(draft, logits(tops, kinds), theta=theta, window=window, **kw)


def verdict_on(draft: list[int], target_logits: torch.Tensor, **acceptor_kw):
    state = DecodeState(tokens=[0], prompt_len=1, max_len=32)
    out = FlyAcceptor(**acceptor_kw).accept(state, Draft(draft), target_logits)
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
    exact = SpeculativePipeline(FullVerifier(lm), StandardAcceptor(), drafter=ModelDrafter(d, k=5))
    fly = SpeculativePipeline(
        FullVerifier(lm), FlyAcceptor(theta=1.0, window=2), drafter=ModelDrafter(d, k=5)
    )
    for prompt in ([1, 5, 9, 17], [3, 4, 5, 6, 7]):
        a = generate(exact, prompt, 40)
        b = generate(fly, prompt, 40)
        assert a.tokens == b.tokens
        assert a.stats.accepted_per_round == b.stats.accepted_per_round


def test_low_theta_accepts_more_than_exact(tiny_target, tiny_drafter):
    _, lm = tiny_target
    _, d = tiny_drafter
    exact = SpeculativePipeline(FullVerifier(lm), StandardAcceptor(), drafter=ModelDrafter(d, k=6))
    fly = SpeculativePipeline(
        FullVerifier(lm), FlyAcceptor(theta=0.0, window=1), drafter=ModelDrafter(d, k=6)
    )
    prompt = [1, 5, 9, 17]
    assert generate(fly, prompt, 60).stats.tau > generate(exact, prompt, 60).stats.tau


# ---------------------------------------------------------------- zero-probability guard


@pytest.mark.parametrize("entropy", ["normalized", "vllm"])
def test_greedy_draft_token_with_minus_inf_logit_is_never_loosely_accepted(entropy):
    # The same round as test_high_entropy_mismatch_with_clean_window_accepts (mismatch at 1,
    # unsure target, window [2, 3] clean), with theta = 0 so the gate is open whatever the
    # entropy; only the target's logit of the draft token 5 at position 1 is -inf.
    tops, kinds = [1, 2, 3, 4, 6, 7], [C, U, C, C, C, C]
    target = logits(tops, kinds)
    kw = dict(theta=0.0, window=2, entropy=entropy)
    assert verdict_on([1, 5, 3, 4, 6], target, **kw) == (5, 7, 1)  # finite logit: loose
    target[1, 5] = float("-inf")
    assert verdict_on([1, 5, 3, 4, 6], target, **kw) == (1, 2, 0)  # -inf: reject at 1


# Sampling, target top-k = 2: at position 1 the target's logits are 2.0 (token 2), 1.9
# (token 3), 1.8 (token 4), so after the top-2 filter p(4) = 0 and p(2), p(3) =
# e^0.1/(1+e^0.1), 1/(1+e^0.1) = 0.5250, 0.4750.  Its normalized top-3 entropy is
# -(0.525 ln 0.525 + 0.475 ln 0.475)/ln 3 = 0.6919/1.0986 = 0.6298 (vllm: 0.6919 nats),
# >= theta 0.3: the gate is open.  Positions 0, 2, 3 are confident (10 vs -20: p = 1.0 in
# float32) and the draft follows them, so they are always ok and the window (W = 2) passes.
def _sampled_round(draft_token_at_1: int, seed: int, entropy: str):
    target = logits([1, 2, 3, 4, 6], [C, C, C, C, C])
    target[1] = torch.full((V,), -20.0)
    target[1, 2], target[1, 3], target[1, 4] = 2.0, 1.9, 1.8
    state = DecodeState(
        tokens=[0], prompt_len=1, max_len=32,
        sampling=SamplingParams(temperature=1.0, top_k=2),
        generator=torch.Generator().manual_seed(seed),
    )
    acceptor = FlyAcceptor(theta=0.3, window=2, entropy=entropy)
    out = acceptor.accept(state, Draft([1, draft_token_at_1, 3, 4]), target)
    return out.num_accepted, out.next_token, state.stats.level_accepted.get("fly_loose", 0)


@pytest.mark.parametrize("entropy", ["normalized", "vllm"])
def test_sampled_draft_token_with_warped_probability_zero_is_never_loosely_accepted(entropy):
    for seed in range(40):
        accepted, token, loose = _sampled_round(4, seed, entropy)  # p(4) = 0 after top-2
        assert (accepted, loose) == (1, 0)
        assert token in (2, 3)  # the correction is drawn from the target's support


@pytest.mark.parametrize("entropy", ["normalized", "vllm"])
def test_sampled_possible_draft_token_can_be_loosely_accepted(entropy):
    # Control: token 3 (p = 0.475) fails the lossless test when u >= 0.475 (q one-hot), and
    # then the open gate and the clean window accept it loosely.
    outcomes = {_sampled_round(3, seed, entropy) for seed in range(40)}
    assert (4, 6, 1) in outcomes  # loose at 1, then the bonus from position 4's argmax 6
    assert (4, 6, 0) in outcomes  # accepted by the lossless test itself


def test_fly_scan_refuses_impossible_tokens():
    ok, ent = [False, True, True], [0.9, 0.0, 0.0]
    assert fly_scan(ok, ent, 0.3, 2) == (3, 1)
    assert fly_scan(ok, ent, 0.3, 2, possible=[True, True, True]) == (3, 1)
    assert fly_scan(ok, ent, 0.3, 2, possible=[False, True, True]) == (0, 0)
    assert fly_scan(ok, ent, 0.0, 2, mode="vllm", possible=[False, True, True]) == (0, 0)


# ---------------------------------------------------------------- entropy definitions


def test_entropy_definitions_hand_computed():
    # probs 0.5, 0.3, 0.1, 0.1; top-3 = 0.5, 0.3, 0.1 (mass s = 0.9).
    probs = torch.tensor([[0.5, 0.3, 0.1, 0.1]])
    # vllm: raw nats over the top-3 as they are:
    #   0.5 ln 2 + 0.3 ln(1/0.3) + 0.1 ln 10 = 0.346574 + 0.361192 + 0.230259 = 0.938024
    assert vllm_entropy(probs, 3).item() == pytest.approx(0.938024, abs=1e-5)
    # normalized: top-3 renormalized to 5/9, 3/9, 1/9:
    #   (5/9 ln 1.8 + 3/9 ln 3 + 1/9 ln 9) / ln 3 = (0.326548 + 0.366204 + 0.244136) / 1.098612
    #   = 0.936888 / 1.098612 = 0.852793
    assert normalized_entropy(probs, 3).item() == pytest.approx(0.852793, abs=1e-5)
    # (the two are tied by vllm = s (H_renorm - ln s) = 0.9 (0.936888 + 0.105361) = 0.938024)
    assert gate_entropy(probs, 3, "vllm").item() == pytest.approx(0.938024, abs=1e-5)
    assert gate_entropy(probs, 3, "normalized").item() == pytest.approx(0.852793, abs=1e-5)
    # Uniform top-3: normalized 1; vllm ln 3 = 1.098612, above 1.
    third = torch.tensor([[1 / 3, 1 / 3, 1 / 3, 0.0]])
    assert normalized_entropy(third, 3).item() == pytest.approx(1.0, abs=1e-6)
    assert vllm_entropy(third, 3).item() == pytest.approx(1.098612, abs=1e-5)
    # Uniform over 4, top-3 = 0.25 x 3: normalized 1 (renormalized to uniform); vllm
    # 3 x 0.25 ln 4 = 0.75 x 1.386294 = 1.039721.
    quarter = torch.full((1, 4), 0.25)
    assert normalized_entropy(quarter, 3).item() == pytest.approx(1.0, abs=1e-6)
    assert vllm_entropy(quarter, 3).item() == pytest.approx(1.039721, abs=1e-5)
    # Full vocabulary (top_k None): vllm is the plain entropy, ln 4 = 1.386294.
    assert vllm_entropy(quarter, None).item() == pytest.approx(1.386294, abs=1e-5)


# A row where the two gates disagree at theta = 0.3: top-3 = 0.846, 0.027, 0.027 (mass
# 0.9 = 0.9 x (0.94, 0.03, 0.03)), five other tokens at 0.02.
#   vllm: 0.846 ln(1/0.846) + 2 x 0.027 ln(1/0.027) = 0.141495 + 0.195031 = 0.336525 >= 0.3
#   normalized: (0.94 ln(1/0.94) + 2 x 0.03 ln(1/0.03)) / ln 3 = 0.268557 / 1.098612
#   = 0.244451 < 0.3
DISAGREE = torch.tensor([[0.846, 0.027, 0.027, 0.02, 0.02, 0.02, 0.02, 0.02]])


def test_the_two_gates_differ_at_theta_0_3():
    assert vllm_entropy(DISAGREE, 3).item() == pytest.approx(0.336525, abs=1e-5)
    assert normalized_entropy(DISAGREE, 3).item() == pytest.approx(0.244451, abs=1e-5)
    # Greedy round: mismatch at 1 on the DISAGREE row, window [2, 3] clean.
    target = logits([1, 0, 3, 4, 6, 7], [C, C, C, C, C, C])
    target[1] = DISAGREE[0].log()  # temperature-1 softmax gives DISAGREE back; argmax 0
    draft = [1, 1, 3, 4, 6]
    assert verdict_on(draft, target, theta=0.3, window=2, entropy="normalized") == (1, 0, 0)
    assert verdict_on(draft, target, theta=0.3, window=2, entropy="vllm") == (5, 7, 1)


def test_theta_one_shuts_only_the_normalized_gate():
    # Uniform-ish top-3 (UNSURE row): normalized 1.0, vllm ln 3 = 1.0986 nats.
    args = ([1, 5, 3, 4, 6], [1, 2, 3, 4, 6, 7], [C, U, C, C, C, C])
    assert verdict(*args, theta=1.0, entropy="normalized") == (1, 2, 0)  # gate shut
    assert verdict(*args, theta=1.0, entropy="vllm") == (5, 7, 1)  # 1.0986 >= 1: defer
    assert verdict(*args, theta=1.1, entropy="vllm") == (1, 2, 0)  # 1.0986 < 1.1
    assert fly_scan([False, True, True], [1.0986, 0, 0], 1.0, 2, mode="vllm") == (3, 1)
    assert fly_scan([False, True, True], [1.0, 0, 0], 1.0, 2, mode="normalized") == (0, 0)


def test_theta_range_depends_on_the_entropy_definition():
    assert FlyAcceptor(theta=1.5, entropy="vllm").theta == 1.5  # raw nats may exceed 1
    with pytest.raises(ConfigError, match="theta must be >= 0 with acceptor.entropy=vllm"):
        FlyAcceptor(theta=-0.1, entropy="vllm")
    with pytest.raises(ConfigError, match="acceptor.entropy must be one of normalized, vllm"):
        FlyAcceptor(entropy="nats")
    with pytest.raises(ConfigError, match="entropy_top_k=1"):
        FlyAcceptor(entropy_top_k=1)
    assert FlyAcceptor(entropy_top_k=1, entropy="vllm").entropy_top_k == 1  # -p ln p: not 0


# ---------------------------------------------------------------- default window


@pytest.mark.parametrize(("k", "window"), [(2, 1), (4, 3), (6, 5), (7, 6), (8, 6), (12, 6)])
def test_null_window_is_min_6_k_minus_1(k, window):
    acceptor = FlyAcceptor(window=None)
    acceptor.check_draft_length(k)
    assert acceptor.window_for(k) == window
    assert acceptor.window_for(k - 1) == window  # a shorter round keeps the configured W


def test_null_window_needs_k_at_least_2():
    with pytest.raises(ConfigError, match="min\\(6, k-1\\) is 0 for the draft length k=1"):
        FlyAcceptor(window=None).check_draft_length(1)
    with pytest.raises(ConfigError, match="window=6 must be < the draft length k=6"):
        FlyAcceptor(window=6).check_draft_length(6)
    FlyAcceptor(window=5).check_draft_length(6)


def test_null_window_without_a_pipeline_uses_the_draft_length():
    # k = 5 -> W = 4: a mismatch at 0 with positions 1..4 clean is accepted loosely...
    assert verdict([0, 2, 3, 4, 6], [1, 2, 3, 4, 6, 7], [U, C, C, C, C, C], window=None) == (
        5, 7, 1,
    )
    # ...a mismatch at 1 cannot fit its window [2, 5] in the draft: rejected.
    assert verdict([1, 5, 3, 4, 6], [1, 2, 3, 4, 6, 7], [C, U, C, C, C, C], window=None) == (
        1, 2, 0,
    )
    # k = 1 -> W = 0: nothing can be deferred.
    assert verdict([0], [1, 2], [U, C], theta=0.0, window=None) == (0, 1, 0)


def test_null_window_pipeline_builds_where_w6_did_not(tiny_target, tiny_drafter):
    _, lm = tiny_target
    _, d = tiny_drafter
    acceptor = FlyAcceptor()  # window=None is the default now (was 6: refused for k <= 6)
    SpeculativePipeline(FullVerifier(lm), acceptor, drafter=ModelDrafter(d, k=4))
    assert acceptor.window_for(4) == 3
    with pytest.raises(ConfigError, match="k=1"):
        SpeculativePipeline(FullVerifier(lm), FlyAcceptor(), drafter=ModelDrafter(d, k=1))


def test_acceptor_conf_files():
    from omegaconf import OmegaConf

    conf = Path(__file__).resolve().parents[1] / "conf" / "acceptor"
    paper = OmegaConf.to_container(OmegaConf.load(conf / "fly.yaml"))
    vllm = OmegaConf.to_container(OmegaConf.load(conf / "fly_vllm.yaml"))
    for node in (paper, vllm):
        assert node.pop("_target_") == "stages.acceptors.fly.FlyAcceptor"
    assert paper == {"theta": 0.3, "window": None, "entropy_top_k": 3, "entropy": "normalized"}
    assert vllm == {"theta": 0.3, "window": None, "entropy_top_k": 3, "entropy": "vllm"}
