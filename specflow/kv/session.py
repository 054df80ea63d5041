"""One model's view of one request: a token sequence and a *layered* KV cache.

Every stage asks a ``ModelSession`` the same question:

    "logits at exit L for positions [start, end) of my token sequence"

and the session computes only what is missing.  It tracks, per decoder layer ``l``,
``computed(l)`` = how many positions layer ``l`` has processed (its ``LayerKV.length``).
Invariant: ``computed(0) >= computed(1) >= ... >= computed(N-1)`` (a layer never runs ahead of
the one below it).  For every boundary ``l`` (input of layer ``l``, 1 <= l <= N-1) the session
keeps the hidden states ``h_l`` of positions ``[computed(l), computed(l-1))``: produced by
layer ``l-1`` but not yet consumed by layer ``l``.  So a deeper exit continues from where a
shallower one stopped and no layer ever runs twice on the same position (HiSpec's reuse).

Rollback is ``set_tokens``: give the session the sequence you want; it keeps the longest
common prefix of every layer's cache and of the kept hidden states and drops the rest.
A drafter whose model was idle while tokens were committed catches up lazily the same way.

An *attention adapter* at exit ``L`` (``LayeredLM.exit_adapter``: an exit head with its own
KV cache, one decoder layer over ``h_L`` of every position) is fed by the session of a
request that reads that exit (``read_exit``): when layer ``L`` consumes ``h_L`` rows the
adapter has not seen, the session keeps them (``AdapterFeed.pending``), and the next question
at exit ``L`` runs the adapter over them and the new rows in one batched call.  The answer
at exit ``L`` is then the adapter's output ``a`` (which ``head`` maps to logits).  So the
adapter never runs in a pass that does not ask its exit, and catches up on positions a deeper
pass consumed (the prefill, a verification, rounds another drafter drafted).

A *token tree* (``set_tree``, a tree draft's verification) is laid out after the committed
tokens in topological order, every node attending to its ancestors only
(``specflow.kv.tree``); the session's sequence is then the tree's rows.  The next
``set_tokens`` finds the path of nodes that spells the new tokens, moves that path's keys/
values and ``h_N`` rows into place (``AttendedKV.keep_rows``) and drops the other nodes, so
the accepted tokens are never computed again.

A feature drafter that reads more than ``h_N`` (EAGLE-3: the inputs of three decoder layers)
declares those layers before the first forward (``keep_layer_inputs``): the session then
holds each such layer's input rows from when the layer consumes them until the last layer
computes the same positions, and keeps them beside ``h_N`` in the same rows (one block of
``[rows, H * (1 + k)]``), so trimming, truncation and a verified tree's path keep both alike.

A session does not care where its keys/values live: its per-layer ``LayerKV``s come from a
KV store (``specflow.kv.stores``): contiguous buffers of its own, or a sequence of a paged
pool shared with other requests (whose full forwards may take the static path, a
``StaticPath``).  ``forward_hidden`` / ``forward_logits`` answer the question
for many sessions of one model at once, one batched ``run_layer`` per layer: a batch of
sequences is the one code path, and ``ModelSession.hidden`` is a batch of one.  A model may
run a full forward of a few rows without the layer loop (``LayeredLM.fused_layers``: a
GGUF-quantized model's layers in one kernel call, the same bits; ``specflow.kv.fused``);
``forward_hidden`` hands it a batch whose every request is such a forward and runs the loop
otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from specflow.errors import ConfigError, PromptTooLongError
from specflow.kv.base import AttendedKV, ExitAdapter, LayeredLM, LayerKV, SelfManagedKV, StaticPath
from specflow.kv.contiguous import KVCache, layer_caches
from specflow.kv.fused import FusedForward, fused_path
from specflow.kv.tree import TreeLayout, path_rows


def common_prefix_length(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    i = 0
    while a[i] == b[i]:
        i += 1
    return i


@dataclass
class AdapterFeed:
    """One attention adapter's state in one session (module doc).

    Invariant, with ``A = cache.length`` (positions the adapter has processed) and ``c`` =
    positions layer ``L`` has processed: ``pending`` holds ``h_L`` of ``[A, max(A, c))`` (rows
    layer ``L`` consumed before the adapter saw them) and ``out`` the adapter's outputs of
    ``[out_start, A)``.
    """

    adapter: ExitAdapter
    cache: KVCache
    pending: torch.Tensor | None = None  # [rows, H]
    out: torch.Tensor | None = None  # [rows, H]
    out_start: int = 0

    @property
    def length(self) -> int:
        return self.cache.length

    def retain(self, start: int, rows: torch.Tensor) -> None:
        """Layer ``L`` consumes ``h_L`` rows of positions ``[start, start + len(rows))``: keep
        those the adapter has not seen (positions >= ``A`` not already pending)."""
        have = self.length + (0 if self.pending is None else self.pending.shape[0])
        first = max(have, start) - start
        if first >= rows.shape[0]:
            return
        if have < start:
            raise RuntimeError(f"adapter input gap: pending up to {have}, layer rows from {start}")
        new = rows[first:]
        self.pending = new if self.pending is None else torch.cat([self.pending, new])

    def inputs(self, kept: torch.Tensor | None, kept_start: int, end: int) -> torch.Tensor:
        """``h_L`` of positions ``[A, end)``: the pending rows, then ``kept`` (rows from
        ``kept_start``, not yet consumed by layer ``L``)."""
        parts = [] if self.pending is None else [self.pending]
        first = self.length + sum(p.shape[0] for p in parts)
        if first < end:
            if kept is None or first < kept_start:
                raise RuntimeError(f"h_L of positions [{first}, {end}) is gone before the "
                                   "adapter read it")
            parts.append(kept[first - kept_start : end - kept_start])
        rows = parts[0] if len(parts) == 1 else torch.cat(parts)
        return rows[: end - self.length]

    def store(self, out: torch.Tensor) -> None:
        """The adapter processed ``len(out)`` more positions (its cache already grew)."""
        fed = out.shape[0]
        if self.pending is not None:
            self.pending = self.pending[fed:] if self.pending.shape[0] > fed else None
        start = self.length - fed
        if self.out is not None and self.out_start + self.out.shape[0] == start:
            self.out = torch.cat([self.out, out])
        else:
            self.out, self.out_start = out, start

    def truncate(self, n: int) -> None:
        """Forget positions ``>= n``."""
        if self.length > n:
            self.cache.truncate(n)
            self.pending = None
        elif self.pending is not None:
            rows = n - self.length
            self.pending = self.pending[:rows] if rows > 0 else None
        if self.out is not None:
            rows = n - self.out_start
            self.out = self.out[:rows] if rows > 0 else None

    def trim(self, first_needed: int) -> None:
        """Drop outputs of positions before ``first_needed`` (never asked for again)."""
        if self.out is not None and self.out_start < first_needed:
            drop = first_needed - self.out_start
            self.out = self.out[drop:] if drop < self.out.shape[0] else None
            self.out_start = first_needed


class ModelSession:
    """Token sequence + layered KV cache of one model for one request (see module doc).

    Args:
        model: the model (already on the device it runs on).
        max_len: the most positions this request may hold.
        caches: one ``LayerKV`` per decoder layer (default: contiguous ones of the model).
        release: frees the caches' storage (a paged sequence's blocks) when the request ends.
        static: the model's static (CUDA-graph) step runner, for full forwards that fit it.
        seq_id: the sequence id of the caches (a paged sequence's block table).
    """

    def __init__(
        self,
        model: LayeredLM,
        max_len: int,
        caches: list[LayerKV] | None = None,
        release: Callable[[], None] | None = None,
        static: StaticPath | None = None,
        seq_id: int = 0,
    ) -> None:
        if max_len > model.info.max_positions:
            raise PromptTooLongError(
                f"requested a context of {max_len} positions but {model.info.name} supports "
                f"{model.info.max_positions}; shorten the prompt or lower max_new_tokens"
            )
        self.model = model
        self.max_len = max_len
        self.tokens: list[int] = []
        self.seq_id = seq_id
        self.caches: list[LayerKV] = (
            caches if caches is not None else layer_caches(model, max_len, seq_id)
        )
        self._release = release
        self.static = static
        # full forwards of this sequence without the layer loop (a quantized model's)
        self.fused: FusedForward | None = fused_path(model, self.caches)
        n = model.info.num_layers
        # kept[l]: h_l of positions [computed(l), computed(l-1)), shape [*, H]; kept[0] unused.
        self.kept: list[torch.Tensor | None] = [None] * (n + 1)
        # h_N (last layer output) of positions [final_start, final_start + rows): the latest
        # contiguous block(s) the last layer computed, trimmed at every set_tokens.
        self.final_hidden: torch.Tensor | None = None
        self.final_start = 0
        # Decoder layers whose inputs are kept beside h_N (``keep_layer_inputs``), in order:
        # held[l] is layer l's input rows of positions [computed(N-1), computed(l)), consumed
        # by the last layer (appended to final_hidden's rows as columns H*(1+j) ..).
        self.held: dict[int, torch.Tensor | None] = {}
        # The first position whose h_N a feature drafter still has to read (None: nobody
        # reads h_N beyond the current round; see ``retain_final_from``).
        self.final_floor: int | None = None
        # Exit L -> the adapter this request feeds there (``read_exit``).
        self.adapters: dict[int, AdapterFeed] = {}
        # The token tree laid out after the committed tokens (``set_tree``), until the next
        # ``set_tokens`` keeps its accepted path.
        self.tree: TreeLayout | None = None
        self.layer_evals = 0  # sum over layers of positions processed (for reuse tests/metrics)

    def release(self) -> None:
        """The request is over: give the KV storage back (the session is unusable after)."""
        if self._release is not None:
            self._release()
            self._release = None

    # ---------------------------------------------------------------- bookkeeping
    @property
    def num_layers(self) -> int:
        return self.model.info.num_layers

    def computed(self, layer: int) -> int:
        """Number of positions decoder layer ``layer`` (0-based) has processed."""
        return self.caches[layer].length

    def set_tokens(self, tokens: list[int]) -> None:
        """Make ``tokens`` this session's sequence, keeping all work on the common prefix."""
        if len(tokens) > self.max_len:
            raise PromptTooLongError(
                f"sequence of {len(tokens)} tokens exceeds this request's context of "
                f"{self.max_len}; lower max_new_tokens or the draft length"
            )
        if self.tree is not None:
            self._keep_tree_path(tokens)
        keep = common_prefix_length(self.tokens, tokens)
        self.truncate(keep)
        self.tokens = list(tokens)
        # Last-layer outputs before the new last token are never asked for again, nor
        # before the last kept position (a verification of ``committed + draft`` asks from
        # the last committed token, which an earlier pass may have computed already: a tree
        # node of a nested pipeline that the outer one committed), except by a feature
        # drafter that has not read them yet (``final_floor``).
        last = min(len(tokens), max(keep, 1)) - 1
        first_needed = last
        if self.final_floor is not None:
            first_needed = min(first_needed, self.final_floor)
        if self.final_hidden is not None and self.final_start < first_needed:
            drop = first_needed - self.final_start
            self.final_hidden = self.final_hidden[drop:] if drop < len(self.final_hidden) else None
            self.final_start = first_needed
        for feed in self.adapters.values():
            feed.trim(last)

    def set_tree(self, committed: list[int], nodes: list[int], parents: list[int]) -> None:
        """Make the sequence ``committed`` followed by a token tree to verify in one forward:
        node ``i`` (token ``nodes[i]``) continues node ``parents[i]`` (-1: the last committed
        token; ``parents[i] < i``).  The tree's rows are the last committed token (row 0,
        the root) and the nodes (row ``i + 1``), from position ``len(committed) - 1`` on;
        ask for logits of ``[len(committed) - 1, len(committed) + len(nodes))`` at the last
        exit (row ``r``'s logits: the distribution after the path to row ``r``).  The next
        ``set_tokens`` keeps the path its tokens spell (module doc)."""
        if isinstance(self.model.kv, SelfManagedKV) or self.adapters:
            raise ConfigError(
                f"{self.model.info.name}: tree drafts need the native backend without an "
                "attention adapter on the verified model; use a chain (drafter.branches=1; "
                "drafter.then.branches in eagle_pld)"
            )
        if len(committed) + len(nodes) > self.max_len:
            raise PromptTooLongError(
                f"a tree of {len(nodes)} nodes after {len(committed)} tokens exceeds this "
                f"request's context of {self.max_len}"
            )
        self.set_tokens(committed)
        root = len(committed) - 1
        self.truncate(root)  # the root is the tree's row 0: computed in the tree's forward
        self.tree = TreeLayout(root, (-1, *(p + 1 for p in parents)))
        for cache in self._attended():
            cache.tree = self.tree
        self.tokens = list(committed) + list(nodes)

    def _attended(self) -> list[AttendedKV]:
        """The layer caches as the attention backends see them (a session with a tree has
        only such caches: ``set_tree`` refuses models that keep their own)."""
        return [c for c in self.caches if isinstance(c, AttendedKV)]

    def _keep_tree_path(self, tokens: list[int]) -> None:
        """Resolve the pending tree against the new sequence ``tokens``: keep the rows of
        the root and of the path of nodes spelling ``tokens`` after it, in order, and forget
        the other nodes; the tree is gone after."""
        tree, self.tree = self.tree, None
        assert tree is not None
        for cache in self._attended():
            cache.tree = None
        root = tree.start
        if common_prefix_length(self.tokens[: root + 1], tokens) <= root:
            self.truncate(root)  # the committed tokens changed under the tree
            return
        nodes = self.tokens[root + 1 :]
        path = self._tree_path(tree, tokens)
        rows = [0, *(i + 1 for i in path)]
        caches = self._attended()
        partial = [c.length for c in caches if root < c.length != tree.end]
        held = [layer for layer in range(1, self.num_layers)
                if self.kept[layer] is not None and self.computed(layer - 1) > root]
        held += [layer for layer, rows in self.held.items()
                 if rows is not None and self.computed(layer) > root]
        if partial or held:  # set_tree's forward is a full one: nothing is half done
            raise RuntimeError(f"a tree of [{root}, {tree.end}) is partly computed "
                               f"(layer lengths {partial}, kept states {held})")
        for cache in caches:
            if cache.length == tree.end:
                cache.keep_rows(root, rows)
        if self.final_hidden is not None:
            have = self.final_start + self.final_hidden.shape[0]
            if self.final_start <= root and have == tree.end:
                at = torch.tensor(rows, device=self.final_hidden.device) + root - self.final_start
                self.final_hidden = torch.cat([self.final_hidden[: root - self.final_start],
                                               self.final_hidden[at]])
            elif have > root:
                self.final_hidden = self.final_hidden[: max(0, root - self.final_start)]
                if self.final_hidden.shape[0] == 0:
                    self.final_hidden = None
        self.tokens = self.tokens[: root + 1] + [nodes[i] for i in path]

    def _tree_path(self, tree: TreeLayout, tokens: list[int]) -> list[int]:
        """The pending tree's nodes that spell ``tokens`` after its root (``path_rows``)."""
        nodes = self.tokens[tree.start + 1 :]
        parents = [p - 1 for p in tree.parents[1:]]
        return path_rows(parents, nodes, tokens[tree.start + 1 :])

    def kept_prefix(self, tokens: list[int]) -> int:
        """How many leading positions of ``tokens`` this session's work is for: the common
        prefix, or with a pending tree the root plus the path ``set_tokens(tokens)`` would
        keep (positions computed or not; see ``computed``)."""
        tree = self.tree
        if tree is None or common_prefix_length(self.tokens[: tree.start + 1], tokens) <= \
                tree.start:
            return common_prefix_length(self.tokens, tokens)
        return tree.start + 1 + len(self._tree_path(tree, tokens))

    def extend(self, new_tokens: list[int]) -> None:
        """Append tokens (no computation happens until logits are asked for)."""
        if self.tree is not None:
            raise RuntimeError("extend() with a pending token tree: use set_tokens")
        if len(self.tokens) + len(new_tokens) > self.max_len:
            raise PromptTooLongError(
                f"sequence of {len(self.tokens) + len(new_tokens)} tokens exceeds this "
                f"request's context of {self.max_len}; lower max_new_tokens or the draft length"
            )
        self.tokens.extend(new_tokens)

    def truncate(self, n: int) -> None:
        """Drop every position ``>= n`` from the sequence, every layer cache and kept state."""
        if self.tree is not None:
            if n > self.tree.start:
                raise RuntimeError("truncate() inside a pending token tree: use set_tokens")
            self.tree = None
            for cache in self._attended():
                cache.tree = None
        if n < len(self.tokens):
            del self.tokens[n:]
        old = [self.computed(layer) for layer in range(self.num_layers)]
        for layer in range(self.num_layers):
            if old[layer] > n:
                self.caches[layer].truncate(n)
            kept = self.kept[layer]
            if layer > 0 and kept is not None:
                # kept[layer] covers [old[layer], old[layer-1]); keep the rows of positions < n.
                rows = min(old[layer - 1], n) - old[layer]
                self.kept[layer] = kept[:rows] if rows > 0 else None
        for layer, held in self.held.items():
            if held is not None:  # covers [old[N-1], old[layer])
                rows = min(old[layer], n) - old[self.num_layers - 1]
                self.held[layer] = held[:rows] if rows > 0 else None
        if self.final_hidden is not None:
            rows = n - self.final_start
            self.final_hidden = self.final_hidden[:rows] if rows > 0 else None
        for feed in self.adapters.values():
            feed.truncate(n)

    def read_exit(self, exit_layer: int) -> None:
        """This request will read exit ``exit_layer``: if the model has an attention adapter
        there, feed it every position from now on (module doc).  Must come before layer
        ``exit_layer`` runs (``RuntimeError`` otherwise: the adapter would miss positions);
        no-op for exits without an adapter and when already feeding."""
        if exit_layer in self.adapters:
            return
        adapter = self.model.exit_adapter(exit_layer)
        if adapter is None:
            return
        if self.computed(exit_layer) > 0:
            raise RuntimeError(
                f"read_exit({exit_layer}) after layer {exit_layer} processed "
                f"{self.computed(exit_layer)} positions: the adapter there would miss them; "
                "declare the exit (the stage's uses()) before the pipeline's begin"
            )
        self.adapters[exit_layer] = AdapterFeed(adapter, KVCache(adapter.kv, self.max_len))

    def retain_final_from(self, position: int) -> None:
        """Keep the last layer's outputs ``h_N`` from ``position`` on across rounds until
        they are read (a feature drafter reads the target's features of every committed
        position, also after rounds it did not draft in)."""
        self.final_floor = position

    @property
    def layer_inputs(self) -> tuple[int, ...]:
        """The decoder layers whose inputs are kept beside ``h_N``, in order (``()``: none)."""
        return tuple(self.held)

    def keep_layer_inputs(self, layers: tuple[int, ...]) -> None:
        """Keep the inputs of decoder ``layers`` (0: the embeddings; in this order) beside
        ``h_N`` for every position the last layer computes from now on (module doc; read
        with ``final_layer_inputs``).  Must come before the first forward (``RuntimeError``
        otherwise: those positions' inputs are gone); no-op when already kept."""
        layers = tuple(int(layer) for layer in layers)
        if layers == self.layer_inputs:
            return
        bad = [layer for layer in layers if not 0 <= layer < self.num_layers]
        if bad or len(set(layers)) != len(layers):
            raise ConfigError(f"{self.model.info.name}: layer inputs {list(layers)} must be "
                              f"distinct layers in 0..{self.num_layers - 1}")
        if self.layer_inputs or self.computed(0) > 0:
            raise RuntimeError(
                f"keep_layer_inputs({list(layers)}) after the session computed positions "
                f"(or kept {list(self.layer_inputs)}): declare them (the stage's uses()) "
                "before the pipeline's begin")
        self.held = dict.fromkeys(layers)

    def final_end(self) -> int:
        """The end of the kept ``h_N`` block: ``h_N`` of positions ``[final_start,
        final_end())`` is kept (empty when ``final_end() == final_start``)."""
        return self.final_start + (0 if self.final_hidden is None else self.final_hidden.shape[0])

    def final_features(self, start: int, end: int) -> torch.Tensor:
        """``h_N [end-start, H]`` of positions ``[start, end)``, as the last layer computed
        them (they must still be kept: see ``retain_final_from``; ``RuntimeError`` if not)."""
        have = 0 if self.final_hidden is None else self.final_hidden.shape[0]
        if end > start and not (self.final_start <= start and end <= self.final_start + have):
            raise RuntimeError(
                f"h_N of positions [{start}, {end}) is not kept (kept: [{self.final_start}, "
                f"{self.final_start + have})); call retain_final_from({start}) before the "
                "target computes them"
            )
        if end <= start:
            return self._empty()
        h = self.model.info.hidden_size
        return self.final_hidden[start - self.final_start : end - self.final_start, :h]

    def final_layer_inputs(self, start: int, end: int) -> torch.Tensor:
        """The inputs of the layers ``layer_inputs`` (concatenated in that order, ``[end -
        start, H * k]``) of positions ``[start, end)``, kept as ``final_features`` is
        (``[end - start, 0]`` when no layer's inputs are kept)."""
        self.final_features(start, end)  # the same rows must be kept
        h = self.model.info.hidden_size
        if end <= start:
            return torch.empty(0, h * len(self.layer_inputs), device=self.model.device)
        return self.final_hidden[start - self.final_start : end - self.final_start, h:]

    # ---------------------------------------------------------------- compute
    def hidden(self, exit_layer: int, end: int) -> tuple[torch.Tensor, int]:
        """Run layers ``0 .. exit_layer-1`` up to position ``end`` (only what is missing).

        Returns ``(h, start)`` where ``h [rows, H]`` is ``h_exit`` for positions
        ``[start, start+rows)`` with ``start+rows >= end``: for an early exit, the positions
        layer ``exit_layer`` has not consumed yet; for the last exit, the positions the
        last layer computed most recently.  (``forward_hidden`` for a batch of one.)
        """
        return forward_hidden([(self, exit_layer, end)])[0]

    # The steps of `forward_hidden`'s layer loop.
    def _take_kept(self, layer: int, done: int, end: int) -> torch.Tensor:
        """Input rows of ``layer`` for positions ``[done, end)``, consumed from ``kept``
        (``kept[layer]`` covers ``[done, computed(layer-1))`` and ``computed(layer-1) >= end``)."""
        kept = self.kept[layer]
        assert kept is not None and kept.shape[0] >= end - done, (layer, done, end)
        self.kept[layer] = kept[end - done :] if kept.shape[0] > end - done else None
        rows = kept[: end - done]
        feed = self.adapters.get(layer)
        if feed is not None:
            feed.retain(done, rows)
        return rows

    def _hold_input(self, layer: int, rows: torch.Tensor) -> None:
        """Layer ``layer`` consumes its input ``rows [r, H]`` (the next positions): hold
        them when its inputs are kept (``keep_layer_inputs``)."""
        if layer in self.held:
            prev = self.held[layer]
            self.held[layer] = rows if prev is None else torch.cat([prev, rows], dim=0)

    def _with_inputs(self, out: torch.Tensor) -> torch.Tensor:
        """The last layer's ``out [r, H]`` followed by the held inputs of the same ``r``
        positions (the oldest held rows, then dropped): ``[r, H * (1 + k)]``."""
        if not self.held:
            return out
        r, parts = out.shape[0], [out]
        for layer in self.held:
            held = self.held[layer]
            assert held is not None and held.shape[0] >= r, (layer, r)
            parts.append(held[:r])
            self.held[layer] = held[r:] if held.shape[0] > r else None
        return torch.cat(parts, dim=-1)

    def _store(self, layer: int, done: int, out: torch.Tensor) -> None:
        """Keep ``layer``'s output rows ``out [rows, H]`` for positions ``[done, done+rows)``
        (the last layer's with the held layer inputs of those positions: ``_with_inputs``)."""
        self.layer_evals += out.shape[0]
        if layer + 1 < self.num_layers:
            prev = self.kept[layer + 1]
            self.kept[layer + 1] = out if prev is None else torch.cat([prev, out], dim=0)
            return
        out = self._with_inputs(out)
        if self.final_hidden is not None and self.final_start + len(self.final_hidden) == done:
            self.final_hidden = torch.cat([self.final_hidden, out], dim=0)  # contiguous block
        else:
            self.final_hidden, self.final_start = out, done

    def record_full_forward(self, start: int, final_hidden: torch.Tensor) -> None:
        """Bookkeeping of a full forward run outside the layer loop (the static or the fused
        path): every layer now holds positions up to ``start + rows`` (the caller set the
        caches' lengths) and ``h_N`` of ``[start, start + rows)`` is kept."""
        rows = final_hidden.shape[0]
        self.layer_evals += rows * (self.num_layers - 1)
        self._store(self.num_layers - 1, start, final_hidden)

    def _result(self, exit_layer: int) -> tuple[torch.Tensor, int]:
        """``(h, start)`` of ``hidden`` once the layers below ``exit_layer`` are computed."""
        n_layers = self.num_layers
        if exit_layer == n_layers:
            if self.final_hidden is None:
                return self._empty(), self.computed(n_layers - 1)
            return self.final_hidden[:, : self.model.info.hidden_size], self.final_start
        feed = self.adapters.get(exit_layer)
        if feed is not None:
            if feed.out is None:
                return self._empty(), feed.length
            return feed.out, feed.out_start
        kept = self.kept[exit_layer]
        if kept is None:  # every position up to `end` was already consumed deeper
            return self._empty(), self.computed(exit_layer)
        return kept, self.computed(exit_layer)

    def _empty(self) -> torch.Tensor:
        return torch.empty(0, self.model.info.hidden_size, device=self.model.device)

    def logits(self, exit_layer: int, start: int, end: int) -> torch.Tensor:
        """Logits ``[end-start, V]`` at ``exit_layer`` for positions ``[start, end)``.

        Row ``i`` is the distribution of the token at position ``start+i+1``.
        """
        return self.model.head(self.exit_hidden(exit_layer, start, end), exit_layer)

    def exit_hidden(self, exit_layer: int, start: int, end: int) -> torch.Tensor:
        """Hidden states ``h_exit [end-start, H]`` for positions ``[start, end)`` (computing
        what is missing), the input of the exit's head."""
        return forward_exit_hidden([(self, exit_layer, start, end)])[0]

    def prefill(self, exit_layer: int | None = None) -> None:
        """Compute every position but the last at layers ``< exit_layer`` (default: all)."""
        exit_layer = exit_layer or self.num_layers
        if len(self.tokens) > 1:
            self.hidden(exit_layer, len(self.tokens) - 1)


# A question to a session: (session, exit layer, first position, end position).
Query = tuple[ModelSession, int, int, int]


def forward_hidden(requests: list[tuple[ModelSession, int, int]]) -> list[tuple[torch.Tensor, int]]:
    """``ModelSession.hidden(exit, end)`` for many sessions of one model, batched per layer.

    ``requests[i] = (session, exit_layer, end)``; the sessions are distinct sequences of the
    same model.  Layer by layer, every session still missing positions contributes its rows
    ``[computed(layer), end)`` to ONE ``run_layer`` call (a ragged batch).
    Returns ``(h, start)`` per request, as ``ModelSession.hidden``.
    """
    if not requests:
        return []
    model = requests[0][0].model
    for sess, exit_layer, end in requests:
        if sess.model is not model:
            raise ValueError("forward_hidden needs sessions of one model")
        if not 1 <= exit_layer <= sess.num_layers:
            raise ValueError(f"exit layer must be in 1..{sess.num_layers}, got {exit_layer}")
        if end > len(sess.tokens):
            raise ValueError(f"position {end} is beyond the sequence ({len(sess.tokens)} tokens)")
    fused = _fused_forward(requests)
    if fused is not None:
        return fused
    memo: dict = {}
    for layer in range(max(e for _, e, _ in requests)):
        todo = [
            (sess, sess.computed(layer), end)
            for sess, exit_layer, end in requests
            if exit_layer > layer and sess.computed(layer) < end
        ]
        if not todo:
            continue
        if layer == 0:
            ids = [tok for sess, done, end in todo for tok in sess.tokens[done:end]]
            inp = model.embed(torch.tensor(ids, dtype=torch.long))  # [N, H]
        else:
            parts = [sess._take_kept(layer, done, end) for sess, done, end in todo]
            inp = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)  # [N, H]
        if any(layer in sess.held for sess, _, _ in todo):  # keep_layer_inputs
            row = 0
            for sess, done, end in todo:
                sess._hold_input(layer, inp[row : row + end - done])
                row += end - done
        batch = [(sess.caches[layer], end - done) for sess, done, end in todo]
        out = model.run_layer(layer, inp, batch, memo)  # [N, H]
        if len(todo) == 1:
            sess, done, _ = todo[0]
            sess._store(layer, done, out)
            continue
        row = 0
        for sess, done, end in todo:
            sess._store(layer, done, out[row : row + end - done])
            row += end - done
    _feed_adapters(requests)
    return [sess._result(exit_layer) for sess, exit_layer, _ in requests]


