#!/usr/bin/env bash
# #23, eighth session: §19.1's comparison with Hugging Face `generate` (scripts/bench_vs_hf.py,
# one process) on the head of 1.5 times the data (43.8 %): ours plain, eagle_pld with a chain
# of 2 and with a 2 x 2 tree drafted always, and HF prompt lookup (HF's best in §18.1-§19.1),
# on the 12 held-out table questions, 128 new tokens, greedy, one repeat, row count probed.
# Nothing else may run on the CPU meanwhile.
set -euo pipefail
cd "$(dirname "$0")/../../.."
source docs/data/issue24/bench_common.sh
NEW_FT5=$MAGPIE3 vs_hf \
  --feature-k 2 --feature-tree 2 2 --feature-trees always --min-rows 0 \
  --only ours_ar ours_eagle_pld_rows ours_eagle_pld_tree_rows hf_pld \
  --out "${OUT:-docs/data/issue23/bench_vs_hf_s8.json}" "$@"
