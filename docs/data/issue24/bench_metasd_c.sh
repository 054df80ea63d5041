#!/usr/bin/env bash
# #24: the UCB exploration scale c of the cost-aware MetaSD (conf/experiment/metasd_rate.yaml)
# with the unclipped rate scale (k + 1),
# chosen on the six held-out questions that choose_exits.sh used (one per category, none in
# the table), next to plain decoding, prompt lookup and PLD -> 0.5B; 128 new tokens, one
# process, interleaved (scripts/bench_interleaved.py).  Every model in fp32.  Nothing else
# may run on the CPU meanwhile.
set -euo pipefail
cd "$(dirname "$0")/../../.."
source docs/data/issue24/bench_common.sh
R="+experiment=metasd_rate drafter.rate_scale=null"
bench "${OUT:-outputs/issue24/metasd_c}" "$CHOOSE_IDS" 128 \
  --method plain "+experiment=ar" \
  --method pld "+experiment=pld" \
  --method sps_pld "+experiment=sps_pld" \
  --method metasd_rate_c0.3 "$R selector.c=0.3" \
  --method metasd_rate_c0.1 "$R selector.c=0.1" \
  --method metasd_rate_c0.03 "$R selector.c=0.03" \
  "$@"