def _whole_forward(sess: ModelSession, exit_layer: int, start: int) -> bool:
    """Whether a forward of ``sess`` to ``exit_layer`` from ``start`` is one a path outside
    the layer loop may run: the last exit, every layer at ``start`` (no partial layers
    pending), no adapter fed (it keeps ``h_L`` between layers) and no layer inputs kept."""
    return (exit_layer == sess.num_layers and not sess.adapters and not sess.held
            and all(sess.computed(layer) == start for layer in range(sess.num_layers)))


def _fused_forward(requests: list[tuple[ModelSession, int, int]]
                   ) -> list[tuple[torch.Tensor, int]] | None:
    """``forward_hidden`` of the requests by their sessions' fused path (``specflow.kv.
    fused``), or ``None`` (the layer loop runs them): only full forwards fit it
    (``_whole_forward``), and the path decides the rest (``FusedForward.fits``)."""
    rows = []
    for sess, exit_layer, end in requests:
        start = sess.computed(0)
        if sess.fused is None or end <= start or not _whole_forward(sess, exit_layer, start):
            return None
        rows.append((sess.fused, sess.tokens[start:end], start))
    first = requests[0][0].fused
    assert first is not None
    hidden = first.hidden(rows)
    if hidden is None:
        return None
    out = []
    for (sess, exit_layer, _), h, (_, _, start) in zip(requests, hidden, rows, strict=True):
        sess.record_full_forward(start, h)
        out.append(sess._result(exit_layer))
    return out


