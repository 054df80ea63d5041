#!/usr/bin/env bash
# #23 on the eighth session's feature head (trained on 1,280 self-written draws instead of
# 640: train_heads/README.md, "Three times the self-written data"), side by side with plain
# decoding in ONE process, interleaved request by request (scripts/bench_interleaved.py): the
# head alone as a chain (k = 2, its best fixed k in §19.2) and with the adaptive draft length
# (k <= 3), eagle_pld with a chain and with its default 2 x 2 tree, and prompt lookup and
# pld_sps with its 0.5B in fp32 (the best lossless pipelines without the head) for reference.
# Qwen2.5-Coder-1.5B, every model in fp32, 2 threads, greedy, 128 new tokens, the 12 held-out table questions (none
# trained on).  No exit heads are loaded (HEADS=null).  Nothing else may run on the CPU
# meanwhile.  resume=true: a rerun continues.
set -euo pipefail
cd "$(dirname "$0")/../../.."
HEADS=${HEADS:-null}
source docs/data/issue24/bench_common.sh
HEAD=${HEAD:-$MAGPIE3}
EAGLE="+experiment=eagle drafter.head=$HEAD"
bench "${OUT:-outputs/issue23/table_s8}" "$TABLE_IDS" 128 \
  --method plain "+experiment=ar" \
  --method pld "+experiment=pld" \
  --method pld_sps "+experiment=pld_sps drafter.then.model.dtype=float32" \
  --method eagle_k2 "$EAGLE drafter.k=2" \
  --method eagle_adaptive "$EAGLE drafter.k=3 draft_length=adaptive" \
  --method eagle_pld_chain "+experiment=eagle_pld drafter.then.head=$HEAD drafter.then.branches=1" \
  --method eagle_pld_tree "+experiment=eagle_pld drafter.then.head=$HEAD" \
  "$@"
