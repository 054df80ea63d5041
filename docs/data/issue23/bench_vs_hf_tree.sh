#!/usr/bin/env bash
# The feature head's 2 x 2 tree inside eagle_pld against Hugging Face generate, in one run
# (scripts/bench_vs_hf.py): ours plain (unpadded and at the probed row count, --min-rows 0),
# eagle_pld with the head's chain of 2 and with its 2 x 2 tree (both at the probed row count),
# and HF prompt lookup (HF's fastest on this CPU, §15.2); the 12 held-out table questions, 128 new tokens, greedy, fp32, 2 threads.
# Nothing else may run on the CPU meanwhile.
set -euo pipefail
cd "$(dirname "$0")/../../.."
source docs/data/issue24/bench_common.sh
vs_hf --feature-k 2 --feature-tree 2 2 --min-rows 0 \
  --only ours_ar_rows ours_eagle_pld_rows ours_eagle_pld_tree_rows hf_pld \
  --out "${OUT:-docs/data/issue23/bench_vs_hf_tree.json}" "$@"
