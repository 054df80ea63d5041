"""Drafter ``token_tree``: training-free token trees from suffix matches and recycled logits.

No model drafts.  Two sources propose each node's children, both free to query:

- **suffix matching** (``suffix_index.SuffixIndex``): the continuations of the
  context's longest suffix seen before, in the request's prompt and output and in the run's
  earlier requests, ranked by how often the corpus continued that way (prompt lookup is the
  case of one occurrence and one chain);
- **token recycling** (``recycling.RecyclingTable``): each token's top-w
  successors as the target's own verification logits showed them at earlier positions
  (rejected draft positions too), kept across the run's requests.

A round, per request: the children of a node are the union of both sources' proposals
(a token both propose once, with the larger estimate); each proposal's estimate ``p`` that
the target keeps it given its parent was kept is calibrated online per evidence bin
(``tree_plan.AcceptanceCalibration``: the suffix's match length, count ratio and
support; the recycled probability).  The tree grows best first by path probability
(``grow_tree``) to depth ``asked`` and at most ``max_nodes`` nodes, then the whole batch's
trees are cut to the size that maximizes expected committed tokens per step-equivalent of
the verify pass (``plan_sizes``), priced by the target's row probe on this machine
(``specflow.costs.RowPrices``); where no probe ran (another device, an
unpacked model) a row costs ``row_cost`` of a step.  So the tree is as large as pays here
and no larger: on a CPU whose verify pass of 9 rows costs 1.3 steps, a node must be kept
with a probability of about 0.1 per extra row to be worth drafting.

Greedy requests draft trees (``Draft.parents``; one best chain is sent as a chain);
sampled requests draft chains (``branches`` 1 for them: each node's best child only),
deterministic (q one-hot), so rejection sampling stays lossless.  ``branches = 1`` drafts
chains for every request (then any acceptor, FLy included, can verify them).

After verification (``observe``) every verified position's target logits update the
recycling table, and every node whose parent was kept counts for its bins' calibration.
All three live as long as the drafter (a run); with ``keep`` they are also kept on disk per
target and weights (``kept_tables``), so the next run starts where this one stopped.
Those four helpers are the modules beside this one in ``stages/drafters/token_tree/``.
"""

from __future__ import annotations

import atexit
import logging
import time
import weakref
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from specflow.costs import RowPrices
from specflow.cpu.row_padding import row_prices, row_probe
from specflow.errors import ConfigError
from specflow.kv.base import LayeredLM
from specflow.models.native import NativeLM
from specflow.models.resolve import as_layered_lm
from specflow.state import Acceptance, DecodeState, Draft, RequestLocal
from stages.drafters.base import DrafterDefaults, check_k
from stages.drafters.token_tree.kept_tables import (
    TargetKey,
    default_tables_dir,
    load_tables,
    save_tables,
)
from stages.drafters.token_tree.recycling import RecyclingTable
from stages.drafters.token_tree.suffix_index import SuffixIndex, TrieNode
from stages.drafters.token_tree.tree_plan import (
    AcceptanceCalibration,
    Candidate,
    PlannedTree,
    grow_tree,
    plan_sizes,
)

log = logging.getLogger(__name__)

# Prior means of the calibration bins (pseudo-observations: ``calibration_strength``).
SUFFIX_PRIOR_BY_LENGTH = {1: 0.25, 2: 0.4, 3: 0.55}  # the match's length, 3 and more alike
RECYCLE_PRIOR_SCALE = 0.8  # a recycled successor's prior: its stored probability times this


def suffix_bin(match_length: int, count: int, parent_count: int) -> tuple[str, int, int, int]:
    """A suffix proposal's calibration bin: match length (1, 2, 3+), count ratio (below
    1/2, below 1, 1) and support (1, 2+ continuations through the child)."""
    ratio = count / parent_count if parent_count else 0.0
    ratio_bin = 0 if ratio < 0.5 else (1 if ratio < 1.0 else 2)
    return ("suffix", min(match_length, 3), ratio_bin, min(count, 2))


def recycle_bin(prob: float) -> tuple[str, int]:
    """A recycled successor's calibration bin: its stored probability in tenths."""
    return ("recycle", min(int(prob * 10), 9))


def _save_at_exit(ref: weakref.ReferenceType[TokenTreeDrafter]) -> None:
    """Write a kept drafter's tables at interpreter exit, if the drafter still exists."""
    drafter = ref()
    if drafter is not None:
        drafter.save_tables()


@dataclass
class _LastDraft:
    """What a request's last draft was planned from (for the calibration)."""

    parents: list[int] = field(default_factory=list)
    evidence: list[tuple[Hashable, ...]] = field(default_factory=list)


