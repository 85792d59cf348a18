#!/usr/bin/env bash
# The one prepared check for a lent GPU machine (one H100 or H200; torch 2.11 cu130, NCCL 2.28.9,
# Python 3.12, nvcc 13, pybind11, ninja, pytest, pytest-timeout, hypothesis preinstalled; 16 cores;
# no network; no torchft). From the repo root:
#
#   tools/gpu_check.sh                      # everything, within GPU_CHECK_BUDGET_S (default 470 s)
#   tools/gpu_check.sh --dry-run            # the plan: each step's budget and command, and that they fit
#   tools/gpu_check.sh --pack-prebuilt [SO] # SO (default: CI job 2's build, $CI_SO below) stripped
#                                           # and gzipped to build/gpu_prebuilt/, the folder to carry
#   tools/gpu_check.sh --stage-deps         # copy pytest & co. (pure Python) from $STAGE_PY's venv into
#                                           # build/gpu_pydeps, to carry to a machine without pytest
#
# What comes back, in $OUT (default ./gpu_check_out): summary.json, logs.tgz (every step's log,
# the junit XML, the probes' figures, env/info/gate JSON) and, after a build here, the stripped
# flcomm._C gzipped with its record (_C.<ext>.so.gz and .gz.json, when under 16 MiB): at most 4
# files. A rerun skips the build with it: GPU_CHECK_PREBUILT=path/to/_C.<ext>.so.gz.
#
# The prebuilt _C: GPU_CHECK_PREBUILT, else build/gpu_prebuilt/_C<ext>.gz when it is there
# (--pack-prebuilt writes it; CI job 2 builds flcomm._C against torch 2.11.0 / NCCL 2.28.9 / sm_90
# in build/ci-211). It is used only when it is for this Python (<ext>), its record's hash of
# csrc/ and setup.py is this tree's, and it passes the gate; otherwise the check builds.
# GPU_CHECK_PREBUILT=none: no prebuilt, whatever the default path holds.
#
# Steps, in order of value. Each has a deadline (the sum of the budgets up to it, scaled to the
# budget less RESERVE_S for the summary): time one step leaves unused goes to the next ones. A
# step with a cap never runs longer than it, whatever it inherits.
#   env              versions of python, torch, CUDA, nvcc, driver, NCCL, setuptools, pytest; GPU name
#   prebuilt         the prebuilt _C installed (tools/gpu_summary.py prebuilt) and gated on its own
#   build            flcomm._C in place for FLCOMM_CUDA_ARCHS (default 90), MAX_JOBS = cores; only
#                    without a prebuilt _C or when it failed: then it replaces it
#   gate             the build gate (tools/gpu_summary.py gate): _C loads with CUDA and NCCL, NCCL
#                    compiled = loaded = torch's, a GPU visible; printed loudly when it fails
#   sass_ftz         cuobjdump -sass of the _C: no .FTZ in the quantization kernels
#   nccl_init        one NCCL init and one-rank all_to_all with NCCL_DEBUG=INFO
#   pytest_probes    tests/gpu/test_gpu_probes.py (overlap, FSDP race, offload, residual)
#   pytest_two_ranks tests/gpu/test_two_ranks_one_gpu.py, capped at 60 s: two processes on the one
#                    GPU (own NCCL_HOSTID each): a 2-rank root and its splits, a frozen peer ended
#                    by the watchdog, FedAvg int8 + EF native vs gloo, the replicate hook
#   pytest_native    tests/gpu/test_native_gpu.py: a one-rank Topology.build(transport="native") mesh
#                    and its hooks against transport="torch"; a split's CTA cap in NCCL's init log
#   bench_kernels    bench/kernels.py on cuda, int8 and fp8, 256 MiB and 1 GiB, block 256, GB/s
#                    against a device copy (64 MiB would fit in the H200's L2)
#   bench_coll       bench/collectives.py --transport both on one GPU (torchrun, 1 rank): flat
#                    all-reduce / reduce-scatter / all-gather at 1M, 16M, 256M, ProcessGroupNCCL and
#                    flcomm's NcclTransport side by side (nccl-tests columns; bench_collectives.json)
#   pytest_gpu       the other test files with gpu / multigpu marks (tools/gpu_summary.py gpu-files:
#                    only those files, so that no module the GPU machine cannot import is collected)
# Every pytest step has per-test timeouts (pytest-timeout, signal method: the run goes on after
# one) and -v output, parsed when the XML is missing. Steps marked gpu are skipped (and say why)
# when the gate finds nothing to run them on; GPU_CHECK_FORCE=1 runs them anyway. The CPU tests
# are left to CI.
#
# Rehearsal without a GPU (tests/system/test_gpu_check.py runs it; the gate fails, as it must):
#   PY=/path/to/venv/bin/python GPU_CHECK_SKIP_BUILD=1 OUT=/tmp/gpu_check tools/gpu_check.sh
# Other knobs: GPU_CHECK_SKIP_BENCH=1 (both benches), GPU_CHECK_WORK (work folder, default
# build/gpu_check), GPU_CHECK_TEST_TIMEOUT_S (per test, default 90), GPU_CHECK_MIN_PASSED (default
# 80% of the single-GPU tests selected), GPU_CHECK_TARGET_EXT (--pack-prebuilt: the suffix of the
# Python that will load the _C, default .cpython-312-x86_64-linux-gnu.so). Exit status 0 when
# summary.json says ok. The device call needs a timeout_s of about 500 (the budget, the packing
# and the fetch); carry build/gpu_prebuilt when it holds a prebuilt _C.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
# NOTE: its pytest steps report skips in its own summary; CI's strict-skip rule (FLCOMM_STRICT_SKIPS,
# tests/conftest.py) is for the suite, not for the forced rehearsals CI runs of this script
unset FLCOMM_STRICT_SKIPS
ROOT=$PWD
MODE=run
case "${1:-}" in
  --dry-run) MODE=dry ;;
  --stage-deps) MODE=stage ;;
  --pack-prebuilt) MODE=pack ;;
  "") ;;
  *) echo "usage: $0 [--dry-run | --pack-prebuilt [SO] | --stage-deps]" >&2; exit 2 ;;
