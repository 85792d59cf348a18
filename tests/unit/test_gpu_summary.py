"""tools/gpu_summary.py's parsers read what pytest, cuobjdump and a killed run leave behind, and
its rules judge the gate and the GPU tests (the rehearsal of tools/gpu_check.sh is in
tests/system/test_gpu_check.py). The verdicts are tested on pytest's own outputs, recorded in
tests/unit/data/gpu_summary/ (its README says how)."""

from __future__ import annotations

import ast
import gzip
import json
import os
import shutil
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))
RECORDED = os.path.join(ROOT, "tests", "unit", "data", "gpu_summary")
PROBE = os.path.join(ROOT, "tests", "gpu", "test_two_ranks_one_gpu.py")

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


# NOTE: each line as pytest 9 printed it (-v) for the runs of tests/unit/data/gpu_summary/ and
# their variants; the old regex read the "/ 1 error /" one as 5 selected (N13)
COLLECTED_LINES = [
    ("collecting ... collected 1 item", dict(collected=1, errors=0, deselected=0, selected=1)),
    ("collecting ... collected 5 items / 1 deselected / 4 selected", dict(collected=5, errors=0, deselected=1,
                                                                          selected=4)),
    ("collecting ... collected 4 items / 1 error", dict(collected=4, errors=1, deselected=0, selected=4)),
    ("collecting ... collected 4 items / 4 deselected / 0 selected", dict(collected=4, errors=0, deselected=4,
                                                                          selected=0)),
    ("collecting ... collected 5 items / 1 error / 1 deselected / 4 selected",
     dict(collected=5, errors=1, deselected=1, selected=4)),
    ("collecting ... collected 0 items / 1 error", dict(collected=0, errors=1, deselected=0, selected=0)),
    ("collected 1508 items / 2 errors / 1422 deselected / 86 selected",
     dict(collected=1508, errors=2, deselected=1422, selected=86)),
]


@pytest.mark.parametrize("line,want", COLLECTED_LINES, ids=[w for w, _ in COLLECTED_LINES])
def test_collected_line_counts_are_read_each_on_its_own(line, want):
    log = f"rootdir: /x\n{line}\n\ntests/gpu/test_ok.py::test_other PASSED      [100%]\n"
    assert gpu_summary.parse_collected(log) == want
    assert gpu_summary.parse_verbose(log, "pytest_gpu")[1] == want["selected"]


def test_collected_line_missing_or_not_pytests():
    assert gpu_summary.parse_collected("") is None
    # NOTE: a test's own output that says "collected" is not pytest's line
    assert gpu_summary.parse_collected("gc collected 5 items of garbage\n") is None


def _recorded_work(tmp_path, case: str, with_xml: bool = True, step: str = "pytest_gpu"):
    """A work folder holding one recorded pytest run as ``step``, a passed gate and the step's rc."""
    work = tmp_path / case
    work.mkdir(parents=True)
    src = os.path.join(RECORDED, case)
    names = [n for n in os.listdir(src) if with_xml or not n.endswith(".xml")]
    for n in names:
        shutil.copy(os.path.join(src, n), work / n.replace(n.split(".")[0], step))
    log = (work / f"{step}.log").read_text()
    rc = 0 if " failed" not in log.splitlines()[-1] and " error" not in log.splitlines()[-1] else 1
    (work / "gate.json").write_text(json.dumps(gpu_summary.gate(_info(), "90")))
    (work / "steps.jsonl").write_text(json.dumps({"step": step, "rc": rc, "seconds": 2}) + "\n")
    return work


@pytest.mark.parametrize("with_xml", [True, False], ids=["junit", "verbose-log"])
def test_verdicts_on_recorded_runs(tmp_path, with_xml):
    """all passed -> ok; one failed, one module that did not collect, one test stopped by
    pytest-timeout -> not ok, each with a reason naming it. From the XML and, as when the run
    was killed before writing it, from the -v log alone."""
    s = gpu_summary.summarize(str(_recorded_work(tmp_path, "passed", with_xml)), 470, 100)
    assert s["ok"], s["reasons"]
    assert s["tests"]["counts"] == {"passed": 3, "skipped": 1} and s["tests"]["selected"] == 4
    assert s["tests"]["single_gpu_selected"] == 3 and s["tests"]["min_passed"] == 3  # NOTE: the 2-GPU skip

    s = gpu_summary.summarize(str(_recorded_work(tmp_path, "failed", with_xml)), 470, 100)
    assert not s["ok"]
    assert "1 tests failed, errored or hung: tests/gpu/test_bad.py::test_fails failed" in s["reasons"], s["reasons"]
    (bad,) = s["failures"]
    assert "At index 2 diff: 3 != 4" in bad["traceback_tail"]

    s = gpu_summary.summarize(str(_recorded_work(tmp_path, "collection_error", with_xml)), 470, 100)
    assert not s["ok"] and s["tests"]["selected"] == 3 and s["tests"]["collection_errors"] == 1
    why = [r for r in s["reasons"] if "failed to collect" in r]
    assert why and why[0].startswith("pytest_gpu: 1 test module(s) failed to collect"), s["reasons"]
    if with_xml:  # NOTE: the junit XML names the module; the -v log lists it only in its summary
        assert why[0].endswith(": tests/gpu/test_broken.py"), why

    s = gpu_summary.summarize(str(_recorded_work(tmp_path, "timeout", with_xml)), 470, 100)
    assert not s["ok"] and s["tests"]["counts"] == {"passed": 4, "failed": 1}
    assert any("tests/gpu/test_slow.py::test_hangs timed out (pytest-timeout)" in r for r in s["reasons"]), s["reasons"]
    assert s["tests"]["passed"] >= s["tests"]["min_passed"]  # NOTE: not ok for the timeout alone


