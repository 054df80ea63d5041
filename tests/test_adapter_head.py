"""Attention adapters at an early exit: the session feeds them every position exactly once,
their answers equal the training path's, and files round-trip."""

from __future__ import annotations

import pytest
import torch

from specflow.errors import ConfigError
from specflow.kv.session import ModelSession
from specflow.models.adapter_head import AdapterHead
from specflow.models.exit_heads import (
    attach_heads,
    load_and_attach,
    read_heads_metadata,
    save_heads,
)
from tests.conftest import make_pair

EXIT = 2
PROMPT = [1, 5, 9, 17, 33, 5, 9, 12, 40, 3]


def perturbed_adapter(lm, exit_layer: int = EXIT, seed: int = 0) -> AdapterHead:
    """An adapter at ``exit_layer`` moved away from its initialisation (as training would)."""
    head = AdapterHead.from_target(lm, exit_layer)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.3 * p.abs().mean() * torch.randn(p.shape, generator=gen))
    return head


@pytest.fixture()
def adapted():
    """A fresh 6-layer tiny target (its own object: attaching heads mutates the model) with a
    perturbed adapter at exit 2, and the adapter."""
    hf, lm = make_pair("llama", seed=3, num_layers=6)
    head = perturbed_adapter(lm)
    attach_heads(lm, {EXIT: head})
    return hf, lm, head


def exit_states(hf, tokens: list[int], exit_layer: int) -> torch.Tensor:
    """``h_L [T, H]`` of every position, from HF's own forward (the outside oracle)."""
    with torch.no_grad():
        out = hf(torch.tensor([tokens]), output_hidden_states=True)
    return out.hidden_states[exit_layer][0]


def test_untrained_adapter_is_the_next_exit():
    """from_target copies layer L: the adapter at exit L answers what exit L+1 answers."""
    _, lm = make_pair("llama", seed=3, num_layers=6)
    plain = ModelSession(lm, 32)
    plain.set_tokens(PROMPT)
    cut = plain.logits(EXIT, 0, len(PROMPT))  # [T, V]: exit L without the adapter
    want = plain.logits(EXIT + 1, 0, len(PROMPT))  # [T, V]
    attach_heads(lm, {EXIT: AdapterHead.from_target(lm, EXIT)})
    sess = ModelSession(lm, 32)
    sess.read_exit(EXIT)
    sess.set_tokens(PROMPT)
    got = sess.logits(EXIT, 0, len(PROMPT))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(got, cut, atol=1e-2)


def test_session_answers_equal_the_training_path(adapted):
    """Positions reach the adapter three ways (asked at its exit, consumed by a deeper pass,
    one token at a time): every answer equals ``AdapterHead.sequence`` over HF's ``h_L``."""
    hf, lm, head = adapted
    tokens = PROMPT + [7, 8, 9, 10, 11]
    with torch.no_grad():
        a = head.sequence(exit_states(hf, tokens, EXIT)[None], torch.ones(1, len(tokens),
                                                                           dtype=torch.bool))[0]
        want = lm.head(a, EXIT)  # [T, V]

    sess = ModelSession(lm, 32)
    sess.read_exit(EXIT)
    sess.set_tokens(tokens[:6])
    first = sess.logits(EXIT, 0, 6)  # asked at the exit: rows 0..5
    sess.extend(tokens[6:10])
    sess.logits(6, 6, 10)  # a full pass consumes h_2 of 6..9 before the adapter sees them
    assert sess.adapters[EXIT].length == 6 and sess.adapters[EXIT].pending.shape[0] == 4
    rows = []
    for t in range(10, len(tokens)):  # then one token at a time, as drafting asks
        sess.extend([tokens[t]])
        rows.append(sess.logits(EXIT, 6 if t == 10 else t, t + 1))  # the pending rows too
    torch.testing.assert_close(first, want[:6], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch.cat(rows), want[6:], rtol=1e-4, atol=1e-4)
    assert sess.adapters[EXIT].length == len(tokens)
    assert sess.adapters[EXIT].pending is None


def test_rollback_refeeds_only_the_new_tokens(adapted):
    hf, lm, head = adapted
    sess = ModelSession(lm, 32)
    sess.read_exit(EXIT)
    sess.set_tokens(PROMPT + [50, 51, 52])
    sess.logits(EXIT, 0, len(PROMPT) + 3)
    sess.set_tokens(PROMPT + [60, 61])  # the drafts were rejected: keep the prompt
    assert sess.adapters[EXIT].length == len(PROMPT)
    got = sess.logits(EXIT, len(PROMPT), len(PROMPT) + 2)
    tokens = PROMPT + [60, 61]
    with torch.no_grad():
        a = head.sequence(exit_states(hf, tokens, EXIT)[None],
                          torch.ones(1, len(tokens), dtype=torch.bool))[0]
    torch.testing.assert_close(got, lm.head(a[len(PROMPT):], EXIT), rtol=1e-4, atol=1e-4)


def test_read_exit_after_the_layer_ran_is_refused(adapted):
    _, lm, _ = adapted
    sess = ModelSession(lm, 32)
    sess.set_tokens(PROMPT)
    sess.logits(6, 0, len(PROMPT))
    with pytest.raises(RuntimeError, match="read_exit"):
        sess.read_exit(EXIT)
    sess.read_exit(EXIT + 1)  # no adapter there: nothing to feed, no error


