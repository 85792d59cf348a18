"""tools/gpu_summary.py's parsers read what pytest, cuobjdump and a killed run leave behind, and
its rules judge the gate and the GPU tests (the rehearsal of tools/gpu_check.sh is in
tests/system/test_gpu_check.py)."""

from __future__ import annotations

import json
import os
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import gpu_summary  # noqa: E402

pytestmark = pytest.mark.timeout(120)


# ---- the parsers of tools/gpu_summary.py ----

VERBOSE_LOG = textwrap.dedent("""\
    ============================= test session starts ==============================
    collected 120 items / 100 deselected / 20 selected

    tests/test_a.py::test_ok PASSED                                          [  5%]
    tests/test_a.py::test_bad[int8] FAILED                                   [ 10%]
    tests/test_a.py::test_two SKIPPED (needs 2+ CUDA GPUs; 1 visible)        [ 15%]
    tests/test_a.py::test_teardown PASSED                                    [ 20%]
    tests/test_a.py::test_teardown ERROR                                     [ 20%]
    tests/test_b.py::test_hangs
    """)


def test_verbose_log_gives_outcomes_and_the_test_a_killed_run_was_in():
    tests, selected = gpu_summary.parse_verbose(VERBOSE_LOG, "pytest_gpu")
    got = {t["test"]: t["outcome"] for t in tests}
    assert got == {"tests/test_a.py::test_ok": "passed", "tests/test_a.py::test_bad[int8]": "failed",
                   "tests/test_a.py::test_two": "skipped", "tests/test_a.py::test_teardown": "error",
                   "tests/test_b.py::test_hangs": "hung"}
    assert selected == 20


def test_verbose_log_summaries_are_not_results_and_tracebacks_are_kept():
    log = VERBOSE_LOG.replace("tests/test_b.py::test_hangs\n", "") + textwrap.dedent("""\
        =================================== FAILURES ===================================
        ________________________________ test_bad[int8] ________________________________
            def test_bad():
        >       assert 1 == 2
        E       assert 1 == 2
        =============================== warnings summary ===============================
        tests/test_c.py::test_warns
          some warning
        =========================== short test summary info ============================
        FAILED tests/test_a.py::test_bad[int8] - assert 1 == 2
        """)
    tests, _ = gpu_summary.parse_verbose(log, "pytest_gpu")
    assert "tests/test_c.py::test_warns" not in {t["test"] for t in tests}
    bad = next(t for t in tests if t["outcome"] == "failed")
    assert "E       assert 1 == 2" in bad["traceback_tail"]


def test_junit_outcomes_and_node_ids(tmp_path):
    xml = tmp_path / "pytest_gpu.xml"
    xml.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_a" name="test_ok" time="0.5"/>'
        '<testcase classname="tests.test_a.TestC" name="test_m" time="0.1">'
        '<failure message="assert 0">line 1\nE   assert 0</failure></testcase>'
        '<testcase classname="tests.test_a" name="test_s" time="0"><skipped message="needs 2+ CUDA GPUs; 1 visible"/>'
        '</testcase><testcase classname="tests.gpu.test_b" name="test_t" time="0"/></testsuite></testsuites>')
    tests = gpu_summary.parse_junit(str(xml), "pytest_gpu")
    assert [(t["test"], t["outcome"]) for t in tests] == [
        ("tests/test_a.py::test_ok", "passed"), ("tests/test_a.py::TestC::test_m", "failed"),
        ("tests/test_a.py::test_s", "skipped"), ("tests/gpu/test_b.py::test_t", "passed")]  # a tier's folder
    assert tests[1]["traceback_tail"].endswith("E   assert 0")
    assert gpu_summary.needs_two_gpus(tests[2])
    assert gpu_summary.parse_junit(str(tmp_path / "missing.xml"), "x") is None


def test_ftz_count_per_quantization_kernel():
    sass = textwrap.dedent("""\
        Function : _ZN6flcomm19quant_blocks_kernelILi0EEEvPKfPfPhS4_ll
            /*0010*/  FMUL R1, R2, R3 ;
            /*0020*/  FMUL.FTZ R1, R2, R3 ;
        Function : _ZN6flcomm21dequant_blocks_kernelEPKhPKfPfll
            /*0010*/  MUFU.RCP R4, R5 ;
        Function : _ZN6flcomm22shard_transpose_kernelIfEEvPKT_PS1_lll
            /*0010*/  FADD.FTZ R1, R2, R3 ;
        """)
    counts = gpu_summary.count_ftz(sass)
    assert counts == {"_ZN6flcomm19quant_blocks_kernelILi0EEEvPKfPfPhS4_ll": 1,
                      "_ZN6flcomm21dequant_blocks_kernelEPKhPKfPfll": 0}


