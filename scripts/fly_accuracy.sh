#!/usr/bin/env bash
# Issue #15: FLy's task accuracy at scale on the 2-core CPU, in sequential parts.
#   bash scripts/fly_accuracy.sh [he] [sweep] [big] [big_exact] [he_theta]
#   (default: he sweep big; big includes big_exact)
#
#   he     HumanEval, all 164 problems, Qwen2.5-Coder-0.5B as target, at batch 8 (accuracy,
#          tau and the loose share; batch 8 decodes about 5x the tokens/s of batch 1 here):
#          fly_self (PLD k 8 + FLy, theta 0.3 normalized, W 3) with plain decoding of the same
#          problems in the same run; exact acceptance of the same drafter (pld); vLLM's gate
#          (acceptor=fly_vllm, W = min(6, k-1)).  ~56 min.
#   sweep  GSM8K (all 20 Spec-Bench math_reasoning questions of the dev split), 0.5B target,
#          batch 1 (speedup as a user sees it): a theta multirun of fly_self at W 3 (vLLM's
#          gate at W 6 is the other window), and exact pld; plain decoding from the baseline
#          cache, filled by the first job side by side and re-timed by every later job
#          (summary batch.baseline_drift).
#          The sweep folder gets sweep_summary.csv/.txt and the Pareto plot
#          sweep_pareto.png (accuracy vs speedup) from callbacks.sweep.  ~36 min.
#   big    the 1.5B as target, fly and fly_mla against plain decoding, HumanEval/0-23 at
#          batch 8, and exact sps (k 6, fp32 drafter as in fly) for tau.  ~22 min.
#   he_theta  (not in the default) HumanEval 164 at theta 0.6, W 3, the GSM8K sweep's
#          point that kept plain accuracy; plain decoding from he's run.  ~13 min.
#
# Summaries: python -m specflow.compare DIR ...; the Pareto plot again:
#   python -m callbacks.sweep SWEEP_DIR [RUN_DIR ...]
set -uo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
OUT=${BENCH_OUT:-outputs/fly15}
mkdir -p "$OUT"
step() { echo "== $1 ($(date +%H:%M:%S))"; }
run() { $PY run.py "$@" callbacks=none 2>&1 | grep -v "Loading weights" | grep -E "results:|Error|error|speedup"; }
parts=${*:-he sweep big}
has() { [[ " $parts " == *" $1 "* ]]; }

SMALL="model=qwen2.5-coder-0.5b runner.threads=2"
HE="workload=humaneval runner.max_new_tokens=384 runner.batch_size=8"
MATH=("workload.categories=[math_reasoning]" "workload.max_turns=1" "runner.max_new_tokens=384")

if has he; then
  step "HumanEval 164: fly_self vs plain (batch 8)"
  run +experiment=fly_self $SMALL $HE hydra.run.dir="$OUT/he_fly_self"
  step "HumanEval 164: pld exact (batch 8)"
  run +experiment=pld $SMALL $HE runner.baseline=false hydra.run.dir="$OUT/he_pld_exact"
  step "HumanEval 164: fly_self with vLLM's gate (batch 8)"
  run +experiment=fly_self acceptor=fly_vllm acceptor.window=null $SMALL $HE \
    runner.baseline=false hydra.run.dir="$OUT/he_fly_vllm"
fi

if has sweep; then
  B1="runner.batch_size=1 runner.baseline_cache=true runner.cache_dir=$OUT/cache"
  step "GSM8K: pld exact, filling the plain-decoding cache side by side (batch 1)"
  run +experiment=pld $SMALL "${MATH[@]}" $B1 hydra.run.dir="$OUT/math_sweep_ref/pld_exact"
  step "GSM8K: vLLM's gate (batch 1)"
  run +experiment=fly_self acceptor=fly_vllm acceptor.window=null $SMALL "${MATH[@]}" $B1 \
    hydra.run.dir="$OUT/math_sweep_ref/fly_vllm"
  step "GSM8K: theta multirun of fly_self at W 3 (batch 1)"
  run -m +experiment=fly_self acceptor.theta=0.3,0.6,0.9 acceptor.window=3 $SMALL \
    "${MATH[@]}" $B1 hydra.sweep.dir="$OUT/math_sweep"
  $PY -m callbacks.sweep "$OUT/math_sweep" "$OUT"/math_sweep_ref/*/
fi

if has big; then
  BIG=("workload=humaneval" "workload.limit=24" "runner.max_new_tokens=384" "runner.batch_size=8")
  step "HumanEval/0-23, 1.5B target: fly and fly_mla vs plain (batch 8)"
  run -m +experiment=fly,fly_mla runner.threads=2 "${BIG[@]}" hydra.sweep.dir="$OUT/he_big"
fi
if has big || has big_exact; then
  BIG=("workload=humaneval" "workload.limit=24" "runner.max_new_tokens=384" "runner.batch_size=8")
  step "HumanEval/0-23, 1.5B target: exact sps with k 6 (tau reference for fly)"
  run +experiment=sps drafter.k=6 drafter.model.dtype=float32 runner.threads=2 "${BIG[@]}" \
    runner.baseline=false hydra.run.dir="$OUT/he_big_sps_exact"
fi

if has he_theta; then
  step "HumanEval 164: fly_self at theta 0.6, W 3 (batch 8; plain decoding from he_fly_self)"
  run +experiment=fly_self acceptor.theta=0.6 $SMALL $HE runner.baseline=false \
    hydra.run.dir="$OUT/he_fly_self_t06"
fi
step done
