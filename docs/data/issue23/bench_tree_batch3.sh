#!/usr/bin/env bash
# eagle_pld's head chain against its 2 x 2 tree at runner.batch_size=3 (the default KV layout,
# contiguous on a CPU; the probed row count), each run next to plain decoding of the same batch (run.py's baseline), the
# 12 held-out table questions, 128 new tokens, greedy, fp32, 2 threads.  Two run.py
# processes one after the other (not interleaved: compare each method with its own run's
# plain decoding).  Nothing else may run on the CPU meanwhile.
set -euo pipefail
cd "$(dirname "$0")/../../.."
source docs/data/issue24/bench_common.sh
OUT=${OUT:-outputs/issue23/tree_batch3}
# TREES=always: a tree every round (as measured first); free_rows (the default since): only
# where the round's verify rows stay within the padded row count.
for branches in ${BRANCHES:-1 2}; do
  $PY run.py +experiment=eagle_pld $(common "$TABLE_IDS" 128) \
    drafter.then.head=$NEW_FT5 drafter.then.branches=$branches \
    drafter.then.trees=${TREES:-free_rows} \
    runner.batch_size=3 hydra.run.dir="$OUT/branches${branches}_${TREES:-free_rows}"
done