def _info(**kw) -> dict:
    base = {"native": True, "native_error": None, "cuda_compiled": True, "cuda_kernels": ["quantize"],
            "cuda_archs": ["sm_90"], "gpus": 1, "nccl_compiled": "2.28.9", "nccl_loaded": "2.28.9",
            "torch_nccl": "2.28.9", "cuda_runtime": 13000}
    return {**base, **kw}


def test_gate_rules():
    assert gpu_summary.gate(_info(), "90")["ok"]
    g = gpu_summary.gate(_info(nccl_compiled=None, nccl_loaded=None), "90")
    assert not g["ok"] and not g["fatal"] and "without NCCL" in g["fail"][0]
    g = gpu_summary.gate(_info(nccl_loaded="2.30.7"), "90")
    assert g["fail"] == ["NCCL versions disagree: compiled 2.28.9, loaded 2.30.7, torch 2.28.9"]
    assert "sm_100" in gpu_summary.gate(_info(), "90;100")["fail"][0]
    assert gpu_summary.gate(_info(cuda_compiled=False, gpus=0), "90")["fatal"] == [
        "flcomm._C was built without CUDA (cuda_compiled false)", "no CUDA GPU visible (gpus 0)"]
    assert gpu_summary.gate(None, "90", "Traceback: boom")["fatal"][0].endswith("Traceback: boom")


def _summary_of(tmp_path, outcomes: list[str], selected: int) -> dict:
    work = tmp_path / "w"
    work.mkdir(parents=True)
    (work / "gate.json").write_text(json.dumps(gpu_summary.gate(_info(), "90")))
    (work / "steps.jsonl").write_text(json.dumps({"step": "pytest_gpu", "rc": 0, "seconds": 1}) + "\n")
    cases = "".join(f'<testcase classname="tests.test_a" name="t{i}" time="0">'
                    + ("<skipped message='x'/>" if o == "skipped" else "") + "</testcase>"
                    for i, o in enumerate(outcomes))
    (work / "pytest_gpu.xml").write_text(f"<testsuite>{cases}</testsuite>")
    (work / "pytest_gpu.log").write_text(f"collected {selected} items\n")
    return gpu_summary.summarize(str(work), 420, 100)


def test_ok_needs_most_gpu_tests_to_pass_and_an_all_skip_run_fails(tmp_path):
    s = _summary_of(tmp_path / "a", ["passed"] * 8 + ["skipped"] * 2, 10)
    assert s["ok"], s["reasons"]
    assert s["tests"]["min_passed"] == 8
    s = _summary_of(tmp_path / "b", ["passed"] * 7 + ["skipped"] * 3, 10)
    assert not s["ok"] and "7 GPU tests passed, 8 needed" in s["reasons"][0]
    s = _summary_of(tmp_path / "c", ["skipped"] * 10, 10)
    assert not s["ok"] and s["tests"]["passed"] == 0


def test_a_bench_without_records_is_not_ok(tmp_path):
    work = tmp_path / "w"
    work.mkdir()
    (work / "steps.jsonl").write_text(json.dumps({"step": "bench_kernels", "rc": 0, "seconds": 1}) + "\n")
    (work / "bench_kernels.json").write_text("[]")
    s = gpu_summary.summarize(str(work), 420, 10)
    assert "bench_kernels gave no CUDA records (see bench_kernels.log)" in s["reasons"]
    rec = {"kernel": "quantize", "codec": "int8", "block_size": 256, "size_bytes": 1 << 28, "gbps": 3000.0,
           "copy_gbps": 3500.0, "of_copy": 0.86, "torch_ops_gbps": 500.0, "time_us": 1.0}
    (work / "bench_kernels.json").write_text(json.dumps([rec]))
    s = gpu_summary.summarize(str(work), 420, 10)
    assert s["bench_kernels"] == [{k: v for k, v in rec.items() if k != "time_us"}]
    assert not any("bench" in r for r in s["reasons"])
