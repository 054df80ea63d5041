#!/usr/bin/env bash
# Before/after of an engine change on this machine, in one go, interleaved A B B A: the
# HF comparison (scripts/bench_vs_hf.py: ours plain / pld / pld+adaptive vs HF generate
# plain / prompt lookup, side by side in one process) and the batch-size scaling
# (scripts/bench_batch.py) run in the BEFORE checkout, then in this one, then in this one
# again, then in BEFORE.  Each script prints ratios measured within its own run, so machine
# drift between the runs does not enter a ratio.  Nothing else may run on the CPU meanwhile.
#
#   git worktree add /tmp/before <commit> && bash scripts/bench_before_after.sh /tmp/before [AFTER]
#
# AFTER defaults to this checkout (give a worktree of the commit to measure while editing).
# Output: one log per run under ${OUT:-outputs/benchmarks/before_after}/.
set -euo pipefail
cd "$(dirname "$0")/.."
BEFORE=$(cd "$1" && pwd)
PY=${PY:-$(pwd)/.venv/bin/python}
AFTER=$(cd "${2:-.}" && pwd)
OUT=${OUT:-outputs/benchmarks/before_after}
mkdir -p "$OUT"
MODEL=${MODEL:-smollm2-135m}
VS_HF="--target $MODEL --drafter= --prompts 4 --max-new-tokens 48 --repeats 3"
BATCH="--model $MODEL --prompts 8 --tokens 32 --batches 1,8 --repeats 3"
run() {  # run TREE NAME
  local tree=$1 name=$2
  echo "== $name: $tree ($(date +%H:%M:%S), load $(cut -d' ' -f1 /proc/loadavg))" | tee -a "$OUT/$name.log"
  (cd "$tree" && $PY scripts/bench_vs_hf.py $VS_HF) 2>&1 | grep -v "^\[" | tee -a "$OUT/$name.log"
  (cd "$tree" && $PY scripts/bench_batch.py $BATCH) 2>&1 | grep -v "^\[" | tee -a "$OUT/$name.log"
}
rm -f "$OUT"/before.log "$OUT"/after.log
run "$BEFORE" before
run "$AFTER" after
run "$AFTER" after
run "$BEFORE" before
