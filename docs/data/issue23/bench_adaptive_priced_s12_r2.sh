#!/usr/bin/env bash
# #23 item 3, twelfth session, run 2: bench_adaptive_priced_s12.sh's comparison again after
# the review of the priced rows (prices never falling with more rows; a tree's nodes and the
# batch's other rows counted): fixed k, the adaptive length with its beta fitted
# (draft_length.row_prices=false; the default when this ran) and with priced rows (the default
# since this run: docs/benchmarks.md §25.3),
# for pld_sps and eagle_pld, on the same 18 held-out questions, in ONE interleaved process,
# side by side with plain decoding.  Qwen2.5-Coder-1.5B, every model in fp32, 2 threads,
# greedy, 128 new tokens.  HEAD: the feature head (default: MAGPIE3).  Nothing else may run
# on the CPU meanwhile.  resume=true.
set -euo pipefail
cd "$(dirname "$0")/../../.."
HEADS=${HEADS:-null}
source docs/data/issue24/bench_common.sh
HEAD=${HEAD:-$MAGPIE3}
EAGLE_PLD="+experiment=eagle_pld drafter.then.head=$HEAD"
PLD_SPS="+experiment=pld_sps drafter.then.model.dtype=float32"
bench "${OUT:-outputs/issue23/adaptive_priced_s12_r2}" "$SPREAD_IDS" 128 \
  --method plain "+experiment=ar" \
  --method pld_sps "$PLD_SPS" \
  --method pld_sps_adaptive "$PLD_SPS draft_length=adaptive draft_length.row_prices=false" \
  --method pld_sps_adaptive_priced "$PLD_SPS draft_length=adaptive draft_length.row_prices=true" \
  --method eagle_pld "$EAGLE_PLD" \
  --method eagle_pld_adaptive "$EAGLE_PLD draft_length=adaptive draft_length.row_prices=false" \
  --method eagle_pld_adaptive_priced "$EAGLE_PLD draft_length=adaptive draft_length.row_prices=true" \
  "$@"
