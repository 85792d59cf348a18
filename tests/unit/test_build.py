"""The shape of the native build that keeps it cheap: which csrc files may include which headers,
and that every operator still gets a CUDA implementation in a CUDA build.

NOTE: compile time on a 2-core CI machine is dominated by torch's headers: torch/extension.h
(the whole C++ frontend and pybind11) costs a host compile about a minute, and nvcc pays for
ATen twice (host and device pass). So the .cu files include no ATen / torch headers (raw-pointer
launchers, cuda_kernels.h), and only the binding file includes the Python glue.
"""

from __future__ import annotations

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CSRC = os.path.join(ROOT, "csrc")
INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', re.MULTILINE)

# c10's header-only scalar types: the conversions the CPU kernels and the reference use too.
CUDA_ALLOWED_TORCH = {"c10/util/BFloat16.h", "c10/util/Float8_e4m3fn.h", "c10/util/Half.h"}
TORCH_PREFIXES = ("ATen/", "torch/", "c10/", "pybind11/", "Python.h")
PYTHON_GLUE = ("torch/extension.h", "torch/python.h", "torch/all.h", "torch/torch.h", "torch/csrc/", "pybind11/",
               "Python.h")
# Most of ATen's headers: ATen/ops/empty_like.h alone preprocesses to 174k lines (torch 2.14),
# ATen/core/Tensor.h, whose Tensor methods do the same work, to 107k.
ATEN_FUNCTIONS = ("ATen/ATen.h", "ATen/Functions.h", "ATen/ops/")


def includes(name: str, seen: set[str] | None = None) -> set[str]:
    """Every header `name` includes, following flcomm's own headers in csrc/."""
    seen = set() if seen is None else seen
    with open(os.path.join(CSRC, name)) as f:
        for inc in INCLUDE.findall(f.read()):
            if inc in seen:
                continue
            seen.add(inc)
            if os.path.exists(os.path.join(CSRC, inc)):
                includes(inc, seen)
    return seen


def sources(ext: str) -> list[str]:
    return sorted(n for n in os.listdir(CSRC) if n.endswith(ext))


def test_includes_follow_flcomm_headers():
    """The helper itself: quant.cpp reaches ATen through quant_checks.h, not directly."""
    got = includes("quant.cpp")
    assert {"quant_checks.h", "quant.h", "ATen/core/Tensor.h"} <= got, sorted(got)


@pytest.mark.parametrize("cu", sources(".cu"))
def test_cuda_sources_include_no_torch_headers(cu):
    torch_headers = {h for h in includes(cu) if h.startswith(TORCH_PREFIXES)}
    extra = sorted(torch_headers - CUDA_ALLOWED_TORCH)
    assert not extra, (f"csrc/{cu} must compile without ATen / torch headers (only {sorted(CUDA_ALLOWED_TORCH)}); "
                       f"it includes {extra}: the torch-facing code belongs in the operator's .cpp")


@pytest.mark.parametrize("src", [s for s in sources(".cpp") if s != "bindings.cpp"])
def test_only_the_binding_file_includes_the_python_glue(src):
    glue = sorted(h for h in includes(src) if h.startswith(PYTHON_GLUE + ATEN_FUNCTIONS))
    assert not glue, (f"csrc/{src} includes {glue}: only bindings.cpp needs torch's Python glue, and none needs ATen's "
                      f"functions; use ATen/core/Tensor.h (Tensor methods), c10 headers or torch/library.h")


def test_cuda_build_registers_every_operator_for_cuda():
    """The CUDA implementations in quant.cpp / reorder.cpp / sparse.cpp compile only with FLCOMM_WITH_CUDA: a
    CUDA build must define it for the C++ sources too, or the kernels would be built and never
    registered."""
    from flcomm import _native
    from flcomm.info import build_info

    if not _native.available():
        pytest.skip(f"flcomm._C not built: {_native.unavailable_reason()}")
    info = build_info()
    from tests.common.native_ops import declared_operators

    expected = declared_operators()
    assert {"quantize", "topk_encode", "shard_transpose"} <= expected, expected  # NOTE: the parse finds them
    assert set(info["cpu_kernels"]) == expected, info["cpu_kernels"]
    if not info["cuda_compiled"]:
        assert info["cuda_kernels"] == [], info["cuda_kernels"]
        return
    missing = expected - set(info["cuda_kernels"])
    assert not missing, f"CUDA build without CUDA kernels for {missing}"


def _guarded_lines(src: str, macro: str) -> list[tuple[int, str, bool]]:
    """(line number, line, inside `#ifdef macro` / `#if defined(macro)` but not its #else) for
    every non-preprocessor, non-comment line of ``src``."""
    stack: list[bool] = []  # per open #if: whether it is the macro's true branch
    out = []
    for i, line in enumerate(src.splitlines(), 1):
        s = line.strip()
        if s.startswith("#if"):
            stack.append(s in (f"#ifdef {macro}", f"#if defined({macro})"))
        elif s.startswith("#else") or s.startswith("#elif"):
            stack[-1] = False
        elif s.startswith("#endif"):
            stack.pop()
        elif not s.startswith(("#", "//")):
            out.append((i, line, any(stack)))
    return out


def _code(line: str) -> str:
    """The line without its string literals and trailing comment (messages may name the field)."""
    return re.sub(r'"(?:[^"\\]|\\.)*"', '""', line).split("//")[0]


def test_cta_policy_compiles_only_against_an_nccl_that_has_it():
    """ncclConfig_t.CTAPolicy and NCCL_CTA_POLICY_* came with NCCL 2.27: every use in
    nccl_comm.cpp sits under FLCOMM_NCCL_HAS_CTA_POLICY, so older headers still compile (and
    split(cta_policy=...) is refused there with the compiled version)."""
    with open(os.path.join(CSRC, "nccl_comm.cpp")) as f:
        src = f.read()
    assert re.search(r"#if NCCL_VERSION_CODE >= NCCL_VERSION\(2, 27, 0\)[^\n]*\n#define FLCOMM_NCCL_HAS_CTA_POLICY 1",
                     src), "FLCOMM_NCCL_HAS_CTA_POLICY must be defined from NCCL_VERSION_CODE >= 2.27"
    uses = [(n, line) for n, line, guarded in _guarded_lines(src, "FLCOMM_NCCL_HAS_CTA_POLICY")
            if re.search(r"\bCTAPolicy\b|NCCL_CTA_POLICY_", _code(line)) and not guarded]
    assert not uses, f"unguarded uses of the NCCL >= 2.27 CTA policy in csrc/nccl_comm.cpp: {uses}"
