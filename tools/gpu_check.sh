#!/usr/bin/env bash
# The one prepared check to run on a lent GPU machine (one H200; torch, nvcc, pybind11, ninja and
# nvidia-nccl-cu13 preinstalled; no network). From the repository root:
#
#   tools/gpu_check.sh                # writes every log and JSON under $OUT (default ./gpu_check_out)
#
# Dry run on a machine without a GPU (GPU tests skip): PY=.venv/bin/python GPU_CHECK_SKIP_BUILD=1 \
#   GPU_CHECK_BUDGET_S=200 OUT=/tmp/gpu_check tools/gpu_check.sh
#
# Steps, each bounded by `timeout`, all within GPU_CHECK_BUDGET_S (default 480 s):
#   1. environment (python, torch, nvcc, GPUs)
#   2. build flcomm._C in place for FLCOMM_CUDA_ARCHS (default 90) with the machine's python
#   3. python -m flcomm info (table and JSON)
#   4. pytest -m "gpu or multigpu" (the NCCL communicator, and every CUDA kernel test marked gpu)
#   5. tests/test_kernels.py in full, when present (its CUDA-vs-CPU cases run with a GPU)
#   6. bench/kernels.py and bench/collectives.py --json, when present
# Ends with $OUT/summary.txt (one line per step: rc and seconds) and exits non-zero if a step failed.
#
# No pytest on the GPU machine? Stage the pure-Python test tools here first and carry them:
#   tools/gpu_check.sh --stage-deps   # copies pytest & co. from .venv into build/gpu_pydeps
# then run with carry ["build/gpu_pydeps"]; this script puts it on PYTHONPATH when pytest is missing.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

if [ "${1:-}" = "--stage-deps" ]; then
  site=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  rm -rf build/gpu_pydeps && mkdir -p build/gpu_pydeps
  for p in pytest _pytest pluggy iniconfig packaging py.py pytest_timeout.py hypothesis sortedcontainers; do
    [ -e "$site/$p" ] && cp -r "$site/$p" build/gpu_pydeps/
  done
  find build/gpu_pydeps -name __pycache__ -prune -exec rm -rf {} +
  du -sh build/gpu_pydeps
  exit 0
fi

OUT=${OUT:-$ROOT/gpu_check_out}
mkdir -p "$OUT"
BUDGET=${GPU_CHECK_BUDGET_S:-480}
T0=$(date +%s)
FAILED=0
: > "$OUT/summary.txt"

note() { echo "[gpu_check] $*" | tee -a "$OUT/summary.txt"; }

# step NAME LIMIT_S CMD...: runs CMD with stdout+stderr in $OUT/NAME.log, bounded by LIMIT_S and by
# what is left of the budget (20 s are kept for the summary).
step() {
  local name=$1 limit=$2
  shift 2
  local left=$((BUDGET - ($(date +%s) - T0) - 20))
  if [ "$left" -lt 15 ]; then
    note "$name: skipped (budget spent)"
    FAILED=1
    return 1
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local s=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  local secs=$(($(date +%s) - s))
  [ "$rc" -eq 124 ] && note "$name: TIMED OUT after ${limit} s" || note "$name: rc=$rc in ${secs} s"
  [ "$rc" -ne 0 ] && FAILED=1
  tail -n 5 "$OUT/$name.log" | sed "s/^/    /"
  return "$rc"
}

# ---- python, CUDA toolkit, build settings ----
PY=${PY:-}
if [ -z "$PY" ]; then
  for c in python3 python; do
    if command -v "$c" > /dev/null && "$c" -c "import torch" 2> /dev/null; then PY=$(command -v "$c"); break; fi
  done
fi
[ -z "$PY" ] && { note "no python with torch found"; exit 2; }
if [ -z "${CUDA_HOME:-}" ]; then
  if [ -x /usr/local/cuda/bin/nvcc ]; then
    CUDA_HOME=/usr/local/cuda
  elif command -v nvcc > /dev/null; then
    CUDA_HOME=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")
  fi
