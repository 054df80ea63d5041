#!/usr/bin/env bash
# #23 item 3, 2026-12-02 (third session): the adaptive draft length with a per-position
# acceptance model (draft_length.acceptance=per_position, stages/draft_length.py) against the
# geometric one and the head's fixed k = 1 and k = 2, on the six questions of
# bench_adaptive_feature.sh (one held-out question per category), 128 new tokens, greedy,
# fp32, one process, interleaved (scripts/bench_interleaved.py); the models at their default
# model.min_rows (null: padded to the probed row count).  Nothing else may run on the
# CPU.
set -euo pipefail
cd "$(dirname "$0")/../../.."
source docs/data/issue24/bench_common.sh
HEAD=${HEAD:-$NEW_FT5}
EAGLE="+experiment=eagle drafter.head=$HEAD"
ADAPTIVE="draft_length=adaptive draft_length.idle_discount=0.9"
bench "${OUT:-outputs/issue23/adaptive_position}" "$ADAPTIVE_IDS" 128 \
  --method plain "+experiment=ar" \
  --method eagle_k1 "$EAGLE drafter.k=1" \
  --method eagle_k2 "$EAGLE drafter.k=2" \
  --method eagle_adaptive_geometric "$EAGLE drafter.k=3 $ADAPTIVE" \
  --method eagle_adaptive_position "$EAGLE drafter.k=3 $ADAPTIVE draft_length.acceptance=per_position" \
  "$@"
