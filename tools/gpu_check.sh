#!/usr/bin/env bash
# The one prepared check for a lent GPU machine (one H200; torch 2.11 cu130, Python 3.12, nvcc 13,
# pybind11, ninja, nvidia-nccl-cu13 preinstalled; 16 cores; no network). From the repo root:
#
#   tools/gpu_check.sh               # everything, within GPU_CHECK_BUDGET_S (default 420 s)
#   tools/gpu_check.sh --dry-run     # the plan: each step's budget and command, and that they fit
#   tools/gpu_check.sh --stage-deps  # copy pytest & co. (pure Python) from $STAGE_PY's venv into
#                                    # build/gpu_pydeps, to carry to a machine without pytest
#
# What comes back, in $OUT (default ./gpu_check_out): summary.json, logs.tgz (every step's log,
# the junit XML, the probes' figures, env/info/gate JSON) and, after a build here, the stripped
# flcomm._C gzipped (_C.<ext>.so.gz, when under 16 MiB). A rerun can skip the build with it:
#   GPU_CHECK_PREBUILT=path/to/_C.cpython-312-x86_64-linux-gnu.so.gz tools/gpu_check.sh
#
# Steps, in order of value. Each has a deadline (the sum of the budgets up to it, scaled to the
# budget less RESERVE_S for the summary): time one step leaves unused goes to the next ones.
#   env            versions of python, torch, CUDA, nvcc, driver, NCCL, setuptools, pytest; GPU name
#   build          flcomm._C in place for FLCOMM_CUDA_ARCHS (default 90), MAX_JOBS = cores
#   gate           the build gate (tools/gpu_summary.py gate): _C loads with CUDA and NCCL, NCCL
#                  compiled = loaded = torch's, a GPU visible; printed loudly when it fails
#   sass_ftz       cuobjdump -sass of the built _C: no .FTZ in the quantization kernels
#   bench_kernels  bench/kernels.py on cuda, int8 and fp8, 256 MiB and 1 GiB, block 256, GB/s
#                  against a device copy (64 MiB would fit in the H200's L2)
#   nccl_init      one NCCL init and one-rank all_to_all with NCCL_DEBUG=INFO
#   pytest_native  tests/gpu/test_native_gpu.py: a one-rank Topology.build(transport="native") mesh
#                  and its hooks against transport="torch"; a split's CTA cap in NCCL's init log
#   bench_coll     bench/collectives.py --transport both on one GPU (torchrun, 1 rank): flat
#                  all-reduce / reduce-scatter / all-gather at 1M, 16M, 256M, ProcessGroupNCCL and
#                  flcomm's NcclTransport side by side (nccl-tests columns; bench_collectives.json)
#   pytest_gpu     every other gpu / multigpu test but the probes; per-test timeouts (pytest-timeout,
#                  signal method: the run goes on after one), -v output parsed if the XML is missing
#   pytest_probes  tests/gpu/test_gpu_probes.py
# Steps marked gpu are skipped (and say why) when the gate finds nothing to run them on; set
# GPU_CHECK_FORCE=1 to run them anyway. The CPU tests are left to CI.
#
# Rehearsal without a GPU (tests/system/test_gpu_check.py runs it; the gate fails, as it must):
#   PY=/path/to/venv/bin/python GPU_CHECK_SKIP_BUILD=1 OUT=/tmp/gpu_check tools/gpu_check.sh
# Other knobs: GPU_CHECK_SKIP_BENCH=1 (both benches), GPU_CHECK_WORK (work folder, default build/gpu_check),
# GPU_CHECK_TEST_TIMEOUT_S (per test, default 90), GPU_CHECK_MIN_PASSED (default 80% of the
# single-GPU tests selected). Exit status 0 when summary.json says ok. The device call needs a
# timeout_s of about 450 (the budget and the packing); pytest, pytest-timeout and hypothesis are
# on the H200 image, so nothing needs carrying but a prebuilt _C if one is used.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
ROOT=$PWD
MODE=run
case "${1:-}" in
  --dry-run) MODE=dry ;;
  --stage-deps) MODE=stage ;;
  "") ;;
  *) echo "usage: $0 [--dry-run | --stage-deps]" >&2; exit 2 ;;
