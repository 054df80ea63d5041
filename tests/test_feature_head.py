"""The feature (EAGLE-style) draft head: training path = inference path, it learns, files,
errors, and the drafter stage (lossless at batch 1 and 3 is in ``test_one_engine``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specflow.engine import SpeculativePipeline
from specflow.errors import ConfigError, ModelNotFoundError
from specflow.kv.contiguous import KVCache
from specflow.models.feature_head import (
    FeatureDraftModel,
    FeatureHead,
    load_feature_head,
    read_feature_head_metadata,
)
from specflow.scheduler import generate
from stages.acceptors.standard import StandardAcceptor
from stages.drafters.feature import FeatureDrafter
from stages.verifiers.full import FullVerifier
from tests.conftest import hf_greedy, make_pair, train_tiny_feature_head
from train_heads.feature_module import collate, feature_losses


@pytest.fixture(scope="module")
def qwen():
    return make_pair("qwen2", seed=2, num_layers=4)  # q/k/v biases, GQA


@pytest.fixture(scope="module")
def trained(qwen, tmp_path_factory):
    path = tmp_path_factory.mktemp("fh") / "feature_head.safetensors"
    head, data = train_tiny_feature_head(qwen[1], path)
    return path, head, data


def test_inference_step_computes_the_training_forward(qwen, trained):
    """``FeatureDraftModel.step`` (one-layer NativeLM, packed weights, KV cache, rows fed in
    two blocks) gives the training forward's outputs."""
    _, lm = qwen
    _, head, data = trained
    tok, feats, _ = data.seq(0)
    t = len(tok) - 2
    emb = F.embedding(tok[1 : t + 1], lm.embed_weight.detach()).float()
    want = head(feats[None, :t], emb[None], torch.ones(1, t, dtype=torch.bool))[0][0]
    dm = FeatureDraftModel(head, lm)
    kv = KVCache(dm.kv, t + 4)
    a = dm.step(feats[:5], tok[1:6], [(kv, 5)])
    b = dm.step(feats[5:t], tok[6 : t + 1], [(kv, t - 5)])
    torch.testing.assert_close(torch.cat([a, b]), want, rtol=1e-4, atol=1e-4)
    assert kv.length == t


