#!/usr/bin/env bash
# #24 on eight times the in-domain data (2026-12-02, seventh session): the exit heads of exits 4
# and 7 trained on the feature head's 135,745 cached positions (Spec-Bench training answers +
# 760 self-written prompts answered by the target; train_heads/README.md, "Exit heads on eight
# times the in-domain data"), and the feature head of §19 (42.2 %). Side by side with plain
# decoding in ONE process, interleaved request by request (scripts/bench_interleaved.py):
# self_spec and hispec as their configs say (exit 4; 4 -> 7), MetaSD's five-arm pool with the
# cost-aware reward (metasd_feature_rate of §16.1) and every one of its arms alone, and
# eagle_pld (the fastest single pipeline, §19) for reference.  Qwen2.5-Coder-1.5B, every model
# in fp32, 2 threads, greedy, 128 new tokens, the 12 held-out questions of §14.2 (none trained
# on by any head).  Nothing else may run on the CPU meanwhile.  resume=true: a rerun continues.
set -euo pipefail
cd "$(dirname "$0")/../../.."
HEADS=${HEADS:-outputs/train_heads/mlp47_magpie/heads.safetensors}
source docs/data/issue24/bench_common.sh
HEAD=${HEAD:-outputs/train_heads/feature_magpie2/feature_head.safetensors}
bench "${OUT:-outputs/issue24/table_s7}" "$TABLE_IDS" 128 \
  --method plain "+experiment=ar" \
  --method pld "+experiment=pld" \
  --method sps_0.5b "+experiment=sps drafter.model.dtype=float32" \
  --method sps_pld "+experiment=sps_pld" \
  --method feature "+experiment=eagle drafter.head=$HEAD drafter.k=2" \
  --method self_spec "+experiment=self_spec" \
  --method hispec "+experiment=hispec" \
  --method metasd_feature_rate "+experiment=metasd_feature $RATE \
drafter.drafters.feature.head=$HEAD drafter.drafters.feature.k=2" \
  --method eagle_pld "+experiment=eagle_pld drafter.then.head=$HEAD drafter.then.branches=1" \
  "$@"
