#!/usr/bin/env bash
# #24: choose the 1.5B's exits (self_spec's L_d; hispec's L_d -> L_i) by measurement, on
# held-out Spec-Bench questions that are NOT the ones the per-category table reports
# (one per category: 149 stem, 221 translation, 293 summarization, 389 qa, 461 math, 533 rag;
# none trained on), side by side with plain decoding in one process, interleaved
# (scripts/bench_interleaved.py).  64 new tokens, greedy, fp32, 2 threads.  The winner goes
# into conf/experiment/self_spec.yaml and hispec.yaml.  Nothing else may run meanwhile.
set -euo pipefail
cd "$(dirname "$0")/../../.."
source docs/data/issue24/bench_common.sh
V="drafter.vocab_subset=32768"
bench "${OUT:-outputs/issue24/choose_exits}" "$CHOOSE_IDS" 64 \
  --method plain "+experiment=ar" \
  --method self_spec_4 "+experiment=self_spec drafter.exit_layer=4 drafter.k=2 $V" \
  --method self_spec_7 "+experiment=self_spec drafter.exit_layer=7 drafter.k=2 $V" \
  --method self_spec_14 "+experiment=self_spec drafter.exit_layer=14 drafter.k=2 $V" \
  --method hispec_4_7 "+experiment=hispec drafter.exit_layer=4 $V intermediate_verifier.exit_layer=7" \
  --method hispec_4_14 "+experiment=hispec drafter.exit_layer=4 $V intermediate_verifier.exit_layer=14" \
  --method hispec_7_14 "+experiment=hispec drafter.exit_layer=7 $V intermediate_verifier.exit_layer=14" \
  "$@"
