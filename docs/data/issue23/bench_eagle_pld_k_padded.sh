#!/usr/bin/env bash
# eagle_pld's head chain (drafter.then.k = 1 or 2) at the padded default (model.min_rows=null:
# the probed row count), next to padded plain decoding, on the 12 held-out questions of the
# table, 128 new tokens, greedy, one process, interleaved (scripts/bench_interleaved.py).
# Every model in fp32.  Nothing else may run on the CPU meanwhile.
set -euo pipefail
cd "$(dirname "$0")/../../.."
source docs/data/issue24/bench_common.sh
bench "${OUT:-outputs/issue23/eagle_pld_k_padded}" "$TABLE_IDS" 128 \
  --method plain "+experiment=ar" \
  --method eagle_pld_k1 "+experiment=eagle_pld drafter.then.head=$NEW_FT5 drafter.then.k=1" \
  --method eagle_pld_k2 "+experiment=eagle_pld drafter.then.head=$NEW_FT5 drafter.then.k=2" \
  "$@"
