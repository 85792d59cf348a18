#!/usr/bin/env bash
# Rebuild flcomm._C in place for development, one build at a time on this machine (flock), and
# incrementally (ninja: only changed sources recompile). Default: with CUDA for sm_90 only, so
# every .cu/.cpp is compile-checked; FLCOMM_CUDA=0 for a CPU-only build.
set -euo pipefail
cd "$(dirname "$0")/.."
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export FLCOMM_CUDA=${FLCOMM_CUDA:-1} FLCOMM_CUDA_ARCHS=${FLCOMM_CUDA_ARCHS:-90}
tag=$([ "$FLCOMM_CUDA" = 0 ] && echo cpu || echo "cuda$FLCOMM_CUDA_ARCHS")
exec flock /tmp/flcomm-build.lock .venv/bin/python setup.py -q build_ext --inplace --build-temp "build/dev-$tag"
