"""Training-free token trees: the planner (best-first growth, size by price, calibration),
the recycling table, the suffix index, and the ``token_tree`` drafter in every pipeline it
composes into (alone, behind prompt lookup, as a pool arm, under the adaptive draft length):
HF's greedy tokens at batch 1 and 3, contiguous and paged, and the target's law when
sampling."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from specflow.cpu.row_padding import RowProbe
from specflow.engine import SpeculativePipeline
from specflow.errors import ConfigError
from specflow.kv.stores import KVLayout
from specflow.sampling import SamplingParams
from specflow.scheduler import Scheduler, SeqRequest, generate
from specflow.state import Acceptance, Draft
from stages.acceptors.standard import StandardAcceptor
from stages.draft_length.adaptive import AdaptiveDraftLength
from stages.drafters.fallback import FallbackDrafter
from stages.drafters.merged_tree import MergedTreeDrafter, merge
from stages.drafters.model import ModelDrafter
from stages.drafters.pld import PLDDrafter
from stages.drafters.pool import PoolDrafter
from stages.drafters.token_tree.drafter import TokenTreeDrafter, recycle_bin, suffix_bin
from stages.drafters.token_tree.recycling import RecyclingTable
from stages.drafters.token_tree.suffix_index import SuffixIndex
from stages.drafters.token_tree.tree_plan import (
    AcceptanceCalibration,
    Candidate,
    grow_tree,
    plan_sizes,
)
from stages.selectors.round_robin import RoundRobinSelector
from stages.verifiers.full import FullVerifier
from tests.conftest import hf_greedy, law_pvalue, make_pair, two_token_law
from tests.test_one_engine import MAX_NEW, PROMPTS, decode

# ---------------------------------------------------------------- the planner


def _children(table: dict[int, list[tuple[int, float]]]):
    """A node's children from a fixed table keyed by the node's token."""
    return lambda token, _state: [Candidate(t, p) for t, p in table.get(token, [])]


def test_grow_tree_adds_nodes_best_first():
    """Root 0's children 1 (0.9) and 2 (0.5); 1's child 3 (0.8): path probabilities 0.9,
    0.72, 0.5; 3's child 4 (0.5) has 0.36 and comes last; parents precede children."""
    table = {0: [(1, 0.9), (2, 0.5)], 1: [(3, 0.8)], 3: [(4, 0.5)], 2: [(5, 0.1)]}
    tree = grow_tree(_children(table), 0, None, max_nodes=4, max_depth=8)
    assert tree.tokens == [1, 3, 2, 4]
    assert tree.parents == [-1, 0, -1, 1]
    assert tree.path_probs == pytest.approx([0.9, 0.72, 0.5, 0.36])
    assert not tree.is_chain
    assert tree.truncated(2).is_chain and tree.truncated(2).tokens == [1, 3]
    # depth 2 at most: 4 (depth 3) is never added; 5 (0.05) is below min_path_prob 0.06
    shallow = grow_tree(_children(table), 0, None, max_nodes=9, max_depth=2,
                        min_path_prob=0.06)
    assert shallow.tokens == [1, 3, 2]


def test_plan_sizes_keeps_a_node_while_it_pays_for_its_row():
    """Rows at 0.1 step each: (1 + 0.9) / 1.1 = 1.727 beats 1; the next node (0.2) would
    give 2.1 / 1.2 = 1.75, better still; a 0.05 node (2.15 / 1.3 = 1.654) is not."""
    price = lambda n: 1.0 + 0.1 * (n - 1)  # noqa: E731
    assert plan_sizes([[0.9, 0.2, 0.05]], price) == [2]
    assert plan_sizes([[0.05]], price) == [0]
    # free rows: every node; a cap on the pass's rows
    assert plan_sizes([[0.9, 0.2, 0.05]], lambda n: 1.0) == [3]
    assert plan_sizes([[0.9, 0.2, 0.05]], lambda n: 1.0, max_rows=2) == [1]
    assert plan_sizes([], price) == []


def test_plan_sizes_merges_a_batch_by_probability():
    """Two requests, rows at 0.05 step: the merged order 0.9 (a), 0.6 (b), 0.5 (a), 0.1 (b):
    (2 + 2.0) / 1.2 = 3.33 at three nodes beats four, (2 + 2.1) / 1.25 = 3.28."""
    price = lambda n: 1.0 + 0.05 * (n - 1)  # noqa: E731
    assert plan_sizes([[0.9, 0.5], [0.6, 0.1]], price) == [2, 1]