fi
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export FLCOMM_CUDA=1 FLCOMM_CUDA_ARCHS=${FLCOMM_CUDA_ARCHS:-90} MAX_JOBS=${MAX_JOBS:-$(nproc)}
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
if ! "$PY" -c "import pytest" 2> /dev/null && [ -d "$ROOT/build/gpu_pydeps" ]; then
  export PYTHONPATH=$PYTHONPATH:$ROOT/build/gpu_pydeps
fi
PYTEST_OPTS=(-q -rs --continue-on-collection-errors -p no:cacheprovider)
# NOTE: pyproject's `timeout` option and timeout marks need pytest-timeout; without it, drop the
# strict-markers addopts so the marks only warn (the step's own `timeout` still bounds the run).
"$PY" -c "import pytest_timeout" 2> /dev/null || PYTEST_OPTS+=(-o "addopts=-ra")
note "python $PY, CUDA_HOME=$CUDA_HOME, arches $FLCOMM_CUDA_ARCHS, MAX_JOBS=$MAX_JOBS, budget ${BUDGET} s"

step env 30 bash -c "
  '$PY' -c 'import sys, torch; print(sys.version); print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda,
            \"gpus\", torch.cuda.device_count(), [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
            \"nccl\", torch.cuda.nccl.version())'
  '$CUDA_HOME/bin/nvcc' --version; nvidia-smi || true; '$PY' -c 'import pytest; print(\"pytest\", pytest.__version__)'"

# ---- build (GPU_CHECK_SKIP_BUILD=1: use the flcomm._C already in the tree, for a dry run) ----
if [ "${GPU_CHECK_SKIP_BUILD:-0}" = 1 ]; then
  note "build: skipped (GPU_CHECK_SKIP_BUILD=1)"
elif ! step build 300 "$PY" setup.py build_ext --inplace --build-temp "build/gpu-sm$FLCOMM_CUDA_ARCHS"; then
  note "build failed: see $OUT/build.log"
  exit 1
fi

step info 60 bash -c "'$PY' -m flcomm info && '$PY' -m flcomm info --json > '$OUT/info.json'"

# ---- tests ----
step pytest_gpu 240 "$PY" -m pytest tests -m "gpu or multigpu" "${PYTEST_OPTS[@]}" \
  --junitxml="$OUT/pytest_gpu.xml"
if [ -f tests/test_kernels.py ]; then
  step pytest_kernels 120 "$PY" -m pytest tests/test_kernels.py "${PYTEST_OPTS[@]}" \
    --junitxml="$OUT/pytest_kernels.xml"
fi

# ---- benchmarks ----
NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2> /dev/null || echo 0)
NGPU=${NGPU:-0}
[ "$NGPU" -gt 8 ] && NGPU=8
if [ -f bench/kernels.py ]; then
  # NOTE: with a GPU only the CUDA rows: the CPU ones are measured on the CPU machines.
  KDEV=(); [ "$NGPU" -ge 1 ] && KDEV=(--device cuda)
  step bench_kernels 90 "$PY" bench/kernels.py "${KDEV[@]}" --json "$OUT/bench_kernels.json"
fi
if [ -f bench/collectives.py ]; then
  # NOTE: one GPU: a 1-rank NCCL world under torchrun, torch vs native transport side by side
  # (exercises the native transport; bandwidth needs more GPUs).
  if [ "$NGPU" -ge 1 ]; then
    step bench_collectives 90 "$PY" -m torch.distributed.run --standalone --nproc-per-node "$NGPU" \
      bench/collectives.py --transport torch native --backend nccl --algos flat -b 1M -e 256M -f 4 \
      --json "$OUT/bench_collectives.json"
  else
    step bench_collectives 90 "$PY" bench/collectives.py --nproc 2 --ranks-per-node 1 --algos flat \
      -b 4K -e 1M -f 16 --json "$OUT/bench_collectives.json"
  fi
fi

note "total $(($(date +%s) - T0)) s; $([ "$FAILED" = 0 ] && echo 'all steps passed' || echo 'some steps FAILED')"
exit "$FAILED"
