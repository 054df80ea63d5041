"""Token trees: layout, the tree-masked forward, keeping the accepted path, the tree walk."""

from __future__ import annotations

import pytest
import torch

from specflow.acceptance import greedy_tree_accept
from specflow.engine import SpeculativePipeline
from specflow.errors import ConfigError, PromptTooLongError, SpecflowError
from specflow.kv.contiguous import KVCache
from specflow.kv.paged import PagedKVCache
from specflow.kv.session import ModelSession, forward_logits
from specflow.kv.tree import TreeLayout, path_rows
from specflow.protocols import DraftPart
from specflow.state import Draft
from stages.acceptors.fly import FlyAcceptor
from stages.acceptors.standard import StandardAcceptor
from stages.verifiers.full import FullVerifier
from tests.conftest import make_pair

# Node i continues node PARENTS[i] (-1: the last committed token): two roots, a chain of
# two under the first, one child under the second.
NODES = [21, 22, 23, 24, 25]
PARENTS = [-1, -1, 0, 1, 2]
COMMITTED = [1, 5, 9, 17, 33, 5]


@pytest.fixture(scope="module")
def lm():
    return make_pair("llama", seed=3, num_layers=3)[1]


def test_layout_depths_positions_and_visibility():
    tree = TreeLayout(5, (-1, 0, 0, 1, 2))
    assert tree.depths == (0, 1, 1, 2, 2)
    assert tree.positions(3, 7) == [3, 4, 5, 6, 6, 7, 7]
    vis = tree.visible(3, 7).int().tolist()
    assert vis[2] == [1] * 6 + [0] * 4  # the root: every earlier position and itself
    assert vis[4] == [1] * 6 + [0, 1, 0, 0]  # row 2 (parent 0) does not see row 1
    assert vis[6] == [1] * 6 + [0, 1, 0, 1]  # row 4 -> 2 -> 0
    with pytest.raises(ValueError, match="parents must precede"):
        TreeLayout(0, (-1, 1))
    with pytest.raises(ValueError, match="does not end where"):
        tree.covers(3, 6)


def test_path_rows_follows_the_first_matching_child():
    assert path_rows(PARENTS, NODES, [22, 24, 99]) == [1, 3]
    assert path_rows(PARENTS, NODES, [21, 23, 25]) == [0, 2, 4]
    assert path_rows(PARENTS, NODES, [7]) == []


def _chain_logits(lm, tokens: list[int]) -> torch.Tensor:
    """The last position's logits of ``tokens`` run as a plain sequence."""
    sess = ModelSession(lm, 64)
    sess.set_tokens(tokens)
    return sess.logits(lm.info.num_layers, len(tokens) - 1, len(tokens))[0]


def _path(i: int) -> list[int]:
    path = []
    while i >= 0:
        path.append(NODES[i])
        i = PARENTS[i]
    return path[::-1]


def _paged_session(lm, seq_id: int = 0) -> ModelSession:
    pool = PagedKVCache(lm.kv, num_blocks=32, block_size=4)
    return ModelSession(lm, 64, pool.add_sequence(seq_id, 64), seq_id=seq_id)


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
def test_tree_forward_equals_each_path_as_a_chain(lm, kind):
    """Row 0 is the distribution after the committed tokens and row i+1 the one after the
    path to node i, as each path run as an ordinary sequence gives it; then the accepted
    path's keys stay in place and decoding continues as if the path had been a chain."""
    n = len(COMMITTED)
    sess = ModelSession(lm, 64) if kind == "contiguous" else _paged_session(lm)
    sess.retain_final_from(0)  # as a feature drafter asks
    sess.set_tokens(COMMITTED)
    sess.prefill()
    sess.set_tree(COMMITTED, NODES, PARENTS)
    logits = sess.logits(lm.info.num_layers, n - 1, n + len(NODES))  # [6, V]
    assert torch.allclose(logits[0], _chain_logits(lm, COMMITTED), atol=1e-4)
    for i in range(len(NODES)):
        want = _chain_logits(lm, COMMITTED + _path(i))
        assert torch.allclose(logits[i + 1], want, atol=1e-4), i
    # Commit the path 1 -> 3 and a bonus token: the keys of nodes 1 and 3 move into place.
    new = COMMITTED + [22, 24, 40]
    assert sess.kept_prefix(new) == n + 2  # what catch-up counts as done, tree pending
    assert sess.kept_prefix(COMMITTED[:-1] + [99]) == n - 1
    sess.set_tokens(new)
    assert sess.tokens == new
    assert [sess.computed(layer) for layer in range(lm.info.num_layers)] == [n + 2] * 3
    assert sess.tree is None
    after = sess.logits(lm.info.num_layers, n + 2, n + 3)[0]
    assert torch.allclose(after, _chain_logits(lm, new), atol=1e-4)
    # The kept h_N rows are the path's: the root's and nodes 1 and 3.
    chain = ModelSession(lm, 64)
    chain.retain_final_from(0)
    chain.set_tokens(new)
    chain.hidden(lm.info.num_layers, len(new))
    assert torch.allclose(sess.final_features(n - 1, n + 2),
                          chain.final_features(n - 1, n + 2), atol=1e-4)


