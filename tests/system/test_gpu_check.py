"""tools/gpu_check.sh on a machine without a GPU: the plan fits its budget, a rehearsal writes
summary.json and logs.tgz as the device run would (and says that the build gate failed, since
there is no GPU), a forced rehearsal runs exactly the GPU-marked tests with no collection error,
a prebuilt _C is installed, gated and dropped for the build when it fails, and a tiny budget
skips every step and still summarizes."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tools", "gpu_check.sh")
STEPS = ["env", "prebuilt", "build", "gate", "sass_ftz", "nccl_init", "pytest_probes", "pytest_two_ranks",
         "pytest_native", "bench_kernels", "bench_coll", "pytest_gpu"]
PYTEST_STEPS = ("pytest_probes", "pytest_two_ranks", "pytest_native", "pytest_gpu")
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="the rehearsal is for a machine without a GPU")

pytestmark = pytest.mark.timeout(300)


def _run(tmp_path, *args: str, script: str = SCRIPT, **env: str) -> subprocess.CompletedProcess:
    # NOTE: GPU_CHECK_PREBUILT=none: a prebuilt _C at the default path must not replace this
    # tree's _C (other tests load it); the prebuilt's own test runs in a copy of the tree
    e = dict(os.environ, PY=sys.executable, OUT=str(tmp_path / "out"), GPU_CHECK_WORK=str(tmp_path / "work"),
             **{"GPU_CHECK_PREBUILT": "none", **env})
    return subprocess.run(["bash", script, *args], capture_output=True, text=True, env=e, timeout=280)


def test_dry_run_plan_fits_the_budget_with_the_probes_first(tmp_path):
    p = _run(tmp_path, "--dry-run")
    assert p.returncode == 0, p.stdout + p.stderr
    rows = re.findall(r"^\[plan\] (\S+)\s+(\d+) s \(by\s+(\d+) s(?:, cap (\d+) s)?\)(.*)$", p.stdout, re.M)
    assert [r[0] for r in rows] == STEPS, p.stdout
    budgets = [int(r[1]) for r in rows]
    assert all(b > 0 for b in budgets)
    assert [int(r[2]) for r in rows] == [sum(budgets[:i + 1]) for i in range(len(budgets))]  # running sums
    assert sum(budgets) + 20 <= 470, budgets  # room for the summary
    assert re.search(r"^\[plan\] steps \d+ s \+ summary 20 s = \d+ s of a 470 s budget: fits$", p.stdout, re.M)
    plan = {r[0]: r for r in rows}
    assert plan["pytest_two_ranks"][3] == "60" and int(plan["pytest_two_ranks"][1]) <= 60
    assert "tests/gpu/test_two_ranks_one_gpu.py" in plan["pytest_two_ranks"][4]
    assert "only without a prebuilt _C" in plan["build"][4] and " prebuilt " in plan["prebuilt"][4]
    # NOTE: N13: only the files with gpu marks, each in one step; never the whole tests/ folder
    gpu = plan["pytest_gpu"][4]
    assert "tests/unit/test_kernels.py" in gpu and "test_gpu_probes.py" not in gpu and " tests " not in gpu
    assert "test_peers.py" not in p.stdout
    assert "--sizes 256M 1G" in p.stdout
    assert not (tmp_path / "out").exists(), "a dry run writes nothing"


@no_gpu
def test_cpu_rehearsal_writes_the_summary_and_the_logs(tmp_path):
    p = _run(tmp_path, GPU_CHECK_SKIP_BUILD="1", GPU_CHECK_SKIP_BENCH="1")
    assert p.returncode == 1, p.stdout + p.stderr  # NOTE: not ok without a GPU
    out = tmp_path / "out"
    files = sorted(os.listdir(out))
    assert len(files) <= 8 and set(files) <= {"summary.json", "logs.tgz"}, files
    s = json.loads((out / "summary.json").read_text())
    assert s["ok"] is False
    assert s["gate"]["ok"] is False and s["gate"]["fatal"], s["gate"]
    assert any("no CUDA GPU visible" in r or "did not load" in r for r in s["gate"]["fatal"]), s["gate"]
    assert any(r.startswith("build gate:") for r in s["reasons"]), s["reasons"]
    assert s["versions"]["torch"] == torch.__version__
    for key in ("python", "torch_cuda", "nvcc", "setuptools", "driver", "gpu_name", "nccl"):
        assert key in s["versions"], key
    assert set(s["versions"]["nccl"]) == {"compiled", "loaded", "torch"}
    ran = {st["step"]: st for st in s["steps"]}
    assert ran["env"]["rc"] == 0 and ran["gate"]["rc"] == 2
    skipped = {k["step"]: k["why"] for k in s["skipped"]}
    assert "GPU_CHECK_SKIP_BUILD" in skipped["build"] and "GPU_CHECK_SKIP_BENCH" in skipped["bench_kernels"]
    assert "GPU_CHECK_SKIP_BENCH" in skipped["bench_coll"] and "GPU_CHECK_PREBUILT=none" in skipped["prebuilt"]
    for gpu_step in ("nccl_init", *PYTEST_STEPS):
        assert "build gate failed" in skipped[gpu_step], skipped
    assert s["tests"]["passed"] == 0 and s["tests"]["min_passed"] >= 1
    assert s["multi_rank"]["verified"] == [] and len(s["multi_rank"]["unverified"]) == 4, s["multi_rank"]
    assert all("build gate failed" in u["why"] for u in s["multi_rank"]["unverified"])
    with tarfile.open(out / "logs.tgz") as tar:
        names = set(tar.getnames())
        tar.extractall(tmp_path / "unpacked", filter="data")
    for want in ("env.json", "env.log", "gate.json", "gate.log", "steps.jsonl"):
        assert f"logs/{want}" in names, names
    gate = json.loads((tmp_path / "unpacked" / "logs" / "gate.json").read_text())
    assert gate == s["gate"]
    assert "BUILD GATE FAILED" in p.stdout


def _gpu_marked_tests() -> set[str]:
    """The reference: every test of the whole suite that ``-m "gpu or multigpu"`` selects, as
    pytest collects it here (where every module imports)."""
    p = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                        "-m", "gpu or multigpu", "tests"], capture_output=True, text=True, cwd=ROOT, timeout=200)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return {ln.strip() for ln in p.stdout.splitlines() if "::" in ln}


@no_gpu
def test_forced_cpu_rehearsal_runs_exactly_the_gpu_marked_tests(tmp_path):
    """GPU_CHECK_FORCE=1: the GPU steps run on the CPU, where every GPU test skips. Together they
    select each GPU-marked test of the suite once, collect no module with an error (N13), and
    leave at most 8 files."""
    p = _run(tmp_path, GPU_CHECK_FORCE="1", GPU_CHECK_SKIP_BUILD="1", GPU_CHECK_SKIP_BENCH="1")
    assert p.returncode == 1, p.stdout + p.stderr  # NOTE: not ok: no GPU
    files = sorted(os.listdir(tmp_path / "out"))
    assert len(files) <= 8 and set(files) <= {"summary.json", "logs.tgz"}, files
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    ran = {st["step"]: st for st in s["steps"]}
    for step in PYTEST_STEPS:
        assert ran[step]["rc"] == 0 and not ran[step].get("skipped"), ran[step]  # NOTE: all skipped: rc 0
    items = s["tests"]["items"]
    assert s["tests"]["collection_errors"] == 0 and "error" not in s["tests"]["counts"], s["tests"]["counts"]
    got = [t["test"] for t in items]
    want = _gpu_marked_tests()
    assert len(got) == len(set(got)), "a GPU test ran in two steps"
    assert set(got) == want, (sorted(set(got) - want), sorted(want - set(got)))
    assert s["tests"]["selected"] == len(want) and s["tests"]["counts"] == {"skipped": len(want)}, s["tests"]["counts"]
    assert not any("failed to collect" in r or "tests failed" in r for r in s["reasons"]), s["reasons"]
    assert [u["test"] for u in s["multi_rank"]["unverified"]] == [
        "test_root_communicator_and_splits", "test_dead_peer_aborted_by_the_watchdog",
        "test_fedavg_int8_error_feedback_native_matches_gloo", "test_replicate_hook_native_matches_gloo"]


def _tree_copy(tmp_path):
    """The tracked and new files of this checkout, and its built _C, in a folder of their own."""
    dest = tmp_path / "tree"
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, names):
        src = os.path.join(ROOT, rel)
        if os.path.isfile(src):
            os.makedirs(dest / os.path.dirname(rel), exist_ok=True)
            shutil.copy2(src, dest / rel)
    return dest


@no_gpu
def test_a_prebuilt_c_is_installed_gated_and_dropped_when_it_fails(tmp_path):
    """--pack-prebuilt writes build/gpu_prebuilt/_C<ext>.gz and its record; the check finds it
    there, installs it, gates it (no GPU: it fails) and drops it for the build (skipped here), and
    the prebuilt's failure is not a reason of its own. A prebuilt of other sources is refused."""
    ext = sysconfig.get_config_var("EXT_SUFFIX")
    so = os.path.join(ROOT, "flcomm", f"_C{ext}")
    if not os.path.exists(so):
        pytest.skip(f"no built {so}")
    tree = _tree_copy(tmp_path)
    script = str(tree / "tools" / "gpu_check.sh")
    env = dict(GPU_CHECK_PREBUILT="", GPU_CHECK_SKIP_BUILD="1", GPU_CHECK_SKIP_BENCH="1")
    p = _run(tmp_path, "--pack-prebuilt", so, script=script, GPU_CHECK_TARGET_EXT=".cpython-312-x86_64-linux-gnu.so")
    assert p.returncode == 1 and "the GPU machine's Python loads only a _C named" in p.stderr, p.stderr
    p = _run(tmp_path, "--pack-prebuilt", so, script=script, GPU_CHECK_TARGET_EXT=ext)
    assert p.returncode == 0, p.stdout + p.stderr
    gz = tree / "build" / "gpu_prebuilt" / f"_C{ext}.gz"
    assert gz.exists() and (tree / "build" / "gpu_prebuilt" / f"_C{ext}.gz.json").exists()

    p = _run(tmp_path / "a", script=script, **env)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "falling back to a build" in p.stdout, p.stdout
    s = json.loads((tmp_path / "a" / "out" / "summary.json").read_text())
    pre = s["prebuilt"]
    assert pre["installed"] and not pre["used"] and pre["gate"]["fatal"], pre
    assert not (tree / "flcomm" / f"_C{ext}").exists(), "the prebuilt that failed its gate was left in place"
    assert not any(r.startswith("step prebuilt") for r in s["reasons"]), s["reasons"]
    # NOTE: the final gate ran on what the tree holds now (here, through the checkout's editable
    # install, the checkout's own _C), and its verdict is the run's
    assert {st["step"]: st for st in s["steps"]}["gate"]["rc"] == 2 and s["gate"]["fatal"], s["gate"]

    (tree / "csrc" / "bindings.cpp").write_text((tree / "csrc" / "bindings.cpp").read_text() + "\n// changed\n")
    p = _run(tmp_path / "b", script=script, **env)
    s = json.loads((tmp_path / "b" / "out" / "summary.json").read_text())
    assert not s["prebuilt"]["installed"] and s["prebuilt"]["refused"].startswith("built from other sources"), \
        s["prebuilt"]


def test_tiny_budget_skips_steps_and_still_summarizes(tmp_path):
    # NOTE: 21 s: the 20 s kept for the summary leave every step a deadline under the 5 s a step
    # needs, however fast the machine (with 30 s a quiet machine ran the last step)
    p = _run(tmp_path, GPU_CHECK_BUDGET_S="21", GPU_CHECK_SKIP_BUILD="1")
    assert p.returncode == 1, p.stdout + p.stderr
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    why = {k["step"]: k["why"] for k in s["skipped"]}
    assert why["env"].startswith("budget spent") and why["pytest_gpu"].startswith("budget spent"), why
    assert any("skipped: budget spent" in r for r in s["reasons"]), s["reasons"]
    assert tarfile.open(tmp_path / "out" / "logs.tgz").getnames()
