#!/usr/bin/env bash
# #23, tenth session: the five-epoch feature head (46.1 % held out) against the three-epoch
# head of the same data (43.8 %) in ONE process, interleaved request by request
# (scripts/bench_interleaved.py), side by side with plain decoding: each head alone (a chain of
# k = 2) and inside eagle_pld (prompt lookup first, then the head; a chain).
# Qwen2.5-Coder-1.5B, every model in fp32, 2 threads, greedy, 128 new tokens, the 12 held-out
# table questions (none trained on); no exit heads.  Nothing else may run on the CPU meanwhile.
# resume=true: a rerun continues.
set -euo pipefail
cd "$(dirname "$0")/../../.."
HEADS=${HEADS:-null}
source docs/data/issue24/bench_common.sh
bench "${OUT:-outputs/issue23/heads_ab_s10}" "$TABLE_IDS" 128 \
  --method plain "+experiment=ar" \
  --method eagle_k2_3ep "+experiment=eagle drafter.head=$MAGPIE3 drafter.k=2" \
  --method eagle_k2_5ep "+experiment=eagle drafter.head=$MAGPIE3_E5 drafter.k=2" \
  --method eagle_pld_chain_3ep "+experiment=eagle_pld drafter.then.head=$MAGPIE3 drafter.then.branches=1" \
  --method eagle_pld_chain_5ep "+experiment=eagle_pld drafter.then.head=$MAGPIE3_E5 drafter.then.branches=1" \
  "$@"
