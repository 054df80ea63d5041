#!/usr/bin/env bash
# #23 item 3, twelfth session: the adaptive draft length with verify rows priced by the
# target's row probe (draft_length.row_prices=true, the new default) against the fitted beta
# of sessions 1-11 (row_prices=false) and against fixed k, on the 18 held-out questions of
# §24.3 (three per category; none trained on by the feature head), in ONE interleaved
# process (scripts/bench_interleaved.py), side by side with plain decoding: pld_sps and
# eagle_pld (its config: the head's 2 x 2 tree where measured to pay).
# Qwen2.5-Coder-1.5B, every model in fp32, 2 threads, greedy, 128 new tokens.  HEAD: the
# feature head (default: MAGPIE3).  Nothing else may run on the CPU meanwhile.  resume=true.
set -euo pipefail
cd "$(dirname "$0")/../../.."
HEADS=${HEADS:-null}
source docs/data/issue24/bench_common.sh
HEAD=${HEAD:-$MAGPIE3}
EAGLE_PLD="+experiment=eagle_pld drafter.then.head=$HEAD"
PLD_SPS="+experiment=pld_sps drafter.then.model.dtype=float32"
bench "${OUT:-outputs/issue23/adaptive_priced_s12}" "$SPREAD_IDS" 128 \
  --method plain "+experiment=ar" \
  --method pld_sps "$PLD_SPS" \
  --method pld_sps_adaptive "$PLD_SPS draft_length=adaptive" \
  --method pld_sps_adaptive_fitted "$PLD_SPS draft_length=adaptive draft_length.row_prices=false" \
  --method eagle_pld "$EAGLE_PLD" \
  --method eagle_pld_adaptive "$EAGLE_PLD draft_length=adaptive" \
  --method eagle_pld_adaptive_fitted "$EAGLE_PLD draft_length=adaptive draft_length.row_prices=false" \
  "$@"