def test_calibration_counts_nodes_whose_parent_was_kept():
    """Tree: roots 0, 1; 2 under 0; 3 under 2.  Path [0, 2] kept: 0, 1, 2 and 3 seen (3's
    parent 2 was kept), 0 and 2 kept."""
    calib = AcceptanceCalibration(strength=2.0)
    calib.record_tree([-1, -1, 0, 2], [("a",), ("b",), ("a",), ("c",)], {0, 2})
    assert calib.counts == {"a": [2.0, 2.0], "b": [0.0, 1.0], "c": [0.0, 1.0]}
    assert calib.estimate("a", 0.5) == pytest.approx((2 + 1) / (2 + 2))
    assert calib.estimate("new", 0.3) == pytest.approx(0.3)
    # a node under a rejected root is not seen
    calib.record_tree([-1, 0], [("d",), ("e",)], set())
    assert calib.counts["d"] == [0.0, 1.0] and "e" not in calib.counts


def test_bins():
    assert suffix_bin(5, 3, 3) == ("suffix", 3, 2, 2)
    assert suffix_bin(1, 1, 4) == ("suffix", 1, 0, 1)
    assert suffix_bin(2, 3, 4) == ("suffix", 2, 1, 2)
    assert recycle_bin(0.999) == ("recycle", 9) and recycle_bin(0.05) == ("recycle", 0)


# ---------------------------------------------------------------- the sources


def test_recycling_table_keeps_each_tokens_latest_top_w():
    table = RecyclingTable(width=2)
    assert table.successors(3) == ([], []) and table.nbytes == 0
    logits = torch.full((2, 6), -10.0)
    logits[0, 4], logits[0, 1] = 5.0, 4.0  # after token 3: 4, then 1
    logits[1, 2] = 5.0  # after token 5: 2 (then the lowest id of the rest, 0)
    table.update([3, 5], logits)
    ids, probs = table.successors(3)
    assert ids == [4, 1]
    p = torch.softmax(logits[0], -1)
    assert probs == pytest.approx([float(p[4]), float(p[1])], abs=1e-3)
    assert table.successors(5)[0][0] == 2
    logits2 = torch.full((1, 6), -10.0)
    logits2[0, 0] = 5.0
    table.update([3], logits2)  # overwritten by the latest position
    assert table.successors(3)[0][0] == 0
    assert table.nbytes == 6 * 2 * (4 + 2)
    # Qwen2.5's vocabulary at width 8: 151,936 x 8 x 6 bytes
    big = RecyclingTable(width=8)
    big.update([0], torch.zeros(1, 151_936))
    assert big.nbytes == 7_292_928


def test_suffix_index_gathers_continuations_of_the_longest_suffix():
    """(1, 2, 3) occurred twice before: followed by 9 then 7; the request's own latest
    occurrence first; another sequence's occurrences count too."""
    index = SuffixIndex(max_ngram=3, min_ngram=1, max_matches=8)
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3]
    match = index.match(tokens, depth=2)
    assert match is not None and match.length == 3
    assert match.root.count == 2
    assert {t: c.count for t, c in match.root.children.items()} == {7: 1, 9: 1}
    assert list(match.root.children) == [7, 9]  # latest first
    assert list(match.root.children[7].children) == [1]
    other = [5, 1, 2, 3, 7, 7]
    index.add(other)
    match = index.match(tokens, depth=1)
    assert {t: c.count for t, c in match.root.children.items()} == {7: 2, 9: 1}
    # the sequences grow: their new n-grams are indexed on the next match
    tokens += [4]
    other += [3, 4, 8]
    match = index.match(tokens, depth=1)
    assert match.length == 2 and list(match.root.children) == [8]
    assert index.match([42, 43], depth=3) is None


def test_suffix_index_drops_the_oldest_sequences_beyond_its_size():
    index = SuffixIndex(max_ngram=2, max_tokens=10)
    first, second = [1, 2, 3, 4, 5, 6], [7, 8, 9, 1, 2]
    index.add(first)
    index.add(second)  # 11 tokens > 10: the first goes
    assert index.num_tokens == 5
    match = index.match([0, 8], depth=2)  # (8) in the second: 9, 1 follow
    assert match is not None and list(match.root.children) == [9]
    assert index.match([5, 6], depth=2) is None  # only the dropped first had (6) ...


def _entries(index: SuffixIndex) -> list[tuple[tuple[int, ...], int, int]]:
    return sorted((key, s, e) for key, hits in index._index.items() for s, e in hits)


