#!/usr/bin/env bash
# Twelfth session: the main job's pipeline (conf/experiment/default.yaml: SmolLM2-135M-Instruct,
# prompt lookup, the adaptive draft length, two requests per Spec-Bench category) with the
# adaptive length's beta fitted (draft_length.row_prices=false) and with priced rows (the default
# since this run, docs/benchmarks.md §25.3),
# beside fixed k and plain decoding, in ONE interleaved process.  128 new tokens, 2 threads.
# Nothing else may run on the CPU meanwhile.  resume=true.
set -euo pipefail
cd "$(dirname "$0")/../../.."
PY=${PY:-.venv/bin/python}
$PY scripts/bench_interleaved.py --out "${OUT:-outputs/issue23/default_job_priced_s12}" \
  --common "+experiment=default runner.threads=2 resume=true" \
  --method plain "drafter=none draft_length=fixed" \
  --method pld_fixed "draft_length=fixed" \
  --method pld_adaptive "draft_length=adaptive draft_length.row_prices=false" \
  --method pld_adaptive_priced "draft_length=adaptive draft_length.row_prices=true" \
  "$@"
