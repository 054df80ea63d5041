"""Drafting over a subset of the vocabulary (``drafter.vocab_subset``): same logits on the
subset, greedy identity with the target kept, clear errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specflow.cpu.int8_weights import quantize_int8
from specflow.drafting import SubVocabHead, draft_with_model
from specflow.engine import SpeculativePipeline
from specflow.errors import ConfigError
from specflow.kv.session import ModelSession
from specflow.kv.stores import KVStores
from specflow.models.native import NativeLM
from specflow.models.tiny import tiny_model_info
from specflow.scheduler import generate
from specflow.state import DecodeState
from stages.acceptors.standard import StandardAcceptor
from stages.drafters.model import ModelDrafter
from stages.verifiers.full import FullVerifier
from tests.conftest import hf_greedy


def test_subset_head_is_the_full_head_restricted(tiny_drafter):
    _, lm = tiny_drafter
    head = SubVocabHead.build(lm, 5, always=[40, 3, 40])
    assert head.ids.tolist() == [0, 1, 2, 3, 4, 40]
    session = ModelSession(lm, 16)
    session.set_tokens([1, 5, 9, 17])
    top = lm.info.num_layers
    full = session.logits(top, 0, 4)  # [4, V]
    sub = head.logits(lm, session.exit_hidden(top, 0, 4), top)  # [4, 6]
    torch.testing.assert_close(sub, full[:, head.ids])
    q = head.to_vocab(sub.softmax(-1))  # [4, V]
    assert q.shape == full.shape
    assert float(q[:, 5:40].abs().sum()) == 0.0
    torch.testing.assert_close(q.sum(-1), torch.ones(4))


def test_greedy_drafts_come_from_the_subset(tiny_drafter):
    _, lm = tiny_drafter
    state = DecodeState(tokens=[1, 5, 9], prompt_len=3, max_len=32, kv=KVStores())
    head = SubVocabHead.build(lm, 4, always=[9])
    (draft,) = draft_with_model([state], lm, lm.info.num_layers, [6], subvocabs=[head])
    assert len(draft.tokens) == 6 and set(draft.tokens) <= {0, 1, 2, 3, 9}


@pytest.mark.parametrize("vocab_subset", [3, 16, 10_000])
def test_sps_with_a_vocab_subset_equals_hf(tiny_target, tiny_drafter, vocab_subset):
    hf, lm = tiny_target
    _, draft_lm = tiny_drafter
    prompt = [1, 5, 9, 17, 33, 5, 9]
    drafter = ModelDrafter(draft_lm, k=4, vocab_subset=vocab_subset)
    pipe = SpeculativePipeline(FullVerifier(lm), StandardAcceptor(), drafter=drafter)
    assert generate(pipe, prompt, 40).tokens == hf_greedy(hf, prompt, 40)


def test_self_drafting_over_the_whole_vocabulary_accepts_everything(tiny_target):
    """A subset covering the vocabulary changes nothing: the model drafting for itself
    through the sliced head still has every draft accepted."""
    hf, lm = tiny_target
    copy = NativeLM.from_hf(hf, tiny_model_info(hf, "copy"))  # its own session
    drafter = ModelDrafter(copy, k=4, vocab_subset=lm.info.vocab_size)
    pipe = SpeculativePipeline(FullVerifier(lm), StandardAcceptor(), drafter=drafter)
    gen = generate(pipe, [1, 5, 9], 20)
    assert gen.stats.accepted == gen.stats.drafted


def test_bad_vocab_subset_fails_clearly(tiny_drafter):
    _, lm = tiny_drafter
    with pytest.raises(ConfigError, match="drafter.vocab_subset must be >= 1 or null, got 0"):
        ModelDrafter(lm, vocab_subset=0)


def test_vocab_subsets_per_request_at_batch_three(tiny_target, tiny_drafter):
    """Each request drafts over its own subset (its prompt's tokens); batched, paged KV."""
    from specflow.kv.stores import KVLayout
    from specflow.scheduler import Scheduler, SeqRequest

    hf, lm = tiny_target
    prompts = [[1, 5, 9, 17, 33, 5, 9], [100, 101, 102, 100, 101], [60, 61, 62]]
    drafter = ModelDrafter(tiny_drafter[1], k=4, vocab_subset=16)
    pipe = SpeculativePipeline(FullVerifier(lm), StandardAcceptor(), drafter=drafter)
    sched = Scheduler(pipe, 3, KVLayout(kind="paged", block_size=4), max_context=64)
    res = sched.generate([SeqRequest(p, 30, tag=i) for i, p in enumerate(prompts)])
    got = {r.request.tag: r.generation for r in res}
    assert [got[i].tokens for i in range(3)] == [hf_greedy(hf, p, 30) for p in prompts]
    assert all(got[i].stats.drafted > 0 for i in range(3))


@pytest.mark.parametrize("blocked", [True, False])
def test_an_int8_prefix_is_a_view_of_the_first_rows(blocked):
    w = torch.randn(21, 6)
    full = quantize_int8(w, blocked=blocked)  # 21 rows: the blocked copy's last block ragged
    pre = full.prefix(16)
    assert pre.shape == (16, 6) and pre.blocked == blocked
    assert pre.q.data_ptr() == full.q.data_ptr()  # a view, not a copy
    assert torch.equal(pre.dequantized(), full.dequantized()[:16])
    for bad in (12, 0, 24):
        with pytest.raises(ValueError, match=f"multiple of 8 rows in 1..21, got {bad}"):
            full.prefix(bad)


def test_the_subset_head_scores_its_prefix_through_the_int8_head(tiny_drafter):
    """With the model's int8 copies at one row, the subset's low ids come from the int8 LM
    head's first rows (bit for bit the full int8 head's columns) and the extra ids from
    their own float rows; the prefix is cut to a multiple of 8, the rest made extras."""
    hf, shared = tiny_drafter
    lm = NativeLM.from_hf(hf, tiny_model_info(hf, "int8 copy"))
    lm.make_int8_copies()
    lm.set_int8_rows(frozenset({1}))
    head = SubVocabHead.build(lm, 19, always=[40, 3])
    assert head.prefix == 16 and head.ids.tolist() == list(range(19)) + [40]
    assert head.extra_weight.shape[0] == 4
    top = lm.info.num_layers
    h = lm.embed(torch.tensor([7]))  # [1, H]
    sub = head.logits(lm, h, top)  # [1, 20]
    assert torch.equal(sub[:, :16], lm.head(h, top)[:, :16])  # the int8 head's columns
    x = lm.head_input(h, top)
    torch.testing.assert_close(sub[:, 16:], F.linear(x, lm.lm_head[[16, 17, 18, 40]]).float())
    two = lm.embed(torch.tensor([7, 9]))  # 2 rows: not an int8 row count, the float head
    torch.testing.assert_close(head.logits(lm, two, top), lm.head(two, top)[:, head.ids])
