#!/usr/bin/env bash
# #23 item 3, 2026-12-02 (second session): the adaptive draft length (with idle_discount 0.9)
# on eagle_pld (prompt lookup, else the feature head at k = 2) against eagle_pld's fixed
# lengths, on the six held-out questions of bench_adaptive_feature.sh, 128 new tokens, greedy,
# fp32, one process, interleaved.  Nothing else may run on the CPU.
set -euo pipefail
cd "$(dirname "$0")/../../.."
source docs/data/issue24/bench_common.sh
HEAD=${HEAD:-$NEW_FT5}
EAGLE_PLD="+experiment=eagle_pld drafter.then.head=$HEAD"
bench "${OUT:-outputs/issue23/adaptive_eagle_pld}" "$ADAPTIVE_IDS" 128 \
  --method plain "+experiment=ar" \
  --method eagle_pld "$EAGLE_PLD" \
  --method eagle_pld_adaptive_idle "$EAGLE_PLD draft_length=adaptive draft_length.idle_discount=0.9" \
  "$@"
