#!/usr/bin/env bash
# #23: the feature head trained on the Spec-Bench dev questions that are not held out, with
# three more answers of each drawn at temperature 0.8 (head.data.specbench_samples=3,
# outputs/train_heads/feature_sb_s3), as a drafter of Qwen2.5-Coder-1.5B (adaptive k <= 6, and
# fixed k = 2), next to plain decoding, prompt lookup and pld_sps, on the 12 held-out
# questions of the #24 table (held out by the head), first turn, 128 new tokens, greedy, one
# process, interleaved
# (scripts/bench_interleaved.py).  Every model in fp32.  Nothing else may run on the CPU.
set -euo pipefail
cd "$(dirname "$0")/../../.."
source docs/data/issue24/bench_common.sh
bench "${OUT:-outputs/issue23/feature_sampled}" "$TABLE_IDS" 128 \
  --method plain "+experiment=ar" \
  --method pld "+experiment=pld" \
  --method sps_pld "+experiment=sps_pld" \
  --method eagle_adaptive "+experiment=eagle drafter.head=$NEW draft_length=adaptive drafter.k=6" \
  --method eagle_k2 "+experiment=eagle drafter.head=$NEW drafter.k=2" \
  "$@"
