"""FallbackDrafter routes each request to its first drafter or, when that one's draft is
too short, to the second (one batched call), and reports back to the one that drafted."""

from __future__ import annotations

import pytest

from specflow.errors import ConfigError
from specflow.protocols import DraftPart
from specflow.state import DecodeState, Draft
from stages.drafters.fallback import FallbackDrafter
from stages.drafters.pld import PLDDrafter


class Scripted:
    """Proposes ``table[first token of the request]`` (cut to k) and records every call."""

    branches = 1

    def __init__(self, name: str, k: int, table: dict[int, list[int]]) -> None:
        self.name, self.k, self.table = name, k, table
        self.proposed: list[tuple[list[int], list[int]]] = []  # (first tokens, ks) per call
        self.observed: list[list[int]] = []  # first tokens per observe call
        self.begun: list[int] = []

    def begin(self, states):
        self.begun += [st.tokens[0] for st in states]

    def models(self):
        return []

    def uses(self):
        return []

    def next_part(self, state):
        found = len(self.table[state.tokens[0]][: self.k])
        return DraftPart("", self.k, found)

    def propose(self, states, ks):
        self.proposed.append(([st.tokens[0] for st in states], list(ks)))
        return [Draft(self.table[st.tokens[0]][:k]) for st, k in zip(states, ks, strict=True)]

    def observe(self, states, drafts, target_logits, verdicts):
        self.observed.append([st.tokens[0] for st in states])


def states(*firsts: int) -> list[DecodeState]:
    return [DecodeState(tokens=[f, 0, 0], prompt_len=3, max_len=16) for f in firsts]


def test_short_drafts_of_the_first_go_to_the_second_in_one_call():
    first = Scripted("pld", 8, {1: [5, 6, 7], 2: [9], 3: []})
    then = Scripted("model", 4, {1: [0], 2: [8, 8, 8, 8, 8], 3: [4, 4]})
    pool = FallbackDrafter(first, then, min_tokens=2)
    assert pool.k == 8
    batch = states(1, 2, 3)
    pool.begin(batch)
    assert first.begun == then.begun == [1, 2, 3]
    drafts = pool.propose(batch, [8, 6, 3])
    assert [d.tokens for d in drafts] == [[5, 6, 7], [8, 8, 8, 8], [4, 4]]
    assert first.proposed == [([1, 2, 3], [8, 6, 3])]
    assert then.proposed == [([2, 3], [4, 3])]  # capped by the model's own k = 4
    pool.observe(batch, drafts, [None] * 3, [None] * 3)
    assert first.observed == [[1]] and then.observed == [[2, 3]]


def test_second_drafter_idle_when_the_first_always_drafts():
    first = Scripted("pld", 4, {1: [5, 6], 2: [7]})
    then = Scripted("model", 4, {1: [0], 2: [0]})
    pool = FallbackDrafter(first, then)
    drafts = pool.propose(states(1, 2), [4, 4])
    assert [d.tokens for d in drafts] == [[5, 6], [7]] and then.proposed == []


def test_min_tokens_must_be_positive():
    with pytest.raises(ConfigError, match="min_tokens"):
        FallbackDrafter(Scripted("a", 1, {}), Scripted("b", 1, {}), min_tokens=0)


def test_next_part_names_the_part_that_will_draft_and_each_draft_carries_it():
    first = Scripted("pld", 8, {1: [5, 6, 7], 2: [9], 3: []})
    then = Scripted("model", 4, {1: [0], 2: [8, 8, 8, 8, 8], 3: [4, 4]})
    pool = FallbackDrafter(first, then, min_tokens=2)
    batch = states(1, 2, 3)
    assert [pool.next_part(st) for st in batch] == [
        DraftPart("first", 8, 3), DraftPart("then", 4, 4), DraftPart("then", 4, 2)
    ]
    assert first.proposed == then.proposed == []  # found without drafting
    assert [d.part for d in pool.propose(batch, [8, 6, 3])] == ["first", "then", "then"]
    # A fallback inside a fallback: the keys say the path.
    nested = FallbackDrafter(Scripted("none", 2, {1: [], 2: []}), pool)
    assert nested.next_part(batch[0]) == DraftPart("then.first", 8, 3)
    assert nested.next_part(batch[1]) == DraftPart("then.then", 4, 4)
    assert [d.part for d in nested.propose(batch[:2], [8, 8])] == ["then.first", "then.then"]


def test_prompt_lookup_part_has_its_match_available():
    pld = PLDDrafter(k=3, max_ngram=2, min_ngram=2)
    repeats = DecodeState(tokens=[7, 1, 2, 3, 4, 5, 1, 2], prompt_len=8, max_len=32)
    assert pld.next_part(repeats) == DraftPart("", 3, 3)  # 1 2 -> 3 4 5, cut to k
    near_end = DecodeState(tokens=[4, 1, 2, 1, 2], prompt_len=5, max_len=32)
    assert pld.next_part(near_end) == DraftPart("", 3, 2)  # 1 2 -> 1 2, the context's end
    none = DecodeState(tokens=[1, 2, 3, 4], prompt_len=4, max_len=32)
    assert pld.next_part(none) == DraftPart("", 3, 0)
    assert [d.tokens for d in pld.propose([repeats, near_end, none], [3, 3, 3])] == [
        [3, 4, 5], [1, 2], []
    ]
