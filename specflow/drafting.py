"""Autoregressive drafting with a model at one exit: the work of every model drafter."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specflow.catchup import sync_tokens
from specflow.cpu.int8_weights import PREFIX_ALIGN
from specflow.cpu.row_padding import row_prices
from specflow.errors import ConfigError
from specflow.kv.base import LayeredLM
from specflow.kv.session import forward_exit_hidden
from specflow.models.native import NativeLM
from specflow.sampling import choose
from specflow.state import DecodeState, Draft


@dataclass(frozen=True)
class SubVocabHead:
    """The LM head restricted to a subset of the vocabulary, for drafting (FR-Spec style).

    A draft step's LM head is a large share of a small drafter's cost (Qwen2.5-0.5B: 136M of
    its 494M weights).  Drafting over N << V tokens skips most of it.  Lossless: the target
    verifies every draft token; a token outside the subset is simply never proposed.  With
    sampling, q is the distribution actually sampled from (renormalized over the subset,
    zero elsewhere), which is what the rejection sampler needs.

    The subset is ids ``0..prefix-1`` (scored by the model's own head rows, a view:
    ``NativeLM.head_prefix``, through its int8 copy where the model runs one) followed by a
    request's ``extra`` ids above them (their rows copied, a few hundred at most), so
    ``logits = [head_prefix(x, prefix) | x @ extra_weight.T]`` and ``ids`` is ascending.

    Attributes:
        ids: ``[N]`` the vocabulary ids kept, ascending: ``0..prefix-1``, then the extras.
        prefix: how many of the lowest ids the model's head scores (a multiple of
            ``int8_weights.PREFIX_ALIGN``, possibly 0).
        extra_weight: ``[N - prefix, H]`` the LM head's rows of the other ids.
        vocab_size: V, to scatter q back to the full vocabulary.
    """

    ids: torch.Tensor
    prefix: int
    extra_weight: torch.Tensor
    vocab_size: int

    @staticmethod
    def check_supported(lm: LayeredLM) -> NativeLM:
        """``lm`` itself when it has an LM head to slice (the native backend); else
        ``ConfigError``."""
        if not isinstance(lm, NativeLM):
            raise ConfigError(
                f"drafter.vocab_subset needs the native backend (an LM head it can slice); "
                f"{lm.info.name} runs on another backend: set drafter.vocab_subset=null"
            )
        return lm

    @classmethod
    def build(cls, model: LayeredLM, top_ids: int, always: list[int]) -> SubVocabHead:
        """Keep ids ``0..top_ids-1`` plus ``always`` (e.g. the prompt's tokens and EOS).

        Byte-level BPE vocabularies (Qwen, Llama 3, SmolLM) number their tokens in merge
        order, so low ids are the frequent ones: ids < 32768 cover about 95 % of the tokens
        the Qwen2.5 and SmolLM2 models here generate on Spec-Bench.
        """
        lm = cls.check_supported(model)
        vocab = lm.info.vocab_size
        top = min(top_ids, vocab)
        prefix = top - top % PREFIX_ALIGN
        extra = [t for t in always if prefix <= t < vocab] + list(range(prefix, top))
        extra_ids = torch.tensor(sorted(set(extra)), dtype=torch.long)  # [E], all >= prefix
        ids = torch.cat([torch.arange(prefix), extra_ids])  # [N], ascending
        extra_weight = lm.head_rows(extra_ids)  # [E, H]
        return cls(ids, prefix, extra_weight, vocab)

    def logits(self, lm: NativeLM, hidden: torch.Tensor, exit_layer: int) -> torch.Tensor:
        """``h_exit [T, H] -> logits [T, N]`` (float32) over the subset."""
        x = lm.head_input(hidden, exit_layer)  # [T, H]
        parts = [lm.head_prefix(x, self.prefix)] if self.prefix else []  # [T, prefix]
        if self.extra_weight.shape[0]:
            parts.append(F.linear(x, self.extra_weight).float())  # [T, N - prefix]
        return torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]  # [T, N]

    def to_vocab(self, probs: torch.Tensor) -> torch.Tensor:
        """``[T, N]`` distributions over the subset -> ``[T, V]`` (zero outside it)."""
        full = probs.new_zeros(probs.shape[0], self.vocab_size)
        return full.index_copy_(1, self.ids, probs)


def catch_up_share(lm: LayeredLM, step_rows: int, pass_rows: int) -> float:
    """The catch-up's share of a drafting step's pass over ``pass_rows`` rows that would have
    been ``step_rows`` rows without it: ``1 - price(step_rows) / price(pass_rows)`` with
    ``lm``'s row prices (``row_prices``), ``1 - step_rows / pass_rows`` where it has none."""
    prices = row_prices(lm)
    if prices is None:
        return 1.0 - step_rows / pass_rows
    return 1.0 - prices(step_rows) / prices(pass_rows)


def draft_with_model(
    states: list[DecodeState],
    lm: LayeredLM,
    exit_layer: int,
    asked: list[int],
    min_confidence: float = 0.0,
    subvocabs: list[SubVocabHead | None] | None = None,
    window: int | None = None,
) -> list[Draft]:
    """Propose up to ``asked[i]`` tokens for each request from ``lm`` at ``exit_layer``.

    Drafting step j is ONE batched forward of one token for every request still drafting
    (``asked[i] > j``, not stopped).  A request stops early when the drafter's top probability
    (temperature 1) falls below ``min_confidence`` (the token is still proposed: it is
    often right, and stopping after it saves the next, likelier-wrong steps).

    Each request's session first syncs to its committed tokens (``sync_tokens``: its
    rejected drafts are dropped).  Greedy: argmax, q = None; sampling: tokens drawn from the
    warped distributions (each request's own generator), q ``[drafted, V]``.  With
    ``subvocabs[i]`` request i's head covers only that vocabulary subset.  With a context
    ``window`` the sessions hold the last ``window`` prompt tokens and what follows
    (``specflow.catchup``).

    Catch-up: the positions a session is behind (the lazy prefill, tokens committed while the
    drafter sat idle, the previous round's last draft token and bonus) ride along with the
    first step, in ONE forward pass of ``behind + 1`` rows per request: a pass of more rows
    costs less than two passes (the 0.5B's GGUF file on an AVX2 EPYC: 3 rows 46 ms, 2 rows
    and then 1 row 39 + 27 ms).
    Where a request was more than one position behind, the seconds of that pass (the
    requests' clock) are split, and the catch-up's share reported as ``Draft.catchup_s``,
    so the drafting steps' time stays comparable from round to round: of a pass over R rows
    that would have been r rows without the catch-up, ``1 - price(r) / price(R)`` with the
    drafter's own row prices (``row_prices``; ``1 - r / R`` where it has none).
    """
    subvocabs = subvocabs or [None] * len(states)
    sessions = [st.session(lm) for st in states]
    active = [i for i, n in enumerate(asked) if n > 0]
    behind = dict(zip(active, sync_tokens([states[i] for i in active], lm, exit_layer, window),
                      strict=True))
    late = [i for i in active if behind[i] > 1]  # more than the previous round's one position
    catchup_s = [0.0] * len(states)
    tokens: list[list[int]] = [[] for _ in states]
    q_rows: list[list[torch.Tensor]] = [[] for _ in states]
    model = sessions[0].model if sessions else lm
    step = 0
    while active:
        queries = [
            (sessions[i], exit_layer, len(sessions[i].tokens) - 1, len(sessions[i].tokens))
            for i in active
        ]
        if step == 0 and late:  # the pass that carries the catch-up, timed
            clock = states[active[0]].clock
            start = clock()
            hidden = forward_exit_hidden(queries)  # each [1, H]
            seconds = (clock() - start) * catch_up_share(
                model, sum(1 if behind[i] > 1 else behind[i] + 1 for i in active),
                sum(behind[i] + 1 for i in active))
            for i in late:
                catchup_s[i] = seconds
        else:
            hidden = forward_exit_hidden(queries)  # each [1, H]
        full = [j for j, i in enumerate(active) if subvocabs[i] is None]
        logits: list[torch.Tensor | None] = [None] * len(active)
        if full:
            h = hidden[full[0]] if len(full) == 1 else torch.cat([hidden[j] for j in full])
            rows = model.head(h, exit_layer).cpu()  # [F, V]
            for r, j in enumerate(full):
                logits[j] = rows[r : r + 1]
        still = []
        for j, i in enumerate(active):
            st, sub = states[i], subvocabs[i]
            if sub is None:
                row = logits[j]
                ids, probs = choose(row, st.sampling, st.generator)
            else:
                row = sub.logits(model, hidden[j], exit_layer).cpu()  # [1, N]
                picked, probs = choose(row, st.sampling, st.generator)
                ids = sub.ids[picked].tolist()
                probs = None if probs is None else sub.to_vocab(probs)  # [1, V]
            sessions[i].extend(ids)
            tokens[i] += ids
            if probs is not None:
                q_rows[i].append(probs)
            confident = min_confidence <= 0.0 or float(row.softmax(-1).max()) >= min_confidence
            if confident and asked[i] > step + 1:
                still.append(i)
        active = still
        step += 1
    return [
        Draft(t, torch.cat(q) if q else None, catchup_s=c)
        for t, q, c in zip(tokens, q_rows, catchup_s, strict=True)
    ]