def test_tree_in_a_batch_beside_a_chain(lm):
    """One batched forward: a tree request and a chain request (contiguous and paged)."""
    for kind in ("contiguous", "paged"):
        pool = PagedKVCache(lm.kv, num_blocks=64, block_size=4) if kind == "paged" else None

        def open_session(seq_id: int, pool=pool) -> ModelSession:
            if pool is None:
                return ModelSession(lm, 64)
            return ModelSession(lm, 64, pool.add_sequence(seq_id, 64), seq_id=seq_id)

        a, b = open_session(0), open_session(1)
        other = [2, 4, 6, 8, 10, 12, 14, 16, 18, 20]
        a.set_tokens(COMMITTED)
        b.set_tokens(other)
        forward_logits([(a, 3, 0, len(COMMITTED) - 1), (b, 3, 0, 2)])
        a.set_tree(COMMITTED, NODES, PARENTS)
        n = len(COMMITTED)
        # The chain's block (8 rows) is longer than the tree's (6): the tree's rows are
        # left-padded in the paged batch.
        tree_rows, chain_rows = forward_logits([(a, 3, n - 1, n + len(NODES)),
                                                (b, 3, 2, len(other))])
        assert torch.allclose(tree_rows[0], _chain_logits(lm, COMMITTED), atol=1e-4)
        for i in range(len(NODES)):
            want = _chain_logits(lm, COMMITTED + _path(i))
            assert torch.allclose(tree_rows[i + 1], want, atol=1e-4), (kind, i)
        for j in range(len(other) - 2):
            want = _chain_logits(lm, other[: j + 3])
            assert torch.allclose(chain_rows[j], want, atol=1e-4), (kind, j)


def test_keep_rows_moves_keys_in_both_layouts(lm):
    spec = lm.kv
    cache = KVCache(spec, 16)
    k = torch.arange(10, dtype=torch.float32)[None, :, None].expand(spec.kv_heads, 10,
                                                                    spec.head_dim)
    cache.k[:, :10] = k
    cache.length = 10
    cache.keep_rows(4, [0, 2, 5])
    assert cache.length == 7
    assert cache.k[0, 4:7, 0].tolist() == [4.0, 6.0, 9.0]
    with pytest.raises(ValueError, match="cannot keep rows"):
        cache.keep_rows(4, [1, 0])
    pool = PagedKVCache(spec, num_blocks=8, block_size=4)
    layers = pool.add_sequence(0, 16)
    pool.reserve(0, 10)  # 3 blocks of 4
    slots = pool.slots(0, 0, 10)
    pool.k[1].view(-1, spec.kv_heads, spec.head_dim)[slots] = k.transpose(0, 1)
    for layer in range(spec.num_layers):
        pool.set_length(0, layer, 10)
    for layer in layers:
        layer.keep_rows(4, [0, 2, 3])
        assert layer.length == 7
    flat = pool.k[1].view(-1, spec.kv_heads, spec.head_dim)
    assert flat[pool.slots(0, 4, 7), 0, 0].tolist() == [4.0, 6.0, 7.0]
    assert len(pool.blocks_of(0)) == 2  # the third block held only dropped rows: freed
    assert pool.allocator.num_used == 2
    pool.remove_sequence(0)
    pool.allocator.check_no_leaks()


def test_keep_rows_already_in_place_only_shortens(lm, monkeypatch):
    """A kept path of rows 0..m-1 (no node accepted, or a chain's first nodes) is where it
    belongs: the length drops to it, the keys stay, and no copy runs (``torch.tensor`` would
    build the gather's indices)."""
    spec = lm.kv
    cache = KVCache(spec, 16)
    cache.k[:, :10] = torch.arange(10, dtype=torch.float32)[None, :, None]
    cache.length = 10
    pool = PagedKVCache(spec, num_blocks=8, block_size=4)
    layers = pool.add_sequence(0, 16)
    pool.reserve(0, 10)  # 3 blocks of 4
    slots = pool.slots(0, 0, 10)
    pool.k[1].view(-1, spec.kv_heads, spec.head_dim)[slots] = 7.0
    for layer in range(spec.num_layers):
        pool.set_length(0, layer, 10)

    def no_gather(*args, **kwargs):
        raise AssertionError("keep_rows gathered rows that were in place")

    monkeypatch.setattr(torch, "tensor", no_gather)
    cache.keep_rows(4, [0, 1])
    for layer in layers:
        layer.keep_rows(4, [0])
    monkeypatch.undo()
    assert cache.length == 6
    assert cache.k[0, :10, 0].tolist() == [float(i) for i in range(10)]
    assert [layer.length for layer in layers] == [5] * spec.num_layers
    flat = pool.k[1].view(-1, spec.kv_heads, spec.head_dim)
    assert bool((flat[pool.slots(0, 0, 5)] == 7.0).all())
    assert len(pool.blocks_of(0)) == 2  # the third block held only dropped rows: freed
    pool.remove_sequence(0)
    pool.allocator.check_no_leaks()


