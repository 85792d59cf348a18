"""Build flcomm and its native extension ``flcomm._C``.

What gets built, and why, is printed at build time:

* always: the C++ sources in ``csrc/`` (CPU kernels and the bindings);
* with a CUDA build of torch and an nvcc found: also ``csrc/*.cu`` and the NCCL communicator,
  compiled against the ``nccl.h`` of the nvidia-nccl wheel torch depends on and linked to the
  same ``libnccl.so.2`` (by rpath), so torch and flcomm share one NCCL.

Environment:
  FLCOMM_CUDA=auto|0|1     build CUDA sources (auto: when torch has CUDA and nvcc is found)
  CUDA_HOME / CUDA_PATH    CUDA toolkit; otherwise /usr/local/cuda, then the nvcc on PATH
                           (a wrapper script that execs the real nvcc is followed)
  FLCOMM_CUDA_ARCHS        e.g. "90" or "8.0;9.0" (falls back to TORCH_CUDA_ARCH_LIST;
                           default 8.0;9.0: A100 and H100/H200)
  NCCL_HOME                an NCCL install with include/ and lib/ (default: the nvidia-nccl wheel)
  MAX_JOBS                 parallel compile jobs (default: from cores and memory)
  DEBUG=1                  -O0 -g
"""

from __future__ import annotations

import glob
import importlib.util
import os
import re
import shutil
import sys

from setuptools import find_packages, setup

LICENSE = "Apache-2.0"

ROOT = os.path.dirname(os.path.abspath(__file__))


def log(msg: str) -> None:
    print(f"[flcomm setup] {msg}", file=sys.stderr, flush=True)


def _is_toolkit(path: str | None) -> bool:
    return bool(path) and os.path.isfile(os.path.join(path, "include", "cuda_runtime.h")) and (
        os.path.isfile(os.path.join(path, "bin", "nvcc"))
    )


def find_cuda_home() -> str | None:
    """The CUDA toolkit root: CUDA_HOME, CUDA_PATH, /usr/local/cuda, or the nvcc on PATH.

    NOTE: torch guesses CUDA_HOME from the nvcc on PATH; here that is /usr/local/bin/nvcc, a
    shell wrapper, which makes torch pick /usr/local. We follow the wrapper's exec instead.
    """
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if _is_toolkit(os.environ.get(env)):
            return os.environ[env]
    if _is_toolkit("/usr/local/cuda"):
        return "/usr/local/cuda"
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None
    real = os.path.realpath(nvcc)
    candidate = os.path.dirname(os.path.dirname(real))
    if _is_toolkit(candidate):
        return candidate
    try:  # a wrapper script: `exec /path/to/cuda/bin/nvcc "$@"`
        with open(real, errors="ignore") as f:
            m = re.search(r"(/\S+)/bin/nvcc\b", f.read(4096))
        if m and _is_toolkit(m.group(1)):
            return m.group(1)
    except OSError:
        pass
    return None


def license_metadata() -> dict[str, str]:
    """The license, in the field this setuptools takes (pyproject declares it dynamic).

    NOTE: setuptools >= 77 wants an SPDX expression, older ones refuse a string
    ``project.license`` in pyproject.toml (the GPU machine's setuptools is not ours to choose).
    """
    import setuptools

    major = int(setuptools.__version__.split(".")[0])
    return {"license_expression": LICENSE} if major >= 77 else {"license": LICENSE}


def find_nccl() -> tuple[str, str] | None:
    """(include dir, lib dir) of the NCCL torch links: NCCL_HOME or the nvidia-nccl wheel."""
    home = os.environ.get("NCCL_HOME")
    if home and os.path.isfile(os.path.join(home, "include", "nccl.h")):
        return os.path.join(home, "include"), os.path.join(home, "lib")
    spec = importlib.util.find_spec("nvidia.nccl")
    if spec is not None and spec.submodule_search_locations:
        # NOTE: nvidia.nccl is a namespace package: no __file__, only __path__.
        base = list(spec.submodule_search_locations)[0]
        inc, lib = os.path.join(base, "include"), os.path.join(base, "lib")
        if os.path.isfile(os.path.join(inc, "nccl.h")) and glob.glob(os.path.join(lib, "libnccl.so*")):
            return inc, lib
    return None


