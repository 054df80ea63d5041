"""Reference-based text metrics: BLEU (sacrebleu), ROUGE (rouge-score), short-answer match.

BLEU is on the 0-100 scale sacrebleu reports (default 13a tokenisation, sentence BLEU with
exponential smoothing and effective order); ROUGE F-measures are in [0, 1] (Porter stemming).
The short-answer match (SQuAD-style normalisation: lower case, no punctuation or articles) is
for Spec-Bench's RAG questions, whose references are lists of acceptable Natural Questions
answers. sacrebleu and rouge-score are Apache-2.0.
"""

from __future__ import annotations

import re
import string
from collections.abc import Sequence
from functools import lru_cache

import sacrebleu

ROUGE_TYPES = ("rouge1", "rouge2", "rougeL")


def _reference_streams(references: Sequence[str] | Sequence[Sequence[str]]) -> list[list[str]]:
    """sacrebleu's layout (one stream per reference set) from one reference, or a list of
    references, per hypothesis."""
    per_hyp = [[ref] if isinstance(ref, str) else list(ref) for ref in references]
    width = max((len(refs) for refs in per_hyp), default=1)
    # Hypotheses with fewer references are padded with None, which sacrebleu skips.
    return [[refs[i] if i < len(refs) else None for refs in per_hyp] for i in range(width)]


def corpus_bleu(
    hypotheses: Sequence[str], references: Sequence[str] | Sequence[Sequence[str]]
) -> float:
    """Corpus BLEU (0-100) of ``hypotheses`` against one reference (or a list) each."""
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references")
    if not hypotheses:
        return 0.0
    return float(sacrebleu.corpus_bleu(list(hypotheses), _reference_streams(references)).score)


def sentence_bleu(hypothesis: str, reference: str | Sequence[str]) -> float:
    """Sentence BLEU (0-100, smoothed) of one hypothesis against one reference or a list."""
    refs = [reference] if isinstance(reference, str) else list(reference)
    return float(sacrebleu.sentence_bleu(hypothesis, refs).score)


@lru_cache(maxsize=1)
def _rouge_scorer():
    from rouge_score import rouge_scorer  # imports nltk: keep it off the import path

    return rouge_scorer.RougeScorer(list(ROUGE_TYPES), use_stemmer=True)


def rouge(prediction: str, reference: str) -> dict[str, float]:
    """ROUGE-1, ROUGE-2 and ROUGE-L F-measures in [0, 1], keyed ``rouge1``, ``rouge2``,
    ``rougeL``."""
    scores = _rouge_scorer().score(reference, prediction)
    return {name: float(scores[name].fmeasure) for name in ROUGE_TYPES}


def rouge_l(prediction: str, reference: str) -> float:
    """ROUGE-L F-measure in [0, 1]."""
    return rouge(prediction, reference)["rougeL"]


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower case, drop punctuation and articles, squeeze whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def answer_match(output: str, answers: str | Sequence[str]) -> bool:
    """True when any acceptable answer occurs (normalised) in the output."""
    candidates = [answers] if isinstance(answers, str) else list(answers)
    haystack = f" {normalize_answer(output)} "
    for answer in candidates:
        needle = normalize_answer(answer)
        if needle and f" {needle} " in haystack:
            return True
    return False