esac
if [ $# -gt $([ "$MODE" = pack ] && echo 2 || echo 1) ]; then
  echo "usage: $0 [--dry-run | --pack-prebuilt [SO] | --stage-deps]; got: $*" >&2; exit 2
fi

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

SUMMARY=tools/gpu_summary.py
PREBUILT_DIR=build/gpu_prebuilt  # NOTE: under build/ (ignored): a session carries it to the device
TARGET_EXT=${GPU_CHECK_TARGET_EXT:-.cpython-312-x86_64-linux-gnu.so}  # the GPU machine's Python 3.12
CI_SO=build/ci-211/flcomm/_C$TARGET_EXT  # CI job 2's build (torch 2.11.0, NCCL 2.28.9, sm_90)

if [ "$MODE" = pack ]; then
  so=${2:-$CI_SO}
  if [ ! -e "$so" ]; then
    echo "[gpu_check] --pack-prebuilt: no $so; CI job 2 leaves it there when its venv's Python is 3.12" \
         "(.ci/run: PYTHON=python3.12 for job 2), or pass a _C$TARGET_EXT" >&2
    exit 2
  fi
  exec "${PY:-python3}" "$SUMMARY" pack-prebuilt "$so" "$PREBUILT_DIR" "$TARGET_EXT"
fi

OUT=${OUT:-$ROOT/gpu_check_out}
WORK=${GPU_CHECK_WORK:-$ROOT/build/gpu_check}
BUDGET=${GPU_CHECK_BUDGET_S:-470}
RESERVE_S=20
note() { echo "[gpu_check] $*"; }

# ---- the plan: step, nominal seconds (they sum to 450 = 470 - RESERVE_S), needs the GPU, cap ----
# NOTE: the build's 120 s are spent only without a prebuilt _C that passes its gate; with one,
# they go to the steps after it
PLAN=(env:10:0 prebuilt:15:0 build:120:0 gate:15:0 sass_ftz:10:0 nccl_init:10:1 pytest_probes:50:1
      pytest_two_ranks:60:1:60 pytest_native:25:1 bench_kernels:30:1 bench_coll:25:1 pytest_gpu:80:1)
declare -A DEADLINE NEEDS_GPU BUDGET_OF CAP
nominal=0
for p in "${PLAN[@]}"; do IFS=: read -r _ s _ _ <<< "$p"; nominal=$((nominal + s)); done
usable=$((BUDGET - RESERVE_S))
cum=0
for p in "${PLAN[@]}"; do
  IFS=: read -r name s gpu cap <<< "$p"
  BUDGET_OF[$name]=$((s * usable / nominal))
  cum=$((cum + BUDGET_OF[$name]))
  DEADLINE[$name]=$cum
  NEEDS_GPU[$name]=$gpu
  CAP[$name]=${cap:-}
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
PYTEST_OPTS=(-v -rA -p no:cacheprovider --continue-on-collection-errors -m "gpu or multigpu")
if "$PY" -c "import pytest_timeout" 2> /dev/null; then
  # NOTE: signal: the timeout raises in the test and the run goes on (thread would end the process)
  PYTEST_OPTS+=(--timeout="${GPU_CHECK_TEST_TIMEOUT_S:-90}" --timeout-method=signal)
else
  # NOTE: without pytest-timeout the timeout marks are unknown: drop --strict-markers so they
  # only warn; the step's own deadline still bounds the run
  PYTEST_OPTS+=(-o "addopts=-ra")
fi
EXT=$("$PY" -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))" 2> /dev/null || echo .so)

