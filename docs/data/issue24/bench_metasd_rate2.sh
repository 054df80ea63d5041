#!/usr/bin/env bash
# #24: the cost-aware MetaSD in two settings: conf/experiment/metasd_rate.yaml as it is (rate
# reward scaled by 3, c = 0.3, warm start of 6 pulls per arm; the run's `metasd_rate_s3`) and
# the unclipped scale k + 1 with c = 0.1 (the run's `metasd_rate`), next to each arm alone, on
# the 12 held-out questions of the table, 128 new tokens, one process, interleaved
# (scripts/bench_interleaved.py).  Every model in fp32.  Nothing else may run on the CPU
# meanwhile.  (When it ran, the yaml held the second setting and the overrides were the other
# way round; the report was rewritten with --report-only from this script: the same settings.)
set -euo pipefail
cd "$(dirname "$0")/../../.."
source docs/data/issue24/bench_common.sh
bench "${OUT:-outputs/issue24/metasd_rate2}" "$TABLE_IDS" 128 "${ARMS_FP32[@]}" \
  --method metasd_rate_s3 "+experiment=metasd_rate" \
  --method metasd_rate "+experiment=metasd_rate drafter.rate_scale=null selector.c=0.1" \
  "$@"
