#!/usr/bin/env bash
# Row padding (model.min_rows, specflow/models/row_padding.py), 2026-12-02 third session: plain
# decoding and eagle_pld with the target's packed matmuls unpadded and padded to the probed
# row count (--min-rows 0: the probe, as model.min_rows=null does), next to HF generate's
# prompt lookup (its best in §15.2), on the 12 held-out questions of the table, 128 new
# tokens, greedy, the methods interleaved per prompt in one process.  Every model in fp32.
# Nothing else may run on the CPU meanwhile.
set -euo pipefail
cd "$(dirname "$0")/../../.."
source docs/data/issue24/bench_common.sh
vs_hf --feature-k 2 --min-rows 0 \
  --only ours_ar_rows ours_eagle_pld ours_eagle_pld_rows hf_pld \
  --out "${OUT:-docs/data/issue23/bench_rows.json}" "$@"
