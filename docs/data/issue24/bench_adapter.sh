#!/usr/bin/env bash
# #24: self-speculation from exit 7 of Qwen2.5-Coder-1.5B, the position-wise mlp head against
# the attention adapter, side by side with plain decoding (runner.baseline_cache=false: each
# request's plain decoding is re-measured right before the method decodes it).  Two held-out
# Spec-Bench questions per category (none of them trained on by any head), first turn, 64
# new tokens, greedy, fp32, 2 threads.  Nothing else may run on the CPU meanwhile.
set -euo pipefail
cd "$(dirname "$0")/../../.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-outputs/issue24/bench_adapter}
MLP=${MLP:-outputs/train_heads/exit7_feature_all/heads.safetensors}
ADAPTER=${ADAPTER:-outputs/train_heads/adapter7_all/heads.safetensors}
IDS="[101,125,173,197,245,269,341,365,413,437,485,509]"
COMMON=("workload.ids=$IDS" workload.max_turns=1 runner.max_new_tokens=64
        runner.baseline_cache=false runner.threads=2 drafter.exit_layer=7
        drafter.vocab_subset=32768)
$PY run.py -m +experiment=self_spec "model.exit_heads=$MLP,$ADAPTER" drafter.k=2 "${COMMON[@]}" \
  hydra.sweep.dir="$OUT/k2" 'hydra.sweep.subdir=${hydra.job.num}'
$PY run.py +experiment=self_spec "model.exit_heads=$ADAPTER" draft_length=adaptive drafter.k=4 \
  "${COMMON[@]}" hydra.run.dir="$OUT/adaptive_adapter"
$PY -m specflow.compare "$OUT"/k2/0 "$OUT"/k2/1 "$OUT"/adaptive_adapter | tee "$OUT/compare.txt"
