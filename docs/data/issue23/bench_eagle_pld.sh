#!/usr/bin/env bash
# #23: prompt lookup first, the feature head where it finds nothing (`+experiment=eagle_pld`,
# conf/drafter/pld_then_feature.yaml: the head of outputs/train_heads/feature_sb_s3, k = 2),
# next to plain decoding, prompt lookup alone and pld_sps (prompt lookup, else the 0.5B in
# fp32), on the 12 held-out questions of the #24 table, first turn, 128 new tokens, greedy,
# one process, interleaved (scripts/bench_interleaved.py).  Every model in fp32.  Nothing
# else may run on the CPU.
set -euo pipefail
cd "$(dirname "$0")/../../.."
source docs/data/issue24/bench_common.sh
bench "${OUT:-outputs/issue23/eagle_pld}" "$TABLE_IDS" 128 \
  --method plain "+experiment=ar" \
  --method pld "+experiment=pld" \
  --method pld_sps "+experiment=pld_sps drafter.then.model.dtype=float32" \
  --method eagle_pld "+experiment=eagle_pld drafter.then.head=$NEW" \
  "$@"
