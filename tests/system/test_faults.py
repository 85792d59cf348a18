"""Faults, fast: the fault matrix of bench/faults.py on FL+FSDP with 4 ranks and a 5 s collective
timeout ({kill, freeze} x {forward, backward, FedAvg exchange, checkpoint save}, the launcher
killed with SIGTERM and SIGKILL), a bit-exact resume after a crash inside a save, non-finite
averages, and the launcher's store. Every rank-fault case asserts:
the other ranks end within 2 x the timeout of the fault, the message names the failed rank and
the phase, no process is left, the last checkpoint verifies. (--nan-policy on gloo ranks:
tests/dist/test_nan_policy.py.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from bench import faults

TIMEOUT_S = 5.0
# NOTE: the peers of a killed or frozen rank end within about one collective timeout of the fault
# (bench/faults.py's table holds them to 2 x); the tests allow 5 x that (a loaded machine): a
# peer that waited for torch's default timeout would still fail
RANK_BOUND_S = 5 * TIMEOUT_S
# one kill and one freeze run by default; the rest of the matrix is slow (-m slow, FLCOMM_SLOW=1)
FAST_FAULTS = {("kill", "checkpoint"), ("freeze", "fedavg")}
RANK_FAULTS = [pytest.param(a, p, id=f"{p}-{a}", marks=() if (a, p) in FAST_FAULTS else pytest.mark.slow)
               for p in faults.PHASES for a in ("kill", "freeze")]


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flcomm.train", "--nproc", "4", *args], env=faults._env(**(env or {})),
                          capture_output=True, text=True, timeout=300)


def _losses(path: str) -> dict[int, float]:
    with open(path) as f:
        recs = [json.loads(line) for line in f]
    return {r["step"]: r["loss"] for r in recs if "step" in r}


@pytest.mark.parametrize("action,phase", RANK_FAULTS)
def test_rank_fault(action, phase, tmp_path):
    r = faults.run_rank_fault("fl-fsdp", action, phase, str(tmp_path), TIMEOUT_S)
    assert not r.hang and r.seconds <= RANK_BOUND_S, r
    assert r.launcher_s <= RANK_BOUND_S + faults.LAUNCHER_SLACK_S, r
    assert r.rc == 2, r
    assert r.names_rank and r.names_phase, r.message
    how = "was killed by SIGKILL" if action == "kill" else "stopped making progress (frozen"
    assert f"rank {faults.FAULTY_RANK} {how}" in r.message, r.message
    assert r.orphans == 0 and len(r.rank_pids) == 4
    # a fault at step 3 or 4 leaves the save of step 2 (a fault inside the save of 4 as well)
    assert r.checkpoint_step == 2, r
    if (action, phase) == ("kill", "checkpoint"):
        _resume_is_bit_exact(str(tmp_path))


def _resume_is_bit_exact(workdir: str) -> None:
    """After the crash inside the save of step 4, a resume from step 2 reproduces an
    uninterrupted run's losses exactly."""
    base = faults.train_args("fl-fsdp", TIMEOUT_S)
    ref = _cli(*base, "--metrics", os.path.join(workdir, "ref.jsonl"))
    assert ref.returncode == 0, ref.stderr
    resumed = _cli(*faults.train_args("fl-fsdp", TIMEOUT_S, ckpt_dir=os.path.join(workdir, "ckpt")), "--resume",
                   "--metrics", os.path.join(workdir, "b.jsonl"))
    assert resumed.returncode == 0, resumed.stderr
    want, got = _losses(os.path.join(workdir, "ref.jsonl")), _losses(os.path.join(workdir, "b.jsonl"))
    assert sorted(got) == [3, 4, 5, 6]
    assert all(got[s] == want[s] for s in got), (got, want)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_launcher_killed_leaves_no_rank(sig, tmp_path):
    r = faults.run_launcher_kill("fl-fsdp", sig, str(tmp_path), TIMEOUT_S)
    assert len(r.rank_pids) == 4, r
    # NOTE: no rank left after run_launcher_kill's wait (bound_s + 5 s, >= 10 x the expected end)
    assert r.orphans == 0 and not r.hang, r
    assert r.rc == -sig


# ---------------------------------------------------------------- non-finite loss
def test_non_finite_average_is_reported_once(tmp_path):
    """Rank 1's parameters turn NaN before a FedAvg sync: FedAvg refuses the average
    (NonFiniteAverageError); the CLI ends with rc 2 and one report naming it, no traceback."""
    p = _cli(*faults.train_args("fl-fsdp", TIMEOUT_S), "--log-dir", str(tmp_path / "log"),
             env={"FLCOMM_FAULT": "1:4:fedavg:nan"})
    assert p.returncode == 2, p.stderr
    assert p.stderr.count("flcomm.train: error:") == 1 and "Traceback" not in p.stderr, p.stderr
    assert "NonFiniteAverageError" in p.stderr and "step 4" in p.stderr, p.stderr


# ---------------------------------------------------------------- the store
def test_store_listens_on_the_master_address_only():
    from datetime import timedelta

    from flcomm.train.launch import bound_store

    store = bound_store("127.0.0.1", 1, timedelta(seconds=5))
    port = store.port
    assert port > 0
    listening = []
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, p = local.split(":")
            if state == "0A" and int(p, 16) == port:
                listening.append(addr)
    v6 = []
    if os.path.exists("/proc/net/tcp6"):
        with open("/proc/net/tcp6") as f:
            v6 = [ln.split()[1] for ln in f.readlines()[1:] if ln.split()[3] == "0A"
                  and int(ln.split()[1].split(":")[1], 16) == port]
    assert listening == ["0100007F"] and not v6, (listening, v6)
    store.set("k", "v")
    assert store.get("k") == b"v"
