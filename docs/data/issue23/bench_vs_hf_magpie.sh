#!/usr/bin/env bash
# The feature head trained on the Spec-Bench training answers + prompts the target wrote itself
# (train_heads/magpie.py; train_heads/README.md "Prompts the target writes itself") against
# Hugging Face generate, in one run (scripts/bench_vs_hf.py): ours plain (unpadded and at the
# probed row count), eagle_pld with the head's chain of 2 (at the probed row count) and with
# its 2 x 2 tree drafted every round (drafter.trees=always: on a CPU whose probe picks fewer
# rows than the tree's 5, free_rows would draft chains), the head alone with that tree, and
# HF prompt lookup; the 12 held-out table questions, 128 new tokens, greedy, fp32, 2 threads.
# Nothing else may run on the CPU meanwhile.
set -euo pipefail
cd "$(dirname "$0")/../../.."
source docs/data/issue24/bench_common.sh
NEW_FT5=$MAGPIE vs_hf --feature-k 2 --feature-tree 2 2 --feature-trees always --min-rows 0 \
  --only ours_ar ours_eagle_pld_rows ours_eagle_pld_tree_rows ours_feature_tree_rows hf_pld \
  --out "${OUT:-docs/data/issue23/bench_vs_hf_magpie.json}" "$@"