# ---- the test files: every file with gpu / multigpu marks, found now (N13) ----
PROBES=tests/gpu/test_gpu_probes.py
TWO_RANKS=tests/gpu/test_two_ranks_one_gpu.py
NATIVE=tests/gpu/test_native_gpu.py
mapfile -t GPU_FILES < <("$PY" "$SUMMARY" gpu-files tests)
OTHER_FILES=()
for f in "${GPU_FILES[@]}"; do
  case "$f" in "$PROBES" | "$TWO_RANKS" | "$NATIVE") ;; *) OTHER_FILES+=("$f") ;; esac
done

# ---- the prebuilt _C, if any ----
PREBUILT=${GPU_CHECK_PREBUILT:-}
if [ "$PREBUILT" = none ]; then
  PREBUILT=  # NOTE: asked for: no prebuilt, not even the default path's
elif [ -z "$PREBUILT" ] && [ -e "$PREBUILT_DIR/_C$EXT.gz" ]; then
  PREBUILT=$PREBUILT_DIR/_C$EXT.gz
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

# step NAME CMD...: CMD with its output in $WORK/NAME.log, stopped at the step's deadline or its
# cap. STEP_COUNTS=false before it: a failure of the step is not a failure of the run.
step() {
  local name=$1
  shift
  if [ "$MODE" = dry ]; then
    local cap=${CAP[$name]:+, cap ${CAP[$name]} s}
    local shown=() a
    for a in "$@"; do [[ "$a" = *" "* && "$a" != "  #"* ]] && shown+=("\"$a\"") || shown+=("$a"); done
    printf '[plan] %-16s %4s s (by %3s s%s)%s: %s\n' "$name" "${BUDGET_OF[$name]}" "${DEADLINE[$name]}" "$cap" \
      "$([ "${NEEDS_GPU[$name]}" = 1 ] && echo ' gpu' || echo '    ')" "${shown[*]}"
    return 0
  fi
  if [ "${NEEDS_GPU[$name]}" = 1 ] && [ "$GATE_FATAL" = 1 ] && [ "${GPU_CHECK_FORCE:-0}" != 1 ]; then
    skip "$name" "the build gate failed: nothing to run it on (see gate.json)" false  # NOTE: the gate counts
    return 1
  fi
  local s limit rc secs
  s=$(date +%s)
  limit=$((T0 + DEADLINE[$name] - s))
  if [ -n "${CAP[$name]}" ] && [ "$limit" -gt "${CAP[$name]}" ]; then limit=${CAP[$name]}; fi
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
  record "$name" "\"rc\": $rc, \"seconds\": $secs, \"limit\": $limit, \"timed_out\": $timed_out, \"counts_against\": ${STEP_COUNTS:-true}"
  [[ "$name" = gate || "$name" = prebuilt ]] || tail -n 3 "$WORK/$name.log" | sed "s/^/    /"
  return "$rc"
}

if [ "$MODE" = run ]; then
  rm -rf "$WORK" && mkdir -p "$WORK" "$OUT"
  rm -f "$OUT/summary.json" "$OUT/logs.tgz"
  for f in "$OUT"/_C*.so.gz "$OUT"/_C*.so.gz.json; do  # NOTE: an earlier run's, unless it is the prebuilt
    [ -e "$f" ] && ! [ "$f" -ef "$PREBUILT" ] && ! [ "$f" -ef "$PREBUILT.json" ] && rm -f "$f"
  done
  : > "$WORK/steps.jsonl"
  : > "$FLCOMM_GPU_FIGURES"
  note "python $PY, CUDA_HOME=$CUDA_HOME, arches $FLCOMM_CUDA_ARCHS, MAX_JOBS=$MAX_JOBS, budget ${BUDGET} s, out $OUT"
  note "${#GPU_FILES[@]} test files with gpu marks: ${GPU_FILES[*]}"
fi

step env "$PY" "$SUMMARY" env "$WORK"

# ---- the _C: a prebuilt one that fits and passes its gate, else a build ----
if [ "$MODE" = dry ] && [ -z "$PREBUILT" ]; then PREBUILT="\${GPU_CHECK_PREBUILT:-$PREBUILT_DIR/_C$EXT.gz}"; fi
prebuilt_ok=0
if [ -z "$PREBUILT" ]; then
  skip prebuilt "$([ "${GPU_CHECK_PREBUILT:-}" = none ] && echo "GPU_CHECK_PREBUILT=none" \
    || echo "no GPU_CHECK_PREBUILT and no $PREBUILT_DIR/_C$EXT.gz"): the _C is built" false
