"""tools/gpu_check.sh on a machine without a GPU: the plan fits its budget, a rehearsal writes
summary.json and logs.tgz as the device run would (and says that the build gate failed, since
there is no GPU), and a tiny budget skips every step and still summarizes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tools", "gpu_check.sh")

pytestmark = pytest.mark.timeout(120)


def _run(tmp_path, *args: str, **env: str) -> subprocess.CompletedProcess:
    e = dict(os.environ, PY=sys.executable, OUT=str(tmp_path / "out"), GPU_CHECK_WORK=str(tmp_path / "work"), **env)
    return subprocess.run(["bash", SCRIPT, *args], capture_output=True, text=True, env=e, timeout=100)


def test_dry_run_plan_fits_the_budget(tmp_path):
    p = _run(tmp_path, "--dry-run")
    assert p.returncode == 0, p.stdout + p.stderr
    rows = re.findall(r"^\[plan\] (\S+)\s+(\d+) s \(by\s+(\d+) s\)", p.stdout, re.M)
    names = [r[0] for r in rows]
    assert names == ["env", "build", "gate", "sass_ftz", "bench_kernels", "nccl_init", "pytest_native", "bench_coll",
                     "pytest_gpu", "pytest_probes"]
    budgets = [int(r[1]) for r in rows]
    assert all(b > 0 for b in budgets)
    assert int(rows[-1][2]) == sum(budgets)  # the deadlines are the running sums
    assert sum(budgets) + 10 <= 420, budgets  # room for the summary
    assert "fits" in p.stdout and "--sizes 256M 1G" in p.stdout
    assert not (tmp_path / "out").exists(), "a dry run writes nothing"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the rehearsal is for a machine without a GPU")
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
    assert "GPU_CHECK_SKIP_BENCH" in skipped["bench_coll"]
    for gpu_step in ("nccl_init", "pytest_native", "pytest_gpu", "pytest_probes"):
        assert "build gate failed" in skipped[gpu_step], skipped
    assert s["tests"]["passed"] == 0 and s["tests"]["min_passed"] >= 1
    with tarfile.open(out / "logs.tgz") as tar:
        names = set(tar.getnames())
        tar.extractall(tmp_path / "unpacked", filter="data")
    for want in ("env.json", "env.log", "gate.json", "gate.log", "steps.jsonl"):
        assert f"logs/{want}" in names, names
    gate = json.loads((tmp_path / "unpacked" / "logs" / "gate.json").read_text())
    assert gate == s["gate"]
    assert "BUILD GATE FAILED" in p.stdout


def test_tiny_budget_skips_steps_and_still_summarizes(tmp_path):
    # NOTE: 21 s: the 20 s kept for the summary leave every step a deadline under the 5 s a step
    # needs, however fast the machine (with 30 s a quiet machine ran the last step)
    p = _run(tmp_path, GPU_CHECK_BUDGET_S="21", GPU_CHECK_SKIP_BUILD="1")
    assert p.returncode == 1, p.stdout + p.stderr
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    why = {k["step"]: k["why"] for k in s["skipped"]}
    assert why["env"].startswith("budget spent") and why["pytest_probes"].startswith("budget spent"), why
    assert any("skipped: budget spent" in r for r in s["reasons"]), s["reasons"]
    assert tarfile.open(tmp_path / "out" / "logs.tgz").getnames()
