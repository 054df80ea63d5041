#!/usr/bin/env bash
# The GPU check, one command (about 8 minutes with the model's
# preparation).  On the GPU machine, prepared as docs/gpu.md says:
#
#   bash scripts/gpu_check.sh
#
# Prints the machine, the CUDA unit tests' result (when pytest is there), and one table:
# ours plain b1/b8/b32, pld and pld+adaptive b1/b8, HF generate plain b1/b8 and prompt lookup
# b1 on the same prompts; tokens/s, ratios, fidelity, kernels used, CUDA graphs captured
# (scripts/gpu_check.py).  With $OUT set, gpu_check.json is written there.  Arguments are
# passed on: --target FOLDER --head EAGLE_FOLDER (EAGLE-1/2/3) or --exit-layer N (LayerSkip)
# time a published pair too (docs/draft-checkpoints.md, "On a GPU").
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())"
if $PY -c "import pytest" 2>/dev/null; then
  timeout 120 $PY -m pytest -q -p no:cacheprovider tests/test_paged_gpu.py tests/test_static.py 2>&1 | tail -4
fi
timeout 400 $PY scripts/gpu_check.py --out "${OUT:-/tmp}" "$@"
