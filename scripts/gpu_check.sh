#!/usr/bin/env bash
# One-command GPU check of the batched/paged path (a few minutes):
#   bash scripts/gpu_check.sh
# 1. installs flash-attn if missing (allowed to fail: then only SDPA is checked),
# 2. runs tests/test_paged_gpu.py (flash vs SDPA logits, batched greedy on CUDA),
# 3. runs a short throughput benchmark (scripts/gpu_check.py) and prints a table.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
if [ -x .venv/bin/python ] && .venv/bin/python -c "import torch,sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
  PY=.venv/bin/python
fi
export HF_HUB_OFFLINE=1 PYTHONPATH=${PYTHONPATH:-}:$(pwd)
$PY - <<'PY'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0))
PY
if ! $PY -c "import flash_attn" 2>/dev/null; then
  echo "flash-attn missing: trying pip install (120 s max; failure -> SDPA only)"
  timeout 120 $PY -m pip install -q flash-attn --no-build-isolation || echo "flash-attn install failed; SDPA only"
fi
$PY -c "import flash_attn; print('flash-attn', flash_attn.__version__)" 2>/dev/null || echo "flash-attn: not available"
timeout 180 $PY -m pytest -q -p no:cacheprovider tests/test_paged_gpu.py tests/test_paged.py -x 2>&1 | tail -15
timeout 240 $PY scripts/gpu_check.py "$@"
