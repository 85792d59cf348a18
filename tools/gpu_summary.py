"""The Python half of tools/gpu_check.sh: the steps that are checks rather than commands, and the
summary. Every subcommand reads and writes files in the check's work folder (WORK):

  env WORK            versions (python, torch, CUDA, nvcc, driver, NCCL, setuptools, pytest) and
                      the GPU name -> WORK/env.json
  gate WORK ARCHS     the build gate (:func:`gate`) on ``python -m flcomm info --json`` ->
                      WORK/info.json, WORK/gate.json; exit 0 pass, 1 fail, 2 fail and nothing
                      needing the GPU build can run (no native module, no CUDA, no GPU)
  sass WORK SO CUOBJDUMP   .FTZ instructions in the quantization kernels' SASS -> WORK/sass_ftz.json
  nccl-init WORK      one NCCL init (NCCL_DEBUG=INFO set by the caller) and a one-rank all_to_all
  summarize WORK OUT  WORK/* -> OUT/summary.json (exit 0 when ok)
  pack WORK OUT       WORK/* -> OUT/logs.tgz (files over 4 MiB keep their head and tail)
  gpu-files TESTS     the test files that hold gpu / multigpu marks (:func:`gpu_test_files`), one a line
  pack-prebuilt SO DIR EXT   SO stripped and gzipped into DIR, with its record (:func:`pack_prebuilt`)
  prebuilt WORK GZ EXT ARCHS a packed _C installed as flcomm/_C<EXT> when its record fits this tree and
                      this Python (:func:`install_prebuilt`), then its own gate -> WORK/prebuilt.json,
                      WORK/gate_prebuilt.json; exit 0 when it is used, else the gate's code or 1

Only ``env``, ``gate`` (through its subprocess) and ``nccl-init`` import torch; the summary, the
packing and the prebuilt's checks need nothing but the standard library, so they run whatever else
broke.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import math
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from typing import Any

#: the float kernels of csrc/quant_cuda.cu and csrc/sparse_cuda.cu, whose SASS must hold no .FTZ
QUANT_KERNELS = ("quant_blocks_kernel", "dequant_blocks_kernel", "cast_kernel", "uncast_kernel",
                 "topk_encode_kernel", "topk_decode_kernel")
#: ok needs at least this fraction of the single-GPU tests (gpu-marked, selected) to pass
MIN_PASSED_FRACTION = 0.8
#: pytest steps; their junit XML and logs are WORK/<step>.xml and WORK/<step>.log
PYTEST_STEPS = ("pytest_probes", "pytest_two_ranks", "pytest_native", "pytest_gpu")
#: the multi-rank NCCL paths of tests/gpu/test_two_ranks_one_gpu.py, by test (the only multi-rank
#: coverage one GPU can give; tests/unit/test_gpu_summary.py checks the names against the file)
MULTI_RANK_STEP = "pytest_two_ranks"
MULTI_RANK_PATHS = {
    "test_root_communicator_and_splits": "a native 2-rank root communicator and its splits (all_reduce, "
                                         "all_gather, reduce_scatter, all_to_all)",
    "test_dead_peer_aborted_by_the_watchdog": "a frozen peer's stream-ordered all_reduce ended by the watchdog "
                                              "(ncclCommAbort, CommFailure)",
    "test_fedavg_int8_error_feedback_native_matches_gloo": "a 2-rank FedAvg sync, int8 + error feedback, on "
                                                           "transport='native' against transport='torch' (gloo)",
    "test_replicate_hook_native_matches_gloo": "the replicate all-reduce hook on a 2-rank native communicator "
                                               "against gloo",
}
#: how the two-ranks probe says that NCCL would not set up two ranks on one GPU (a skip's message)
REFUSED = "NCCL refused two ranks on one GPU"
#: how pytest-timeout (signal method) fails a test that ran past its limit
TIMEOUT_MESSAGE = re.compile(r"Timeout \(>[\d.]+s\) from pytest-timeout")
#: the test files' marks that the GPU steps select (``@pytest.mark.gpu``, ``pytestmark = ...``, ``marks=``)
GPU_MARK = re.compile(r"^\s*(?:@|pytestmark\s*=.*|.*\bmarks\s*=.*)pytest\.mark\.(?:gpu|multigpu)\b", re.M)
#: what the build of flcomm._C reads: a prebuilt _C fits a tree whose hash of these is its own
BUILD_SOURCES = ("setup.py", "csrc")
GZ_LIMIT = 16 << 20  # a packed _C over this is not kept (what comes back from a device run is limited)
TAIL_LINES = 40
#: the columns of bench/kernels.py's records kept in the summary (all are in logs.tgz)
BENCH_KEYS = ("kernel", "codec", "block_size", "size_bytes", "gbps", "copy_gbps", "of_copy", "torch_ops_gbps")
PACK_FILE_LIMIT = 4 << 20


def _write(path: str, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, default=str)


def _load(path: str) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _jsonl(path: str) -> list[dict]:
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            out.append({"unreadable": line[:200]})
    return out


def tail(path: str, n: int = TAIL_LINES) -> str:
    """The last ``n`` lines of a text file ('' when missing)."""
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


def _run(cmd: list[str], timeout: float = 20) -> str:
    """stdout+stderr of ``cmd``, or why it did not run."""
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        return (p.stdout + p.stderr).strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"not run: {e}"


# ---------------------------------------------------------------- env
def _dist_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def collect_env() -> dict[str, Any]:
    """Versions and the GPU, each from the tool that owns it (nvidia-smi, else torch and
    /proc for the driver)."""
    env: dict[str, Any] = {"python": sys.version.split()[0], "executable": sys.executable}
    for name in ("setuptools", "pytest", "pytest-timeout", "hypothesis", "nvidia-nccl-cu13", "cupy-cuda13x", "ninja"):
        env[name] = _dist_version(name)
    cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    nvcc = _run([os.path.join(cuda_home, "bin", "nvcc"), "--version"])
    m = re.search(r"release ([\d.]+), V([\d.]+)", nvcc)
    env["nvcc"] = m.group(2) if m else nvcc[-200:]
    smi = _run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"])
    env["nvidia_smi"] = smi
    if smi and not smi.startswith("not run") and "," in smi:
        name, driver, mem = [s.strip() for s in smi.splitlines()[0].split(",")[:3]]
        env.update(gpu_name=name, driver=driver, gpu_memory=mem)
    try:
        with open("/proc/driver/nvidia/version") as f:
            env["driver_proc"] = f.readline().strip()
    except OSError:
        pass
    import torch

    env.update(torch=torch.__version__, torch_cuda=torch.version.cuda, cuda_available=torch.cuda.is_available(),
               gpus=torch.cuda.device_count() if torch.cuda.is_available() else 0)
    try:
        v = torch.cuda.nccl.version()
        env["torch_nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception as e:  # noqa: BLE001 - a CPU build of torch
        env["torch_nccl"] = f"error: {e}"
    if env["gpus"]:
        env.setdefault("gpu_name", torch.cuda.get_device_name(0))
        cap = torch.cuda.get_device_capability(0)
        env["capability"] = f"sm_{cap[0]}{cap[1]}"
        try:
            env["cuda_driver_api"] = torch.cuda.driver_version() if hasattr(torch.cuda, "driver_version") else None
        except Exception:  # noqa: BLE001
            pass
    return env


# ---------------------------------------------------------------- gate
def gate(info: dict | None, want_archs: str, info_error: str = "") -> dict[str, Any]:
    """The build gate on ``python -m flcomm info --json``: flcomm._C loads, with CUDA and NCCL
    compiled in, for the arches asked for, a GPU is visible, and the NCCL versions compiled,
    loaded and torch's agree. ``fatal`` reasons leave nothing for the GPU steps to run."""
    fatal, fail = [], []
    if info is None:
        return {"ok": False, "fatal": [f"`python -m flcomm info --json` gave no JSON: {info_error[-600:]}"],
                "fail": [], "nccl": {}}
    if not info.get("native"):
        fatal.append(f"flcomm._C did not load: {info.get('native_error')}")
    elif not info.get("cuda_compiled"):
        fatal.append("flcomm._C was built without CUDA (cuda_compiled false)")
    elif not info.get("cuda_kernels"):
        fatal.append("flcomm._C registers no CUDA kernels")
    if not info.get("gpus"):
        fatal.append("no CUDA GPU visible (gpus 0)")
    nccl = {k: info.get(k) for k in ("nccl_compiled", "nccl_loaded", "torch_nccl")}
    if info.get("native") and not nccl["nccl_compiled"]:
        fail.append("flcomm._C was built without NCCL (nccl_compiled null)")
    elif info.get("native") and len(set(nccl.values())) != 1:
        fail.append("NCCL versions disagree: compiled {nccl_compiled}, loaded {nccl_loaded}, torch "
                    "{torch_nccl}".format(**nccl))
    archs = info.get("cuda_archs") or []
    for a in filter(None, re.split(r"[ ;,_]+", want_archs)):
        if info.get("cuda_compiled") and f"sm_{a.replace('.', '')}" not in archs:
            fail.append(f"built for {archs}, sm_{a} was asked for")
    return {"ok": not fatal and not fail, "fatal": fatal, "fail": fail, "nccl": nccl,
            "cuda_archs": archs, "cuda_runtime": info.get("cuda_runtime")}