elif STEP_COUNTS=false step prebuilt "$PY" "$SUMMARY" prebuilt "$WORK" "$PREBUILT" "$EXT" "$FLCOMM_CUDA_ARCHS"; then
  [ "$MODE" = run ] && prebuilt_ok=1
elif [ "$MODE" = run ]; then
  note "prebuilt: the prebuilt _C is not used; falling back to a build:"
  grep -E "NOT USED|BUILD GATE|^  - " "$WORK/prebuilt.log" | sed "s/^/    /"
  # NOTE: a failed build must not leave a prebuilt _C that failed its gate to be gated as built
  grep -q "installed as" "$WORK/prebuilt.log" && rm -f "flcomm/_C$EXT"
fi
if [ "$MODE" = dry ]; then
  step build "$PY" setup.py build_ext --inplace --build-temp "build/gpu-sm$FLCOMM_CUDA_ARCHS" \
    "  # only without a prebuilt _C, or when it failed"
elif [ "$prebuilt_ok" = 1 ]; then
  skip build "the prebuilt _C ($PREBUILT) passed its gate" false
elif [ "${GPU_CHECK_SKIP_BUILD:-0}" = 1 ]; then
  skip build "GPU_CHECK_SKIP_BUILD=1: the flcomm._C in the tree is used" false
elif step build "$PY" setup.py build_ext --inplace --build-temp "build/gpu-sm$FLCOMM_CUDA_ARCHS"; then
  # NOTE: the stripped _C for a rerun without the build (GPU_CHECK_PREBUILT=$OUT/_C<ext>.gz)
  [ "$MODE" = run ] && "$PY" "$SUMMARY" pack-prebuilt "flcomm/_C$EXT" "$OUT" "$EXT" > "$WORK/so_pack.log" 2>&1
  [ "$MODE" = run ] && sed "s/^/    /" "$WORK/so_pack.log"
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

step nccl_init env NCCL_DEBUG=INFO "$PY" "$SUMMARY" nccl-init
step pytest_probes "$PY" -m pytest "$PROBES" "${PYTEST_OPTS[@]}" --junitxml="$WORK/pytest_probes.xml"
step pytest_two_ranks "$PY" -m pytest "$TWO_RANKS" "${PYTEST_OPTS[@]}" --junitxml="$WORK/pytest_two_ranks.xml"
step pytest_native "$PY" -m pytest "$NATIVE" "${PYTEST_OPTS[@]}" --junitxml="$WORK/pytest_native.xml"
if [ "${GPU_CHECK_SKIP_BENCH:-0}" = 1 ]; then
  skip bench_kernels "GPU_CHECK_SKIP_BENCH=1" false
  skip bench_coll "GPU_CHECK_SKIP_BENCH=1" false
else
  step bench_kernels "$PY" bench/kernels.py --device cuda --formats int8 fp8 --sizes 256M 1G --block-sizes 256 \
    --json "$WORK/bench_kernels.json"
  step bench_coll "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 bench/collectives.py \
    --transport both --algos flat --codecs none -b 1M -e 256M -f 16 -w 3 -n 20 --json "$WORK/bench_collectives.json"
fi
if [ "${#OTHER_FILES[@]}" = 0 ]; then
  skip pytest_gpu "no test file with gpu marks found by tools/gpu_summary.py gpu-files tests"
else
  step pytest_gpu "$PY" -m pytest "${OTHER_FILES[@]}" "${PYTEST_OPTS[@]}" --junitxml="$WORK/pytest_gpu.xml"
fi

if [ "$MODE" = dry ]; then
  total=${DEADLINE[pytest_gpu]}
  printf '[plan] %-16s %4s s: %s\n' summary "$RESERVE_S" "$OUT/summary.json and $OUT/logs.tgz (tools/gpu_summary.py)"
  verdict=$([ $((total + RESERVE_S)) -le "$BUDGET" ] && echo fits || echo "DOES NOT FIT")
  echo "[plan] steps ${total} s + summary ${RESERVE_S} s = $((total + RESERVE_S)) s of a ${BUDGET} s budget: $verdict"
  echo "[plan] ${#GPU_FILES[@]} test files with gpu marks; the build's ${BUDGET_OF[build]} s go to the later steps" \
       "when a prebuilt _C passes its gate"
  [ "$verdict" = fits ]
  exit
fi

"$PY" "$SUMMARY" summarize "$WORK" "$OUT" "$BUDGET" "$(($(date +%s) - T0))"
rc=$?
"$PY" "$SUMMARY" pack "$WORK" "$OUT" || rc=1
note "back in $OUT: $(cd "$OUT" && echo *)"
exit "$rc"
