#!/usr/bin/env bash
# #24: the cost-aware MetaSD (conf/experiment/metasd_rate.yaml) with and without the switch
# cost (drafter.switch_horizon = 8: an idle arm's estimated catch-up, spread over 8 of its
# rounds, lowers its UCB index), next to plain decoding and the two best arms of §14.3, on
# the 12 held-out questions of the table, 128 new tokens, one process, interleaved
# (scripts/bench_interleaved.py).  Every model in fp32.  Nothing else may run on the CPU.
set -euo pipefail
cd "$(dirname "$0")/../../.."
source docs/data/issue24/bench_common.sh
bench "${OUT:-outputs/issue24/metasd_switch}" "$TABLE_IDS" 128 \
  --method plain "+experiment=ar" \
  --method pld "+experiment=pld" \
  --method sps_pld "+experiment=sps_pld" \
  --method metasd_rate "+experiment=metasd_rate" \
  --method metasd_switch "+experiment=metasd_rate drafter.switch_horizon=8" \
  "$@"
