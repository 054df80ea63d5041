"""Drafter ``fallback``: a cheap drafter first, a second one only where the first has nothing.

Each round, ``first`` (typically prompt lookup: free) proposes for every request; the
requests whose draft has fewer than ``min_tokens`` tokens are handed, in one batched call,
to ``then`` (typically a draft model).  So a request drafts for free while its output copies
its context (summaries, retrieved passages, code edits) and pays for the model elsewhere.

Lossless with any acceptor: the target verifies whichever draft a request got; a draft
from ``first`` without distributions is one-hot (exact for prompt lookup).  The idle
drafter's model session falls behind while ``first`` drafts and catches up on its next
draft (timed apart, ``Draft.catchup_s``).

Two parts for a draft-length policy (``Drafter.next_part``): ``"first"`` where ``first``
has a draft of ``min_tokens`` for the request (prompt lookup: a match), else ``"then"``, so
an adaptive policy asks prompt lookup's copies for their own length, learned from their
own acceptance, and the head or draft model for its own, instead of one length for both.
"""

from __future__ import annotations

import torch

from specflow.errors import ConfigError
from specflow.protocols import Drafter, DraftPart, draft_limit, sub_part
from specflow.state import Acceptance, DecodeState, Draft, RequestLocal
from stages.drafters.base import ComposedDrafter


class FallbackDrafter(ComposedDrafter):
    """``first``'s draft when it has at least ``min_tokens`` tokens, else ``then``'s.

    Args:
        first: the drafter asked first.
        then: the drafter asked for the requests ``first`` left short.
        min_tokens: the shortest draft of ``first`` that is used.

    ``k`` is the larger of the two drafters' k; the length asked of this drafter is passed
    on to each part through ``draft_limit`` (capped by that part's own k).
    """

    name = "fallback"

    def __init__(self, first: Drafter, then: Drafter, min_tokens: int = 1) -> None:
        if min_tokens < 1:
            raise ConfigError(f"drafter.min_tokens must be >= 1, got {min_tokens}")
        self.first = first
        self.then = then
        self.parts = (first, then)
        self.min_tokens = min_tokens
        self.k = max(first.k, then.k)
        self.branches = max(first.branches, then.branches)
        # Per request: whether its draft of this round came from ``first``.
        self._from_first: RequestLocal[bool] = RequestLocal(lambda _state: True)

    def next_part(self, state: DecodeState) -> DraftPart:
        """``first``'s part where it has ``min_tokens`` tokens available, else ``then``'s
        (keys prefixed ``first`` / ``then``)."""
        part = self.first.next_part(state)
        prefix = "first"
        if part.available < self.min_tokens:
            part, prefix = self.then.next_part(state), "then"
        return DraftPart(sub_part(prefix, part.key), part.k, part.available)

    def propose(self, states: list[DecodeState], asked: list[int]) -> list[Draft]:
        drafts = self.first.propose(states, [draft_limit(self.first, n) for n in asked])
        for draft in drafts:
            draft.part = sub_part("first", draft.part)
        short = [i for i, d in enumerate(drafts) if len(d.tokens) < self.min_tokens]
        if short:
            more = self.then.propose(
                [states[i] for i in short], [draft_limit(self.then, asked[i]) for i in short]
            )
            for i, draft in zip(short, more, strict=True):
                draft.part = sub_part("then", draft.part)
                drafts[i] = draft
        handed_on = set(short)
        for i, st in enumerate(states):
            self._from_first.set(st, i not in handed_on)
        return drafts

    def observe(
        self,
        states: list[DecodeState],
        drafts: list[Draft],
        target_logits: list[torch.Tensor],
        verdicts: list[Acceptance],
    ) -> None:
        for drafter, from_first in ((self.first, True), (self.then, False)):
            rows = [i for i, st in enumerate(states) if self._from_first.get(st) is from_first]
            if rows:
                drafter.observe(
                    [states[i] for i in rows],
                    [drafts[i] for i in rows],
                    [target_logits[i] for i in rows],
                    [verdicts[i] for i in rows],
                )