esac

if [ "$MODE" = stage ]; then
  SPY=${STAGE_PY:-.venv/bin/python}
  site=$("$SPY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  rm -rf build/gpu_pydeps && mkdir -p build/gpu_pydeps
  for p in pytest _pytest pluggy iniconfig packaging pygments py.py pytest_timeout.py hypothesis \
           _hypothesis_pytestplugin.py sortedcontainers attr attrs; do
    [ -e "$site/$p" ] && cp -r "$site/$p" build/gpu_pydeps/
  done
  find build/gpu_pydeps -name __pycache__ -prune -exec rm -rf {} +
  du -sh build/gpu_pydeps
  exit 0
fi

OUT=${OUT:-$ROOT/gpu_check_out}
WORK=${GPU_CHECK_WORK:-$ROOT/build/gpu_check}
BUDGET=${GPU_CHECK_BUDGET_S:-420}
RESERVE_S=20
SUMMARY=tools/gpu_summary.py
note() { echo "[gpu_check] $*"; }

# ---- the plan: step, nominal seconds (they sum to 400 = 420 - RESERVE_S), needs the GPU ----
PLAN=(env:15:0 build:160:0 gate:15:0 sass_ftz:10:0 bench_kernels:35:1 nccl_init:10:1 pytest_native:25:1
      bench_coll:20:1 pytest_gpu:65:1 pytest_probes:45:1)
declare -A DEADLINE NEEDS_GPU BUDGET_OF
nominal=0
for p in "${PLAN[@]}"; do IFS=: read -r _ s _ <<< "$p"; nominal=$((nominal + s)); done
usable=$((BUDGET - RESERVE_S))
cum=0
for p in "${PLAN[@]}"; do
  IFS=: read -r name s gpu <<< "$p"
  BUDGET_OF[$name]=$((s * usable / nominal))
  cum=$((cum + BUDGET_OF[$name]))
  DEADLINE[$name]=$cum
  NEEDS_GPU[$name]=$gpu
done

# ---- python, CUDA toolkit, build settings ----
PY=${PY:-}
if [ -z "$PY" ]; then
  for c in python3 python; do
    if command -v "$c" > /dev/null && "$c" -c "import torch" 2> /dev/null; then PY=$(command -v "$c"); break; fi
  done
fi
if [ -z "$PY" ]; then
  if [ "$MODE" != dry ]; then note "no python with torch found"; exit 2; fi
  PY=python3
fi
if [ -z "${CUDA_HOME:-}" ]; then
  if [ -x /usr/local/cuda/bin/nvcc ]; then
    CUDA_HOME=/usr/local/cuda
  elif command -v nvcc > /dev/null; then
    CUDA_HOME=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")
  fi
fi
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export FLCOMM_CUDA=1 FLCOMM_CUDA_ARCHS=${FLCOMM_CUDA_ARCHS:-90} MAX_JOBS=${MAX_JOBS:-$(nproc)}
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export FLCOMM_GPU_FIGURES=$WORK/figures.jsonl
if ! "$PY" -c "import pytest" 2> /dev/null && [ -d "$ROOT/build/gpu_pydeps" ]; then
  export PYTHONPATH=$PYTHONPATH:$ROOT/build/gpu_pydeps
fi
PYTEST_OPTS=(-v -rA -p no:cacheprovider --continue-on-collection-errors)
if "$PY" -c "import pytest_timeout" 2> /dev/null; then
  # NOTE: signal: the timeout raises in the test and the run goes on (thread would end the process)
  PYTEST_OPTS+=(--timeout="${GPU_CHECK_TEST_TIMEOUT_S:-90}" --timeout-method=signal)
else
  # NOTE: without pytest-timeout the timeout marks are unknown: drop --strict-markers so they
  # only warn; the step's own deadline still bounds the run
  PYTEST_OPTS+=(-o "addopts=-ra")
fi

T0=$(date +%s)
GATE_FATAL=0

# record NAME JSON-FIELDS: one line of $WORK/steps.jsonl
record() { echo "{\"step\": \"$1\", $2}" >> "$WORK/steps.jsonl"; }

# skip NAME WHY [counts]: the step did not run; counts=false when that was asked for (an option)
skip() {
  note "$1: skipped ($2)"
  [ "$MODE" = dry ] || record "$1" "\"rc\": null, \"seconds\": 0, \"skipped\": \"$2\", \"counts_against\": ${3:-true}"
}

# step NAME CMD...: CMD with its output in $WORK/NAME.log, stopped at the step's deadline.
step() {
  local name=$1
  shift
  if [ "$MODE" = dry ]; then
    printf '[plan] %-14s %4s s (by %3s s)%s: %s\n' "$name" "${BUDGET_OF[$name]}" "${DEADLINE[$name]}" \
      "$([ "${NEEDS_GPU[$name]}" = 1 ] && echo ' gpu' || echo '    ')" "$*"
    return 0
  fi
  if [ "${NEEDS_GPU[$name]}" = 1 ] && [ "$GATE_FATAL" = 1 ] && [ "${GPU_CHECK_FORCE:-0}" != 1 ]; then
    skip "$name" "the build gate failed: nothing to run it on (see gate.json)" false  # NOTE: the gate counts
    return 1
  fi
  local s limit rc secs
  s=$(date +%s)
  limit=$((T0 + DEADLINE[$name] - s))
  if [ "$limit" -lt 5 ]; then
    skip "$name" "budget spent: ${limit} s left before its deadline at ${DEADLINE[$name]} s"
    return 1
  fi
  timeout --kill-after=5 "$limit" "$@" > "$WORK/$name.log" 2>&1
  rc=$?
  secs=$(($(date +%s) - s))
  local timed_out=false
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then timed_out=true; note "$name: TIMED OUT after ${limit} s"
  else note "$name: rc=$rc in ${secs} s (limit ${limit} s)"; fi
  record "$name" "\"rc\": $rc, \"seconds\": $secs, \"limit\": $limit, \"timed_out\": $timed_out"
  [ "$name" = gate ] || tail -n 3 "$WORK/$name.log" | sed "s/^/    /"
  return "$rc"
}

# The stripped, gzipped _C for a rerun without the build ($OUT/_C.<ext>.so.gz, under 16 MiB).
pack_so() {
  local so=$1 gz
  gz=$OUT/$(basename "$so").gz
  strip --strip-unneeded -o "$WORK/_C_stripped.so" "$so" 2> /dev/null || cp "$so" "$WORK/_C_stripped.so"
  gzip -6 -c "$WORK/_C_stripped.so" > "$gz"
  local n
  n=$(stat -c %s "$gz")
  if [ "$n" -ge $((16 << 20)) ]; then
    rm -f "$gz"
    note "so: $(basename "$gz") is $n bytes, over 16 MiB: not kept"
  else
    note "so: $(basename "$gz") ($n bytes) for GPU_CHECK_PREBUILT"
  fi
  echo "{\"so\": \"$(basename "$so")\", \"gz_bytes\": $n, \"kept\": $([ -e "$gz" ] && echo true || echo false)}" \
    > "$WORK/so_pack.json"
}

if [ "$MODE" = run ]; then
  rm -rf "$WORK" && mkdir -p "$WORK" "$OUT"
  rm -f "$OUT/summary.json" "$OUT/logs.tgz" "$OUT"/_C*.so.gz
  : > "$WORK/steps.jsonl"
  : > "$FLCOMM_GPU_FIGURES"
  note "python $PY, CUDA_HOME=$CUDA_HOME, arches $FLCOMM_CUDA_ARCHS, MAX_JOBS=$MAX_JOBS, budget ${BUDGET} s, out $OUT"
fi
EXT=$("$PY" -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))" 2> /dev/null || echo .so)

