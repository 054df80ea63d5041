#!/usr/bin/env bash
# The benchmarks of the closing notes of #9 (adaptive), #6 (MetaSD), #3 (FLy) and #5
# (HiSpec / self-spec), in one sequential go on a quiet machine (~1 h 30 min on 2 CPU
# cores).  Qwen2.5-Coder-1.5B target everywhere; greedy; every run also measures (or reuses
# from the baseline cache) plain decoding of the same requests on this machine.
#   bash scripts/bench_issues.sh [w1] [pld9] [sps9] [metasd] [metasd_bd] [metasd_run] [fly]
#                                [fly_long] [hispec] [vocab] [control]
#   (default: w1 fly hispec vocab; w1 = pld9 sps9 metasd)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
OUT=${BENCH_OUT:-outputs/benchmarks/issues}
mkdir -p "$OUT"
step() { echo "== $1 ($(date +%H:%M:%S))"; }
run() { $PY run.py "$@" 2>&1 | grep -v "Loading weights" | grep -E "results:|Error|error|speedup" ; }
parts=${*:-w1 fly hispec vocab}
has() { [[ " $parts " == *" $1 "* ]]; }

# This 2-core VM's speed drifts by up to ~40 % over minutes (same prefill: 1.4 s, later 2.0 s),
# so every run re-measures plain decoding request by request, interleaved with the method
# (runner.baseline_cache=false): each speedup is a side-by-side ratio.
NC="runner.baseline_cache=false"
# W1: every Spec-Bench category, 1 request each, first turn, 64 new tokens.
W1="model=qwen2.5-coder-1.5b workload.per_category=1 workload.max_turns=1 runner.max_new_tokens=64 $NC"
if has w1 || has pld9; then
  step "#9: pld, fixed vs adaptive draft length"
  run -m +experiment=pld draft_length=fixed,adaptive $W1 hydra.sweep.dir="$OUT/w1_pld"
fi
if has w1 || has sps9; then
  step "#9: sps, fixed vs adaptive draft length"
  run -m +experiment=sps draft_length=fixed,adaptive $W1 hydra.sweep.dir="$OUT/w1_sps"
fi
if has w1 || has metasd; then
  step "#6: MetaSD, block divergence (bd) and block efficiency (be)"
  run -m +experiment=metasd,metasd_be $W1 hydra.sweep.dir="$OUT/w1_metasd"
  step "#6: the pool's other arms alone (arm 0 = pld fixed, arm 1 = sps fixed above)"
  run -m +experiment=metasd selector=fixed selector.arm=2,3 $W1 hydra.sweep.dir="$OUT/w1_arms"
  for m in 0 1; do  # sweep job folders are <job number>_<overrides>
    $PY -m specflow.oracle "$OUT"/w1_pld/0_* "$OUT"/w1_sps/0_* "$OUT"/w1_arms/0_* \
      "$OUT"/w1_arms/1_* --metasd "$OUT"/w1_metasd/${m}_* --by speedup \
      | tee "$OUT/w1_oracle_$m.txt"
  done
fi

# FLy: GSM8K-style math (Spec-Bench math_reasoning) and HumanEval, k = 6 for every method
# (fly / fly_mla set k = 6; sps gets drafter.k=6 in its own run: a multirun cannot override
# a key that the primary config's drafter lacks).
F="model=qwen2.5-coder-1.5b runner.max_new_tokens=160 $NC"
MATH=("workload.categories=[math_reasoning]" "workload.per_category=3")  # quoted: [] globs
CODE=("workload=humaneval" "workload.limit=3")
if has fly; then
  step "#3: sps vs fly vs fly_mla on math_reasoning"
  run -m +experiment=fly,fly_mla $F "${MATH[@]}" hydra.sweep.dir="$OUT/fly_math"
  run +experiment=sps drafter.k=6 $F "${MATH[@]}" hydra.run.dir="$OUT/fly_math/2_sps"
  step "#3: sps vs fly vs fly_mla on HumanEval"
  run -m +experiment=fly,fly_mla $F "${CODE[@]}" hydra.sweep.dir="$OUT/fly_code"
  run +experiment=sps drafter.k=6 $F "${CODE[@]}" hydra.run.dir="$OUT/fly_code/2_sps"
  $PY -m specflow.compare "$OUT"/fly_math/*/ | tee "$OUT/fly_math_compare.txt"
  $PY -m specflow.compare "$OUT"/fly_code/*/ | tee "$OUT/fly_code_compare.txt"
fi

# GSM8K answers need ~200-300 tokens to reach the final number: FLy vs plain decoding only.
if has fly_long; then
  step "#3: fly vs plain decoding on math_reasoning, 320 new tokens"
  run +experiment=fly model=qwen2.5-coder-1.5b runner.max_new_tokens=320 $NC "${MATH[@]}" \
    hydra.run.dir="$OUT/fly_math_long/0_fly"
fi

# HiSpec vs self-spec (same L_d = 4) vs sps on the exit heads' held-out prompts.
if has hispec; then
  ids=$($PY -c "import json,pathlib;p=pathlib.Path.home()/'.cache/specflow/heads/qwen2.5-coder-1.5b/heads.json';print(','.join(json.loads(p.read_text())['extra']['eval_prompt_ids']))")
  step "#5: self_spec vs hispec vs sps on held-out prompts"
  run -m +experiment=self_spec,hispec,sps "workload.ids=[$ids]" workload.per_category=1 \
    workload.max_turns=1 runner.max_new_tokens=64 $NC hydra.sweep.dir="$OUT/hispec"
  $PY -m specflow.compare "$OUT"/hispec/*/ | tee "$OUT/hispec_compare.txt"
fi

if has vocab; then
  step "#9: sps drafting over a 32k-token vocabulary subset (W1)"
  run -m +experiment=sps drafter.vocab_subset=32768 $W1 \
    hydra.sweep.dir="$OUT/w1_sps_vocab"
fi
if has metasd_bd; then
  step "#6: MetaSD (bd) alone"
  run -m +experiment=metasd $W1 hydra.sweep.dir="$OUT/w1_metasd_bd"
fi
if has metasd_run; then
  step "#6: MetaSD (bd) keeping the bandit across requests, smaller exploration (c=0.3)"
  run -m +experiment=metasd selector.reset=false selector.c=0.3 $W1 \
    hydra.sweep.dir="$OUT/w1_metasd_run"
fi
if has control; then
  step "noise control: plain decoding measured against itself (ar vs its own baseline)"
  run +experiment=ar $W1 hydra.run.dir="$OUT/w1_control/0_ar"
fi
if has w1 || has metasd || has vocab; then
  $PY -m specflow.compare "$OUT"/w1_*/*/ | tee "$OUT/w1_compare.txt"
fi
step done
