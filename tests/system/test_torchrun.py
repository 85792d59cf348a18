"""The driver under torchrun as on a two-node cluster: two torchrun agents on localhost
(``--nnodes 2 --nproc-per-node 2``, ``--node-rank 0`` and ``1``) run
``python -m flcomm.train --strategy fl-fsdp`` on gloo, with the c10d rendezvous (torchrun
ignores ``--node-rank`` there and orders the nodes by host name) and with the static one (the
node ranks as given; what a cluster recipe uses to keep federation groups on network cells).

Checks that both agents exit 0 within a time limit, that the run trained (loss fell, the
FedAvg syncs happened, bytes crossed between the groups), and that the ranks per node came
from torchrun's LOCAL_WORLD_SIZE (2; no ``--ranks-per-node`` is given, and without it the
driver would take the whole world of 4 as one node). Every process the test starts has its
environment marked with a tag; whatever still carries it at the end is killed (and is a
failure when the agents had exited on their own), so nothing outlives the test.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from flcomm.train.metrics import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS, E = 8, 2


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
    """SIGTERM the agents still running (they stop their workers), then SIGKILL whatever carries
    ``tag``. Returns the pids that were left for the SIGKILL."""
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
    """A port for torchrun's rendezvous (torchrun binds it itself, so it can only be picked here
    and handed over)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# NOTE: c10d, torchrun's default rendezvous, runs by default; static under -m slow
@pytest.mark.parametrize("rdzv_backend", ["c10d", pytest.param("static", marks=pytest.mark.slow)])
def test_driver_under_two_torchrun_agents(tmp_path, rdzv_backend):
    port = free_port()
    metrics = tmp_path / "run.jsonl"
    tag = f"{os.getpid()}-{port}-{rdzv_backend}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "FLCOMM_TEST_TAG": tag}
    train_args = ["--strategy", "fl-fsdp", "--backend", "gloo", "--steps", str(STEPS), "--sync-every", str(E),
                  "--batch-size", "2", "--seq-len", "32", "--max-tokens", "300000", "--eval-batches", "1",
                  "--eval-fraction", "0.05", "--warmup", "1", "--no-progress", "--timeout-s", "60",
                  "--metrics", str(metrics)]
    agents, logs = [], []
    try:
        for node in range(2):
            log = open(tmp_path / f"agent{node}.log", "w")
            logs.append(log)
            rdzv = (["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"flcomm-{port}"]
                    if rdzv_backend == "c10d" else
                    ["--rdzv-backend", "static", "--master-addr", "127.0.0.1", "--master-port", str(port)])
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2", *rdzv,
                   "--node-rank", str(node), "--max-restarts", "0", "--monitor-interval", "0.5",
                   "-m", "flcomm.train", *train_args]
            agents.append(subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 240
        while any(a.poll() is None for a in agents) and time.monotonic() < deadline:
            if any(a.poll() not in (None, 0) for a in agents):
                break  # one agent failed: the other would wait for its peers until the timeout
            time.sleep(0.5)
        codes = [a.poll() for a in agents]
    finally:
        left = _stop(agents, f"FLCOMM_TEST_TAG={tag}".encode())
        for log in logs:
            log.close()
    out = "\n".join(f"--- agent {i}\n" + (tmp_path / f"agent{i}.log").read_text()[-3000:] for i in range(2))
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
