"""Drafter ``pld``: prompt lookup decoding (n-gram copy from the context; no model).

Find the most recent earlier occurrence of the context's last n tokens (n from
``max_ngram`` down to ``min_ngram``) and propose the k tokens that followed it.  Drafts are
deterministic: q is one-hot (``Draft.probs is None``).
"""

from __future__ import annotations

import numpy as np

from specflow.errors import ConfigError
from specflow.protocols import DraftPart
from specflow.state import DecodeState, Draft
from stages.drafters.base import DrafterDefaults, check_k


def lookup_continuation(tokens: list[int], k: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier match of the last n-gram."""
    seq = np.asarray(tokens, dtype=np.int64)
    length = seq.shape[0]
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = seq[length - n :]
        # Candidate starts s with s + n < length (a match strictly before the suffix itself).
        limit = length - n
        hits = np.ones(limit, dtype=bool)
        for i in range(n):
            hits &= seq[i : limit + i] == suffix[i]
        starts = np.flatnonzero(hits)
        if starts.size:
            follow = int(starts[-1]) + n
            return seq[follow : follow + k].tolist()
    return []


class PLDDrafter(DrafterDefaults):
    """Prompt lookup drafter (see module doc).

    Args:
        k: the most tokens drafted per round (``Drafter.k``, config ``drafter.k``).
        max_ngram: longest suffix n-gram to look up.
        min_ngram: shortest suffix n-gram to look up.
    """

    name = "pld"

    def __init__(self, k: int = 8, max_ngram: int = 3, min_ngram: int = 1) -> None:
        self.k = check_k(k)
        if not 1 <= min_ngram <= max_ngram:
            raise ConfigError(
                f"need 1 <= drafter.min_ngram <= drafter.max_ngram, got {min_ngram} and {max_ngram}"
            )
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def next_part(self, state: DecodeState) -> DraftPart:
        """One part; ``available``: the tokens the latest match continues with (0: none)."""
        found = lookup_continuation(state.tokens, self.k, self.max_ngram, self.min_ngram)
        return DraftPart("", self.k, len(found))

    def propose(self, states: list[DecodeState], asked: list[int]) -> list[Draft]:
        return [
            Draft(lookup_continuation(st.tokens, k, self.max_ngram, self.min_ngram))
            for st, k in zip(states, asked, strict=True)
        ]
