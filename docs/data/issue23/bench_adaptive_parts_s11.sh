#!/usr/bin/env bash
# #23 item 3, eleventh session: the adaptive draft length with one cost model per part of a
# fallback drafter (draft_length.by_part=true, the new default: prompt lookup's copies and the
# head / draft model each asked for their own length) against one model for both parts
# (by_part=false, the policy of §23.1) and against fixed k, in ONE process, interleaved
# request by request (scripts/bench_interleaved.py), side by side with plain decoding.
# Qwen2.5-Coder-1.5B, every model in fp32, 2 threads, greedy, 128 new tokens, the 12 held-out
# table questions (none trained on); no exit heads.  HEAD: the feature head (default: the
# installed three-epoch head, MAGPIE3).  Nothing else may run on the CPU meanwhile.
# resume=true: a rerun continues.
set -euo pipefail
cd "$(dirname "$0")/../../.."
HEADS=${HEADS:-null}
source docs/data/issue24/bench_common.sh
HEAD=${HEAD:-$MAGPIE3}
EAGLE_PLD="+experiment=eagle_pld drafter.then.head=$HEAD"
PLD_SPS="+experiment=pld_sps drafter.then.model.dtype=float32"
ADAPTIVE="draft_length=adaptive"
bench "${OUT:-outputs/issue23/adaptive_parts_s11}" "$TABLE_IDS" 128 \
  --method plain "+experiment=ar" \
  --method pld_sps "$PLD_SPS" \
  --method pld_sps_adaptive "$PLD_SPS $ADAPTIVE" \
  --method eagle_pld_chain "$EAGLE_PLD drafter.then.branches=1" \
  --method eagle_pld_adaptive "$EAGLE_PLD drafter.then.branches=1 drafter.then.k=3 $ADAPTIVE" \
  --method eagle_pld_adaptive_pooled \
    "$EAGLE_PLD drafter.then.branches=1 drafter.then.k=3 $ADAPTIVE draft_length.by_part=false" \
  --method eagle_pld "$EAGLE_PLD" \
  --method eagle_pld_tree_adaptive "$EAGLE_PLD $ADAPTIVE" \
  "$@"