step env "$PY" "$SUMMARY" env "$WORK"

if [ -n "${GPU_CHECK_PREBUILT:-}" ]; then
  step build bash -c "gunzip -c '$GPU_CHECK_PREBUILT' > 'flcomm/_C$EXT' && echo 'prebuilt: $GPU_CHECK_PREBUILT'"
elif [ "${GPU_CHECK_SKIP_BUILD:-0}" = 1 ]; then
  skip build "GPU_CHECK_SKIP_BUILD=1: the flcomm._C in the tree is used" false
elif step build "$PY" setup.py build_ext --inplace --build-temp "build/gpu-sm$FLCOMM_CUDA_ARCHS"; then
  [ "$MODE" = run ] && pack_so "flcomm/_C$EXT"
fi

step gate "$PY" "$SUMMARY" gate "$WORK" "$FLCOMM_CUDA_ARCHS"
gate_rc=$?
if [ "$MODE" = run ]; then
  [ "$gate_rc" = 0 ] || GATE_FATAL=$([ "$gate_rc" = 1 ] && echo 0 || echo 1)  # NOTE: 1: fails, GPU steps still run
  sed -n '/BUILD GATE/,$p' "$WORK/gate.log"
fi

if [ "$MODE" = run ] && [ ! -e "flcomm/_C$EXT" ]; then
  skip sass_ftz "no flcomm/_C$EXT to disassemble"
