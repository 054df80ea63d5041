#!/usr/bin/env bash
# #24: MetaSD against each of its arms alone, with the block-divergence reward (MetaSD's own)
# and with the cost-aware `rate` reward + warm start (conf/experiment/metasd_rate.yaml), on
# the 12 held-out questions of the table (two per category), 128 new tokens, one process,
# interleaved request by request (scripts/bench_interleaved.py).  The arms: prompt lookup,
# the 0.5B, the 1.5B's layer-4 exit (through the exit heads in $HEADS), PLD -> 0.5B.
# Every model in fp32 (the 0.5B too: sps would take bf16 on a CPU with native bf16), as the
# aims of #24 ask.  Nothing else may run on the CPU meanwhile.
set -euo pipefail
cd "$(dirname "$0")/../../.."
source docs/data/issue24/bench_common.sh
bench "${OUT:-outputs/issue24/metasd_rate}" "$TABLE_IDS" 128 "${ARMS_FP32[@]}" \
  --method metasd_bd "+experiment=metasd" \
  --method metasd_rate "+experiment=metasd_rate" \
  "$@"