def test_a_replaced_sequence_keeps_its_common_prefix_and_reindexes_the_rest():
    """``replace``: the new list's text past the common prefix replaces the old one's, in
    the index exactly as if the new list had been added alone (no entry of the dropped
    tail, none twice); an unknown old list just adds the new one."""
    index = SuffixIndex(max_ngram=3, min_ngram=1)
    old = [1, 2, 3, 9, 9]
    index.match(old, depth=2)  # indexed: 5 tokens
    old += [4]  # appended after indexing: never indexed, nothing to drop
    new = [1, 2, 3, 7, 1, 2]
    index.replace(old, new)
    match = index.match(new, depth=2)
    assert match is not None and match.length == 2
    assert {t: c.count for t, c in match.root.children.items()} == {3: 1}
    alone = SuffixIndex(max_ngram=3, min_ngram=1)
    alone.match(list(new), depth=2)
    assert _entries(index) == _entries(alone)
    assert index.sequences() == [new]
    fresh = [5, 6]
    index.replace([8, 8], fresh)  # an old list it never saw
    assert index.sequences() == [new, fresh]


# ---------------------------------------------------------------- the drafter


@pytest.fixture(scope="module")
def target():
    """Packed: its measured row prices (the probe times packed matmuls) let trees be drafted."""
    return make_pair("llama", seed=3, num_layers=6, packed=True)


def tree_drafter(lm, suffix: bool = True, recycling: bool = True, **kw) -> TokenTreeDrafter:
    kw.setdefault("k", 4)
    kw.setdefault("branches", 3)
    return TokenTreeDrafter(lm, suffix=SuffixIndex(max_ngram=4) if suffix else None,
                            recycling=RecyclingTable(width=4) if recycling else None, **kw)


def build(method: str, lm) -> SpeculativePipeline:
    def pipe(drafter, **kw) -> SpeculativePipeline:
        return SpeculativePipeline(FullVerifier(lm), StandardAcceptor(), drafter=drafter,
                                   name=method, **kw)

    if method == "suffix_recycle":
        return pipe(tree_drafter(lm))
    if method == "recycle":
        return pipe(tree_drafter(lm, suffix=False))
    if method == "suffix":
        return pipe(tree_drafter(lm, recycling=False))
    if method == "chains":
        return pipe(tree_drafter(lm, branches=1))
    if method == "pld_then_tree":
        return pipe(FallbackDrafter(PLDDrafter(k=5, min_ngram=2), tree_drafter(lm)))
    if method == "pool_arm":
        arms = {"pld": PLDDrafter(k=4), "tree": tree_drafter(lm)}
        return pipe(PoolDrafter(arms, RoundRobinSelector()))
    if method == "adaptive":
        return pipe(tree_drafter(lm, k=5), draft_length=AdaptiveDraftLength())
    if method == "suffix_then_model":  # conf/drafter/suffix_then_model.yaml
        first = TokenTreeDrafter(lm, k=4, branches=3, suffix=SuffixIndex(max_ngram=4,
                                                                          min_ngram=2))
        return pipe(FallbackDrafter(first, ModelDrafter(draft_model(), k=3)))
    if method == "pld_then_tree_model":  # conf/drafter/pld_then_tree_model.yaml: the draft
        # model, sped up by the trees it verifies, drafts chains for the target
        inner = SpeculativePipeline(FullVerifier(draft_model()), StandardAcceptor(),
                                    drafter=tree_drafter(draft_model()), level="draft", k=4)
        return pipe(FallbackDrafter(PLDDrafter(k=4, min_ngram=2), inner))
    if method == "model_and_tree":  # conf/drafter/model_and_tree.yaml
        return pipe(MergedTreeDrafter(ModelDrafter(draft_model(), k=3),
                                      tree_drafter(lm, k=4, max_nodes=4), extra_nodes=4))
    raise ValueError(method)


_DRAFT_MODEL: list = []


def draft_model():
    """A second tiny model of the same vocabulary (made once)."""
    if not _DRAFT_MODEL:
        _DRAFT_MODEL.append(make_pair("llama", seed=4, num_layers=2)[1])
    return _DRAFT_MODEL[0]


METHODS = ["suffix_recycle", "recycle", "suffix", "chains", "pld_then_tree", "pool_arm",
           "adaptive", "suffix_then_model", "model_and_tree", "pld_then_tree_model"]
