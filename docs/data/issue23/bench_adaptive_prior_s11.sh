#!/usr/bin/env bash
# #23 item 3, eleventh session: does the adaptive draft length lose per category because a
# request inherits the previous request's acceptance (another category's) as its prior?
# §24.1's run 2 skipped the 0.5B for 36 of the first 45 rounds of a math answer (413) that
# then accepted 42 of its 43 drafted tokens, after a translation answer accepted 4 of 15.
# draft_length.prior_strength=8 (the default: the inherited evidence counts as 8 draft
# positions) against 2, next to fixed k, in ONE interleaved process, by part (the default).
# Qwen2.5-Coder-1.5B, every model in fp32, 2 threads, greedy, 128 new tokens, the 12 held-out
# table questions.  HEAD: the feature head (default: MAGPIE3).  Nothing else may run on the
# CPU meanwhile.  resume=true: a rerun continues.
set -euo pipefail
cd "$(dirname "$0")/../../.."
HEADS=${HEADS:-null}
source docs/data/issue24/bench_common.sh
HEAD=${HEAD:-$MAGPIE3}
EAGLE_PLD="+experiment=eagle_pld drafter.then.head=$HEAD"
PLD_SPS="+experiment=pld_sps drafter.then.model.dtype=float32"
ADAPTIVE="draft_length=adaptive"
bench "${OUT:-outputs/issue23/adaptive_prior_s11}" "$TABLE_IDS" 128 \
  --method plain "+experiment=ar" \
  --method pld_sps "$PLD_SPS" \
  --method pld_sps_adaptive "$PLD_SPS $ADAPTIVE" \
  --method pld_sps_adaptive_p2 "$PLD_SPS $ADAPTIVE draft_length.prior_strength=2" \
  --method eagle_pld "$EAGLE_PLD" \
  --method eagle_pld_tree_adaptive_p2 "$EAGLE_PLD $ADAPTIVE draft_length.prior_strength=2" \
  "$@"