def cuda_archs() -> list[str]:
    raw = os.environ.get("FLCOMM_CUDA_ARCHS") or os.environ.get("TORCH_CUDA_ARCH_LIST") or "8.0;9.0"
    archs = []
    for tok in re.split(r"[;, ]+", raw.strip()):
        if not tok:
            continue
        tok = tok.replace("+PTX", "").replace("sm_", "")
        if "." not in tok:
            if not tok.isdigit() or len(tok) < 2:
                raise SystemExit(f"FLCOMM_CUDA_ARCHS: expected arches like '90' or '9.0', got {tok!r}")
            tok = f"{tok[:-1]}.{tok[-1]}"
        archs.append(tok)
    return archs


def nvcc_flags(debug: bool = False) -> list[str]:
    """nvcc flags of flcomm's CUDA sources (on top of torch's own).

    NOTE: no --use_fast_math: it implies -ftz=true, and flushing subnormals to zero breaks the
    bit-for-bit match with the CPU kernels (error-feedback residuals of tiny blocks keep
    subnormals). -ftz=false is spelled out; the kernels round explicitly (__fmul_rn, ...), so FMA
    contraction does not matter. tests/system/test_ptx_ftz.py compiles csrc/quant_cuda.cu and
    csrc/sparse_cuda.cu to PTX with these flags (ptx_command) and asserts that no `.ftz`
    instruction appears.
    """
    opt = ["-O0", "-g"] if debug else ["-O3"]
    return opt + ["-ftz=false", "-prec-div=true", "-prec-sqrt=true", "--expt-relaxed-constexpr", "-lineinfo"]


def ptx_command(source: str, output: str, arch: str = "90", cuda_home: str | None = None) -> list[str]:
    """The nvcc command that compiles one of our .cu files to PTX with the flags of the real build
    (ours, torch's common ones, the include paths, the C++ standard); used by the `.ftz` test."""
    import sysconfig

    from torch.utils import cpp_extension

    home = cuda_home or find_cuda_home() or "/usr/local/cuda"
    try:
        incs = cpp_extension.include_paths(device_type="cuda")
    except TypeError:  # torch < 2.6: include_paths(cuda=True)
        incs = cpp_extension.include_paths(cuda=True)
    cmd = [os.path.join(home, "bin", "nvcc"), "--ptx", source, "-o", output, f"-arch=sm_{arch}",
           "-DFLCOMM_WITH_CUDA=1", f"-I{os.path.join(ROOT, 'csrc')}",
           f"-I{sysconfig.get_paths()['include']}"]
    cmd += [f"-I{i}" for i in incs]
    cmd += list(cpp_extension.COMMON_NVCC_FLAGS) + nvcc_flags()
    cmd.append(_torch_cxx_std())
    return cmd


def _torch_cxx_std() -> str:
    """The -std torch's cpp_extension adds (C++20 since torch 2.13, C++17 before)."""
    import torch

    major, minor = (int(v) for v in torch.__version__.split("+")[0].split(".")[:2])
    return "-std=c++20" if (major, minor) >= (2, 13) else "-std=c++17"


