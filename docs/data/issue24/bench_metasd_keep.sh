#!/usr/bin/env bash
# #24: MetaSD with the bandit's statistics kept across requests (selector.reset=false) next to
# plain decoding and prompt lookup (the best arm of §14.2), the same 12 held-out questions,
# 128 new tokens, one process, interleaved (scripts/bench_interleaved.py).  Nothing else may
# run on the CPU meanwhile.
set -euo pipefail
cd "$(dirname "$0")/../../.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-outputs/issue24/metasd_keep}
HEADS=${HEADS:-outputs/heads/exits_4a7_14.safetensors}
FEATURE=${FEATURE:-outputs/train_heads/feature_sb_ft/feature_head.safetensors}
IDS="[101,125,173,197,245,269,341,365,413,437,485,509]"
$PY scripts/bench_interleaved.py --out "$OUT" \
  --common "model=qwen2.5-coder-1.5b model.exit_heads=$HEADS workload.ids=$IDS \
            workload.max_turns=1 runner.max_new_tokens=128 runner.threads=2 resume=true" \
  --method plain "+experiment=ar" \
  --method pld "+experiment=pld" \
  --method metasd_keep "+experiment=metasd_feature drafter.drafters.feature.head=$FEATURE \
                        selector.reset=false" \
  "$@"
