"""Autoregressive drafting with a model at one exit: the work of every model drafter."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specflow.errors import ConfigError
from specflow.models.base import LayeredLM
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

    Attributes:
        ids: ``[N]`` the vocabulary ids kept, ascending.
        weight: ``[N, H]`` their rows of the LM head.
        vocab_size: V, to scatter q back to the full vocabulary.
    """

    ids: torch.Tensor
    weight: torch.Tensor
    vocab_size: int

    @staticmethod
    def check_supported(lm: LayeredLM) -> None:
        """Raise ``ConfigError`` unless ``lm`` exposes an LM head to slice (native backend)."""
        if getattr(lm, "lm_head", None) is None or not hasattr(lm, "head_input"):
            raise ConfigError(
                f"drafter.vocab_subset needs the native backend (an LM head it can slice); "
                f"{lm.info.name} runs on another backend: set drafter.vocab_subset=null"
            )

    @classmethod
    def build(cls, lm: LayeredLM, top_ids: int, always: list[int]) -> SubVocabHead:
        """Keep ids ``0..top_ids-1`` plus ``always`` (e.g. the prompt's tokens and EOS).

        Byte-level BPE vocabularies (Qwen, Llama 3, SmolLM) number their tokens in merge
        order, so low ids are the frequent ones: ids < 32768 cover about 95 % of the tokens
        the Qwen2.5 and SmolLM2 models here generate on Spec-Bench.
        """
        cls.check_supported(lm)
        weight = lm.lm_head  # type: ignore[attr-defined]  # [V, H]
        vocab = lm.info.vocab_size
        extra = torch.tensor([t for t in always if 0 <= t < vocab], dtype=torch.long)
        ids = torch.cat([torch.arange(min(top_ids, vocab)), extra]).unique()  # sorted
        return cls(ids, weight.index_select(0, ids.to(weight.device)).contiguous(), vocab)

    def logits(self, lm: LayeredLM, hidden: torch.Tensor, exit_layer: int) -> torch.Tensor:
        """``h_exit [T, H] -> logits [T, N]`` (float32) over the subset."""
        x = lm.head_input(hidden, exit_layer)  # type: ignore[attr-defined]  # [T, H]
        return F.linear(x, self.weight).float()  # [T, N]

    def to_vocab(self, probs: torch.Tensor) -> torch.Tensor:
        """``[T, N]`` distributions over the subset -> ``[T, V]`` (zero outside it)."""
        full = probs.new_zeros(probs.shape[0], self.vocab_size)
        return full.index_copy_(1, self.ids, probs)


def draft_with_model(
    state: DecodeState,
    lm: LayeredLM,
    exit_layer: int,
    k: int,
    min_confidence: float = 0.0,
    subvocab: SubVocabHead | None = None,
) -> Draft:
    """Propose up to ``k`` tokens from ``lm`` at ``exit_layer``, one forward pass each.

    Drafting stops early when the drafter's top probability (temperature 1) falls below
    ``min_confidence`` (the token is still proposed: it is often right, and stopping after
    it saves the next, likelier-wrong steps).

    The model's session first syncs to the committed tokens: it catches up on tokens
    committed since it last ran and drops its rejected drafts.  Greedy: argmax, q = None;
    sampling: tokens drawn from the warped distributions, returned as q ``[k, V]``.
    With ``subvocab`` the drafter's head covers only that subset of the vocabulary.
    A catch-up of more than one position (the lazy prefill, or tokens committed while the
    drafter sat idle) runs first and is timed apart (``Draft.catchup_s``), so the time of
    the k drafting steps stays measurable; the usual one position left by the previous
    round (its bonus token) rides along with the first step, in one forward pass.
    """
    session = state.session(lm)
    session.set_tokens(state.tokens)
    catchup_s = 0.0
    behind = len(session.tokens) - 1 - session.computed(exit_layer - 1)
    if behind > 1:  # more than the usual one token of the previous round: a real catch-up
        start = time.perf_counter()
        session.hidden(exit_layer, len(session.tokens) - 1)  # computes only what is missing
        catchup_s = time.perf_counter() - start
    tokens: list[int] = []
    q_rows: list[torch.Tensor] = []
    for _ in range(k):
        n = len(session.tokens)
        if subvocab is None:
            logits = session.logits(exit_layer, n - 1, n)  # [1, V]
            ids, probs = choose(logits, state.sampling, state.generator)
        else:
            hidden = session.exit_hidden(exit_layer, n - 1, n)  # [1, H]
            logits = subvocab.logits(lm, hidden, exit_layer)  # [1, N]
            picked, probs = choose(logits, state.sampling, state.generator)
            ids = subvocab.ids[picked].tolist()
            probs = None if probs is None else subvocab.to_vocab(probs)  # [1, V]
        session.extend(ids)
        tokens += ids
        if probs is not None:
            q_rows.append(probs)
        if min_confidence > 0.0 and float(logits.softmax(-1).max()) < min_confidence:
            break
    return Draft(tokens, torch.cat(q_rows) if q_rows else None, catchup_s=catchup_s)
