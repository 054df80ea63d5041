#!/usr/bin/env bash
# The feature head of 2026-12-02's sixth session: the Spec-Bench training answers + the 319
# self-written prompts of the fifth session (read back with head.data.prompt_files) + 640 new
# draws (head.data.seed=1), trained as the fifth session's head was (train_heads/README.md);
# against Hugging Face generate in one run, the same methods, questions and settings as
# bench_vs_hf_magpie.sh (§18.1 of docs/benchmarks.md).  Nothing else may run on the CPU.
set -euo pipefail
cd "$(dirname "$0")/../../.."
source docs/data/issue24/bench_common.sh
NEW_FT5=${MAGPIE2:-outputs/train_heads/feature_magpie2/feature_head.safetensors} vs_hf \
  --feature-k 2 --feature-tree 2 2 --feature-trees always --min-rows 0 \
  --only ours_ar ours_eagle_pld_rows ours_eagle_pld_tree_rows ours_feature_tree_rows hf_pld \
  --out "${OUT:-docs/data/issue23/bench_vs_hf_magpie_s1.json}" "$@"
