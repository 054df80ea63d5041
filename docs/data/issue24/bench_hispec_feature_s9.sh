#!/usr/bin/env bash
# #24 and #23, ninth session, in ONE process, interleaved request by request
# (scripts/bench_interleaved.py), side by side with plain decoding:
# - hispec_feature (the feature head drafts k = 2, exit 7 pre-verifies N_i = 4 or 2, the
#   target verifies) against the head alone (eagle k = 2, the single-level speculation it
#   builds on), on an mlp exit-7 head trained on the feature head's 1,280-draw data
#   (train_heads/README.md, "Exit 7 on the 1,280-draw data");
# - eagle_pld with a chain, with trees drafted always and with trees=measured (a tree where
#   the trees verified so far committed enough more tokens to pay for their verify rows,
#   priced by the row probe; stages/feature_drafter.py TreeGain).
# Qwen2.5-Coder-1.5B, every model in fp32, 2 threads, greedy, 128 new tokens, the 12 held-out
# table questions (none trained on).  Nothing else may run on the CPU meanwhile.
# resume=true: a rerun continues.
set -euo pipefail
cd "$(dirname "$0")/../../.."
HEADS=${HEADS:-outputs/train_heads/mlp7_magpie3/heads.safetensors}
source docs/data/issue24/bench_common.sh
HEAD=${HEAD:-$MAGPIE3}
HISPEC="+experiment=hispec_feature drafter.head=$HEAD"
EAGLE_PLD="+experiment=eagle_pld drafter.then.head=$HEAD"
bench "${OUT:-outputs/issue24/table_s9}" "$TABLE_IDS" 128 \
  --method plain "+experiment=ar" \
  --method eagle_k2 "+experiment=eagle drafter.head=$HEAD drafter.k=2" \
  --method hispec_feature "$HISPEC" \
  --method hispec_feature_n2 "$HISPEC intermediate_verifier.accumulate=2" \
  --method eagle_pld_chain "$EAGLE_PLD drafter.then.branches=1" \
  --method eagle_pld_always "$EAGLE_PLD drafter.then.trees=always" \
  --method eagle_pld_measured "$EAGLE_PLD drafter.then.trees=measured" \
  "$@"
