"""``FLCOMM_REQUIRE`` turns a missing native feature into a failed run: a copy of the package
without ``flcomm._C`` (the broken build CI must not pass as skips) fails at start-up, naming the
feature; the real build passes."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from flcomm.info import build_info, missing_features
from tests.common.native_ops import declared_operators

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _pytest(where: pathlib.Path, require: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "FLCOMM_REQUIRE": require, "PYTHONPATH": str(where)}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_ok.py"],
                          cwd=where, env=env, capture_output=True, text=True, timeout=120)


def _tree(tmp_path: pathlib.Path, with_native: bool) -> pathlib.Path:
    shutil.copytree(ROOT / "flcomm", tmp_path / "flcomm",
                    ignore=shutil.ignore_patterns("__pycache__", *(() if with_native else ("*.so",))))
    if not with_native:  # NOTE: a module that fails to import, as a broken build's _C does
        (tmp_path / "flcomm" / "_C.py").write_text("raise ImportError('undefined symbol: a broken build')\n")
    (tmp_path / "tests").mkdir()
    shutil.copy(ROOT / "tests" / "conftest.py", tmp_path / "tests" / "conftest.py")
    shutil.copytree(ROOT / "tests" / "common", tmp_path / "tests" / "common",
                    ignore=shutil.ignore_patterns("__pycache__"))  # NOTE: the conftest imports its rules
    (tmp_path / "tests" / "test_ok.py").write_text("def test_ok():\n    assert True\n")
    return tmp_path


def test_a_build_without_the_native_module_fails_the_run(tmp_path):
    r = _pytest(_tree(tmp_path, with_native=False), "native")
    assert r.returncode != 0, r.stdout + r.stderr
    assert "FLCOMM_REQUIRE=native, but this flcomm lacks: native: not in this build" in r.stdout + r.stderr
    assert "1 passed" not in r.stdout


def test_this_build_passes_with_what_it_has(tmp_path):
    info = build_info()
    have = ["native"] + [f for f in ("cuda", "nccl") if not missing_features([f], info)]
    r = _pytest(_tree(tmp_path, with_native=True), ",".join(have))
    assert r.returncode == 0 and "1 passed" in r.stdout, r.stdout + r.stderr


def test_the_required_operators_are_every_one_the_bindings_declare():
    from flcomm.info import OPERATORS

    assert set(OPERATORS) == declared_operators()


def test_missing_features_reads_the_build_info():
    every = sorted(declared_operators())
    info = {"native": True, "native_error": None, "cpu_kernels": every, "cuda_kernels": [],
            "cuda_compiled": False, "nccl_compiled": None}
    assert missing_features("native", info) == []
    assert [m.split(":")[0] for m in missing_features("native,cuda,nccl", info)] == ["cuda", "nccl"]
    # F8c: one CPU kernel is not a native build; the message names what is missing
    partial = {**info, "cpu_kernels": ["quantize"], "cuda_compiled": True, "cuda_kernels": every[:-1]}
    got = missing_features("native,cuda", partial)
    assert len(got) == 2 and got[0].startswith("native: not in this build (no CPU kernel of [")
    assert all(op in got[0] for op in every if op != "quantize") and every[-1] in got[1]
    assert every[0] not in got[1]
    with pytest.raises(ValueError, match=r"unknown flcomm feature\(s\) \['gpu'\]; expected some of"):
        missing_features("native,gpu", info)


SKIPS = '''import pytest

def test_no_gpu():
    pytest.skip("needs a CUDA GPU; none visible")

def test_no_tool():
    pytest.skip("iproute2 is not installed")

def test_ok():
    assert True
'''


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "default"])
def test_a_skip_outside_the_allow_list_fails_a_strict_run(tmp_path, strict):
    where = _tree(tmp_path, with_native=True)
    (where / "tests" / "test_ok.py").write_text(SKIPS)
    env = {**os.environ, "PYTHONPATH": str(where), "FLCOMM_STRICT_SKIPS": "1" if strict else "0"}
    env.pop("FLCOMM_REQUIRE", None)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_ok.py"],
                       cwd=where, env=env, capture_output=True, text=True, timeout=120)
    out = r.stdout + r.stderr
    assert "1 passed, 2 skipped" in out, out
    if strict:
        assert r.returncode == 1, out
        assert "skips outside the allow-list" in out and "test_no_tool: Skipped: iproute2 is not installed" in out
        assert "test_no_gpu" not in out.split("skips outside the allow-list")[1]
    else:
        assert r.returncode == 0, out


def test_the_allow_list_admits_only_missing_hardware():
    from tests.common.markers import skip_allowed

    assert skip_allowed("Skipped: needs a CUDA GPU; none visible")
    assert skip_allowed("needs 2+ CUDA GPUs; 1 visible") and skip_allowed("no AVX-512F+BW")
    for reason in ("transformers is not installed (the hf extra)", "needs 2+ CUDA GPUs", "no ip or tc",
                   "needs a CUDA GPU; none visible, and more"):
        assert not skip_allowed(reason), reason


def test_a_skip_for_the_extension_is_allowed_only_when_it_is_switched_off(monkeypatch):
    from tests.common.markers import skip_allowed

    reason = "Skipped: flcomm._C not built: ModuleNotFoundError: No module named 'flcomm._C'"
    monkeypatch.delenv("FLCOMM_NATIVE", raising=False)
    assert not skip_allowed(reason)
    monkeypatch.setenv("FLCOMM_NATIVE", "1")
    assert not skip_allowed(reason)
    monkeypatch.setenv("FLCOMM_NATIVE", "0")
    assert skip_allowed(reason) and skip_allowed("flcomm._C is not built with the sparse kernels")
    assert not skip_allowed("transformers is not installed (the hf extra)")


def test_flcomm_native_0_switches_the_extension_off():
    """In fresh processes (the extension loads once per process): with ``FLCOMM_NATIVE=0`` the
    extension is unavailable with the switch's reason; with ``1`` it loads as it does unset."""
    from flcomm import _native

    code = "import json, flcomm._native as n; print(json.dumps([n.available(), n.unavailable_reason()]))"

    def probe(value):
        env = {k: v for k, v in os.environ.items() if k != "FLCOMM_NATIVE"}
        if value is not None:
            env["FLCOMM_NATIVE"] = value
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout.strip().splitlines()[-1])

    avail, why = probe("0")
    assert avail is False and "FLCOMM_NATIVE=0" in why and "plain-torch" in why, why
    assert probe("1") == probe(None)
    if not _native.switched_off():
        assert probe(None)[0] is _native.available()