def _gate_main(work: str, archs: str, name: str = "gate") -> int:
    """The gate, written to WORK/<name>.json (and the info to WORK/info.json, or
    WORK/<name>_info.json for a gate other than the final one)."""
    p = subprocess.run([sys.executable, "-m", "flcomm", "info", "--json"], capture_output=True, text=True,
                       timeout=120)
    info = None
    try:
        info = json.loads(p.stdout)
    except ValueError:
        pass
    if info is not None:
        _write(os.path.join(work, "info.json" if name == "gate" else f"{name}_info.json"), info)
    g = gate(info, archs, p.stdout + p.stderr)
    _write(os.path.join(work, f"{name}.json"), g)
    print(json.dumps(info, indent=1))
    if g["ok"]:
        print(f"BUILD GATE PASSED: CUDA, NCCL {g['nccl'].get('nccl_compiled')} (compiled = loaded = torch's), "
              f"{g['cuda_archs']}")
        return 0
    bar = "!" * 78
    print(f"{bar}\nBUILD GATE FAILED" + (" (nothing needing the GPU build can run)" if g["fatal"] else ""))
    for r in g["fatal"] + g["fail"]:
        print(f"  - {r}")
    print(bar)
    return 2 if g["fatal"] else 1


# ---------------------------------------------------------------- which tests, which _C
def gpu_test_files(tests_dir: str) -> list[str]:
    """The ``test_*.py`` files under ``tests_dir`` that mark a test gpu or multigpu
    (:data:`GPU_MARK`), sorted. The GPU steps run only these: collecting the whole suite would
    import modules whose packages the GPU machine lacks (tests/system/test_peers.py: torchft, N13)."""
    if not os.path.isdir(tests_dir):
        raise FileNotFoundError(f"gpu-files: {tests_dir!r} is not a folder of tests")
    found = []
    for folder, dirs, files in os.walk(tests_dir):
        dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__")))
        for name in sorted(files):
            if name.startswith("test_") and name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path, errors="replace") as f:
                    if GPU_MARK.search(f.read()):
                        found.append(os.path.normpath(path))
    return sorted(found)


