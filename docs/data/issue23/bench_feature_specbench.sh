#!/usr/bin/env bash
# #23: the feature head trained on local text alone against the same head fine-tuned on the
# Spec-Bench dev questions that are not held out (train_heads head.data.specbench_train),
# as drafters of Qwen2.5-Coder-1.5B with the adaptive draft length (k <= 6), side by side
# with plain decoding (runner.baseline_cache=false: each request's plain decoding is
# re-measured right before the method decodes it).  Two held-out Spec-Bench questions per
# category (held out by both heads), first turn, 64 new tokens, greedy, fp32, 2 threads.
set -euo pipefail
cd "$(dirname "$0")/../../.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-outputs/issue23/bench_feature_specbench}
OLD=${OLD:-$HOME/.cache/specflow/heads/qwen2.5-coder-1.5b/feature_head.safetensors}
NEW=${NEW:-outputs/train_heads/feature_sb_ft/feature_head.safetensors}
IDS="[101,125,173,197,245,269,341,365,413,437,485,509]"
$PY run.py -m +experiment=eagle "drafter.head=$OLD,$NEW" draft_length=adaptive drafter.k=6 \
  "workload.ids=$IDS" workload.max_turns=1 runner.max_new_tokens=64 runner.baseline_cache=false \
  runner.threads=2 hydra.sweep.dir="$OUT" 'hydra.sweep.subdir=${hydra.job.num}'
$PY -m specflow.compare "$OUT"/0 "$OUT"/1 | tee "$OUT/compare.txt"
