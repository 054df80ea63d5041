#!/usr/bin/env bash
# Tree drafting with the feature head (drafter.branches, #23 item 2), at the padded default
# (model.min_rows=null: the probed row count), next to padded plain decoding, on the 12
# held-out questions of the table, 128 new tokens, greedy, one process, interleaved
# (scripts/bench_interleaved.py).  Chains against trees of the same verify rows: a tree of
# m x d = 4 nodes is verified in 5 rows, the probed row count on the AVX-512 EPYC, where a
# chain of 2 is padded to 5 rows anyway.  Every model in fp32.  Nothing else may run on the
# CPU meanwhile.
set -euo pipefail
cd "$(dirname "$0")/../../.."
source docs/data/issue24/bench_common.sh
bench "${OUT:-outputs/issue23/tree}" "${IDS:-$TABLE_IDS}" 128 \
  --method plain "+experiment=ar" \
  --method eagle_pld_k2 "+experiment=eagle_pld drafter.then.head=$NEW_FT5 drafter.then.k=2" \
  --method eagle_pld_t2x2 "+experiment=eagle_pld drafter.then.head=$NEW_FT5 drafter.then.k=2 drafter.then.branches=2" \
  --method eagle_pld_t4x1 "+experiment=eagle_pld drafter.then.head=$NEW_FT5 drafter.then.k=1 drafter.then.branches=4" \
  --method feature_k1 "+experiment=eagle drafter.head=$NEW_FT5 drafter.k=1" \
  --method feature_t4x1 "+experiment=eagle drafter.head=$NEW_FT5 drafter.k=1 drafter.branches=4" \
  "$@"
