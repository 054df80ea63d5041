#!/usr/bin/env bash
# #24 (and #23): every drafter that lives in the target, the pool that picks among them, and
# the arms alone, side by side with plain decoding in ONE process, interleaved request by
# request (scripts/bench_interleaved.py: request i by every method, order rotated per
# request, then request i + 1).  Qwen2.5-Coder-1.5B, fp32, 2 threads, greedy, 128 new tokens,
# two held-out Spec-Bench questions per category (none trained on by any head), first turn.
# self_spec, hispec and metasd's exit arm as their configs say: the exits chosen by
# choose_exits.sh.  Nothing else may run on the CPU meanwhile.  resume=true: a rerun continues where it stopped.
set -euo pipefail
cd "$(dirname "$0")/../../.."
source docs/data/issue24/bench_common.sh
bench "${OUT:-outputs/issue24/table128}" "$TABLE_IDS" 128 \
  --method plain "+experiment=ar" \
  --method pld "+experiment=pld" \
  --method sps_0.5b "+experiment=sps" \
  --method eagle "+experiment=eagle drafter.head=$FEATURE draft_length=adaptive drafter.k=6" \
  --method self_spec "+experiment=self_spec" \
  --method hispec "+experiment=hispec" \
  --method metasd "+experiment=metasd_feature drafter.drafters.feature.head=$FEATURE" \
  "$@"
