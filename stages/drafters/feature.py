"""Drafter ``feature``: an EAGLE-style head drafts from the target's own last-layer features.

The head (``specflow.models.feature_head``, trained by ``python -m train_heads.train
head=feature``) is one decoder layer on the target's features ``h_N`` plus the target's
final norm and LM head over a draft vocabulary; a published EAGLE-1/2 head reads the normed
``h_N`` the same way, an EAGLE-3 head the inputs of three of the target's layers, which the
target's sessions keep beside ``h_N`` (``ModelUse.layer_inputs``).  It runs no layer of the
target and no prefill of its own: the target verifier's pass computes ``h_N`` of every
committed position, and the drafter reads it from the target's session (``ModelSession.
final_features``; ``retain_final_from`` keeps it across rounds the drafter sits out).

A round, for a batch (``FeatureDraftModel`` doc for the math): step 0 is ONE batched head
forward over every request's new committed positions (the target's features, usually the
``accepted + 1`` positions of the last round) and yields each first draft token; each further
step is one batched forward of one row per request still drafting.  The head's cache is
then cut back to the positions computed from the target's features.

With ``branches = m > 1`` a greedy request drafts a *tree* instead of a chain: the head's
top-m tokens at the first step, then a top-1 chain under each of them, to depth ``asked``
(``m * asked`` nodes, ``Draft.parents``), verified by the target in one forward with a tree
mask (``ModelSession.set_tree``).  Each further step runs the m branches as m rows of the
head's own cache laid out as a tree (``specflow.kv.tree``: a branch attends to the target's
features and to its own earlier rows), so a tree of depth d costs d head steps like a chain
of d, with m rows each.  Sampled requests draft chains (trees are greedy-only,
``specflow.acceptance``), and so does a request too close to its context limit for the
tree; ``min_confidence`` stops chains only.  By default (``trees=free_rows``) a CPU round
drafts trees only where they add no verify rows the target's row padding does not pay for
anyway (batch 1 at the probed row count); the rows counted are this drafter's requests'
(in a fallback, requests another drafter drafts for in the same round are not counted).
``trees=measured`` also drafts them where they cost rows but measurably pay (``TreeGain``):
the tokens a tree round commits against what its first branch alone (the chain) would have,
counted on every tree the target verified, against the verify pass's cost at the two row
counts from the target's row probe.

**Provisional tokens** (HiSpec: ``drafter=feature`` under an ``intermediate_verifier``).  An
intermediate verifier at exit L_i accepts the head's drafts provisionally and asks for more
before the target runs, so the committed tokens can end in positions whose ``h_N`` the target
has not computed yet.  The head then reads its own predicted features there, as its chain
did: a chain's rows stay in its cache after the round (``HeadRows``), the rows whose tokens
were committed are kept, and the positions after them (the verifier's correction, or the
token after a fully accepted chain) get rows one at a time, each reading the previous row's
output.  As soon as the target has computed ``h_N`` of a position, the head's rows from
there on are recomputed from the target's features (every round of a pipeline without an
intermediate verifier: then nothing changes against a chain that is cut back each round).
The drafter runs none of the target's layers itself (``ModelUse.reads_only``): the
intermediate verifier computes layers ``< L_i`` of the drafts, the target continues from
there.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from specflow.cpu.row_padding import RowProbe, row_probe
from specflow.errors import ConfigError, ModelNotFoundError
from specflow.kv.base import ModelInfo
from specflow.kv.contiguous import KVCache
from specflow.kv.tree import TreeLayout
from specflow.models.eagle_export import place_feature_head
from specflow.models.feature_head import default_feature_head_path, load_feature_head
from specflow.models.native import NativeLM
from specflow.models.published_heads import load_published_head
from specflow.models.resolve import as_layered_lm
from specflow.protocols import FeatureHeadRunner, ModelUse
from specflow.sampling import choose
from specflow.state import Acceptance, DecodeState, Draft, RequestLocal
from stages.drafters.base import DrafterDefaults, check_k

log = logging.getLogger(__name__)


@dataclass
class HeadRows:
    """A request's rows of the head's cache (module doc, "Provisional tokens").

    Row ``p`` reads the feature of position ``p`` and token ``t_{p+1}`` and outputs ``f^_{p+1}``.
    Rows ``[0, true_rows)`` read the target's features ``h_N``; the rows ``[true_rows,
    kv.length)`` read the head's own predicted features, row ``true_rows + j`` having read
    token ``read[j]``.  ``outputs[j]`` is the output of row ``true_rows - 1 + j``: the
    predicted feature ``f^`` of position ``true_rows + j`` (``[H]``).

    Invariants: ``kv.length == true_rows + len(read)``; once any row exists,
    ``len(outputs) == len(read) + 1``.
    """

    kv: KVCache
    true_rows: int = 0
    read: list[int] = field(default_factory=list)
    outputs: list[torch.Tensor] = field(default_factory=list)

    def drop_predicted(self) -> None:
        """Forget every row that read a predicted feature, and the outputs."""
        self.kv.truncate(self.true_rows)
        self.read.clear()
        self.outputs.clear()

    def keep_committed(self, tokens: list[int]) -> None:
        """Keep the predicted rows whose tokens ``tokens`` (the committed sequence) holds:
        row ``p`` stays iff every predicted row up to it read ``t_{q+1}`` (q <= p) and
        ``p < len(tokens) - 1`` (the last committed token's row is the next draft's)."""
        end, m = len(tokens) - 1, 0
        while (m < len(self.read) and self.true_rows + m < end
               and self.read[m] == tokens[self.true_rows + m + 1]):
            m += 1
        self.kv.truncate(self.true_rows + m)
        del self.read[m:]
        del self.outputs[m + 1 :]

    def add(self, token: int, output: torch.Tensor) -> None:
        """Record a row that read a predicted feature and ``token``, with its ``output [H]``."""
        self.read.append(token)
        self.outputs.append(output)


@dataclass
class TreeGain:
    """Whether a tree pays where it costs verify rows (``trees=measured``), from what the
    target's verdicts showed.

    A greedy tree of m branches holds the chain as its first branch (the head's top-1 token,
    then top-1 under it: ``Draft.first_chain``), so each verified tree tells both what it
    committed, ``a_tree + 1`` tokens, and what the chain alone would have, ``a_chain + 1``
    (``a_chain``: the kept path's common prefix with the first branch).  Over the trees seen,
    ``gain = sum(a_tree + 1) / sum(a_chain + 1) >= 1``.  A round of ``r_t`` verify rows with
    trees instead of ``r_c`` with chains pays iff ``gain >= c(r_t) / c(r_c)``, ``c`` the
    probed seconds of the target's packed matmuls at that row count
    (``specflow.cpu.row_padding.RowProbe``: the rows' share of a verify pass; the draft's
    own extra head rows are not counted).  Until ``warmup`` trees were seen, and on every
    ``explore``-th undecided round after, trees are drafted to keep ``gain`` measured; a row
    count the probe did not time is not paid for (chains).
    """

    warmup: int = 8
    explore: int = 16
    tree_tokens: int = 0
    chain_tokens: int = 0
    trees_seen: int = 0
    decisions: int = 0

    @property
    def gain(self) -> float:
        return self.tree_tokens / self.chain_tokens if self.chain_tokens else 1.0

    def pays(self, chain_rows: int, tree_rows: int, probe: RowProbe | None) -> bool:
        """Whether ``tree_rows`` verify rows with trees beat ``chain_rows`` with chains."""
        self.decisions += 1
        if probe is None or chain_rows not in probe.seconds or tree_rows not in probe.seconds:
            return False
        if self.trees_seen < self.warmup or self.decisions % self.explore == 0:
            return True
        return self.gain >= probe.seconds[tree_rows] / probe.seconds[chain_rows]

    def count(self, draft: Draft, verdict: Acceptance) -> None:
        """Add one verified tree draft (``draft.parents`` set, ``verdict.path`` its kept
        path)."""
        path, chain = verdict.path or [], draft.first_chain()
        shared = 0
        while shared < min(len(path), len(chain)) and path[shared] == chain[shared]:
            shared += 1
        self.tree_tokens += len(path) + 1
        self.chain_tokens += shared + 1
        self.trees_seen += 1


def feature_head_placer(lm: NativeLM, head: str
                        ) -> tuple[Callable[[NativeLM], FeatureHeadRunner], str, tuple[int, ...]]:
    """``drafter.head`` -> (a function placing the head beside a placed target, its path,
    the target layers whose inputs it reads: ``FeatureHeadRunner.layer_inputs``).

    ``default``: ``<cache>/heads/<model>/feature_head.safetensors``; a ``.safetensors`` file:
    the project's own head; a folder (or hub id) with ``config.json``: a published EAGLE-1/2
    or EAGLE-3 head (``specflow.models.published_heads``).  Every check (the target, keys,
    shapes) runs here, before any decoding.
    """
    name = lm.info.name
    path = default_feature_head_path(name) if head in ("default", "auto") else Path(head)
    if path.expanduser().is_file():
        own = load_feature_head(path, lm.info)
        return partial(place_feature_head, own), str(path), ()
    if path.expanduser().is_dir() or (head.count("/") == 1 and not path.suffix):
        eagle = load_published_head(head, lm.info, lm.embed_weight)
        return eagle.place, eagle.source, eagle.layer_inputs
    raise ModelNotFoundError(
        f"drafter.head={head}: no feature head at {path}; train one with "
        f"`python -m train_heads.train head=feature model={name}` (see "
        f"docs/heads.md), pass a published EAGLE-1/2 head's folder, or pick another "
        f"drafter (drafter=pld)"
    )


class FeatureDrafter(DrafterDefaults):
    """Draft up to ``k`` tokens per round with a feature head of the target ``model``.

    Args:
        model: the target (the same config as the pipeline's ``model``: the drafter reads
            the target verifier's session of it).
        head: a feature-head file, ``default`` for
            ``<cache>/heads/<model>/feature_head.safetensors``, or the folder (or hub id)
            of a published EAGLE-1/2 head (``feature_head_placer``).
        k: the most tokens drafted per round (``Drafter.k``, config ``drafter.k``); with
            ``branches > 1``, the tree's depth.
        min_confidence: stop drafting once the head's top probability drops below this.
        branches: 1 drafts a chain; m > 1 drafts (greedy requests) a tree of m branches of
            depth up to k (module doc).
        trees: when a round drafts trees (``branches > 1``): ``free_rows`` (default) only
            when, on a CPU, the round's verify rows with trees stay within what the target's
            padded matmuls pay for anyway, ``max(model.min_rows, rows with chains)`` (batch
            1 at the probed 5 rows: a 2 x 2 tree; at batch 3 the extra rows cost: chains);
            on other devices always; ``measured``: also where the extra rows cost, when the
            trees verified so far committed enough more tokens to pay for them
            (``TreeGain``); ``always``: every round that can.
    """

    name = "feature"

    def __init__(self, model: Any, head: str = "default", k: int = 4,
                 min_confidence: float = 0.0, branches: int = 1,
                 trees: str = "free_rows") -> None:
        self.k = check_k(k)
        if branches < 1:
            raise ConfigError(f"drafter.branches must be >= 1 (1: a chain), got {branches}")
        if trees not in ("free_rows", "measured", "always"):
            raise ConfigError(
                f"drafter.trees must be free_rows, measured or always, got {trees!r}"
            )
        self.branches = branches
        self.trees = trees
        if not 0.0 <= min_confidence < 1.0:
            raise ConfigError(f"drafter.min_confidence must be in [0, 1), got {min_confidence}")
        self.lm = as_layered_lm(model)
        if not isinstance(self.lm, NativeLM):
            raise ConfigError(
                f"drafter=feature needs the native backend (the target's layers and LM head); "
                f"{self.lm.info.name} runs on another backend: set model.backend=native"
            )
        self.place, self.head_path, self.layer_inputs = feature_head_placer(self.lm, head)
        self.min_confidence = min_confidence
        self._draft_models: dict[int, FeatureHeadRunner] = {}  # by id(placed target)
        self._rows: RequestLocal[HeadRows] = RequestLocal(self._new_rows)
        self.tree_gain = TreeGain()  # trees=measured: what verified trees showed
        self._trees_paid: bool | None = None  # its last decision (logged when it changes)
        if trees == "measured" and branches > 1 and self.lm.device.type == "cpu":
            # The prices of rows: a target whose model.min_rows was given, not probed, is
            # probed once here (one or two seconds; its row padding unchanged, the run summary's
            # row_padding shows the milliseconds).
            row_probe(self.lm)

    def models(self) -> list[ModelInfo]:
        return [self.lm.info]

    def uses(self) -> list[ModelUse]:
        return [ModelUse(self.lm, self.lm.info.num_layers, reads_only=True,
                         layer_inputs=self.layer_inputs)]

    def _draft_model(self, state: DecodeState) -> FeatureHeadRunner:
        placed = state.session(self.lm).model  # the target as placed for this run
        dm = self._draft_models.get(id(placed))
        if dm is None:
            dm = self._draft_models[id(placed)] = self.place(placed)
        return dm

    def _new_rows(self, state: DecodeState) -> HeadRows:
        return HeadRows(KVCache(self._draft_model(state).kv, state.max_len))

    def begin(self, states: list[DecodeState]) -> None:
        """Keep the target's features from position 0 on; a fresh head cache per request."""
        for st in states:
            st.session(self.lm).retain_final_from(0)
            self._rows.set(st, self._new_rows(st))

    def propose(self, states: list[DecodeState], asked: list[int]) -> list[Draft]:
        drafts = [Draft([]) for _ in states]
        todo = [i for i, n in enumerate(asked) if n > 0 and len(states[i].tokens) >= 2]
        if not todo:
            return drafts
        dm = self._draft_model(states[todo[0]])
        heads = {i: self._rows.get(states[i]) for i in todo}
        caches = {i: heads[i].kv for i in todo}
        # Step 0: each request's committed positions the head has not seen.  Those with the
        # target's features first (its first call: the whole prompt), in one forward; then,
        # after provisionally accepted tokens (HiSpec), those the target has not verified,
        # one row per request and forward, each reading the previous row's output.
        feats, ids, batch, firsts, pending, catchup = [], [], [], [], {}, []
        last = self.lm.info.num_layers - 1
        for i in list(todo):
            st, rows = states[i], heads[i]
            sess = st.session(self.lm)
            end = len(st.tokens) - 1
            before = rows.kv.length
            # Sync to the committed tokens: drops a rejected chain, keeps a verified tree's
            # accepted path in place (its features are read below).
            sess.set_tokens(st.tokens)
            if not rows.outputs and sess.computed(last) == 0:
                # The target has not run yet (HiSpec: a one-token prompt's first tokens come
                # from the intermediate verifier alone): no feature to draft from.
                todo.remove(i)
                continue
            verified = min(end, sess.final_end())
            if verified > rows.true_rows or not rows.outputs:
                # The target's features replace the head's own (none kept at all: the
                # error of ``final_features`` names what is missing).
                upto = verified if verified > rows.true_rows else end
                rows.drop_predicted()
                feats.append(dm.features(sess.final_features(rows.true_rows, upto),
                                         sess.final_layer_inputs(rows.true_rows, upto)))
                ids += st.tokens[rows.true_rows + 1 : upto + 1]
                batch.append((rows.kv, upto - rows.true_rows))
                firsts.append(i)
                rows.true_rows = upto
            else:
                rows.keep_committed(st.tokens)
            pending[i] = list(range(rows.true_rows + len(rows.read), end))
            catchup.append(end - min(before, rows.kv.length) > asked[i] + 1)
        if not todo:
            return drafts
        clock = states[todo[0]].clock  # the pipeline's clock (Draft.catchup_s)
        t0 = clock()
        if firsts:
            rows_in = torch.cat(feats) if len(feats) > 1 else feats[0]
            out = dm.step(rows_in, torch.tensor(ids, dtype=torch.long), batch)  # [R, H]
            ends = torch.tensor([t for _, t in batch]).cumsum(0) - 1
            for i, e in zip(firsts, ends.tolist(), strict=True):
                heads[i].outputs = [out[e].clone()]  # f^ of position true_rows
        while any(pending.values()):  # rows on predicted features, one per request a step
            on = [i for i in todo if pending[i]]
            nxt = [states[i].tokens[pending[i].pop(0) + 1] for i in on]
            out = dm.step(torch.stack([heads[i].outputs[-1] for i in on]),
                          torch.tensor(nxt, dtype=torch.long), [(caches[i], 1) for i in on])
            for r, (i, t) in enumerate(zip(on, nxt, strict=True)):
                heads[i].add(t, out[r].clone())
        step0_s = clock() - t0
        predicted = torch.stack([heads[i].outputs[-1] for i in todo])  # [A, H]: f^_{n-1}
        tokens: dict[int, list[int]] = {i: [] for i in todo}
        q_rows: dict[int, list[torch.Tensor]] = {i: [] for i in todo}
        # Per tree request: every node's parent (-1: the last committed token).
        parents: dict[int, list[int]] = {
            i: [] for i in todo if self._width(states[i], asked[i]) > 1
        } if self._trees_pay(dm, [states[i] for i in todo], [asked[i] for i in todo]) else {}
        rows_of = dict.fromkeys(todo, 1)  # rows of `predicted` per active request
        active = list(todo)
        step = 0
        try:
            while active:
                logits = dm.logits(predicted).cpu()  # [R, S]
                still, sources, next_ids, added = [], [], [], []
                row = 0
                for i in active:
                    st, r = states[i], rows_of[i]
                    block = logits[row : row + r]  # [r, S]
                    if i in parents:  # a tree: top-m at the first step, then top-1 per branch
                        m = self._width(st, asked[i])
                        picked = block[0].topk(m).indices if step == 0 else block.argmax(-1)
                        new = [int(t) for t in dm.ids[picked].tolist()]
                        first = len(tokens[i]) - r  # the previous level's first node
                        parents[i] += [-1] * m if step == 0 else list(range(first, first + m))
                        src = [row] * m if step == 0 else list(range(row, row + m))
                        go_on = asked[i] > step + 1
                    else:
                        picked, probs = choose(block, st.sampling, st.generator)
                        new, src = [int(dm.ids[picked[0]])], [row]
                        if probs is not None:
                            q_rows[i].append(dm.to_vocab(probs))
                        confident = (self.min_confidence <= 0.0
                                     or float(block.softmax(-1).max()) >= self.min_confidence)
                        go_on = confident and asked[i] > step + 1
                    tokens[i] += new
                    if go_on:
                        still.append(i)
                        sources += src
                        next_ids += new
                        added.append(len(new))
                    row += r
                step += 1
                if not still:
                    break
                for i in still:
                    if i in parents:  # the head's rows of this step continue their branches
                        caches[i].tree = TreeLayout(len(states[i].tokens) - 1, tuple(parents[i]))
                predicted = dm.step(predicted[sources], torch.tensor(next_ids, dtype=torch.long),
                                    [(caches[i], t) for i, t in zip(still, added, strict=True)])
                row = 0
                for i, t in zip(still, added, strict=True):
                    if i not in parents:  # a chain's row stays (module doc)
                        heads[i].add(next_ids[row], predicted[row].clone())
                    row += t
                rows_of.update(zip(still, added, strict=True))
                active = still
        finally:  # a tree's layout never outlives the round
            for i in todo:
                caches[i].tree = None
        for pos, i in enumerate(todo):
            st, rows = states[i], heads[i]
            rows.kv.truncate(rows.true_rows + len(rows.read))  # a tree's rows go
            st.session(self.lm).retain_final_from(rows.true_rows)
            probs = torch.cat(q_rows[i]) if q_rows[i] else None
            drafts[i] = Draft(tokens[i], probs, catchup_s=step0_s if catchup[pos] else 0.0,
                              parents=parents.get(i))
        return drafts

    def _trees_pay(self, dm: FeatureHeadRunner, states: list[DecodeState], asked: list[int]
                   ) -> bool:
        """Whether this round drafts trees (``trees``, class doc): the verify rows of the
        drafting requests with trees against with chains and the target's row padding."""
        if self.branches == 1:
            return False
        if self.trees == "always" or dm.target.device.type != "cpu":
            return True
        chains = sum(1 + n for n in asked)
        with_trees = sum(1 + n * self._width(st, n) for st, n in zip(states, asked, strict=True))
        chain_rows = max(dm.target.min_rows, chains)  # what the target runs with chains
        if with_trees <= chain_rows:
            return True
        if self.trees != "measured":
            return False
        probe = dm.target.row_probe
        pays = self.tree_gain.pays(chain_rows, with_trees,
                                   probe if isinstance(probe, RowProbe) else None)
        if pays != self._trees_paid:  # the decision changed: say why, once
            self._trees_paid = pays
            log.info("trees=measured: %s at %d verify rows against %d (tokens per round %.3f "
                     "times the chain's over %d trees)", "trees" if pays else "chains",
                     with_trees, chain_rows, self.tree_gain.gain, self.tree_gain.trees_seen)
        return pays

    def _width(self, state: DecodeState, asked: int) -> int:
        """The branches a request drafts this round: ``branches`` for a greedy request whose
        context holds the tree's ``branches * asked`` nodes, else 1 (a chain)."""
        if (self.branches > 1 and state.sampling.greedy
                and len(state.tokens) + self.branches * asked <= state.max_len):
            return self.branches
        return 1

    def observe(
        self,
        states: list[DecodeState],
        drafts: list[Draft],
        target_logits: list[torch.Tensor],
        verdicts: list[Acceptance],
    ) -> None:
        """``trees=measured``: count each verified tree (``TreeGain.count``)."""
        if self.trees != "measured":
            return
        for draft, verdict in zip(drafts, verdicts, strict=True):
            if draft.parents is not None:
                self.tree_gain.count(draft, verdict)