else
  step sass_ftz "$PY" "$SUMMARY" sass "$WORK" "flcomm/_C$EXT" "$CUDA_HOME/bin/cuobjdump"
fi

if [ "${GPU_CHECK_SKIP_BENCH:-0}" = 1 ]; then
  skip bench_kernels "GPU_CHECK_SKIP_BENCH=1" false
else
  step bench_kernels "$PY" bench/kernels.py --device cuda --formats int8 fp8 --sizes 256M 1G --block-sizes 256 \
    --json "$WORK/bench_kernels.json"
fi

step nccl_init env NCCL_DEBUG=INFO "$PY" "$SUMMARY" nccl-init
step pytest_native "$PY" -m pytest tests/gpu/test_native_gpu.py -m "gpu or multigpu" "${PYTEST_OPTS[@]}" \
  --junitxml="$WORK/pytest_native.xml"
if [ "${GPU_CHECK_SKIP_BENCH:-0}" = 1 ]; then
  skip bench_coll "GPU_CHECK_SKIP_BENCH=1" false
else
  step bench_coll "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 bench/collectives.py \
    --transport both --algos flat --codecs none -b 1M -e 256M -f 16 -w 3 -n 20 --json "$WORK/bench_collectives.json"
fi
step pytest_gpu "$PY" -m pytest tests -m "gpu or multigpu" --ignore=tests/gpu/test_gpu_probes.py \
  --ignore=tests/gpu/test_native_gpu.py "${PYTEST_OPTS[@]}" --junitxml="$WORK/pytest_gpu.xml"
step pytest_probes "$PY" -m pytest tests/gpu/test_gpu_probes.py -m "gpu or multigpu" "${PYTEST_OPTS[@]}" \
  --junitxml="$WORK/pytest_probes.xml"

if [ "$MODE" = dry ]; then
  total=${DEADLINE[pytest_probes]}
  printf '[plan] %-14s %4s s: %s\n' summary "$RESERVE_S" "$OUT/summary.json and $OUT/logs.tgz (tools/gpu_summary.py)"
  verdict=$([ $((total + RESERVE_S)) -le "$BUDGET" ] && echo fits || echo "DOES NOT FIT")
  echo "[plan] steps ${total} s + summary ${RESERVE_S} s = $((total + RESERVE_S)) s of a ${BUDGET} s budget: $verdict"
  [ "$verdict" = fits ]
  exit
fi

"$PY" "$SUMMARY" summarize "$WORK" "$OUT" "$BUDGET" "$(($(date +%s) - T0))"
rc=$?
"$PY" "$SUMMARY" pack "$WORK" "$OUT" || rc=1
note "back in $OUT: $(cd "$OUT" && echo *)"
exit "$rc"