def _feed_adapters(requests: list[tuple[ModelSession, int, int]]) -> None:
    """Run each asked exit's adapter over the positions it has not seen up to ``end``: one
    batched call per exit (the sessions' pending rows, then their kept ``h_L``)."""
    by_exit: dict[int, list[tuple[ModelSession, AdapterFeed, int]]] = {}
    for sess, exit_layer, end in requests:
        feed = sess.adapters.get(exit_layer)
        if feed is not None and feed.length < end:
            by_exit.setdefault(exit_layer, []).append((sess, feed, end))
    for exit_layer, todo in by_exit.items():
        parts = [feed.inputs(sess.kept[exit_layer], sess.computed(exit_layer), end)
                 for sess, feed, end in todo]
        inp = parts[0] if len(parts) == 1 else torch.cat(parts)  # [R, H]
        batch = [(feed.cache, end - feed.length) for _, feed, end in todo]
        out = todo[0][1].adapter.run(inp, batch, {})  # [R, H]; the caches grew
        row = 0
        for (_, feed, _), part in zip(todo, parts, strict=True):
            feed.store(out[row : row + part.shape[0]])
            row += part.shape[0]


def forward_exit_hidden(queries: list[Query]) -> list[torch.Tensor]:
    """``h_exit [end - start, H]`` per query (``ModelSession.exit_hidden``, batched)."""
    hs = forward_hidden([(s, e, end) for s, e, _, end in queries])
    rows: list[torch.Tensor] = []
    for (_, exit_layer, start, end), (h, h_start) in zip(queries, hs, strict=True):
        if start < h_start:
            raise RuntimeError(
                f"positions from {start} at exit {exit_layer} were consumed by a deeper layer "
                f"(kept from {h_start}); ask for them before running deeper"
            )
        rows.append(h[start - h_start : end - h_start])
    return rows


