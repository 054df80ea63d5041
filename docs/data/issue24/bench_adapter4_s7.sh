#!/usr/bin/env bash
# #24, 2026-12-02 seventh session: self_spec with the attention adapter at exit 4 trained on
# the same 115,105 in-domain rows as bench_table_s7.sh's mlp heads (train_heads/README.md,
# "Exit heads on eight times the in-domain data"), and with the mlp head at exit 7, side by
# side with plain decoding and the feature head alone in ONE interleaved process.  The
# experiments of one bench share one exit-heads file, so the mlp head of exit 4 cannot run
# here: its ratio is bench_table_s7.sh's.  The heads file is merged first (adapter 4 + mlp 7).
# Same questions and settings as bench_table_s7.sh.  Nothing else may run on the CPU.
set -euo pipefail
cd "$(dirname "$0")/../../.."
HEADS=${HEADS:-outputs/heads/exits_a4_7_magpie.safetensors}
ADAPTER=${ADAPTER:-outputs/train_heads/adapter4_magpie/heads.safetensors}
MLP=${MLP:-outputs/train_heads/mlp47_magpie/heads.safetensors}
source docs/data/issue24/bench_common.sh
[ -f "$HEADS" ] || $PY -m train_heads.merge "$HEADS" "$ADAPTER:4" "$MLP:7"
HEAD=${HEAD:-outputs/train_heads/feature_magpie2/feature_head.safetensors}
bench "${OUT:-outputs/issue24/adapter4_s7}" "$TABLE_IDS" 128 \
  --method plain "+experiment=ar" \
  --method feature "+experiment=eagle drafter.head=$HEAD drafter.k=2" \
  --method self_spec_adapter4 "+experiment=self_spec" \
  --method self_spec_mlp7 "+experiment=self_spec drafter.exit_layer=7" \
  "$@"
