#!/usr/bin/env bash
# #23, tenth session: the comparison with Hugging Face `generate` (scripts/bench_vs_hf.py, one
# process) on the five-epoch head (46.1 %): ours plain, eagle_pld (a chain of 2; a 2 x 2 tree
# under trees=measured, the config's rule) and HF prompt lookup (HF's best in §18.1-§22.2), on
# the 12 held-out table questions, 128 new tokens, greedy, one repeat, row count probed.
# Nothing else may run on the CPU meanwhile.
set -euo pipefail
cd "$(dirname "$0")/../../.."
source docs/data/issue24/bench_common.sh
NEW_FT5=$MAGPIE3_E5 vs_hf --feature-k 2 --feature-tree 2 2 --feature-trees measured --min-rows 0 \
  --only ours_ar ours_eagle_pld_rows ours_eagle_pld_tree_rows hf_pld \
  --out "${OUT:-docs/data/issue23/bench_vs_hf_s10.json}" "$@"
