"""Drafter ``feature``: an EAGLE-style head drafts from the target's own last-layer features.

The head (``specflow.models.feature_head``, trained by ``python -m train_heads.train
head=feature``) is one decoder layer on the target's features ``h_N`` plus the target's
final norm and LM head over a draft vocabulary.  It runs no layer of the target and no
prefill of its own: the target verifier's pass computes ``h_N`` of every committed
position, and the drafter reads it from the target's session (``ModelSession.
final_features``; ``retain_final_from`` keeps it across rounds the drafter sits out).

A round, for a batch (``FeatureDraftModel`` doc for the math): step 0 is ONE batched head
forward over every request's new committed positions (the target's features, usually the
``accepted + 1`` positions of the last round) and yields each first draft token; each further
step is one batched forward of one row per request still drafting.  The head's cache is
then cut back to the positions computed from the target's features.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from specflow.errors import ConfigError, ModelNotFoundError
from specflow.kv.base import ModelInfo
from specflow.kv.contiguous import KVCache
from specflow.kv.session import common_prefix_length
from specflow.models.feature_head import (
    FeatureDraftModel,
    default_feature_head_path,
    load_feature_head,
)
from specflow.models.native import NativeLM
from specflow.models.resolve import as_layered_lm
from specflow.protocols import ModelUse
from specflow.sampling import choose
from specflow.state import Acceptance, DecodeState, Draft, RequestLocal


class FeatureDrafter:
    """Draft up to ``k`` tokens per round with a feature head of the target ``model``.

    Args:
        model: the target (the same config as the pipeline's ``model``: the drafter reads
            the target verifier's session of it).
        head: a feature-head file, or ``default`` for
            ``<cache>/heads/<model>/feature_head.safetensors``.
        k: the most tokens drafted per round (``Drafter.k``, config ``drafter.k``).
        min_confidence: stop drafting once the head's top probability drops below this.
    """

    name = "feature"

    def __init__(self, model: Any, head: str = "default", k: int = 4,
                 min_confidence: float = 0.0) -> None:
        if k < 1:
            raise ConfigError(f"drafter.k must be >= 1, got {k}")
        if not 0.0 <= min_confidence < 1.0:
            raise ConfigError(f"drafter.min_confidence must be in [0, 1), got {min_confidence}")
        self.lm = as_layered_lm(model)
        if not isinstance(self.lm, NativeLM):
            raise ConfigError(
                f"drafter=feature needs the native backend (the target's layers and LM head); "
                f"{self.lm.info.name} runs on another backend: set model.backend=native"
            )
        name = self.lm.info.name
        path = default_feature_head_path(name) if head in ("default", "auto") else Path(head)
        if not path.expanduser().exists():
            raise ModelNotFoundError(
                f"drafter.head={head}: no feature head at {path}; train one with "
                f"`python -m train_heads.train head=feature model={name}` (see "
                f"train_heads/README.md) or pick another drafter (drafter=pld)"
            )
        self.head = load_feature_head(path, self.lm.info)
        self.head_path = str(path)
        self.k = k
        self.min_confidence = min_confidence
        self._draft_models: dict[int, FeatureDraftModel] = {}  # by id(placed target)
        self._kv: RequestLocal[KVCache] = RequestLocal(self._new_cache)

    def models(self) -> list[ModelInfo]:
        return [self.lm.info]

    def uses(self) -> list[ModelUse]:
        return [ModelUse(self.lm, self.lm.info.num_layers)]

    def _draft_model(self, state: DecodeState) -> FeatureDraftModel:
        placed = state.session(self.lm).model  # the target as placed for this run
        dm = self._draft_models.get(id(placed))
        if dm is None:
            dm = self._draft_models[id(placed)] = FeatureDraftModel(self.head, placed)
        return dm

    def _new_cache(self, state: DecodeState) -> KVCache:
        return KVCache(self._draft_model(state).kv, state.max_len)

    def begin(self, states: list[DecodeState]) -> None:
        """Keep the target's features from position 0 on; a fresh head cache per request."""
        for st in states:
            st.session(self.lm).retain_final_from(0)
            self._kv.set(st, self._new_cache(st))

    def propose(self, states: list[DecodeState], asked: list[int]) -> list[Draft]:
        drafts = [Draft([]) for _ in states]
        todo = [i for i, n in enumerate(asked) if n > 0 and len(states[i].tokens) >= 2]
        if not todo:
            return drafts
        dm = self._draft_model(states[todo[0]])
        caches = {i: self._kv.get(states[i]) for i in todo}
        # Step 0: each request's committed positions the head has not seen, with the
        # target's features (its first call: the whole prompt).
        feats, ids, batch, catchup = [], [], [], []
        for i in todo:
            st, kv = states[i], caches[i]
            sess = st.session(self.lm)
            start, end = kv.length, len(st.tokens) - 1
            if common_prefix_length(sess.tokens, st.tokens) < end:
                raise RuntimeError("the target's session does not hold the committed tokens")
            feats.append(sess.final_features(start, end))
            ids += st.tokens[start + 1 : end + 1]
            batch.append((kv, end - start))
            catchup.append(end - start > asked[i] + 1)
        clock = states[todo[0]].clock  # the pipeline's clock (Draft.catchup_s)
        t0 = clock()
        rows = torch.cat(feats) if len(feats) > 1 else feats[0]
        out = dm.step(rows, torch.tensor(ids, dtype=torch.long), batch)  # [R, H]
        step0_s = clock() - t0
        ends = torch.tensor([t for _, t in batch]).cumsum(0) - 1
        predicted = out[ends]  # [A, H]: f^_{n-1} per request
        tokens: dict[int, list[int]] = {i: [] for i in todo}
        q_rows: dict[int, list[torch.Tensor]] = {i: [] for i in todo}
        active = list(todo)
        step = 0
        while active:
            logits = dm.logits(predicted).cpu()  # [A, S]
            still, still_rows, next_ids = [], [], []
            for j, i in enumerate(active):
                st = states[i]
                row = logits[j : j + 1]
                picked, probs = choose(row, st.sampling, st.generator)
                tok = int(dm.ids[picked[0]])
                tokens[i].append(tok)
                if probs is not None:
                    q_rows[i].append(dm.to_vocab(probs))
                confident = (self.min_confidence <= 0.0
                             or float(row.softmax(-1).max()) >= self.min_confidence)
                if confident and asked[i] > step + 1:
                    still.append(i)
                    still_rows.append(j)
                    next_ids.append(tok)
            step += 1
            if not still:
                break
            predicted = dm.step(predicted[still_rows], torch.tensor(next_ids, dtype=torch.long),
                                [(caches[i], 1) for i in still])
            active = still
        for pos, i in enumerate(todo):
            st = states[i]
            committed = len(st.tokens) - 1
            caches[i].truncate(committed)  # only rows of target features stay
            st.session(self.lm).retain_final_from(committed)
            probs = torch.cat(q_rows[i]) if q_rows[i] else None
            drafts[i] = Draft(tokens[i], probs, catchup_s=step0_s if catchup[pos] else 0.0)
        return drafts

    def observe(
        self,
        states: list[DecodeState],
        drafts: list[Draft],
        target_logits: list[torch.Tensor],
        verdicts: list[Acceptance],
    ) -> None:
        pass