def test_second_step_of_training_is_the_drafting_chain(qwen, trained):
    """Step 2 of the training forward at row p (its own prediction from row p-1 fed back,
    target-feature keys of rows < p) = the drafter's second step after the target's
    features of rows [0, p)."""
    _, lm = qwen
    _, head, data = trained
    tok, feats, _ = data.seq(1)
    t, p = len(tok) - 2, 7
    emb = F.embedding(tok[1 : t + 1], lm.embed_weight.detach()).float()
    steps = head(feats[None, :t], emb[None], torch.ones(1, t, dtype=torch.bool), depth=2)
    dm = FeatureDraftModel(head, lm)
    kv = KVCache(dm.kv, t + 4)
    first = dm.step(feats[:p], tok[1 : p + 1], [(kv, p)])[-1:]  # f^_p from row p-1
    second = dm.step(first, tok[p + 1 : p + 2], [(kv, 1)])  # row p, predicted input
    torch.testing.assert_close(first[0], steps[0][0, p - 1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(second[0], steps[1][0, p], rtol=1e-4, atol=1e-4)


def test_training_raises_agreement(qwen, trained):
    _, lm = qwen
    _, head, data = trained
    batch = collate(data, list(range(data.num_seqs)), skip=0)
    args = (batch, lm.embed_weight.detach(), lm.final_norm, lm.lm_head, lm.eps)
    untrained = FeatureHead.from_target(lm, torch.arange(lm.info.vocab_size))
    before = feature_losses(untrained, *args)
    after = feature_losses(head, *args)
    assert float(after["agree"]) > float(before["agree"]) + 0.3
    assert float(after["kl"].detach()) < float(before["kl"].detach())


def test_file_round_trip_and_wrong_model(qwen, trained, tmp_path):
    _, lm = qwen
    path, head, _ = trained
    meta = read_feature_head_metadata(path)
    assert meta["base_model"] == lm.info.name and meta["draft_vocab_size"] == lm.info.vocab_size
    loaded = load_feature_head(path, lm.info)
    for (k, a), (_, b) in zip(head.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a.to(b.dtype), b), k
    other = make_pair("qwen2", seed=5, num_layers=4)[1]
    with pytest.raises(ConfigError, match="head=feature model="):
        load_feature_head(path, other.info)
    with pytest.raises(ModelNotFoundError, match="python -m train_heads.train head=feature"):
        FeatureDrafter(lm, head=str(tmp_path / "none.safetensors"))


def test_drafter_accepts_and_matches_hf_greedy(qwen, trained):
    """A trained head's drafts are accepted on prompts like its training data (tau > 1.5)
    and the output is HF greedy on those and on others."""
    hf, lm = qwen
    path, _, _ = trained
    pipe = SpeculativePipeline(FullVerifier(lm), StandardAcceptor(),
                               drafter=FeatureDrafter(lm, head=str(path), k=4))
    _, _, data = trained
    prompts = [data.seq(i)[0][: data.seq(i)[2]].tolist() for i in (0, 1)]  # trained on
    for p in prompts + [[3, 9, 4, 1, 7]]:
        gen = generate(pipe, p, 20)
        assert gen.tokens == hf_greedy(hf, p, 20)
    for p in prompts:
        assert generate(pipe, p, 20).stats.tau > 1.5


def test_drafts_after_provisional_tokens_continue_the_chain(qwen, trained):
    """Committed tokens whose h_N the target has not computed (HiSpec's provisionally
    accepted drafts) are read through the head's own predicted features, as its chain did:
    after committing a 6-token chain's first 4 tokens the next 2-token draft is the chain's
    tokens 5 and 6; after all 6, the next token is a 7-token chain's 7th.  The drafter runs
    none of the target's layers (``ModelUse.reads_only``)."""
    from specflow.kv.stores import KVStores
    from specflow.state import DecodeState

    _, lm = qwen
    path, _, data = trained
    prompt = data.seq(0)[0][: data.seq(0)[2]].tolist()

    def started() -> tuple[DecodeState, FeatureDrafter]:
        st = DecodeState(tokens=list(prompt), prompt_len=len(prompt), max_len=64,
                         kv=KVStores())
        drafter = FeatureDrafter(lm, head=str(path), k=8)
        FullVerifier(lm).begin([st])  # the target's prefill: h_N of the prompt
        drafter.begin([st])
        return st, drafter

    st, drafter = started()
    chain = drafter.propose([st], [6])[0].tokens
    assert len(chain) == 6
    done = [st.session(lm).computed(layer) for layer in range(lm.info.num_layers)]
    st.tokens += chain[:4]
    assert drafter.propose([st], [2])[0].tokens == chain[4:6]
    st.tokens += chain[4:6]
    after_all = drafter.propose([st], [1])[0].tokens
    assert [st.session(lm).computed(layer) for layer in range(lm.info.num_layers)] == done
    assert drafter.uses()[0].reads_only

    ref, ref_drafter = started()
    longer = ref_drafter.propose([ref], [7])[0].tokens
    assert longer[:6] == chain and after_all == longer[6:]


def test_drafter_sitting_out_rounds_reads_the_features_later(qwen, trained):
    """Rounds without drafting (k = 0) keep the target's features; the next draft reads
    them (the session's ``retain_final_from``) and the output stays exact."""

    hf, lm = qwen
    path, _, _ = trained

    class EveryOther:
        def begin(self, state):
            state.locals[self] = 0

        def use_prices(self, prices):
            pass

        def choose(self, state, k_max, part=""):
            state.locals[self] = n = state.locals[self] + 1
            return k_max if n % 2 else 0

        def observe(self, state, report):
            pass

    pipe = SpeculativePipeline(FullVerifier(lm), StandardAcceptor(),
                               drafter=FeatureDrafter(lm, head=str(path), k=3),
                               draft_length=EveryOther())
    _, _, data = trained
    p = data.seq(0)[0][: data.seq(0)[2]].tolist()
    gen = generate(pipe, p, 20)
    assert gen.tokens == hf_greedy(hf, p, 20)
    assert 0 in gen.stats.drafted_per_round and gen.stats.accepted > 0


def test_session_keeps_unread_final_features_only_when_asked(qwen):
    """Without ``retain_final_from`` the next round's ``set_tokens`` drops h_N before the
    new last token (a clear error names the fix); with it, the rows stay and equal a fresh
    forward's."""
    from specflow.kv.session import ModelSession

    _, lm = qwen
    n = lm.info.num_layers
    prompt = [3, 9, 4, 1, 7, 2]
    for retain in (False, True):
        sess = ModelSession(lm, 16)
        if retain:
            sess.retain_final_from(0)
        sess.set_tokens(prompt)
        sess.prefill()
        sess.set_tokens(prompt + [5])  # the next round: one more committed token
        if not retain:
            with pytest.raises(RuntimeError, match="retain_final_from"):
                sess.final_features(0, 5)
            continue
        fresh = ModelSession(lm, 16)
        fresh.set_tokens(prompt)
        want = fresh.exit_hidden(n, 0, 5)
        torch.testing.assert_close(sess.final_features(0, 5), want)