def default_max_jobs(cuda: bool) -> int:
    cores = os.cpu_count() or 1
    try:
        mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        mem_gb = 8.0
    per_job_gb = 3.0 if cuda else 1.0  # nvcc with two arches peaks near 3 GB
    return max(1, min(cores, int(mem_gb // per_job_gb)))


def extensions():
    mode = os.environ.get("FLCOMM_CUDA", "auto").lower()
    if mode not in ("auto", "0", "1"):
        raise SystemExit(f"FLCOMM_CUDA must be auto, 0 or 1, got {mode!r}")
    cuda_home = find_cuda_home()
    if cuda_home:
        # Must be set before torch.utils.cpp_extension is imported: it reads CUDA_HOME once.
        os.environ["CUDA_HOME"] = cuda_home
    import torch
    from torch.utils import cpp_extension

    torch_cuda = torch.version.cuda
    reasons = []
    if mode == "0":
        reasons.append("FLCOMM_CUDA=0")
    if torch_cuda is None:
        reasons.append(f"torch {torch.__version__} is a CPU build")
    if cuda_home is None:
        reasons.append("no CUDA toolkit found (set CUDA_HOME)")
    with_cuda = not reasons
    if mode == "1" and not with_cuda:
        raise SystemExit("FLCOMM_CUDA=1 but CUDA cannot be built: " + "; ".join(reasons))

    debug = os.environ.get("DEBUG", "0") == "1"
    # NOTE: -g0 drops the -g of Python's own CFLAGS (distutils puts it first, ours come last): debug
    # info for torch's headers is most of a host object's compile time and size, and it does not
    # change the generated code. DEBUG=1 keeps it.
    opt = ["-O0", "-g"] if debug else ["-O3", "-g0"]
    # NOTE: torch picks -std (C++20 since 2.13). -ffp-contract=off: GCC fuses a * b + c (vector
    # intrinsics included) into an FMA wherever FMA is enabled, as it is in quant.cpp's AVX-512
    # functions; the fused rounding would break the bit-for-bit match with the reference.
    cxx_flags = opt + ["-fopenmp", "-ffp-contract=off"]
    define_macros = []
    sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
    include_dirs = [os.path.join(ROOT, "csrc")]
    library_dirs, libraries, extra_link = [], [], ["-fopenmp"]

    if with_cuda:
        archs = cuda_archs()
        # NOTE: torch adds -gencode flags from TORCH_CUDA_ARCH_LIST (or every arch of its own
        # build when unset and no GPU is visible): pin it to ours.
        os.environ["TORCH_CUDA_ARCH_LIST"] = ";".join(archs)
        sources += sorted(glob.glob(os.path.join("csrc", "*.cu")))
        define_macros.append(("FLCOMM_WITH_CUDA", "1"))
        define_macros.append(("FLCOMM_CUDA_ARCHS_TOKEN", "_".join(a.replace(".", "") for a in archs)))
        nccl = find_nccl()
        if nccl is not None:
            inc, lib = nccl
            include_dirs.append(inc)
            library_dirs.append(lib)
            # NOTE: the wheel ships only libnccl.so.2 (no libnccl.so), so -lnccl fails.
            extra_link += [f"-L{lib}", "-l:libnccl.so.2", f"-Wl,-rpath,{lib}"]
            define_macros.append(("FLCOMM_WITH_NCCL", "1"))
            nccl_msg = f"NCCL from {os.path.dirname(inc)}"
        else:
            nccl_msg = "no NCCL found (pip install nvidia-nccl-cu13 or set NCCL_HOME): NCCL communicator skipped"
        log(f"building C++ and CUDA (torch {torch.__version__}, CUDA {torch_cuda}, toolkit {cuda_home}, "
            f"arches {','.join(archs)}); {nccl_msg}")
        ext = cpp_extension.CUDAExtension(
            "flcomm._C", sources, include_dirs=include_dirs, library_dirs=library_dirs,
            libraries=libraries, define_macros=define_macros,
            extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags(debug)}, extra_link_args=extra_link)
    else:
        log(f"building C++ only (CPU kernels): {'; '.join(reasons)}")
        ext = cpp_extension.CppExtension(
            "flcomm._C", sources, include_dirs=include_dirs, define_macros=define_macros,
            extra_compile_args={"cxx": cxx_flags}, extra_link_args=extra_link)

    os.environ.setdefault("MAX_JOBS", str(default_max_jobs(with_cuda)))
    log(f"MAX_JOBS={os.environ['MAX_JOBS']}")
    return [ext], cpp_extension.BuildExtension.with_options(use_ninja=True)


if __name__ == "__main__":  # NOTE: importable (tests ask for nvcc_flags / ptx_command)
    ext_modules, build_ext = extensions()
    setup(
        packages=find_packages(include=["flcomm", "flcomm.*"]),
        ext_modules=ext_modules,
        cmdclass={"build_ext": build_ext},
        **license_metadata(),
    )
