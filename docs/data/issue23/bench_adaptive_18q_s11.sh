#!/usr/bin/env bash
# #23 item 3, eleventh session: the adaptive draft length (by part, the default) against fixed
# k on three held-out questions per category instead of two (the table's 12 plus the six of
# CHOOSE_IDS; none trained on by the feature head, whose metadata lists all 18 as held out),
# in ONE interleaved process (scripts/bench_interleaved.py), side by side with plain decoding:
# pld_sps and eagle_pld (its config: the head's 2 x 2 tree where measured to pay), each with
# fixed k and with draft_length=adaptive.
# Qwen2.5-Coder-1.5B, every model in fp32, 2 threads, greedy, 128 new tokens.  HEAD: the
# feature head (default: MAGPIE3).  Nothing else may run on the CPU meanwhile.  resume=true.
set -euo pipefail
cd "$(dirname "$0")/../../.."
HEADS=${HEADS:-null}
source docs/data/issue24/bench_common.sh
HEAD=${HEAD:-$MAGPIE3}
EAGLE_PLD="+experiment=eagle_pld drafter.then.head=$HEAD"
PLD_SPS="+experiment=pld_sps drafter.then.model.dtype=float32"
bench "${OUT:-outputs/issue23/adaptive_18q_s11}" "$SPREAD_IDS" 128 \
  --method plain "+experiment=ar" \
  --method pld_sps "$PLD_SPS" \
  --method pld_sps_adaptive "$PLD_SPS draft_length=adaptive" \
  --method eagle_pld "$EAGLE_PLD" \
  --method eagle_pld_adaptive "$EAGLE_PLD draft_length=adaptive" \
  "$@"
