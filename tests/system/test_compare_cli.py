"""``python -m flcomm.train compare`` in subprocesses: the progress bar leaves no semaphore behind,
and (slow, root) the README's main job on the emulated cluster prints the table with the
"x vs FSDP" column, the summary and the titled PNG. Its parts: tests/unit/test_compare.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LEAK = "leaked semaphore"

# NOTE: a spawned rank (spawn start method, as on macOS, or forkserver, Python 3.14's default)
# registers every multiprocessing semaphore with the resource tracker, and ranks end with os._exit
_RANK = """
import io, multiprocessing as mp, os, sys
mp.set_start_method("spawn")
class Tty(io.StringIO):
    def isatty(self):
        return True
sys.stdout, sys.stderr = Tty(), Tty()
from flcomm.train.loop import progress_bar
bar = progress_bar(3, 0, "fsdp")
assert bar is not None
bar.update(3)
bar.close()
os._exit(0)
"""


def test_a_rank_with_a_progress_bar_leaks_no_semaphore():
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-c", _RANK], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert LEAK not in r.stderr, r.stderr


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(os.geteuid() != 0 or not all(map(shutil.which, ("ip", "tc"))),
                    reason="the emulated cluster needs root and iproute2 (ip, tc)")
def test_compare_on_the_emulated_cluster(tmp_path):
    cmd = [sys.executable, "-m", "flcomm.train", "compare", "--emulate", "--nproc", "4", "--steps", "8",
           "--eval-every", "4", "--eval-batches", "1", "--sync-every", "4", "--out-dir", str(tmp_path)]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=580,
                       env={**os.environ, "PYTHONPATH": REPO})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = r.stdout.splitlines()
    assert "x vs FSDP" in next(line for line in out if line.startswith("run "))
    assert out[-1].startswith("FL+FSDP: ") and "the tokens/s of FSDP on 2 emulated nodes at 100 Mbit/s" in out[-1]
    assert "not an emulated cluster" not in r.stdout
    assert (tmp_path / "compare.png").stat().st_size > 0
    assert LEAK not in r.stderr