def test_draft_depth_and_first_chain():
    tree = Draft(NODES, parents=PARENTS)
    assert (tree.depth, tree.first_chain()) == (3, [0, 2, 4])
    chain = Draft([4, 5])
    assert (chain.depth, chain.first_chain()) == (2, [0, 1])
    assert Draft([], parents=[]).depth == 0


def test_greedy_tree_accept_walks_the_argmax_path():
    vocab = 50
    # rows: root, node 0..4; the target wants 22 after the root, 24 after node 1, 7 after 3
    wants = [22, 0, 24, 0, 7, 0]
    logits = torch.full((6, vocab), -1.0)
    logits[torch.arange(6), torch.tensor(wants)] = 1.0
    verdict = greedy_tree_accept(NODES, PARENTS, logits)
    assert (verdict.num_accepted, verdict.next_token, verdict.path) == (2, 7, [1, 3])
    assert Draft(NODES, parents=PARENTS).accepted_tokens(verdict) == [22, 24]
    logits[0] = -1.0
    logits[0, 30] = 1.0  # no root-level node is the target's token
    verdict = greedy_tree_accept(NODES, PARENTS, logits)
    assert (verdict.num_accepted, verdict.next_token, verdict.path) == (0, 30, [])


class _TreeOnce:
    """A drafter that proposes one fixed tree (for the refusal tests); ``branches`` is what
    it declares (1: a drafter that breaks its contract)."""

    name = "tree"
    k = 2

    def __init__(self, branches: int = 2) -> None:
        self.branches = branches

    def begin(self, states):
        pass

    def next_part(self, state):
        return DraftPart("", self.k, self.k)

    def propose(self, states, asked):
        return [Draft([3, 4], parents=[-1, -1]) for _ in states]

    def observe(self, states, drafts, target_logits, verdicts):
        pass

    def models(self):
        return []

    def uses(self):
        return []


def test_a_chain_only_acceptor_refuses_a_tree_drafter_when_built(lm):
    from specflow.scheduler import generate

    with pytest.raises(ConfigError, match=r"drafter.branches=2: .* \(FlyAcceptor\) verifies "
                                          r"chains only"):
        SpeculativePipeline(FullVerifier(lm), FlyAcceptor(theta=1.0, window=1),
                            drafter=_TreeOnce())
    ok = SpeculativePipeline(FullVerifier(lm), StandardAcceptor(), drafter=_TreeOnce())
    assert len(generate(ok, [1, 2, 3], 4).tokens) == 4


def test_a_tree_from_a_drafter_declaring_chains_is_refused_at_its_round(lm):
    from specflow.scheduler import generate

    pipe = SpeculativePipeline(FullVerifier(lm), StandardAcceptor(),
                               drafter=_TreeOnce(branches=1))
    with pytest.raises(SpecflowError, match="'tree' declares branches=1 .* proposed a token "
                                            "tree"):
        generate(pipe, [1, 2, 3], 4)


def test_an_intermediate_verifier_refuses_a_tree_drafter_when_built(lm):
    from stages.verifiers.early_exit import EarlyExitVerifier

    with pytest.raises(ConfigError, match="drafter.branches=2: an intermediate_verifier "
                                          "verifies chains"):
        SpeculativePipeline(FullVerifier(lm), StandardAcceptor(), drafter=_TreeOnce(),
                            intermediate_verifier=EarlyExitVerifier(lm, exit_layer=1,
                                                                   accumulate=2))


def test_set_tree_refuses_a_tree_beyond_the_context(lm):
    sess = ModelSession(lm, 8)
    with pytest.raises(PromptTooLongError, match="exceeds this request's context"):
        sess.set_tree([1, 2, 3, 4], [5, 6, 7, 8, 9], [-1, -1, 0, 1, 2])


def test_a_committed_tree_node_is_verified_again_from_its_kept_row(lm):
    """A nested pipeline's outer target may commit a node of the draft model's last tree
    (path 1 -> 3), so the last committed token is a computed position; verifying a chain
    after it asks from that position: its h_N row is kept through the path's resolution and
    the next ``set_tokens``, and the logits are a chain's."""
    n = len(COMMITTED)
    sess = ModelSession(lm, 64)
    sess.set_tokens(COMMITTED)
    sess.prefill()
    sess.set_tree(COMMITTED, NODES, PARENTS)
    sess.logits(lm.info.num_layers, n - 1, n + len(NODES))
    committed = COMMITTED + [22, 24]  # the path 1 -> 3: the last committed token computed
    sess.set_tokens(committed)
    assert sess.computed(lm.info.num_layers - 1) == len(committed)
    sess.set_tokens(committed + [40, 41])  # a chain draft after it
    logits = sess.logits(lm.info.num_layers, len(committed) - 1, len(committed) + 2)
    for j in range(3):
        want = _chain_logits(lm, committed + [40, 41][:j])
        assert torch.allclose(logits[j], want, atol=1e-4), j