def forward_logits(queries: list[Query]) -> list[torch.Tensor]:
    """Logits ``[end - start, V]`` per query (``ModelSession.logits`` for many sessions of
    one model): one batched forward, one head call per distinct exit, and one copy to the
    CPU when the model runs elsewhere (stages decide on the CPU)."""
    if not queries:
        return []
    static = queries[0][0].static
    if static is not None:
        done = _static_forward(static, queries)
        if done is not None:
            return _to_cpu(done)
    rows = forward_exit_hidden(queries)
    model = queries[0][0].model
    if len(queries) == 1:
        return _to_cpu([model.head(rows[0], queries[0][1])])
    by_query: dict[int, torch.Tensor] = {}
    for exit_layer in sorted({q[1] for q in queries}):
        idx = [i for i, q in enumerate(queries) if q[1] == exit_layer]
        logits = model.head(torch.cat([rows[i] for i in idx]), exit_layer)  # [R, V]
        row = 0
        for i in idx:
            n = rows[i].shape[0]
            by_query[i] = logits[row : row + n]
            row += n
    return _to_cpu([by_query[i] for i in range(len(queries))])


def _static_forward(static: StaticPath, queries: list[Query]) -> list[torch.Tensor] | None:
    """Logits per query from the static path, or ``None`` (run eagerly).  Only a full forward
    fits it: every query asks the last exit for positions ``[start, end)`` with every layer
    at ``start`` (no partial layers pending), and no session feeds an adapter (it keeps
    ``h_L`` between layers, which the static path never hands out) or keeps layer inputs
    (likewise), and no session lays out a token tree (the static path's rows are chains)."""
    for sess, exit_layer, start, _ in queries:
        if sess.tree is not None or not _whole_forward(sess, exit_layer, start):
            static.note_eager()
            return None
    out = static.run([(s.seq_id, s.tokens[start:end], start) for s, _, start, end in queries])
    if out is None:
        return None
    for (sess, _, start, _), (hidden, _) in zip(queries, out, strict=True):
        sess.record_full_forward(start, hidden)
    return [logits for _, logits in out]


def _to_cpu(out: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors on the CPU with ONE device-to-host copy (none when already there)."""
    if out[0].device.type == "cpu":
        return out
    sizes = [o.shape[0] for o in out]
    return list(torch.cat(out).cpu().split(sizes))