def test_a_collection_error_in_junit_names_the_module():
    tests = gpu_summary.parse_junit(os.path.join(RECORDED, "collection_error", "pytest_gpu.xml"), "pytest_gpu")
    assert [(t["test"], t["outcome"]) for t in tests][0] == ("tests/gpu/test_broken.py", "error")
    assert "No module named 'not_a_module_anywhere'" in tests[0]["traceback_tail"]


def _mark(kind: str) -> str:
    return "pytest.mark." + kind  # NOTE: spelled apart, so this file holds no mark the finder would take


def test_gpu_test_files_finds_every_way_of_marking(tmp_path):
    files = {
        "unit/test_deco.py": f"import pytest\n\n\n@{_mark('gpu')}\ndef test_a():\n    pass\n",
        "unit/test_module.py": f"import pytest\n\npytestmark = [{_mark('multigpu')}, pytest.mark.timeout(9)]\n",
        "unit/test_param.py": "import pytest\n\n\n@pytest.mark.parametrize('d', [\n"
                              f"    pytest.param(1, marks={_mark('gpu')})])\ndef test_p(d):\n    pass\n",
        "unit/test_cpu.py": "import pytest\n\n\n@pytest.mark.slow\ndef test_c():\n    pass\n",
        "unit/test_words.py": f"def test_w():\n    assert '{_mark('gpuish')}' != 'gpu marks in a string'\n",
        "unit/helper.py": f"import pytest\n\n\n@{_mark('gpu')}\ndef test_h():\n    pass\n",  # NOTE: no test_ name
        "gpu/test_mgpu.py": f"import pytest\n\n\n@{_mark('multigpu')}\ndef test_m():\n    pass\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    got = [os.path.relpath(p, tmp_path) for p in gpu_summary.gpu_test_files(str(tmp_path))]
    assert got == ["gpu/test_mgpu.py", "unit/test_deco.py", "unit/test_module.py", "unit/test_param.py"]
    with pytest.raises(FileNotFoundError, match="is not a folder of tests"):
        gpu_summary.gpu_test_files(str(tmp_path / "nowhere"))


def test_gpu_test_files_of_this_repo():
    got = set(gpu_summary.gpu_test_files(os.path.join(ROOT, "tests")))
    rel = {os.path.relpath(p, ROOT) for p in got}
    assert {"tests/gpu/test_two_ranks_one_gpu.py", "tests/gpu/test_gpu_probes.py", "tests/gpu/test_native_gpu.py",
            "tests/unit/test_kernels.py"} <= rel, rel
    # NOTE: N13: the module that needs torchft holds no GPU test, so no GPU step collects it
    assert "tests/system/test_peers.py" not in rel and "tests/unit/test_gpu_summary.py" not in rel


def test_multi_rank_paths_are_the_probes_gpu_tests():
    """tools/gpu_summary.py names the probe's paths by test: the names must be the probe file's
    gpu-marked tests, and the refusal's wording the one the probe skips with."""
    tree = ast.parse(open(PROBE).read())
    gpu_tests = [f.name for f in tree.body if isinstance(f, ast.FunctionDef) and f.name.startswith("test_")
                 and any("gpu" in ast.unparse(d) and "mark" in ast.unparse(d) for d in f.decorator_list)]
    assert gpu_tests == list(gpu_summary.MULTI_RANK_PATHS)
    refused = [n.value.value for n in tree.body if isinstance(n, ast.Assign)
               and any(getattr(t, "id", None) == "REFUSED" for t in n.targets)]
    assert refused == [gpu_summary.REFUSED]


def test_multi_rank_section_on_the_probes_cpu_run_and_on_a_refusal(tmp_path):
    work = _recorded_work(tmp_path, "two_ranks_cpu", step="pytest_two_ranks")
    s = gpu_summary.summarize(str(work), 470, 100)
    mr = s["multi_rank"]
    assert mr["verified"] == [] and mr["refused"] is None
    assert [u["test"] for u in mr["unverified"]] == list(gpu_summary.MULTI_RANK_PATHS)
    assert all(u["why"] == "skipped: needs a CUDA GPU; none visible" for u in mr["unverified"]), mr
    # the same run as a GPU run would leave it when NCCL refuses the setup after part 1 passed
    xml = work / "pytest_two_ranks.xml"
    text = xml.read_text()
    first = '<skipped type="pytest.skip" message="needs a CUDA GPU; none visible">'
    head, rest = text.split(first, 1)
    passed = head[:head.rindex(">") + 1].replace('time="0.001">', 'time="3.2" />', 1)
    refusal = f"{gpu_summary.REFUSED}: rank 0: NcclError after 1.0 s: Duplicate GPU"
    rest = rest.split("</testcase>", 1)[1].replace("needs a CUDA GPU; none visible", refusal)
    xml.write_text(passed + rest)
    mr = gpu_summary.summarize(str(work), 470, 100)["multi_rank"]
    assert mr["verified"] == [gpu_summary.MULTI_RANK_PATHS["test_root_communicator_and_splits"]], mr
    assert mr["refused"] == refusal and len(mr["unverified"]) == 3
    # a step that did not run leaves every path unverified, saying why
    (work / "steps.jsonl").write_text(json.dumps({"step": "pytest_two_ranks", "rc": None, "seconds": 0,
                                                  "skipped": "budget spent: 3 s left"}) + "\n")
    mr = gpu_summary.summarize(str(work), 470, 100)["multi_rank"]
    assert mr["verified"] == [] and {u["why"] for u in mr["unverified"]} == {
        "the step was skipped: budget spent: 3 s left"}


def _tree(tmp_path):
    root = tmp_path / "tree"
    (root / "csrc").mkdir(parents=True)
    (root / "flcomm").mkdir()
    (root / "setup.py").write_text("print('build')\n")
    (root / "csrc" / "a.cpp").write_text("int a() { return 1; }\n")
    return root


EXT = ".cpython-312-x86_64-linux-gnu.so"


def test_prebuilt_pack_then_install_and_its_refusals(tmp_path):
    root = _tree(tmp_path)
    so = tmp_path / f"_C{EXT}"
    so.write_bytes(b"not an ELF file, " * 1000)
    rec = gpu_summary.pack_prebuilt(str(so), str(tmp_path / "pack"), EXT, str(root))
    gz = tmp_path / "pack" / f"_C{EXT}.gz"
    assert rec["gz"] == str(gz) and rec["how"].startswith("not stripped")  # NOTE: strip refuses a non-ELF file
    assert json.loads((tmp_path / "pack" / f"_C{EXT}.gz.json").read_text())["sources_sha256"] == \
        gpu_summary.sources_hash(str(root))
    res = gpu_summary.install_prebuilt(str(gz), EXT, str(root))
    assert res["installed"] and (root / "flcomm" / f"_C{EXT}").read_bytes() == so.read_bytes()
    # another Python's, other sources, no record, not there
    assert "built for another Python" in gpu_summary.install_prebuilt(str(gz), ".cpython-311-x86_64-linux-gnu.so",
                                                                      str(root))["refused"]
    (root / "csrc" / "a.cpp").write_text("int a() { return 2; }\n")
    res = gpu_summary.install_prebuilt(str(gz), EXT, str(root))
    assert not res["installed"] and res["refused"].startswith("built from other sources"), res
    os.remove(str(gz) + ".json")
    assert "no record" in gpu_summary.install_prebuilt(str(gz), EXT, str(root))["refused"]
    assert gpu_summary.install_prebuilt(str(tmp_path / "none.gz"), EXT, str(root))["refused"].startswith("no file")
    with pytest.raises(ValueError, match="_C.cpython-312-x86_64-linux-gnu.so is not _C.cpython-311"):
        gpu_summary.pack_prebuilt(str(so), str(tmp_path / "pack"), ".cpython-311-x86_64-linux-gnu.so", str(root))
    with pytest.raises(FileNotFoundError, match="no flcomm._C at"):
        gpu_summary.pack_prebuilt(str(tmp_path / "missing.so"), str(tmp_path / "pack"), EXT, str(root))


def test_prebuilt_pack_strips_a_real_extension(tmp_path):
    import sysconfig

    ext = sysconfig.get_config_var("EXT_SUFFIX")
    so = os.path.join(ROOT, "flcomm", f"_C{ext}")
    if not os.path.exists(so):
        pytest.skip(f"no built {so}")
    root = _tree(tmp_path)
    rec = gpu_summary.pack_prebuilt(so, str(tmp_path / "pack"), ext, str(root))
    assert rec["how"] == "strip --strip-unneeded" and rec["bytes"] <= os.path.getsize(so)
    data = gzip.decompress((tmp_path / "pack" / f"_C{ext}.gz").read_bytes())
    assert data[:4] == b"\x7fELF" and len(data) == rec["bytes"]


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
