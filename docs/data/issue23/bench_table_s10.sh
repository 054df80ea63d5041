#!/usr/bin/env bash
# #23's per-category table, tenth session, in ONE process, interleaved request by request
# (scripts/bench_interleaved.py), side by side with plain decoding: plain, pld_sps (prompt
# lookup, else the 0.5B, fp32), the feature head alone (a chain of k = 2, and the adaptive
# draft length up to k = 3), and eagle_pld (prompt lookup, else the head) with a chain, with
# its default trees=measured, and with the adaptive draft length.
# Qwen2.5-Coder-1.5B, every model in fp32, 2 threads, greedy, 128 new tokens, the 12 held-out
# table questions (none trained on); no exit heads.  HEAD: the feature head (default: the
# five-epoch head of train_heads/README.md).  Nothing else may run on the CPU meanwhile.
# resume=true: a rerun continues.
set -euo pipefail
cd "$(dirname "$0")/../../.."
HEADS=${HEADS:-null}
source docs/data/issue24/bench_common.sh
HEAD=${HEAD:-$MAGPIE3_E5}
EAGLE="+experiment=eagle drafter.head=$HEAD"
EAGLE_PLD="+experiment=eagle_pld drafter.then.head=$HEAD"
bench "${OUT:-outputs/issue23/table_s10}" "$TABLE_IDS" 128 \
  --method plain "+experiment=ar" \
  --method pld_sps "+experiment=pld_sps drafter.then.model.dtype=float32" \
  --method eagle_k2 "$EAGLE drafter.k=2" \
  --method eagle_adaptive "$EAGLE drafter.k=3 draft_length=adaptive" \
  --method eagle_pld_chain "$EAGLE_PLD drafter.then.branches=1" \
  --method eagle_pld "$EAGLE_PLD" \
  --method eagle_pld_adaptive "$EAGLE_PLD drafter.then.branches=1 draft_length=adaptive" \
  "$@"