def sources_hash(root: str) -> str:
    """sha256 of what the build of flcomm._C reads (:data:`BUILD_SOURCES`: each file's path
    relative to ``root`` and its bytes, in path order): a prebuilt _C fits a tree with the same."""
    h = hashlib.sha256()
    paths = []
    for src in BUILD_SOURCES:
        full = os.path.join(root, src)
        if os.path.isfile(full):
            paths.append(src)
        elif os.path.isdir(full):
            for folder, dirs, files in os.walk(full):
                dirs[:] = [d for d in dirs if d != "__pycache__"]
                paths += [os.path.relpath(os.path.join(folder, n), root) for n in files]
        else:
            raise FileNotFoundError(f"sources_hash: {full} is missing (the build reads it)")
    for rel in sorted(paths):
        with open(os.path.join(root, rel), "rb") as f:
            h.update(rel.encode() + b"\0" + f.read() + b"\0")
    return h.hexdigest()


def pack_prebuilt(so: str, dest_dir: str, ext: str, root: str) -> dict[str, Any]:
    """``so`` stripped (``strip --strip-unneeded``, a copy when strip fails) and gzipped to
    ``dest_dir/_C<ext>.gz``, with its record beside it (``.json``: the sources' hash, sizes,
    where it came from). ValueError when ``so`` is not a _C for ``ext`` (the Python that will
    load it: a _C for another CPython does not import) or packs over :data:`GZ_LIMIT`."""
    name = os.path.basename(so)
    if not os.path.isfile(so):
        raise FileNotFoundError(f"pack-prebuilt: no flcomm._C at {so}")
    if name != f"_C{ext}":
        raise ValueError(f"pack-prebuilt: {name} is not _C{ext}: the GPU machine's Python loads only a _C named "
                         f"_C{ext} (build it with that Python, e.g. CI job 2 with PYTHON=python3.12), or set "
                         "GPU_CHECK_TARGET_EXT to the suffix of the Python that will load it")
    os.makedirs(dest_dir, exist_ok=True)
    gz = os.path.join(dest_dir, f"{name}.gz")
    with tempfile.TemporaryDirectory() as tmp:
        stripped = os.path.join(tmp, name)
        p = subprocess.run(["strip", "--strip-unneeded", "-o", stripped, so], capture_output=True, text=True)
        how = "strip --strip-unneeded"
        if p.returncode:
            with open(so, "rb") as f, open(stripped, "wb") as g:
                g.write(f.read())
            how = f"not stripped ({(p.stderr or 'strip failed').strip()[:200]})"
        with open(stripped, "rb") as f:
            data = f.read()
    packed = gzip.compress(data, 6)
    if len(packed) >= GZ_LIMIT:
        raise ValueError(f"pack-prebuilt: {name} packs to {len(packed)} bytes, over {GZ_LIMIT}: not kept")
    with open(gz + ".part", "wb") as f:
        f.write(packed)
    os.replace(gz + ".part", gz)
    rec = {"so": name, "from": os.path.abspath(so), "sources_sha256": sources_hash(root), "bytes": len(data),
           "gz_bytes": len(packed), "how": how, "packed_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    _write(gz + ".json", rec)
    return {**rec, "gz": gz}


def install_prebuilt(gz: str, ext: str, root: str) -> dict[str, Any]:
    """Install a packed _C (``gz``, from :func:`pack_prebuilt`) as ``root/flcomm/_C<ext>`` when it
    fits: its name is ``_C<ext>.gz`` (this Python's), and its record's sources hash is this
    tree's (a _C built from other sources would pass the gate and test other code). Written
    through a temporary file and a rename: a process that has the old _C loaded keeps it. Returns
    what was done; ``installed`` False with ``refused`` saying why."""
    out: dict[str, Any] = {"gz": os.path.abspath(gz), "installed": False, "refused": None}
    rec = _load(gz + ".json")
    out["record"] = rec
    if not os.path.isfile(gz):
        out["refused"] = f"no file {gz}"
    elif os.path.basename(gz) != f"_C{ext}.gz":
        out["refused"] = f"{os.path.basename(gz)} is not _C{ext}.gz: built for another Python than this one"
    elif rec is None:
        out["refused"] = f"no record {gz}.json beside it (pack it with tools/gpu_check.sh --pack-prebuilt)"
    elif rec.get("sources_sha256") != (here := sources_hash(root)):
        theirs = str(rec.get("sources_sha256"))[:12]
        out["refused"] = f"built from other sources (its csrc/ and setup.py hash {theirs}, this tree's {here[:12]})"
    if out["refused"]:
        return out
    dest = os.path.join(root, "flcomm", f"_C{ext}")
    try:
        with gzip.open(gz, "rb") as f:
            data = f.read()
    except (OSError, EOFError) as e:
        out["refused"] = f"{gz} does not unpack: {e}"
        return out
    with open(dest + ".part", "wb") as f:
        f.write(data)
    os.replace(dest + ".part", dest)
    out.update(installed=True, path=dest, bytes=len(data))
    return out


# ---------------------------------------------------------------- SASS
def count_ftz(sass: str, kernels: tuple[str, ...] = QUANT_KERNELS) -> dict[str, int]:
    """``{function: .FTZ instructions}`` for every SASS function (``Function : <mangled>``) whose
    name holds one of ``kernels`` (a name matches its longest kernel: dequant_blocks_kernel is not
    quant_blocks_kernel)."""
    counts: dict[str, int] = {}
    current = None
    for line in sass.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            name = m.group(1)
            hits = [k for k in kernels if k in name]
            current = name if hits else None
            if current:
                counts[current] = 0
            continue
        if current and re.search(r"\.FTZ\b", line):
            counts[current] += 1
    return counts


def _sass_main(work: str, so: str, cuobjdump: str) -> int:
    out = os.path.join(work, "sass_ftz.json")
    if not os.access(cuobjdump, os.X_OK):
        _write(out, {"skipped": f"no cuobjdump at {cuobjdump}"})
        print(f"skipped: no cuobjdump at {cuobjdump}")
        return 0
    p = subprocess.run([cuobjdump, "-sass", so], capture_output=True, text=True, timeout=120)
    if p.returncode:
        _write(out, {"error": p.stderr[-2000:]})
        print(p.stderr[-2000:])
        return 1
    counts = count_ftz(p.stdout)
    # NOTE: the quantization kernels' SASS is kept (small) for a reader; the whole dump is not
    keep, on = [], False
    for line in p.stdout.splitlines():
        if "Function : " in line:
            on = any(k in line for k in QUANT_KERNELS)
        if on:
            keep.append(line)
    with open(os.path.join(work, "sass_quant.txt"), "w") as f:
        f.write("\n".join(keep))
    total = sum(counts.values())
    ok = bool(counts) and total == 0
    _write(out, {"ftz": counts, "total": total, "functions": len(counts), "ok": ok})
    print(f".FTZ instructions in {len(counts)} quantization kernel functions: {total} (pass rule: 0)")
    for k, v in counts.items():
        print(f"  {v:4d}  {k}")
    if not counts:
        print(f"no function named like {QUANT_KERNELS} in the SASS of {so}")
    return 0 if ok else 1


# ---------------------------------------------------------------- NCCL init
NCCL_KEYS = re.compile(r"NCCL version|cudaDriverVersion|Bootstrap|NET/|Init COMPLETE|init\.cc|nranks|"
                       r"CC/|Channel 00|Using network|NCCL_[A-Z_]+ set|WARN|comm 0x")


def nccl_key_lines(log: str, limit: int = 40) -> list[str]:
    """The lines of an NCCL_DEBUG=INFO log that say which NCCL, driver, network and channels, and
    every warning (at most ``limit``)."""
    lines = [ln.strip() for ln in log.splitlines() if "NCCL" in ln and NCCL_KEYS.search(ln)]
    return lines[:limit]


def _nccl_init_main() -> int:
    import torch

    from flcomm import _native

    c = _native.native()
    comm = c.NcclComm(c.nccl_unique_id(), 1, 0, 0, 60.0)
    x = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
    out = torch.empty_like(x)
    assert comm.all_to_all(out, x).wait(30.0)
    torch.cuda.synchronize()
    same = torch.equal(out, x)
    comm.destroy()
    print(f"one-rank NCCL all_to_all of 4 MiB: {'equal' if same else 'DIFFERENT'}")
    return 0 if same else 1


# ---------------------------------------------------------------- pytest results
# NOTE: ``id SKIPPED (reason) [ 50%]``: -v prints the reason where the line has room for it
_VERBOSE = re.compile(r"^(?P<id>\S+::\S+?)(?:\s+(?P<out>PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b"
                      r"(?:\s+\((?P<why>.*)\)(?=\s+\[\s*\d+%\]))?.*)?\s*$")
_OUTCOME = {"PASSED": "passed", "FAILED": "failed", "ERROR": "error", "SKIPPED": "skipped", "XFAIL": "skipped",
            "XPASS": "passed"}


def _node_id(classname: str, name: str) -> str:
    """pytest's node id from junit's classname (``tests.unit.test_x`` or ``tests.unit.test_x.TestC``).
    A module that failed to collect has no classname and its dotted path as name: its file."""
    if not classname and re.fullmatch(r"[\w.]+", name) and name.split(".")[-1].startswith("test_"):
        return name.replace(".", "/") + ".py"
    parts = classname.split(".")
    mods = [i for i, p in enumerate(parts) if p.startswith("test_")]
    if not mods:
        return f"{classname}::{name}"
    m = mods[0]
    return "::".join(["/".join(parts[:m + 1]) + ".py", *parts[m + 1:], name])


def parse_junit(path: str, step: str) -> list[dict] | None:
    """Tests of a junit XML file; None when missing or unreadable (the run was killed)."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    tests = []
    for tc in root.iter("testcase"):
        outcome, message, text = "passed", None, ""
        for tag in ("failure", "error", "skipped"):
            el = tc.find(tag)
            if el is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (el.get("message") or "")[:1000]
                text = el.text or ""
                break
        test = _node_id(tc.get("classname") or "", tc.get("name") or "")
        tests.append({"step": step, "test": test, "outcome": outcome, "seconds": round(float(tc.get("time") or 0), 3),
                      "message": message, "traceback_tail": "\n".join(text.splitlines()[-TAIL_LINES:])})
    return tests


def parse_collected(log: str) -> dict[str, int] | None:
    """pytest's collection line, each count read on its own (None when the log has none):

        collected 1 item
        collected 5 items / 1 deselected / 4 selected
        collected 4 items / 1 error
        collected 5 items / 1 error / 1 deselected / 4 selected

    ``selected`` is pytest's own count where it prints one, else collected less deselected;
    ``errors`` are modules that failed to collect (their tests are in no count)."""
    m = re.search(r"^(?:collecting \.\.\. )?collected (\d+) items?((?: / \d+ \w+)*)\s*$", log, re.M)
    if not m:
        return None
    rest = m.group(2)

    def count(word: str) -> int | None:
        c = re.search(rf"/ (\d+) {word}\b", rest)
        return int(c.group(1)) if c else None

    collected, deselected = int(m.group(1)), count("deselected") or 0
    selected = count("selected")
    return {"collected": collected, "errors": count("errors?") or 0, "deselected": deselected,
            "selected": selected if selected is not None else collected - deselected}


def parse_verbose(log: str, step: str) -> tuple[list[dict], int | None]:
    """Tests of a ``pytest -v`` log (when the junit XML is missing): each ``id OUTCOME`` line,
    and a test that started but printed no outcome as ``hung`` (the run was killed in it). Also
    the number of tests selected (:func:`parse_collected`)."""
    tests = []
    c = parse_collected(log)
    selected = c["selected"] if c else None
    seen: dict[str, dict] = {}
    lines = log.splitlines()
    start = next((i for i, ln in enumerate(lines) if re.match(r"collect(ed|ing)", ln)), 0)
    for line in lines[start + 1:]:
        if line.startswith("====="):
            break  # NOTE: the warnings summary and the short summary list ids too: not results
        v = _VERBOSE.match(line.strip())
        if not v:
            continue
        tid, out = v.group("id"), v.group("out")
        rec = seen.get(tid)
        if rec is None:
            rec = seen[tid] = {"step": step, "test": tid, "outcome": "hung", "seconds": None, "message": None,
                               "traceback_tail": ""}
            tests.append(rec)
        if out:
            # NOTE: a teardown error prints a second outcome for a passed test: the worse one wins
            rec["outcome"] = _OUTCOME[out] if rec["outcome"] in ("hung", "passed", "skipped") else rec["outcome"]
            if v.group("why") and rec["outcome"] == "skipped":
                rec["message"] = v.group("why")
    for rec in tests:
        if rec["outcome"] == "hung":
            rec["message"] = "started but no outcome: the step was stopped in this test (a hang or the step's timeout)"
    _attach_tracebacks(log, tests)
    return tests, selected


def _attach_tracebacks(log: str, tests: list[dict]) -> None:
    """The tail of each ``____ name ____`` section of the FAILURES / ERRORS part of a log."""
    sections = re.split(r"^_{3,} (.+?) _{3,}$", log, flags=re.M)
    bodies = {sections[i].strip(): sections[i + 1] for i in range(1, len(sections) - 1, 2)}
    for rec in tests:
        if rec["outcome"] not in ("failed", "error"):
            continue
        name = rec["test"].split("::")[-1]
        for head, body in bodies.items():
            if head.endswith(name):
                rec["traceback_tail"] = "\n".join(body.strip().splitlines()[-TAIL_LINES:])
                break


def collect_tests(work: str, step: str) -> dict[str, Any]:
    log_path = os.path.join(work, f"{step}.log")
    try:
        with open(log_path, errors="replace") as f:
            log = f.read()
    except OSError:
        log = ""
    vtests, selected = parse_verbose(log, step)
    collected = parse_collected(log)
    tests = parse_junit(os.path.join(work, f"{step}.xml"), step)
    source = "junit"
    if tests is None:
        tests, source = vtests, "verbose log (no junit XML: the run was stopped)" if log else "none"
    else:
        # NOTE: junit has no entry for a test the run was stopped in; the log does
        ids = {t["test"] for t in tests}
        tests += [t for t in vtests if t["outcome"] == "hung" and t["test"] not in ids]
    return {"tests": tests, "selected": selected, "source": source,
            "collection_errors": collected["errors"] if collected else 0}


def needs_two_gpus(t: dict) -> bool:
    return t["outcome"] == "skipped" and "2+ CUDA GPUs" in (t.get("message") or "")


# ---------------------------------------------------------------- summary
def multi_rank(step: dict | None, tests: list[dict]) -> dict[str, Any]:
    """Which multi-rank NCCL paths of the two-ranks probe (:data:`MULTI_RANK_PATHS`) passed, and
    why each other one stayed unverified: its test's outcome and message, NCCL's refusal of the
    setup, or the step's skip. A refusal is not a failure of flcomm, but nothing multi-rank was
    verified then, and the summary says so."""
    by_name = {t["test"].split("::")[-1]: t for t in tests}
    refused = next((t["message"] for t in tests if t["outcome"] == "skipped"
                    and REFUSED in (t.get("message") or "")), None)
    verified, unverified = [], []
    for name, path in MULTI_RANK_PATHS.items():
        t = by_name.get(name)
        if t is not None and t["outcome"] == "passed":
            verified.append(path)
            continue
        if step is None:
            why = "the step did not run"
        elif step.get("skipped"):
            why = f"the step was skipped: {step['skipped']}"
        elif t is None:
            why = ("not run: the step was stopped before it" if step.get("timed_out")
                   else "not in the step's results")
        else:
            why = f"{t['outcome']}: {(t.get('message') or '').strip()[:300]}"
        unverified.append({"path": path, "test": name, "why": why})
    return {"verified": verified, "unverified": unverified, "refused": refused}


def summarize(work: str, budget: int, total: int) -> dict[str, Any]:
    steps = _jsonl(os.path.join(work, "steps.jsonl"))
    env = _load(os.path.join(work, "env.json")) or {}
    info = _load(os.path.join(work, "info.json")) or {}
    g = _load(os.path.join(work, "gate.json")) or {"ok": False, "fatal": ["the build gate did not run"], "fail": []}
    reasons: list[str] = []
    if not g.get("ok"):
        reasons += [f"build gate: {r}" for r in g.get("fatal", []) + g.get("fail", [])]

    by_step = {s.get("step"): s for s in steps}
    step_failures = []
    for s in steps:
        if s.get("skipped"):
            if s.get("counts_against", True):
                reasons.append(f"step {s['step']} skipped: {s['skipped']}")
            continue
        if s.get("rc") not in (0, None):
            what = "timed out" if s.get("timed_out") else f"rc {s['rc']}"
            # NOTE: the gate's own reasons are listed above; a prebuilt _C that failed its gate
            # is a fallback to the build (see "prebuilt"), not a failure of the run
            if s["step"] != "gate" and s.get("counts_against", True):
                reasons.append(f"step {s['step']} {what}")
            step_failures.append({"step": s["step"], "rc": s["rc"], "timed_out": s.get("timed_out", False),
                                  "log_tail": tail(os.path.join(work, f"{s['step']}.log"))})

    tests, sources, selected, collection_errors = [], {}, 0, 0
    for step in PYTEST_STEPS:
        if step not in by_step or by_step[step].get("skipped"):
            continue
        res = collect_tests(work, step)
        tests += res["tests"]
        sources[step] = res["source"]
        selected += res["selected"] if res["selected"] is not None else len(res["tests"])
        collection_errors += res["collection_errors"]
        if res["collection_errors"]:
            broken = [t["test"] for t in res["tests"] if t["outcome"] == "error" and "::" not in t["test"]]
            reasons.append(f"{step}: {res['collection_errors']} test module(s) failed to collect"
                           + (f": {', '.join(broken)}" if broken else ""))
    for t in tests:  # NOTE: the junit message says it; without the XML, the log's traceback does
        if t["outcome"] == "failed" and TIMEOUT_MESSAGE.search((t.get("message") or "") + t["traceback_tail"]):
            t["timed_out"] = True
    counts: dict[str, int] = {}
    for t in tests:
        counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
    single_gpu = selected - sum(needs_two_gpus(t) for t in tests)
    env_min = os.environ.get("GPU_CHECK_MIN_PASSED")
    min_passed = int(env_min) if env_min else max(1, math.ceil(MIN_PASSED_FRACTION * single_gpu))
    passed = counts.get("passed", 0)
    if passed < min_passed:
        reasons.append(f"{passed} GPU tests passed, {min_passed} needed ({MIN_PASSED_FRACTION:.0%} of the "
                       f"{single_gpu} single-GPU tests selected); outcomes {counts}")
    bad = [t for t in tests if t["outcome"] in ("failed", "error", "hung")]
    if bad:
        def kind(t: dict) -> str:
            return "timed out (pytest-timeout)" if t.get("timed_out") else t["outcome"]

        named = "; ".join(f"{t['test']} {kind(t)}" for t in bad[:5]) + ("; ..." if len(bad) > 5 else "")
        reasons.append(f"{len(bad)} tests failed, errored or hung: {named}")
    failures = []
    for t in bad:
        failures.append({**t, "log_tail": tail(os.path.join(work, f"{t['step']}.log"), 15)})

    sass = _load(os.path.join(work, "sass_ftz.json"))
    if sass and sass.get("total"):
        reasons.append(f"{sass['total']} .FTZ instructions in the quantization kernels (pass rule: 0)")
    bench = _load(os.path.join(work, "bench_kernels.json"))
    ran_bench = "bench_kernels" in by_step and not by_step["bench_kernels"].get("skipped")
    if ran_bench and not bench:
        reasons.append("bench_kernels gave no CUDA records (see bench_kernels.log)")
    figures: dict[str, list] = {}
    for rec in _jsonl(os.path.join(work, "figures.jsonl")):
        figures.setdefault(rec.pop("test", "?"), []).append(rec)
    try:
        with open(os.path.join(work, "nccl_init.log"), errors="replace") as f:
            nccl_lines = nccl_key_lines(f.read())
    except OSError:
        nccl_lines = []
    versions = {k: env.get(k) for k in ("python", "torch", "torch_cuda", "nvcc", "driver", "driver_proc",
                                        "gpu_name", "capability", "gpus", "setuptools", "pytest", "pytest-timeout",
                                        "nvidia-nccl-cu13")}
    versions["nccl"] = {"compiled": info.get("nccl_compiled"), "loaded": info.get("nccl_loaded"),
                        "torch": info.get("torch_nccl") or env.get("torch_nccl")}
    versions["cuda_runtime_flcomm"] = info.get("cuda_runtime")
    skipped = [{"step": s["step"], "why": s["skipped"]} for s in steps if s.get("skipped")]
    return {
        "ok": not reasons,
        "reasons": reasons,
        "budget_s": budget,
        "total_seconds": total,
        "multi_rank": multi_rank(by_step.get(MULTI_RANK_STEP), [t for t in tests if t["step"] == MULTI_RANK_STEP]),
        "versions": versions,
        "prebuilt": _load(os.path.join(work, "prebuilt.json")),
        "gate": g,
        "steps": steps,
        "skipped": skipped,
        "step_failures": step_failures,
        "tests": {"counts": counts, "passed": passed, "min_passed": min_passed, "selected": selected,
                  "single_gpu_selected": single_gpu, "collection_errors": collection_errors, "sources": sources,
                  "items": tests},
        "failures": failures,
        "sass_ftz": sass,
        "bench_kernels": [{k: r.get(k) for k in BENCH_KEYS} for r in bench or []],
        "probe_figures": figures,
        "nccl_init": {"key_lines": nccl_lines, "log": "nccl_init.log in logs.tgz"},
        "env": env,
        "info": info,
    }


def pack(work: str, dest: str) -> list[str]:
    """WORK's files (not the folders' binaries: *.so) into ``dest`` (tar.gz); a file over
    PACK_FILE_LIMIT keeps its first and last quarter of the limit. Returns the names packed."""
    names = []
    with tarfile.open(dest, "w:gz") as tar:
        for name in sorted(os.listdir(work)):
            path = os.path.join(work, name)
            if not os.path.isfile(path) or name.endswith(".so"):
                continue
            with open(path, "rb") as f:
                data = f.read()
            if len(data) > PACK_FILE_LIMIT:
                q = PACK_FILE_LIMIT // 4
                data = data[:q] + f"\n[... {len(data) - 2 * q} bytes left out ...]\n".encode() + data[-q:]
            ti = tarfile.TarInfo(f"logs/{name}")
            ti.size = len(data)
            tar.addfile(ti, io.BytesIO(data))
            names.append(name)
    return names


def main(argv: list[str]) -> int:
    cmd, *args = argv
    if cmd == "env":
        _write(os.path.join(args[0], "env.json"), env := collect_env())
        print(json.dumps(env, indent=1))
        return 0
    if cmd == "gate":
        return _gate_main(*args)
    if cmd == "gpu-files":
        print("\n".join(gpu_test_files(args[0])))
        return 0
    if cmd == "pack-prebuilt":
        try:
            rec = pack_prebuilt(args[0], args[1], args[2], os.getcwd())
        except (OSError, ValueError) as e:
            print(f"[gpu_check] {e}", file=sys.stderr)
            return 1
        print(f"[gpu_check] {rec['gz']} ({rec['gz_bytes']} bytes, {rec['how']}; sources "
              f"{rec['sources_sha256'][:12]}) and its record {rec['gz']}.json")
        return 0
    if cmd == "prebuilt":
        work, gz, ext, archs = args
        res = install_prebuilt(gz, ext, os.getcwd())
        print(f"prebuilt _C {gz}: " + (f"installed as {res['path']}" if res["installed"]
                                        else f"NOT USED: {res['refused']}"), flush=True)
        rc = 1
        if res["installed"]:  # NOTE: its own gate; the final one runs after the fallback, if any
            rc = _gate_main(work, archs, "gate_prebuilt")
            res["gate"] = _load(os.path.join(work, "gate_prebuilt.json"))
        res["used"] = rc == 0
        _write(os.path.join(work, "prebuilt.json"), res)
        return rc
    if cmd == "sass":
        return _sass_main(*args)
    if cmd == "nccl-init":
        return _nccl_init_main()
    if cmd == "summarize":
        work, out, budget, total = args[0], args[1], int(args[2]), int(args[3])
        s = summarize(work, budget, total)
        _write(os.path.join(out, "summary.json"), s)
        print(f"[gpu_check] ok={s['ok']} tests={s['tests']['counts']} passed {s['tests']['passed']}/"
              f"{s['tests']['min_passed']} needed, {total} s of {budget} s")
        for r in s["reasons"]:
            print(f"[gpu_check]   not ok: {r}")
        mr = s["multi_rank"]
        if mr["refused"]:
            print(f"[gpu_check] {mr['refused']}")
        print(f"[gpu_check] multi-rank NCCL paths verified: {len(mr['verified'])} of {len(MULTI_RANK_PATHS)}")
        for u in mr["unverified"]:
            print(f"[gpu_check]   unverified: {u['path']} ({u['why'][:160]})")
        return 0 if s["ok"] else 1
    if cmd == "pack":
        names = pack(args[0], os.path.join(args[1], "logs.tgz"))
        print(f"[gpu_check] logs.tgz: {len(names)} files")
        return 0
    raise SystemExit(f"unknown subcommand {cmd!r}; see {__file__}'s docstring")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
