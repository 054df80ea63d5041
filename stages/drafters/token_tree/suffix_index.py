"""Suffix matching over a request's context and the run's earlier sequences.

Prompt lookup copies what followed the latest earlier occurrence of the context's last n
tokens.  ``SuffixIndex`` generalises it the way SuffixDecoding does: it indexes every
n-gram (``min_ngram <= n <= max_ngram``) of every sequence it was given (each request's
prompt and output as they grow, and those of the requests before it in the run), finds the
longest suffix of the context that occurred before, and gathers the continuations of up to
``max_matches`` of its occurrences (the request's own, latest first, then the other
sequences', latest first) into a trie whose nodes count how many continuations pass
through them.  A child's count over its parent's count is the frequency with which the
corpus continued that way: a tree drafter ranks continuations by it.

Sequences are the requests' own token lists, read as they grow (committed tokens are only
appended, or cut after an EOS).  The index keeps at most ``max_tokens`` tokens: beyond
that the oldest sequences are dropped (down to three quarters of it) and the index is
rebuilt.  Memory: about ``(max_ngram - min_ngram + 1)`` index entries per token.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TrieNode:
    """A continuation trie node: how many gathered continuations pass through it."""

    count: int = 0
    children: dict[int, TrieNode] = field(default_factory=dict)


@dataclass(frozen=True)
class SuffixMatch:
    """The trie of continuations of the context's longest earlier-seen suffix (``length``
    tokens long), ``root.count`` continuations gathered."""

    root: TrieNode
    length: int


@dataclass
class _Sequence:
    serial: int
    tokens: list[int]
    indexed: int = 0  # positions whose n-grams ending there are in the index


class SuffixIndex:
    """An n-gram index over registered token sequences (module doc).

    Args:
        max_ngram: longest suffix looked up.
        min_ngram: shortest suffix looked up.
        max_matches: most occurrences whose continuations are gathered.
        max_tokens: most tokens indexed over all sequences.
    """

    def __init__(self, max_ngram: int = 6, min_ngram: int = 1, max_matches: int = 16,
                 max_tokens: int = 262_144) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if max_matches < 1 or max_tokens < 1:
            raise ValueError("max_matches and max_tokens must be >= 1")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.max_matches = max_matches
        self.max_tokens = max_tokens
        self._seqs: dict[int, _Sequence] = {}  # id(token list) -> sequence, oldest first
        self._by_serial: dict[int, _Sequence] = {}
        self._index: dict[tuple[int, ...], list[tuple[int, int]]] = {}  # n-gram -> (serial, end)
        self._serial = 0

    @property
    def num_tokens(self) -> int:
        return sum(len(s.tokens) for s in self._seqs.values())

    def add(self, tokens: list[int]) -> None:
        """Register a sequence (kept by reference: later appends are indexed too)."""
        if id(tokens) in self._seqs:
            return
        seq = _Sequence(self._serial, tokens)
        self._serial += 1
        self._seqs[id(tokens)] = seq
        self._by_serial[seq.serial] = seq
        if self.num_tokens > self.max_tokens:
            self._evict(keep=tokens)

    def replace(self, old: list[int], new: list[int]) -> None:
        """The sequence ``old`` goes on as the list ``new`` (the same text up to their common
        prefix, then ``new``'s): e.g. a nested pipeline's request, whose committed tokens the
        outer pipeline rewrites each round as a fresh list.  The n-grams ending past the
        common prefix are dropped and ``new`` is indexed from there on, under the same
        sequence, so the text is never indexed twice.  ``old`` unknown (never added, or
        evicted): ``new`` is added."""
        seq = self._seqs.pop(id(old), None)
        if seq is None or id(new) in self._seqs:
            if seq is not None:  # new already registered on its own: drop old's entries
                self._drop_from(seq, 0)
                del self._by_serial[seq.serial]
            self.add(new)
            return
        keep = 0
        for a, b in zip(seq.tokens, new, strict=False):  # the common indexed prefix
            if a != b or keep >= seq.indexed:
                break
            keep += 1
        self._drop_from(seq, keep)
        seq.tokens = new
        self._seqs[id(new)] = seq

    def _drop_from(self, seq: _Sequence, start: int) -> None:
        """Remove ``seq``'s index entries of the n-grams ending past ``start`` tokens (read
        from the tokens they were indexed from); ``seq.indexed = start``."""
        toks = seq.tokens
        for p in range(start, seq.indexed):
            for n in range(self.min_ngram, min(self.max_ngram, p + 1) + 1):
                key = tuple(toks[p + 1 - n : p + 1])
                hits = self._index.get(key)
                if hits is None:
                    continue
                for j in range(len(hits) - 1, -1, -1):  # recent entries sit at the end
                    if hits[j] == (seq.serial, p + 1):
                        del hits[j]
                        break
                if not hits:
                    del self._index[key]
        seq.indexed = min(seq.indexed, start)

    def sequences(self) -> list[list[int]]:
        """Copies of the indexed sequences, oldest first (what ``add`` would rebuild the
        index from)."""
        return [list(seq.tokens) for seq in self._seqs.values()]

    def match(self, tokens: list[int], depth: int) -> SuffixMatch | None:
        """The continuation trie (``depth`` tokens deep at most) of the longest suffix of
        ``tokens`` that occurred before, in ``tokens`` itself or another sequence; ``None``
        when no suffix of ``min_ngram`` tokens did."""
        self.add(tokens)
        self._sync()
        own = self._seqs[id(tokens)].serial
        end_here = len(tokens)
        for n in range(min(self.max_ngram, end_here - 1), self.min_ngram - 1, -1):
            hits = self._index.get(tuple(tokens[end_here - n :]))
            if not hits:
                continue
            mine = [e for s, e in reversed(hits) if s == own and e < end_here]
            others = [(s, e) for s, e in reversed(hits) if s != own]
            picked = [(own, e) for e in mine] + others
            root = TrieNode()
            for serial, end in picked:
                seq = self._by_serial.get(serial)
                follow = seq.tokens[end : end + depth] if seq is not None else []
                if not follow:
                    continue
                root.count += 1
                node = root
                for t in follow:
                    node = node.children.setdefault(t, TrieNode())
                    node.count += 1
                if root.count >= self.max_matches:
                    break
            if root.count:
                return SuffixMatch(root, n)
        return None

    def _sync(self) -> None:
        """Index the n-grams ending at every position not yet indexed."""
        for seq in self._seqs.values():
            toks = seq.tokens
            seq.indexed = min(seq.indexed, len(toks))  # cut after an EOS
            for p in range(seq.indexed, len(toks)):
                for n in range(self.min_ngram, min(self.max_ngram, p + 1) + 1):
                    key = tuple(toks[p + 1 - n : p + 1])
                    self._index.setdefault(key, []).append((seq.serial, p + 1))
            seq.indexed = len(toks)

    def _evict(self, keep: list[int]) -> None:
        """Drop the oldest sequences (never ``keep``) to 3/4 of ``max_tokens``; rebuild."""
        total = self.num_tokens
        for key in list(self._seqs):
            if total <= self.max_tokens * 3 // 4:
                break
            seq = self._seqs[key]
            if seq.tokens is keep:
                continue
            total -= len(seq.tokens)
            del self._seqs[key]
            del self._by_serial[seq.serial]
        self._index.clear()
        for seq in self._seqs.values():
            seq.indexed = 0
