#!/usr/bin/env bash
# #23, 2026-12-02 (second session): our lossless pipelines against Hugging Face `generate`'s
# speculative methods, side by side in one process, interleaved per prompt
# (scripts/bench_vs_hf.py): ours plain; the feature head alone (k = 2); eagle_pld (prompt
# lookup first, the head at k = 2: conf/drafter/pld_then_feature.yaml); HF prompt lookup
# (prompt_lookup_num_tokens=10) and HF assisted generation with the 0.5B.  Every model in
# fp32 (the 0.5B assistant too).  The 12 held-out questions of the #24 table (TABLE_IDS,
# none trained on), first turn, 128 new tokens, greedy, one repeat.  Nothing else may run on
# the CPU.  HEAD: the feature head (default: the continued training of this session).
set -euo pipefail
cd "$(dirname "$0")/../../.."
source docs/data/issue24/bench_common.sh
HEAD=${HEAD:-$NEW_FT5}
IDS=$(echo "$TABLE_IDS" | tr -d '[]' | tr ',' ' ')
# shellcheck disable=SC2086
$PY scripts/bench_vs_hf.py --target qwen2.5-coder-1.5b --drafter qwen2.5-coder-0.5b \
  --drafter-dtype float32 --ids $IDS --max-new-tokens 128 --repeats 1 --threads 2 \
  --feature-head "$HEAD" --feature-k 2 \
  --only ours_feature ours_eagle_pld hf_pld hf_sps \
  --out "${OUT:-docs/data/issue23/bench_vs_hf_eagle.json}" "$@"
