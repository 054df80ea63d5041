#!/usr/bin/env bash
# #23: the head's chain length, k = 1 against k = 2, alone and inside eagle_pld (prompt lookup,
# else the head), on the 12 held-out questions of the table, 128 new tokens, one process,
# interleaved (scripts/bench_interleaved.py).  scripts/feature_head_sim.py predicted k = 1 to
# be as fast as k = 2 or faster on this CPU (a second draft token is accepted after a first
# one about a fifth of the time, and costs 0.075 of a step).  Every model in fp32.  Nothing
# else may run on the CPU meanwhile.
set -euo pipefail
cd "$(dirname "$0")/../../.."
source docs/data/issue24/bench_common.sh
bench "${OUT:-outputs/issue23/feature_k1}" "$TABLE_IDS" 128 \
  --method plain "+experiment=ar" \
  --method feature_k1 "+experiment=eagle drafter.head=$NEW_FT5 drafter.k=1" \
  --method feature_k2 "+experiment=eagle drafter.head=$NEW_FT5 drafter.k=2" \
  --method eagle_pld_k1 "+experiment=eagle_pld drafter.then.head=$NEW_FT5 drafter.then.k=1" \
  --method eagle_pld_k2 "+experiment=eagle_pld drafter.then.head=$NEW_FT5 drafter.then.k=2" \
  "$@"
