#!/usr/bin/env bash
# #23, ninth session: trees=measured where a tree's rows cost, in ONE process, interleaved
# request by request (scripts/bench_interleaved.py): eagle_pld with a chain, with its 2 x 2
# tree drafted always and with trees=measured (stages/feature_drafter.py TreeGain: prices
# from the row probe, which the drafter runs itself because the row count is given), every
# method at model.min_rows=1 (unpadded, the case of §21.3, where the tree was 6 % ahead).
# Qwen2.5-Coder-1.5B, fp32, 2 threads, greedy, 128 new tokens, the 12 held-out table
# questions, no exit heads.  Nothing else may run on the CPU meanwhile.  resume=true.
set -euo pipefail
cd "$(dirname "$0")/../../.."
HEADS=${HEADS:-null}
source docs/data/issue24/bench_common.sh
HEAD=${HEAD:-$MAGPIE3}
EAGLE_PLD="+experiment=eagle_pld drafter.then.head=$HEAD model.min_rows=1"
bench "${OUT:-outputs/issue23/trees_rows1_s9}" "$TABLE_IDS" 128 \
  --method plain "+experiment=ar model.min_rows=1" \
  --method eagle_pld_chain "$EAGLE_PLD drafter.then.branches=1" \
  --method eagle_pld_always "$EAGLE_PLD drafter.then.trees=always" \
  --method eagle_pld_measured "$EAGLE_PLD drafter.then.trees=measured" \
  "$@"
