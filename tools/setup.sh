#!/usr/bin/env bash
# Set up flcomm in a virtual environment in this checkout (idempotent).
#
#   FLCOMM_TORCH=2.14.1   torch to install: 2.14.1 (CUDA 13 build; CUDA/NCCL sources compiled
#                         when nvcc is found), 2.13.0 (CPU build; CPU kernels only) or 2.11.0
#                         (the low end of the supported range; see FLCOMM_TORCH_LEAN)
#   FLCOMM_VENV=.venv     where the virtual environment goes (e.g. .venv-211 for a second torch)
#   FLCOMM_TORCH_LEAN=0|1 1: install torch without its CUDA wheels (--no-deps, then its pure-Python
#                         requirements and the NCCL wheel it pins) and borrow the other CUDA libraries
#                         of FLCOMM_CUDA_LIBS_FROM (default .venv) by symlinks. For a test venv of a
#                         second torch whose only wheel in the registry is a CUDA build: 0.7 GB
#                         instead of ~3.5 GB.
#   FLCOMM_CUDA=auto|0|1  build the CUDA sources (1: fail if they cannot be built)
#   FLCOMM_CUDA_ARCHS     GPU arches, e.g. "90" (default 8.0;9.0)
#   FLCOMM_SETUP=all|torch  torch: stop once torch (and, lean, its borrowed libraries) is in place,
#                         before the build (CI fetches job 2's torch while job 1 runs its tests)
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_VERSION=${FLCOMM_TORCH:-2.14.1}
VENV=${FLCOMM_VENV:-.venv}
LEAN=${FLCOMM_TORCH_LEAN:-0}
PY=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
  echo "[setup] installing torch==$TORCH_VERSION into $VENV$([ "$LEAN" = 1 ] && echo ' (lean: no CUDA wheels)')"
  if [ "$LEAN" = 1 ]; then
    # NOTE: a CUDA build of torch loads libcudart, cuBLAS, cuDNN, NCCL, ... at import even on a
    # CPU; they come from the nvidia/ namespace package of another venv with the same CUDA major
    # (torch finds them through its rpath $ORIGIN/../../nvidia/*/lib). torch 2.11 needs CUDA 13.0
    # libraries; the 2.14.1 venv has 13.0-13.5 and cuDNN 9.24 (checked: the suite runs).
    "$VENV/bin/pip" install -q --no-deps "torch==$TORCH_VERSION"
    "$VENV/bin/pip" install -q filelock fsspec jinja2 networkx sympy typing-extensions "setuptools<82"
  else
    "$VENV/bin/pip" install -q "torch==$TORCH_VERSION"
  fi
fi
if [ "$LEAN" = 1 ]; then
  FROM=${FLCOMM_CUDA_LIBS_FROM:-.venv}
  from_site=$("$FROM/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  [ -d "$from_site/nvidia" ] || { echo "[setup] $FROM has no nvidia/ CUDA libraries: set up $FROM first" >&2; exit 1; }
  # NOTE: one link per library, NCCL excepted: torch and flcomm's NCCL communicator load (and
  # flcomm compiles against) the NCCL this torch pins, installed into this venv below
  [ -L "$site/nvidia" ] && rm "$site/nvidia"
  mkdir -p "$site/nvidia"
  for lib in "$(cd "$from_site" && pwd)"/nvidia/*; do
    [ "$(basename "$lib")" = nccl ] || ln -sfn "$lib" "$site/nvidia/$(basename "$lib")"
  done
  nccl=$("$VENV/bin/python" -c "
import importlib.metadata as m, re
for r in m.requires('torch') or []:
  g = re.match(r'nvidia-nccl-cu\d+==([\d.]+)', r)
  if g: print(r.split(';')[0].strip())")
  [ -n "$nccl" ] && "$VENV/bin/pip" install -q --no-deps "$nccl"
fi
if [ "$LEAN" = 1 ]; then
  # NOTE: --no-deps: pip would otherwise resolve torch's own requirements (the CUDA wheels) again.
  # The list is pyproject's dependencies and [test,plot,hf] extras, less torch.
  "$VENV/bin/pip" install -q "setuptools>=77,<82" wheel ninja numpy tqdm "pytest>=8" pytest-timeout \
    "pytest-xdist>=3.5" hypothesis matplotlib "ruff>=0.17,<0.18" "transformers>=4.57"
fi
case "${FLCOMM_SETUP:-all}" in
  all) ;;
  torch) echo "[setup] torch==$TORCH_VERSION is in $VENV (FLCOMM_SETUP=torch: no build)"; exit 0 ;;
  *) echo "[setup] FLCOMM_SETUP: expected all or torch, got '${FLCOMM_SETUP}'" >&2; exit 2 ;;
esac
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then export CUDA_HOME=/usr/local/cuda; fi
echo "[setup] building flcomm in $VENV (CUDA_HOME=${CUDA_HOME:-unset}, FLCOMM_CUDA=${FLCOMM_CUDA:-auto})"
if [ "$LEAN" = 1 ]; then
  "$VENV/bin/pip" install -q --no-build-isolation --no-deps -e .
else
  "$VENV/bin/pip" install -q "setuptools>=77" wheel ninja numpy
  "$VENV/bin/pip" install -q --no-build-isolation -e ".[test,plot,hf,peers]"
fi
"$VENV/bin/python" -m flcomm info