CHAINS_ONLY = ("chains", "pld_then_tree_model")  # the target verifies chains only


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
@pytest.mark.parametrize("batch_size", [1, 3])
@pytest.mark.parametrize("method", METHODS)
def test_token_trees_give_hf_greedy_tokens(method, batch_size, kind, target):
    """Every prompt twice (the second time the table and the index know the first):
    HF's greedy tokens, with trees verified (where the drafter may draft them: by the
    target, or by the draft model in ``pld_then_tree_model``) and some of their tokens
    accepted."""
    hf, lm = target
    prompts = PROMPTS * 2
    pipe = build(method, lm)
    inner_trees = []  # pld_then_tree_model: the trees the draft model verified
    if method == "pld_then_tree_model":
        tree = pipe.drafter.then.drafter
        propose = tree.propose

        def counted(states, asked):
            drafts = propose(states, asked)
            inner_trees.extend(d for d in drafts if d.parents is not None)
            return drafts

        tree.propose = counted
    gens, sched = decode(pipe, batch_size, kind, prompts, MAX_NEW)
    assert [g.tokens for g in gens] == [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    assert max(sched.stats.occupancy) == batch_size
    assert sum(g.stats.accepted for g in gens) > 0
    trees = sum(g.stats.tree_rounds for g in gens)
    assert (trees == 0) == (method in CHAINS_ONLY)
    assert (len(inner_trees) > 0) == (method == "pld_then_tree_model")


def test_merge_puts_the_chain_first_and_shares_equal_nodes():
    """The chain 5 6 7 is nodes 0..2; the tree's 5 (root) and 6 under it are the chain's
    nodes, its 9 under 5 and 8 (root) are added, its 4 under 8 is beyond ``extra_nodes``,
    its 3 under that 4 is left out with it."""
    tokens, parents, tree_at = merge([5, 6, 7], [5, 8, 6, 9, 4, 3], [-1, -1, 0, 0, 1, 4], 2)
    assert tokens == [5, 6, 7, 8, 9]
    assert parents == [-1, 0, 1, -1, 0]
    assert tree_at == [0, 3, 1, 4, -1, -1]
    # A chain tree: its nodes continue each other.
    assert merge([5, 6], [5, 7], None, 4) == ([5, 6, 7], [-1, 0, 0], [0, 2])


def test_a_merged_round_shows_each_drafter_its_own_draft(target):
    """The target kept the tree's branch 5 -> 9: the chain drafter sees its first token
    kept; the tree drafter sees its own nodes, their rows of the target's logits and the
    path 5 -> 9 in its own numbering."""
    from specflow.state import Acceptance, DecodeState, Draft

    seen: dict = {}

    class Fixed:
        """A drafter that proposes one fixed draft and records what it observes."""

        def __init__(self, name: str, draft: Draft, branches: int) -> None:
            self.name, self.draft, self.branches, self.k = name, draft, branches, 4

        def propose(self, states, asked):
            return [self.draft for _ in states]

        def observe(self, states, drafts, target_logits, verdicts):
            seen[self.name] = (drafts[0], target_logits[0], verdicts[0])

    chain = Fixed("chain", Draft([5, 6, 7]), 1)
    tree = Fixed("tree", Draft([5, 8, 6, 9], parents=[-1, -1, 0, 0]), 3)
    merged = MergedTreeDrafter(chain, tree, extra_nodes=4)
    st = DecodeState(tokens=[1, 2], prompt_len=2, max_len=32)
    [draft] = merged.propose([st], [4])
    assert draft.tokens == [5, 6, 7, 8, 9] and draft.parents == [-1, 0, 1, -1, 0]
    logits = torch.arange(6.0)[:, None].repeat(1, 3)  # row r holds r
    merged.observe([st], [draft], [logits], [Acceptance(2, 42, path=[0, 4])])
    c_draft, c_logits, c_verdict = seen["chain"]
    assert c_draft.tokens == [5, 6, 7] and c_logits[:, 0].tolist() == [0, 1, 2, 3]
    assert (c_verdict.num_accepted, c_verdict.next_token) == (1, 42)
    t_draft, t_logits, t_verdict = seen["tree"]
    assert t_draft.tokens == [5, 8, 6, 9] and t_logits[:, 0].tolist() == [0, 1, 4, 2, 5]
    assert (t_verdict.num_accepted, t_verdict.path) == (2, [0, 3])


def test_recycled_logits_draft_what_the_target_said_before(target):
    """A prompt decoded twice: the second time the recycling table holds the target's own
    successors of every token the first pass verified, so the drafts are accepted far more
    often (fewer rounds for the same tokens)."""
    hf, lm = target
    drafter = tree_drafter(lm, suffix=False)
    pipe = SpeculativePipeline(FullVerifier(lm), StandardAcceptor(), drafter=drafter)
    prompt = PROMPTS[0]
    first = generate(pipe, prompt, MAX_NEW)
    second = generate(pipe, prompt, MAX_NEW)
    assert first.tokens == second.tokens == hf_greedy(hf, prompt, MAX_NEW)
    assert second.stats.rounds < first.stats.rounds
    assert second.stats.accepted > first.stats.accepted


def test_tree_size_follows_the_price_of_rows(target):
    """Rows priced by the target's row probe: where every row count costs as one step the
    trees take every node the sources propose (up to ``max_nodes``); where each extra row
    costs 100 times more, no node pays and every round is plain; HF's tokens either way."""
    hf, lm = target
    want = [hf_greedy(hf, p, MAX_NEW) for p in PROMPTS]
    drafted = {}
    saved = lm.row_probe, lm.min_rows
    try:
        for cost in (1.0, 100.0):
            lm.row_probe, lm.min_rows = RowProbe({r: cost ** r for r in range(1, 7)}, 1), 1
            pipe = SpeculativePipeline(FullVerifier(lm), StandardAcceptor(),
                                       drafter=tree_drafter(lm, max_nodes=6))
            gens, _ = decode(pipe, 1, "contiguous", PROMPTS * 2, MAX_NEW)
            assert [g.tokens for g in gens] == want * 2
            drafted[cost] = [d for g in gens for d in g.stats.drafted_per_round]
    finally:
        lm.row_probe, lm.min_rows = saved
    assert max(drafted[1.0]) == 6 and sum(drafted[1.0]) > 0
    assert sum(drafted[100.0]) == 0


def test_sampled_requests_draft_chains_and_follow_the_target_law(target):
    """Two sampled tokens at batch 3 (paged) with rejection sampling: every draft is a
    chain (q one-hot), the joint law of the output is the target's (chi-square), and the
    run is reproducible: a fresh drafter on the same seeded requests draws the same tokens
    for every request (the tables learn across requests, so a request's draft depends on
    the ones before it, not on timing).  Rows are priced by a fixed probe (a timed one
    would make the chains' length, and so the draws, depend on the machine's noise)."""
    _, lm = target
    sampling = SamplingParams(temperature=1.0, top_k=3)
    prompt = [1, 5, 9]
    law = two_token_law(lm, prompt, sampling)
    trials = 900
    reqs = [SeqRequest(prompt, 2, seed=s, stop_token_ids=()) for s in range(trials)]

    def run():
        draft = tree_drafter(lm)
        propose = draft.propose

        def chains_only(states, asked):
            drafts = propose(states, asked)
            assert all(d.parents is None and d.probs is None for d in drafts)
            return drafts

        draft.propose = chains_only
        pipe = SpeculativePipeline(FullVerifier(lm), StandardAcceptor(), drafter=draft)
        sched = Scheduler(pipe, 3, KVLayout(kind="paged", block_size=4), max_context=16)
        return sched.generate(reqs, sampling)

    saved = lm.row_probe, lm.min_rows
    try:
        lm.row_probe, lm.min_rows = RowProbe({r: 1.0 + 0.1 * (r - 1) for r in range(1, 7)}, 1), 1
        results, again = run(), run()
    finally:
        lm.row_probe, lm.min_rows = saved
    counts = dict.fromkeys(law, 0)
    for r in results:
        counts[tuple(r.generation.tokens)] += 1
    cells = list(law)
    total = sum(law.values())
    expected = [law[c] / total * trials for c in cells]
    pvalue = chisquare([counts[c] for c in cells], expected).pvalue
    assert pvalue > 1e-3, (pvalue, counts)
    assert sum(r.generation.stats.drafted for r in results) > 0
    assert [r.generation.tokens for r in again] == [r.generation.tokens for r in results]


def test_model_and_tree_samples_chains_with_the_models_q(target):
    """Sampled requests (batch 3, paged, rejection sampling) get the draft model's chain
    with its q, never a merged tree: the joint law of two sampled tokens is the target's."""
    _, lm = target
    sampling = SamplingParams(temperature=1.0, top_k=3)
    prompt = [1, 5, 9]
    law = two_token_law(lm, prompt, sampling)
    trials = 600
    draft = MergedTreeDrafter(ModelDrafter(draft_model(), k=2), tree_drafter(lm), 4)
    propose = draft.propose

    def chains_with_q(states, asked):
        drafts = propose(states, asked)
        assert all(d.parents is None and (d.probs is not None or not d.tokens)
                   for d in drafts)
        return drafts

    draft.propose = chains_with_q
    pipe = SpeculativePipeline(FullVerifier(lm), StandardAcceptor(), drafter=draft)
    sched = Scheduler(pipe, 3, KVLayout(kind="paged", block_size=4), max_context=16)
    reqs = [SeqRequest(prompt, 2, seed=s, stop_token_ids=()) for s in range(trials)]
    results = sched.generate(reqs, sampling)
    pvalue = law_pvalue(results, law)
    assert pvalue > 1e-3, pvalue
    assert sum(r.generation.stats.drafted for r in results) > 0


def test_observe_recycles_every_verified_row_and_calibrates(target):
    """A tree of roots 11, 12 and 13 under 11 verified with root 11 kept: the table learns
    the successors after the last committed token and after each node; 11 and 12 are seen,
    11 kept, 13 seen (its parent kept) and not kept."""
    _, lm = target
    drafter = tree_drafter(lm, suffix=False)
    from specflow.state import DecodeState

    state = DecodeState(tokens=[1, 2, 3], prompt_len=3, max_len=16)
    drafter._last.set(state, drafter._last.factory(state))
    drafter._last.get(state).parents[:] = [-1, -1, 0]
    drafter._last.get(state).evidence[:] = [(("recycle", 1),), (("recycle", 2),),
                                           (("recycle", 3),)]
    draft = Draft([11, 12, 13], parents=[-1, -1, 0])
    logits = torch.full((4, lm.info.vocab_size), -5.0)
    for row, best in enumerate([11, 20, 21, 22]):
        logits[row, best] = 5.0
    drafter.observe([state], [draft], [logits], [Acceptance(1, 22, path=[0])])
    assert [drafter.recycling.successors(t)[0][0] for t in (3, 11, 12, 13)] == [11, 20, 21, 22]
    assert drafter.calibration.counts == {("recycle", 1): [1.0, 1.0],
                                          ("recycle", 2): [0.0, 1.0],
                                          ("recycle", 3): [0.0, 1.0]}


def test_a_drafter_without_sources_is_refused():
    with pytest.raises(ConfigError, match="needs a source: set drafter.suffix"):
        TokenTreeDrafter(None)
    with pytest.raises(ConfigError, match="drafter.branches must be >= 1"):
        TokenTreeDrafter(None, branches=0, recycling=RecyclingTable())


# ------------------------------------------------------------ tables kept across runs


def test_kept_tables_round_trip_exactly(target, tmp_path):
    """A drafter with ``keep`` writes its recycling table, suffix sequences and calibration
    when requests join and at exit; a new drafter on the same folder starts with exactly
    them, and decodes the same tokens (greedy, batch 3, paged) as plain decoding."""
    hf, lm = target
    want = [hf_greedy(hf, p, MAX_NEW) for p in PROMPTS]
    first = tree_drafter(lm, keep=str(tmp_path))
    gens, _ = decode(SpeculativePipeline(FullVerifier(lm), StandardAcceptor(), drafter=first),
                     3, "paged", PROMPTS, MAX_NEW)
    assert [g.tokens for g in gens] == want
    first.save_tables()  # what exit does
    again = tree_drafter(lm, keep=str(tmp_path))
    assert torch.equal(again.recycling.ids, first.recycling.ids)
    assert torch.equal(again.recycling.probs, first.recycling.probs)
    assert again.suffix.sequences() == first.suffix.sequences()
    assert len(again.suffix.sequences()) == len(PROMPTS)
    assert again.calibration.counts == first.calibration.counts and again.calibration.counts
    gens, _ = decode(SpeculativePipeline(FullVerifier(lm), StandardAcceptor(), drafter=again),
                     3, "paged", PROMPTS, MAX_NEW)
    assert [g.tokens for g in gens] == want


def test_kept_tables_of_another_model_are_refused(target, tmp_path):
    _, lm = target
    from stages.drafters.token_tree.kept_tables import TargetKey, save_tables

    save_tables(tmp_path, TargetKey("other-model", "0123abcd", lm.info.vocab_size),
                RecyclingTable(width=4), SuffixIndex(), AcceptanceCalibration())
    with pytest.raises(ConfigError, match=r"made for model 'other-model' .* fix: point "
                                          r"drafter.keep at another folder"):
        tree_drafter(lm, keep=str(tmp_path))