def test_sequence_padding_does_not_leak():
    _, lm = make_pair("llama", seed=3, num_layers=6)
    head = perturbed_adapter(lm)
    gen = torch.Generator().manual_seed(1)
    h = torch.randn(2, 7, lm.hidden_size, generator=gen)
    valid = torch.ones(2, 7, dtype=torch.bool)
    valid[1, 4:] = False
    with torch.no_grad():
        both = head.sequence(h, valid)
        alone = head.sequence(h[1:, :4], valid[1:, :4])
    torch.testing.assert_close(both[1, :4], alone[0], rtol=1e-5, atol=1e-5)


def test_file_round_trip_and_placement(adapted, tmp_path):
    hf, lm, head = adapted
    path = save_heads(tmp_path / "heads.safetensors", {EXIT: head}, lm.info)
    assert read_heads_metadata(path)["head_type"] == "adapter"
    _, fresh = make_pair("llama", seed=3, num_layers=6)
    loaded = load_and_attach(fresh, path)[EXIT]
    assert isinstance(loaded, AdapterHead)
    for (name, a), (_, b) in zip(head.state_dict().items(), loaded.state_dict().items(),
                                 strict=True):
        assert torch.equal(a, b), name
    assert fresh.exit_adapter(EXIT) is not None and fresh.exit_adapter(EXIT + 1) is None
    moved = fresh.to(torch.device("cpu"), torch.bfloat16)
    assert moved.exit_adapter(EXIT).layer.wqkv.dtype == torch.bfloat16


def test_an_adapter_needs_an_early_exit():
    _, lm = make_pair("llama", seed=3, num_layers=6)
    with pytest.raises(ConfigError, match="early exit"):
        AdapterHead.from_target(lm, 6)
    with pytest.raises(ConfigError, match="early exit"):
        attach_heads(lm, {6: AdapterHead.from_target(lm, 5)})


def test_self_spec_drafts_through_the_adapter(adapted, monkeypatch):
    """The early-exit drafter reads the adapter (its rows are run, and the drafts differ from
    the bare exit's), and the output stays the target's."""
    from specflow.engine import SpeculativePipeline
    from specflow.models.native import LayerAdapter
    from specflow.scheduler import generate
    from stages.acceptors.standard import StandardAcceptor
    from stages.drafters.model import ModelDrafter
    from stages.verifiers.full import FullVerifier
    from tests.conftest import hf_greedy

    hf, lm, _ = adapted
    fed = []
    run = LayerAdapter.run
    monkeypatch.setattr(LayerAdapter, "run",
                        lambda self, h, batch, memo: fed.append(h.shape[0]) or run(self, h, batch,
                                                                                   memo))

    def self_spec(model):
        pipe = SpeculativePipeline(FullVerifier(model), StandardAcceptor(),
                                   drafter=ModelDrafter(model, k=3, exit_layer=EXIT))
        return generate(pipe, PROMPT, 24)

    with_adapter = self_spec(lm)
    assert sum(fed) >= len(PROMPT) + 24 - 1  # every committed position at least once
    _, bare = make_pair("llama", seed=3, num_layers=6)
    without = self_spec(bare)
    assert with_adapter.tokens == without.tokens == hf_greedy(hf, PROMPT, 24)
    assert with_adapter.stats.accepted_per_round != without.stats.accepted_per_round


def test_merge_heads_takes_each_exit_from_its_file(adapted, tmp_path):
    """An mlp file (exits 1, 3) and an adapter file (exit 2) merge into one file whose heads
    are the sources' tensors, loadable and attachable; bad merges are refused by name."""
    from specflow.models.exit_heads import ExitHead, load_heads, merge_heads

    _, lm, adapter = adapted
    gen = torch.Generator().manual_seed(1)
    mlps = {e: ExitHead(lm.info.hidden_size, "mlp", rank=4) for e in (1, 3)}
    for head in mlps.values():
        with torch.no_grad():
            for p in head.parameters():
                p.add_(torch.randn(p.shape, generator=gen))
    a = save_heads(tmp_path / "mlp.safetensors", mlps, lm.info)
    b = save_heads(tmp_path / "adapter.safetensors", {EXIT: adapter}, lm.info)
    out = merge_heads(tmp_path / "merged.safetensors", [(a, [3]), (b, None)])
    meta = read_heads_metadata(out)
    assert meta["layers"] == [2, 3] and meta["head_type"] == "adapter+mlp"
    assert meta["extra"]["merged_from"]["3"]["file"] == str(a)
    loaded = load_heads(out, lm.info)
    assert isinstance(loaded[2], AdapterHead) and isinstance(loaded[3], ExitHead)
    for want, got in ((mlps[3], loaded[3]), (adapter, loaded[2])):
        for (name, x), (_, y) in zip(want.state_dict().items(), got.state_dict().items(),
                                     strict=True):
            assert torch.equal(x, y), name
    with pytest.raises(ConfigError, match="exit 3 is given by"):
        merge_heads(tmp_path / "m2.safetensors", [(a, None), (out, [3])])
    with pytest.raises(ConfigError, match=r"has exits \[1, 3\], not 2"):
        merge_heads(tmp_path / "m3.safetensors", [(a, [2])])
    _, other = make_pair("llama", seed=4, num_layers=6)
    c = save_heads(tmp_path / "other.safetensors", {1: ExitHead(other.info.hidden_size)},
                   other.info)
    with pytest.raises(ConfigError, match="weights_fingerprint"):
        merge_heads(tmp_path / "m4.safetensors", [(b, None), (c, None)])