@dataclass
class _IndexedTokens:
    """The token list a request's suffix matches last read (a nested pipeline's request gets
    a fresh list each outer round: ``SuffixIndex.replace`` carries its entries over)."""

    tokens: list[int] | None = None


class TokenTreeDrafter(DrafterDefaults):
    """Token trees from suffix matches and recycled target logits (module doc).

    Args:
        model: the target, whose row probe prices verify rows (``model: ${model}``);
            ``None``: every row costs ``row_cost``.
        k: the deepest tree (``Drafter.k``; a round's depth is at most the asked length).
        branches: the most children a node has (1: chains only).
        suffix: the suffix index (``None``: no suffix source).
        recycling: the recycling table (``None``: no recycling source).
        max_nodes: the most nodes a request's tree may have before pricing.
        min_path_prob: nodes whose path probability is below this are never drafted.
        calibration_strength: the prior's weight in pseudo-observations per bin.
        row_cost: the price of a verify row beyond the first, in steps, where the target
            has no row probe (``None``: 0.1 on a CPU, 0 elsewhere).
        keep: a folder where the tables (recycling, the suffix index's sequences, the
            calibration) are kept across runs of this target (``kept_tables``):
            read at construction, written when requests join and at most every
            ``keep_every_s`` seconds of drafting, and at exit if the drafter still exists
            (so at most the last ``keep_every_s`` seconds of learning are lost); ``"default"``:
            ``<cache>/token_trees/<model>/<weights fingerprint>/``; ``None``: every run
            starts empty.
        keep_every_s: the longest time between two writes of the kept tables.
    """

    name = "token_tree"

    def __init__(self, model: Any = None, k: int = 8, branches: int = 3,
                 suffix: SuffixIndex | None = None, recycling: RecyclingTable | None = None,
                 max_nodes: int = 12, min_path_prob: float = 0.01,
                 calibration_strength: float = 4.0, row_cost: float | None = None,
                 keep: str | None = None, keep_every_s: float = 10.0) -> None:
        self.k = check_k(k)
        if branches < 1:
            raise ConfigError(f"drafter.branches must be >= 1 (1: chains), got {branches}")
        if max_nodes < 1:
            raise ConfigError(f"drafter.max_nodes must be >= 1, got {max_nodes}")
        if suffix is None and recycling is None:
            raise ConfigError(
                "drafter=token_tree needs a source: set drafter.suffix or drafter.recycling "
                "(conf/drafter/suffix_recycle.yaml has both)"
            )
        self.lm: LayeredLM | None = None if model is None else as_layered_lm(model)
        self.branches = branches
        self.suffix = suffix
        self.recycling = recycling
        self.max_nodes = max_nodes
        self.min_path_prob = min_path_prob
        self.calibration = AcceptanceCalibration(calibration_strength)
        self.row_cost = row_cost
        self._last: RequestLocal[_LastDraft] = RequestLocal(lambda _state: _LastDraft())
        self._indexed: RequestLocal[_IndexedTokens] = RequestLocal(lambda _s: _IndexedTokens())
        if isinstance(self.lm, NativeLM) and self.lm.packed and self.lm.device.type == "cpu":
            row_probe(self.lm)  # prices of verify rows: probed once per model and process
        self.keep: Path | None = None
        self.keep_every_s = keep_every_s
        self._saved_at = time.monotonic()
        if keep is not None:
            if self.lm is None:
                raise ConfigError("drafter.keep needs the target (drafter.model): the tables "
                                  "are kept per model and weights")
            info = self.lm.info
            self._key = TargetKey(info.name, info.weights_fingerprint, info.vocab_size)
            self.keep = (default_tables_dir(info.name, info.weights_fingerprint)
                         if keep == "default" else Path(keep).expanduser())
            load_tables(self.keep, self._key, self.recycling, self.suffix, self.calibration)
            atexit.register(_save_at_exit, weakref.ref(self))  # not keeping the model alive

    def begin(self, states: list[DecodeState]) -> None:
        """Each request's tokens join the suffix index (read as they grow)."""
        if self.suffix is not None:
            for st in states:
                self.suffix.add(st.tokens)
                self._indexed.get(st).tokens = st.tokens
        if self.keep is not None:
            self.save_tables()

    def save_tables(self) -> None:
        """Write the tables to the ``keep`` folder (no-op without one)."""
        if self.keep is not None:
            save_tables(self.keep, self._key, self.recycling, self.suffix, self.calibration)
            self._saved_at = time.monotonic()

    # ------------------------------------------------------------------ drafting
    def propose(self, states: list[DecodeState], asked: list[int]) -> list[Draft]:
        plans = [self._grow(st, n) for st, n in zip(states, asked, strict=True)]
        sizes = plan_sizes([p.path_probs for p in plans], self._price(states))
        drafts = []
        for st, plan, size in zip(states, plans, sizes, strict=True):
            plan = plan.truncated(size)
            self._last.set(st, _LastDraft(plan.parents, plan.evidence))
            parents = None if plan.is_chain else plan.parents
            drafts.append(Draft(plan.tokens, parents=parents))
        return drafts

    def _grow(self, state: DecodeState, asked: int) -> PlannedTree:
        """The request's best-first tree of depth <= ``asked``."""
        if asked < 1 or not state.tokens:
            return PlannedTree()
        greedy = state.sampling.greedy
        width = self.branches if greedy else 1
        room = state.max_len - len(state.tokens)  # the context's free positions
        cap = min(self.max_nodes, room) if width > 1 else min(asked, room)
        match = None
        if self.suffix is not None:
            seen = self._indexed.get(state)
            if seen.tokens is not None and seen.tokens is not state.tokens:
                self.suffix.replace(seen.tokens, state.tokens)  # the same request, a new list
            seen.tokens = state.tokens
            match = self.suffix.match(state.tokens, asked)
        length = match.length if match is not None else 0
        children = self._children_fn(width, length)
        root = match.root if match is not None else None
        return grow_tree(children, state.tokens[-1], root, cap, asked, self.min_path_prob)

    def _children_fn(self, width: int, match_length: int
                     ) -> Callable[[int, object | None], list[Candidate]]:
        """A node's children: both sources' proposals, merged by token, best ``width``."""
        calib = self.calibration
        table = self.recycling

        def children(token: int, state: object | None) -> list[Candidate]:
            found: dict[int, Candidate] = {}
            if isinstance(state, TrieNode):
                for t, child in state.children.items():
                    key = suffix_bin(match_length, child.count, state.count)
                    prior = SUFFIX_PRIOR_BY_LENGTH[min(match_length, 3)] * \
                        (child.count / state.count)
                    found[t] = Candidate(t, calib.estimate(key, prior), (key,), child)
            if table is not None:
                ids, probs = table.successors(token)
                for t, q in zip(ids[:width], probs[:width], strict=True):
                    key = recycle_bin(q)
                    p = calib.estimate(key, RECYCLE_PRIOR_SCALE * q)
                    had = found.get(t)
                    if had is None:
                        found[t] = Candidate(t, p, (key,), None)
                    else:  # both sources: the larger estimate, both bins learn
                        found[t] = Candidate(t, max(p, had.prob), had.evidence + (key,),
                                             had.state)
            best = sorted(found.values(), key=lambda c: -c.prob)
            return best[:width]

        return children

    def _price(self, states: list[DecodeState]) -> Callable[[float], float]:
        """What a verify pass of n rows costs in one-token steps: the target's row probe
        where it ran, else ``1 + row_cost * (n - 1)``."""
        prices: RowPrices | None = None
        if self.lm is not None and states:
            sess = states[0].sessions.get(id(self.lm))
            prices = row_prices(sess.model if sess is not None else self.lm)
        if prices is not None:
            return prices
        cost = self.row_cost
        if cost is None:
            on_cpu = self.lm is None or self.lm.device.type == "cpu"
            cost = 0.1 if on_cpu else 0.0
        return lambda n: 1.0 + cost * (n - 1.0)

    # ------------------------------------------------------------------ learning
    def observe(
        self,
        states: list[DecodeState],
        drafts: list[Draft],
        target_logits: list[torch.Tensor],
        verdicts: list[Acceptance],
    ) -> None:
        """Recycle every verified position's logits; calibrate on the kept nodes."""
        inputs: list[int] = []
        for st, draft, verdict in zip(states, drafts, verdicts, strict=True):
            inputs += [st.tokens[-1], *draft.tokens]  # row 0 follows the last committed token
            last = self._last.get(st)
            if len(last.parents) == len(draft.tokens) and draft.tokens:
                kept = set(verdict.path) if verdict.path is not None \
                    else set(range(verdict.num_accepted))
                self.calibration.record_tree(last.parents, last.evidence, kept)
            self._last.set(st, _LastDraft())
        if self.recycling is not None and inputs:
            rows = torch.cat([lg.reshape(-1, lg.shape[-1]) for lg in target_logits])
            self.recycling.update(inputs, rows)
        if self.keep is not None and time.monotonic() - self._saved_at > self.keep_every_s:
            self.save_tables()
