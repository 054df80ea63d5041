#!/usr/bin/env bash
# The same two feature heads as bench_feature_specbench.sh, fixed k = 3 (no draft-length
# policy: every round drafts, so τ and acceptance show the heads' difference directly).
set -euo pipefail
cd "$(dirname "$0")/../../.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-outputs/issue23/bench_feature_specbench_k3}
OLD=${OLD:-$HOME/.cache/specflow/heads/qwen2.5-coder-1.5b/feature_head.safetensors}
NEW=${NEW:-outputs/train_heads/feature_sb_ft/feature_head.safetensors}
IDS="[101,125,173,197,245,269,341,365,413,437,485,509]"
$PY run.py -m +experiment=eagle "drafter.head=$OLD,$NEW" drafter.k=3 \
  "workload.ids=$IDS" workload.max_turns=1 runner.max_new_tokens=64 runner.baseline_cache=false \
  runner.threads=2 hydra.sweep.dir="$OUT" 'hydra.sweep.subdir=${hydra.job.num}'
$PY -m specflow.compare "$OUT"/0 "$OUT"/1 | tee "$OUT/compare.txt"
