"""Acceptors: exact tables for greedy, a statistical test for lossless sampling."""

from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chisquare

from specflow.acceptance import greedy_accept, rejection_accept
from specflow.engine import SpeculativePipeline
from specflow.sampling import SamplingParams, greedy_tokens, warp
from specflow.scheduler import Scheduler, SeqRequest, generate
from stages.acceptors.standard import StandardAcceptor
from stages.drafters.model import ModelDrafter
from stages.verifiers.full import FullVerifier


def logits_for(argmaxes: list[int], vocab: int = 6) -> torch.Tensor:
    """Logits [len, V] whose argmax rows are ``argmaxes``."""
    out = torch.zeros(len(argmaxes), vocab)
    out[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 5.0
    return out


@pytest.mark.parametrize(
    ("draft", "target", "accepted", "next_token"),
    [
        ([1, 2, 3], [1, 2, 3, 4], 3, 4),  # all accepted: bonus from the last row
        ([1, 2, 3], [0, 2, 3, 4], 0, 0),  # first rejected: correction = target's choice
        ([1, 2, 3], [1, 5, 3, 4], 1, 5),  # a later match after a mismatch does not count
        ([1, 2, 3], [1, 2, 0, 4], 2, 0),
        ([], [3], 0, 3),  # plain decoding
    ],
)
def test_greedy_accept_table(draft, target, accepted, next_token):
    verdict = greedy_accept(draft, logits_for(target))
    assert (verdict.num_accepted, verdict.next_token) == (accepted, next_token)


def test_rejection_with_one_hot_target_is_deterministic():
    p = torch.eye(6)[[1, 2, 3, 4]]  # target certain of 1, 2, 3, 4
    g = torch.Generator().manual_seed(0)
    assert rejection_accept([1, 2, 3], None, p, g).num_accepted == 3
    verdict = rejection_accept([1, 5, 3], None, p, g)  # p(5) = 0 at position 1
    assert (verdict.num_accepted, verdict.next_token) == (1, 2)


def _emit_two_tokens(p: torch.Tensor, q: torch.Tensor, k: int, g: torch.Generator, accept_fn):
    """Simulate rounds until two tokens are emitted; p, q: [positions, V] fixed per position."""
    out: list[int] = []
    while len(out) < 2:
        pos = len(out)
        draft = [int(torch.multinomial(q[pos + i], 1, generator=g)) for i in range(k)]
        verdict = accept_fn(draft, q[pos : pos + k], p[pos : pos + k + 1], g)
        out += draft[: verdict.num_accepted] + [verdict.next_token]
    return tuple(out[:2])


def _chi2_pvalue(p: torch.Tensor, q: torch.Tensor, accept_fn, trials: int = 6000) -> float:
    g = torch.Generator().manual_seed(1234)
    vocab = p.shape[1]
    counts = dict.fromkeys(itertools.product(range(vocab), repeat=2), 0)
    for _ in range(trials):
        counts[_emit_two_tokens(p, q, 2, g, accept_fn)] += 1
    cells = list(counts)
    expected = torch.tensor([float(p[0, a] * p[1, b]) * trials for a, b in cells])
    observed = torch.tensor([float(counts[c]) for c in cells])
    return float(chisquare(observed.numpy(), expected.numpy()).pvalue)


def _distributions(vocab: int = 4, positions: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    p = torch.softmax(torch.randn(positions, vocab, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(positions, vocab, generator=g) * 1.5, -1)
    return p, q


def test_rejection_sampling_matches_target_distribution():
    p, q = _distributions()
    assert _chi2_pvalue(p, q, rejection_accept) > 1e-3


def test_the_statistical_test_catches_a_biased_acceptor():
    """An acceptor that keeps every draft emits q, not p: the same test must reject it."""
    p, q = _distributions()

    def accept_all(draft, q_rows, p_rows, g):
        return type(rejection_accept(draft, q_rows, p_rows, g))(
            len(draft), int(torch.multinomial(p_rows[len(draft)], 1, generator=g))
        )

    assert _chi2_pvalue(p, q, accept_all) < 1e-6


@pytest.mark.parametrize("vocab_subset", [None, 6])
def test_sampled_pipeline_matches_target_distribution(tiny_target, tiny_drafter, vocab_subset):
    """End to end with real models: the first two sampled tokens follow the target's law
    (also when the drafter samples from a subset of the vocabulary: q is then zero outside)."""
    _, lm = tiny_target
    _, draft_lm = tiny_drafter
    sampling = SamplingParams(temperature=1.0, top_k=3)
    drafter = ModelDrafter(draft_lm, k=2, vocab_subset=vocab_subset)
    pipe = SpeculativePipeline(FullVerifier(lm), StandardAcceptor(), drafter=drafter)
    prompt = [1, 5, 9]
    # Exact law of (t1, t2) under the warped target.
    from specflow.kv.session import ModelSession

    sess = ModelSession(lm, 16)
    sess.set_tokens(prompt)
    p1 = warp(sess.logits(lm.info.num_layers, 2, 3), sampling)[0]
    law = {}
    for t1 in p1.nonzero().flatten().tolist():
        sess.set_tokens(prompt + [t1])
        p2 = warp(sess.logits(lm.info.num_layers, 3, 4), sampling)[0]
        for t2 in p2.nonzero().flatten().tolist():
            law[(t1, t2)] = float(p1[t1] * p2[t2])
    trials = 1500  # 32 requests a round: each draws what it draws alone (checked for seed 7)
    reqs = [SeqRequest(prompt, 2, seed=s, stop_token_ids=()) for s in range(trials)]
    results = Scheduler(pipe, 32, max_context=16).generate(reqs, sampling)
    counts = dict.fromkeys(law, 0)
    for r in results:
        counts[tuple(r.generation.tokens)] += 1  # a KeyError = a token outside the support
    cells = list(law)
    pvalue = chisquare(
        [counts[c] for c in cells], [law[c] * trials / sum(law.values()) for c in cells]
    ).pvalue
    assert pvalue > 1e-3
    alone = generate(pipe, prompt, 2, sampling, seed=7, stop_token_ids=()).tokens
    assert next(r for r in results if r.request.seed == 7).generation.tokens == alone


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_greedy_tokens_are_torchs_argmax_first_maximum_included(dtype):
    """The host's fast argmax (NumPy for float32) picks what ``argmax(-1)`` picks: the first
    index of a tied maximum, on contiguous and strided rows, in every dtype."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 1000, generator=g).to(dtype)
    logits[1, [10, 500, 999]] = 50.0  # a three-way tie: the first one
    logits[2, :] = 0.0  # all equal: index 0
    logits[3, 999] = 60.0  # the last index
    want = logits.argmax(-1).tolist()
    assert want[1:4] == [10, 0, 999]
    assert greedy_tokens(logits) == want
    strided = logits[:, ::2]  # [7, 500], not contiguous
    assert greedy_tokens(strided) == strided.argmax(-1).tolist()
    assert greedy_tokens(logits[4:5]) == [int(logits[4].argmax())]
