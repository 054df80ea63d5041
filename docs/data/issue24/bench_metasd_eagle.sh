#!/usr/bin/env bash
# #24: MetaSD with the feature head.  `metasd_eagle` (conf/experiment/metasd_eagle.yaml): UCB
# over two arms, eagle_pld (prompt lookup, else the feature head) and PLD -> 0.5B, with
# metasd_rate's cost-aware reward and warm start.  `metasd_feature_rate`: the pool #24 names
# (PLD, the 0.5B, the layer-4 exit in $HEADS, PLD -> 0.5B and the feature head at k = 2) with
# the same reward and selector.  Next to plain decoding and the strongest arms alone (pld,
# eagle_pld, sps_pld), on the 12 held-out questions of the table, 128 new tokens, one process,
# interleaved (scripts/bench_interleaved.py).  Every model in fp32.  Nothing else may run on
# the CPU meanwhile.
set -euo pipefail
cd "$(dirname "$0")/../../.."
source docs/data/issue24/bench_common.sh
bench "${OUT:-outputs/issue24/metasd_eagle}" "$TABLE_IDS" 128 \
  --method plain "+experiment=ar" \
  --method pld "+experiment=pld" \
  --method eagle_pld "+experiment=eagle_pld drafter.then.head=$NEW_FT5" \
  --method sps_pld "+experiment=sps_pld" \
  --method metasd_eagle "+experiment=metasd_eagle drafter.drafters.eagle_pld.then.head=$NEW_FT5" \
  --method metasd_feature_rate "+experiment=metasd_feature $RATE \
drafter.drafters.feature.head=$NEW_FT5 drafter.drafters.feature.k=2" \
  "$@"
