"""The driver under torchrun as on a two-node cluster: two torchrun agents on localhost
(``--nnodes 2 --nproc-per-node 2``, ``--node-rank 0`` and ``1``) run
``python -m flcomm.train --strategy fl-fsdp`` on gloo, with the c10d rendezvous (torchrun
ignores ``--node-rank`` there and orders the nodes by host name) and with the static one (the
node ranks as given; what a cluster recipe uses to keep federation groups on network cells).
With c10d the test hosts the rendezvous store itself, on a port the kernel picked and kept
bound, so no other process can take it between picking and binding (review F11).

Checks that both agents exit 0 within a time limit, that the run trained (loss fell, the
FedAvg syncs happened, bytes crossed between the groups), and that the ranks per node came
from torchrun's LOCAL_WORLD_SIZE (2; no ``--ranks-per-node`` is given, and without it the
driver would take the whole world of 4 as one node). Every process the test starts has its
environment marked with a tag; whatever still carries it at the end is killed (and is a
failure when the agents had exited on their own), so nothing outlives the test.

Faults under the agents (no flcomm launcher gathers the reports: each rank finds the culprit
alone, flcomm.train.monitor): bench/faults.py's tiny run with a 5 s collective timeout, a rank
killed in the forward, in the backward (reduce-scatter), in the FedAvg exchange, frozen in the
exchange, and rank 0 (the store's node) killed, on fl-fsdp and fl-hsdp. Every rank but the
faulty one (its agent's other worker too: the agent terminates it) prints one line, and each
line names the faulty rank, its step and phase, and how it failed, or, when the store is gone
with rank 0, says that the culprit could not be determined because the store is unreachable.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from datetime import timedelta

import pytest

from bench import faults
from flcomm.train.metrics import read_metrics
from flcomm.train.monitor import FAULT_ENV, process_state

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS, E = 8, 2
FAULT_TIMEOUT_S = 5.0
# NOTE: the fault cases' wall bound: start-up (4 ranks importing torch on a loaded machine) and
# the timeout; the ranks end within about 2 timeouts of the fault (bench/faults.py's bound)
FAULT_WALL_S = 180.0


def _tagged(tag: bytes) -> list[int]:
    """Processes whose environment holds ``tag``: the agents and their workers (torchrun starts
    each worker in a session of its own, so a signal to the agent's group misses them)."""
    pids = []
    for d in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if d.isdigit() and int(d) != os.getpid():
            try:
                with open(f"/proc/{d}/environ", "rb") as f:
                    if tag in f.read().split(b"\0"):
                        pids.append(int(d))
            except OSError:  # gone, or not ours to read
                pass
    return pids


def _stop(agents: list[subprocess.Popen], tag: bytes) -> list[int]:
    """SIGKILL frozen workers, SIGTERM the agents still running (they stop their workers), then
    SIGKILL whatever carries ``tag``. Returns the pids that were left for the SIGKILL."""
    for pid in _tagged(tag):  # NOTE: a frozen worker ignores its agent's SIGTERM, and the agent waits for it
        if process_state(pid) == "stopped":
            os.kill(pid, signal.SIGKILL)
    for a in agents:
        if a.poll() is None:
            a.terminate()
    for a in agents:
        try:
            a.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pass
    left = _tagged(tag)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for a in agents:
        a.wait()
    return left


def free_port() -> int:
    """A port for torchrun's static rendezvous, which binds it itself in agent 0 (so it can only be
    picked here and handed over: a port another process may take in between; the c10d
    rendezvous below has no such window)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def _rendezvous(rdzv_backend: str):
    """``(port, rendezvous arguments)``. c10d: the test hosts the rendezvous store itself, on a
    port the kernel picked and that stays bound for the whole run, and both agents join it as
    clients (``is_host=false``); agent 0 then hosts its workers' store on a port the kernel picks
    (torchrun shares its TCP store). static: :func:`free_port`."""
    if rdzv_backend != "c10d":
        port = free_port()
        yield port, ["--rdzv-backend", "static", "--master-addr", "127.0.0.1", "--master-port", str(port)]
        return
    from flcomm.train.launch import bound_store

    store = bound_store("127.0.0.1", 3, timedelta(seconds=300))
    try:
        yield store.port, ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{store.port}",
                           "--rdzv-id", f"flcomm-{store.port}", "--rdzv-conf", "is_host=false"]
    finally:
        del store


def _agents(tmp_path, train_args: list[str], rdzv_backend: str = "c10d", env: dict | None = None,
            wall_s: float = 240.0, until: Callable[[], bool] | None = None) -> tuple[list, list[int]]:
    """Two torchrun agents of 2 workers each running ``python -m flcomm.train *train_args``;
    waits until both exited, one failed, ``until()`` holds or ``wall_s`` passed, then stops
    whatever is left. Returns the agents' exit codes (None: still running) and the pids that
    had to be killed."""
    with _rendezvous(rdzv_backend) as (port, rdzv):
        return _run_agents(tmp_path, train_args, port, rdzv, rdzv_backend, env, wall_s, until)


def _run_agents(tmp_path, train_args, port, rdzv, rdzv_backend, env, wall_s, until):
    tag = f"{os.getpid()}-{port}-{rdzv_backend}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "FLCOMM_TEST_TAG": tag, **(env or {})}
    agents, logs = [], []
    try:
        for node in range(2):
            log = open(tmp_path / f"agent{node}.log", "w")
            logs.append(log)
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2", *rdzv,
                   "--node-rank", str(node), "--max-restarts", "0", "--monitor-interval", "0.5",
                   "-m", "flcomm.train", *train_args]
            agents.append(subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + wall_s
        while any(a.poll() is None for a in agents) and time.monotonic() < deadline:
            if until is not None and until():
                break
            if until is None and any(a.poll() not in (None, 0) for a in agents):
                break  # one agent failed: the other would wait for its peers until the timeout
            time.sleep(0.5)
        codes = [a.poll() for a in agents]
    finally:
        left = _stop(agents, f"FLCOMM_TEST_TAG={tag}".encode())
        for log in logs:
            log.close()
    return codes, left


def _agent_logs(tmp_path) -> str:
    return "\n".join(f"--- agent {i}\n" + (tmp_path / f"agent{i}.log").read_text() for i in range(2))


# NOTE: c10d, torchrun's default rendezvous, runs by default; static under -m slow
@pytest.mark.parametrize("rdzv_backend", ["c10d", pytest.param("static", marks=pytest.mark.slow)])
def test_driver_under_two_torchrun_agents(tmp_path, rdzv_backend):
    metrics = tmp_path / "run.jsonl"
    train_args = ["--strategy", "fl-fsdp", "--backend", "gloo", "--steps", str(STEPS), "--sync-every", str(E),
                  "--batch-size", "2", "--seq-len", "32", "--max-tokens", "300000", "--eval-batches", "1",
                  "--eval-fraction", "0.05", "--warmup", "1", "--no-progress", "--timeout-s", "60",
                  "--metrics", str(metrics)]
    codes, left = _agents(tmp_path, train_args, rdzv_backend)
    out = _agent_logs(tmp_path)[-6000:]
    assert codes == [0, 0], f"agents exited with {codes} (None: still running after 240 s)\n{out}"
    assert not left, f"processes {left} outlived their agents"

    run = read_metrics(str(metrics))
    cfg = run.config
    assert cfg["world_size"] == 4 and cfg["backend"] == "gloo"
    assert cfg["ranks_per_node"] == 2, f"ranks_per_node {cfg['ranks_per_node']}, expected LOCAL_WORLD_SIZE 2"
    # fl-fsdp's default group is one node: 2 groups of 2, FSDP traffic inside the node only
    assert cfg["mesh_shape"] == [2, 1, 2] and cfg["group_size"] == 2
    assert cfg["fsdp_bytes_per_step"]["intra_node"] > 0 and cfg["fsdp_bytes_per_step"]["inter_node"] == 0
    steps = run.steps
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    assert steps[-1]["num_syncs"] == STEPS // E
    assert [s["step"] for s in steps if s["intergroup_bytes"] > 0] == list(range(E, STEPS + 1, E))
    first, last = sum(s["loss"] for s in steps[:2]) / 2, sum(s["loss"] for s in steps[-2:]) / 2
    assert last < first, (first, last)


# ---------------------------------------------------------------- faults: every survivor names the culprit
# (strategy, action, case of bench/faults.py's PHASES, faulty rank, rendezvous); one kill and one
# freeze by default. With the static rendezvous rank 0's own process serves the store: it dies with it
FAULTS = [(s, a, p, r, "c10d") for s in ("fl-fsdp", "fl-hsdp")
          for a, p, r in (("kill", "forward", 1), ("kill", "backward", 1), ("kill", "fedavg", 1),
                          ("freeze", "fedavg", 1), ("kill", "fedavg", 0))]
FAULTS.append(("fl-fsdp", "kill", "fedavg", 0, "static"))
FAST = {("fl-fsdp", "kill", "fedavg", 1, "c10d"), ("fl-hsdp", "freeze", "fedavg", 1, "c10d")}


def _error_lines(tmp_path) -> dict[int, list[str]]:
    """Each rank's "flcomm.train: error: rank R: ..." lines in the agents' logs."""
    lines: dict[int, list[str]] = {}
    for m in re.finditer(r"^flcomm\.train: error: rank (\d+): .*$", _agent_logs(tmp_path), re.M):
        lines.setdefault(int(m.group(1)), []).append(m.group(0))
    return lines


@pytest.mark.parametrize("strategy,action,phase,faulty,rdzv", [
    pytest.param(*f, id="-".join(map(str, f)), marks=() if f in FAST else pytest.mark.slow) for f in FAULTS])
def test_every_survivor_names_the_culprit(tmp_path, strategy, action, phase, faulty, rdzv):
    step, mphase = faults.PHASES[phase]
    survivors = [r for r in range(4) if r != faulty]
    args = [*faults.train_args(strategy, FAULT_TIMEOUT_S), "--backend", "gloo", "--log-dir", str(tmp_path / "log")]
    # NOTE: a frozen rank keeps its agent waiting (SIGTERM does nothing to a stopped process):
    # the test ends once every survivor has said its line
    codes, _ = _agents(tmp_path, args, rdzv, env={FAULT_ENV: f"{faulty}:{step}:{mphase}:{action}"},
                       wall_s=FAULT_WALL_S, until=lambda: set(survivors) <= set(_error_lines(tmp_path)))
    lines = _error_lines(tmp_path)
    out = _agent_logs(tmp_path)[-8000:]
    assert sorted(lines) == survivors and all(len(v) == 1 for v in lines.values()), \
        f"expected one error line from each of ranks {survivors}, got {lines}\n{out}"
    how = "exited" if action == "kill" else "stopped answering"
    named = f"culprit: rank {faulty} (step {step}, phase "
    for r in survivors:
        line = lines[r][0]
        if named in line:
            tail = line.split(named, 1)[1]
            assert faults.PHASE_WORDS[phase] in tail.split(")")[0] and f") {how}" in tail, line
        else:
            # NOTE: rank 0 hosts the store's node: once it is gone, a rank may only say so
            assert faulty == 0 and "the culprit could not be determined: the store at" in line \
                and "unreachable" in line, line
