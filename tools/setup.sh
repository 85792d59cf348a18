#!/usr/bin/env bash
# Set up flcomm in a virtual environment at .venv in this checkout (idempotent).
#
#   FLCOMM_TORCH=2.14.1   torch to install: 2.14.1 (CUDA 13 build; CUDA/NCCL sources compiled
#                         when nvcc is found) or 2.13.0 (CPU build; CPU kernels only)
#   FLCOMM_CUDA=auto|0|1  build the CUDA sources (1: fail if they cannot be built)
#   FLCOMM_CUDA_ARCHS     GPU arches, e.g. "90" (default 8.0;9.0)
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_VERSION=${FLCOMM_TORCH:-2.14.1}
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
if ! .venv/bin/python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
  echo "[setup] installing torch==$TORCH_VERSION into .venv"
  .venv/bin/pip install -q "torch==$TORCH_VERSION"
fi
.venv/bin/pip install -q "setuptools>=77" wheel ninja numpy
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then export CUDA_HOME=/usr/local/cuda; fi
echo "[setup] building flcomm (CUDA_HOME=${CUDA_HOME:-unset}, FLCOMM_CUDA=${FLCOMM_CUDA:-auto})"
.venv/bin/pip install -q --no-build-isolation -e ".[test,plot,hf]"
.venv/bin/python -m flcomm info
