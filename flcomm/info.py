"""What this flcomm was built with and what this machine offers (``python -m flcomm info``)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Any

from flcomm import _native


def native_kernels() -> dict[str, list[str]]:
    """``{op name: [dispatch keys with an implementation]}`` for every ``flcomm::`` operator."""
    import torch

    _native.native()
    out = {}
    for name in sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith("flcomm::")):
        dump = torch._C._dispatch_dump(name)
        out[name.split("::", 1)[1]] = [k for k in ("CPU", "CUDA") if f"\n{k}: registered" in dump]
    return out


def _version() -> str:
    # NOTE: the version lives in pyproject.toml only
    try:
        return version("flcomm")
    except PackageNotFoundError:  # a source tree on sys.path that was never installed
        return "0+unknown"


VERSION = _version()


def build_info() -> dict[str, Any]:
    """A dict: versions, native kernels, CUDA/NCCL compiled in and loaded, GPUs visible."""
    import torch

    info: dict[str, Any] = {
        "flcomm": VERSION,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "native": _native.available(),
        "native_error": _native.unavailable_reason(),
        "cpu_kernels": [],
        "cuda_kernels": [],
        "cuda_compiled": False,
        "cuda_archs": [],
        "nccl_compiled": None,
        "nccl_loaded": None,
        "cuda_runtime": None,
        "gpus": 0,
        "torch_nccl": None,
    }
    try:
        info["gpus"] = torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - no driver: zero GPUs
        info["gpus"] = 0
    try:
        v = torch.cuda.nccl.version()
        info["torch_nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception:  # noqa: BLE001 - CPU build of torch
        pass
    if not info["native"]:
        return info
    C = _native.native()
    info["cpu_kernels"] = [n for n, devs in native_kernels().items() if "CPU" in devs]
    info["cuda_kernels"] = [n for n, devs in native_kernels().items() if "CUDA" in devs]
    info["cuda_compiled"] = bool(C.compiled_with_cuda())
    info["cuda_archs"] = [f"sm_{a}" for a in C.cuda_archs().split("_") if a]
    info["nccl_compiled"] = _native.nccl_version_string(C.nccl_version_compiled())
    if C.compiled_with_nccl():
        try:
            info["nccl_loaded"] = _native.nccl_version_string(C.nccl_version_loaded())
        except RuntimeError as e:
            info["nccl_loaded"] = f"error: {e}"
    if info["cuda_compiled"]:
        try:
            info["cuda_runtime"] = C.cuda_runtime_version()
        except RuntimeError as e:
            info["cuda_runtime"] = f"error: {e}"
    return info


def format_info(info: dict[str, Any]) -> str:
    width = max(len(k) for k in info)
    lines = []
    for k, v in info.items():
        if isinstance(v, list):
            v = ", ".join(map(str, v)) if v else "(none)"
        elif isinstance(v, dict):
            v = "; ".join(f"{name}: {what}" for name, what in v.items())
        lines.append(f"{k:<{width}}  {v}")
    return "\n".join(lines)


# the operators of flcomm._C that flcomm calls (csrc/bindings.cpp declares them; a test reads
# its schemas): a build has "native" only with a CPU kernel of each, and "cuda" with a CUDA one
OPERATORS: tuple[str, ...] = ("apply_average", "dequantize", "quantize", "quantize_error_feedback",
                              "shard_transpose", "shard_transpose_out", "topk_decode", "topk_encode")


# what each feature of ``missing_features`` needs from ``build_info()``: the field that says the
# build has it, and for the kernel features the field that lists their operators, and the device
FEATURES: dict[str, tuple[str, str | None, str | None]] = {
    "native": ("native", "cpu_kernels", "CPU"),
    "cuda": ("cuda_compiled", "cuda_kernels", "CUDA"),
    "nccl": ("nccl_compiled", None, None),
}


def _lacking(feature: str, info: dict[str, Any]) -> str | None:
    """None when the build has ``feature``; else why not ("" when it was built without it)."""
    flag, kernels, device = FEATURES[feature]
    if info[flag] is None or info[flag] is False:
        return ""
    lack = [op for op in OPERATORS if op not in info[kernels]] if kernels else []
    return f"no {device} kernel of {lack}" if lack else None


def missing_features(required: str | list[str], info: dict[str, Any] | None = None) -> list[str]:
    """The features of ``required`` (names of :data:`FEATURES`, or a comma-separated string as
    in ``FLCOMM_REQUIRE=native,cuda,nccl``) that this build lacks, each as a sentence saying why.
    An unknown name is a ValueError."""
    names = [n.strip() for n in required.split(",")] if isinstance(required, str) else list(required)
    names = [n for n in names if n]
    unknown = sorted(set(names) - set(FEATURES))
    if unknown:
        raise ValueError(f"unknown flcomm feature(s) {unknown}; expected some of {sorted(FEATURES)}")
    info = build_info() if info is None else info
    why = info.get("native_error") or "flcomm._C was built without it"
    lacking = [(n, _lacking(n, info)) for n in names]
    return [f"{n}: not in this build ({lack or why})" for n, lack in lacking if lack is not None]
