# Sourced by the #24 bench scripts (choose_exits.sh, bench_table128.sh, bench_metasd_*.sh) and
# the #23 ones of 2026-12-02 (bench_feature_sampled.sh, bench_eagle_pld.sh,
# bench_vs_hf_eagle.sh, bench_adaptive_*.sh):
# what they share, declared once.  Overridable from the environment.
PY=${PY:-.venv/bin/python}
HEADS=${HEADS:-outputs/heads/exits_4a7_14.safetensors}   # mlp 4 + adapter 7 + mlp 14
FEATURE=${FEATURE:-outputs/train_heads/feature_sb_ft/feature_head.safetensors}
# the feature head on 4x the in-domain answers (#23, 2026-12-02: specbench_samples=3)
NEW=${NEW:-outputs/train_heads/feature_sb_s3/feature_head.safetensors}
# that head after five more epochs on the cached data (#23, 2026-12-02, second session)
NEW_FT5=${NEW_FT5:-outputs/train_heads/feature_sb_s3_ft5/feature_head.safetensors}
# the feature head on the Spec-Bench answers + 319 prompts the target wrote itself (#23,
# 2026-12-02, fifth session: head.data.magpie_prompts=512)
MAGPIE=${MAGPIE:-outputs/train_heads/feature_sb_magpie/feature_head.safetensors}
# the feature head on 1,280 self-written draws (#23, 2026-12-03, eighth session: 43.8 %)
MAGPIE3=${MAGPIE3:-outputs/train_heads/feature_magpie3/feature_head.safetensors}
# the same data and recipe, five epochs instead of three (#23, 2026-12-03, tenth session)
MAGPIE3_E5=${MAGPIE3_E5:-outputs/train_heads/feature_magpie3_e5/feature_head.safetensors}
# two held-out Spec-Bench questions per category, none trained on by any head (the table)
TABLE_IDS="[101,125,173,197,245,269,341,365,413,437,485,509]"
# one more held-out question per category, not in the table (choosing the exits)
CHOOSE_IDS="[149,221,293,389,461,533]"
# three held-out questions a category: the table's twelve and CHOOSE_IDS (#23, from §24.3)
SPREAD_IDS="[101,125,149,173,197,221,245,269,293,341,365,389,413,437,461,485,509,533]"
# the table's second question of each category: not used to diagnose the adaptive policy (#23)
ADAPTIVE_IDS="[125,197,269,365,437,509]"
# what every experiment of a bench gets: the target, its heads, first turns, 2 threads
common() {  # common IDS MAX_NEW_TOKENS
  echo "model=qwen2.5-coder-1.5b model.exit_heads=$HEADS workload.ids=$1 \
workload.max_turns=1 runner.max_new_tokens=$2 runner.threads=2 resume=true"
}
# one interleaved bench: bench OUT IDS MAX_NEW_TOKENS --method NAME "OVERRIDES"... [options]
bench() {
  local out=$1 ids=$2 tokens=$3
  shift 3
  $PY scripts/bench_interleaved.py --out "$out" --common "$(common "$ids" "$tokens")" "$@"
}
# MetaSD's cost-aware reward and warm start (conf/experiment/metasd_rate.yaml's settings), for
# pools composed from another experiment (metasd_feature): +experiment=metasd_feature $RATE
RATE="drafter.reward=rate drafter.rate_scale=3.0 selector.c=0.3 selector.prior=6"
# plain decoding (the reference) and MetaSD's arms alone, every model in fp32 (the 0.5B
# too: sps would take bf16 on a CPU with native bf16)
ARMS_FP32=(
  --method plain "+experiment=ar"
  --method pld "+experiment=pld"
  --method sps_0.5b "+experiment=sps drafter.model.dtype=float32"
  --method self_spec "+experiment=self_spec"
  --method sps_pld "+experiment=sps_pld"
)
# ours against HF generate in one process (scripts/bench_vs_hf.py), the 1.5B without a second
# model, on the table's questions, 128 new tokens, one repeat, with the feature head:
# vs_hf OPTIONS... (--feature-k, --min-rows, --only, --out, ...)
vs_hf() {
  local ids=${TABLE_IDS//[\[\],]/ }
  # shellcheck disable=SC2086  # the ids are separate arguments
  $PY scripts/bench_vs_hf.py --target qwen2.5-coder-1.5b --drafter "" --ids $ids \
    --max-new-tokens 128 --repeats 1 --threads 2 --feature-head "$NEW_FT5" "$@"
}
