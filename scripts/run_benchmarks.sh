#!/usr/bin/env bash
# The measurements behind docs/benchmarks.md, in one go (run on a quiet machine; ~1 h on
# 2 CPU cores).  Each step prints its table and appends it to benchmarks/<name>.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
OUT=${BENCH_OUT:-outputs/benchmarks}
mkdir -p "$OUT"
step() { echo "== $1 ($(date +%H:%M))"; }

step "1. ours vs HF generate (Qwen2.5-Coder 1.5B target, 0.5B drafter)"
$PY scripts/bench_vs_hf.py --target qwen2.5-coder-1.5b --drafter qwen2.5-coder-0.5b \
  --prompts 3 --max-new-tokens 40 --repeats 2 --out "$OUT/vs_hf.json" 2>&1 \
  | grep -v "Loading weights" | tee "$OUT/vs_hf.txt"

step "2. fixed vs adaptive draft length, every Spec-Bench category (pld, sps)"
$PY run.py -m +experiment=pld,sps model=qwen2.5-coder-1.5b draft_length=fixed,adaptive \
  workload.per_category=1 runner.max_new_tokens=48 callbacks=none \
  hydra.sweep.dir="$OUT/adaptive" 2>&1 | grep -v "Loading weights" | tee "$OUT/adaptive.txt"

step "3. per-category comparison of the adaptive sweep"
$PY -m specflow.compare "$OUT"/adaptive/*/ 2>&1 | tee "$OUT/adaptive_compare.txt"

step "4. batched decoding throughput vs batch size (SmolLM2-135M)"
$PY scripts/bench_batch.py --prompts 8 --tokens 32 --repeats 1 2>&1 \
  | grep -v "Loading weights" | tee "$OUT/batch.txt"
