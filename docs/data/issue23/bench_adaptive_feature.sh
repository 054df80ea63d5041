#!/usr/bin/env bash
# #23 item 3, 2026-12-02 (second session): the adaptive draft length with the feature head
# against its best fixed k (2), after the cost model's beta refit (stages/draft_length.py),
# with and without idle_discount = 0.9.  One held-out question per category that the
# diagnosis of the policy (requests 245 and 485) did not use, 128 new tokens, greedy, fp32,
# one process, interleaved (scripts/bench_interleaved.py).  Nothing else may run on the CPU.
set -euo pipefail
cd "$(dirname "$0")/../../.."
source docs/data/issue24/bench_common.sh
HEAD=${HEAD:-$NEW_FT5}
EAGLE="+experiment=eagle drafter.head=$HEAD"
bench "${OUT:-outputs/issue23/adaptive_feature}" "$ADAPTIVE_IDS" 128 \
  --method plain "+experiment=ar" \
  --method eagle_k2 "$EAGLE drafter.k=2" \
  --method eagle_adaptive "$EAGLE drafter.k=3 draft_length=adaptive" \
  --method eagle_adaptive_idle "$EAGLE drafter.k=3 draft_length=adaptive draft_length.idle_discount=0.9" \
  "$@"
