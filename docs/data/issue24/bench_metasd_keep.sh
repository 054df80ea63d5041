#!/usr/bin/env bash
# #24: MetaSD with the bandit's statistics kept across requests (selector.reset=false) next to
# plain decoding and prompt lookup (the best arm of §14.2), the same 12 held-out questions,
# 128 new tokens, one process, interleaved (scripts/bench_interleaved.py).  Nothing else may
# run on the CPU meanwhile.
set -euo pipefail
cd "$(dirname "$0")/../../.."
source docs/data/issue24/bench_common.sh
bench "${OUT:-outputs/issue24/metasd_keep}" "$TABLE_IDS" 128 \
  --method plain "+experiment=ar" \
  --method pld "+experiment=pld" \
  --method metasd_keep "+experiment=metasd_feature drafter.drafters.feature.head=$FEATURE \
                        selector.reset=false" \
  "$@"
