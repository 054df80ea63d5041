"""One entry point from a request's category to its task-accuracy metrics.

Categories (Spec-Bench names, plus ``humaneval``) and what they report, per request:

- ``math_reasoning`` (GSM8K): ``task/gsm8k_exact`` 0/1;
- ``humaneval``: ``task/pass@1`` 0/1 (greedy: the mean over problems is pass@1);
- ``translation`` (WMT14 de-en): ``task/bleu``, sentence BLEU 0-100;
- ``summarization`` (CNN/DM): ``task/rouge_l``, ROUGE-L F in [0, 1];
- ``rag`` (Natural Questions): ``task/answer_match`` 0/1, any acceptable short answer occurs;
- anything else (MT-bench chat categories, ``qa`` without references, MT-bench ``math`` /
  ``reasoning`` whose references are free-form notes for a judge): ``{}``.

:func:`aggregate_scores` turns per-request scores into run-level numbers: the mean of every
metric, the count per category, and the corpus BLEU of the translation requests
(``task/bleu_corpus``), which is the BLEU to quote (sentence BLEUs do not average to it).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

from specflow.tasks import text_metrics
from specflow.tasks.gsm8k import gsm8k_correct

GSM8K_EXACT = "task/gsm8k_exact"
PASS_AT_1 = "task/pass@1"
BLEU = "task/bleu"
BLEU_CORPUS = "task/bleu_corpus"
ROUGE_L = "task/rouge_l"
ANSWER_MATCH = "task/answer_match"

SCORED_CATEGORIES = ("math_reasoning", "humaneval", "translation", "summarization", "rag")


def first_reference(reference: Any) -> Any:
    """The reference of the first turn: Spec-Bench stores one reference per turn in a list
    (``["... #### 18"]``; for RAG ``[["answer", "alias"]]``). A plain string is returned as is."""
    if isinstance(reference, (list, tuple)):
        return reference[0] if reference else None
    return reference


def _need_text(category: str, reference: Any) -> str:
    if not isinstance(reference, str):
        raise TypeError(f"category {category!r} needs a reference string, got {reference!r}")
    return reference


def score_request(
    category: str,
    output: str,
    reference: str | Sequence[Any] | None,
    problem: dict | None = None,
    timeout_s: float = 5.0,
) -> dict[str, float]:
    """Task metrics of one request's ``output``: see the module docstring for the mapping.

    ``reference`` may be a string or Spec-Bench's per-turn list (the first turn is used);
    ``problem`` is the HumanEval problem dict, needed for ``humaneval`` only (its code runs in
    a sandboxed subprocess for at most ``timeout_s`` seconds).
    """
    reference = first_reference(reference)
    if category == "math_reasoning":
        return {GSM8K_EXACT: float(gsm8k_correct(output, _need_text(category, reference)))}
    if category == "humaneval":
        if problem is None:
            raise ValueError("category 'humaneval' needs the problem dict (problem=...)")
        from specflow.tasks import humaneval

        code = humaneval.extract_code(problem, output)
        return {PASS_AT_1: float(humaneval.check_correctness(problem, code, timeout_s))}
    if category == "translation":
        return {BLEU: text_metrics.sentence_bleu(output.strip(), _need_text(category, reference))}
    if category == "summarization":
        return {ROUGE_L: text_metrics.rouge_l(output, _need_text(category, reference))}
    if category == "rag":
        if reference is None:
            return {}
        return {ANSWER_MATCH: float(text_metrics.answer_match(output, reference))}
    return {}


def aggregate_scores(
    records: Iterable[tuple[str, dict[str, float], str, Any]],
) -> dict[str, float]:
    """Run-level task metrics from ``(category, scores, output, reference)`` per request.

    Returns the mean of every metric over the requests that have it (keyed by the metric's
    name, e.g. ``task/gsm8k_exact``), ``task/n/<category>`` for each scored category, and
    ``task/bleu_corpus`` over the translation requests. Unscored requests are ignored.
    """
    sums: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    per_category: dict[str, int] = defaultdict(int)
    hypotheses: list[str] = []
    references: list[str] = []
    for category, scores, output, reference in records:
        if not scores:
            continue
        per_category[category] += 1
        for name, value in scores.items():
            sums[name] += float(value)
            counts[name] += 1
        if category == "translation":
            hypotheses.append(output.strip())
            references.append(_need_text(category, first_reference(reference)))
    summary = {name: sums[name] / counts[name] for name in sorted(sums)}
    summary.update({f"task/n/{cat}": float(n) for cat, n in sorted(per_category.items())})
    if hypotheses:
        summary[BLEU_CORPUS] = text_metrics.corpus_bleu(hypotheses, references)
    return summary
