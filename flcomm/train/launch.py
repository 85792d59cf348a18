"""Starting the ranks: N local CPU processes (:func:`launch_local`) or one rank under torchrun
(:func:`worker_main`), and what happens when one of them fails.

The local launcher:

1. checks everything that can be refused before a process starts (:func:`check_before_launch`);
2. hosts the rendezvous store itself, bound to the master address on a port the kernel picks
   (port 0, read back: no race for a "free" port), so the store outlives any rank;
3. spawns the ranks; each asks the kernel for SIGKILL when the launcher dies
   (``PR_SET_PDEATHSIG``) and exits at once if the launcher is already gone;
4. forwards SIGTERM / SIGHUP / SIGINT to the ranks and then exits;
5. on the first failure waits until every rank reported or its time is up (the collective
   timeout plus a margin), stops the rest, and raises :class:`LaunchError` naming the rank that
   failed first (:func:`flcomm.train.monitor.first_failure`), its step and phase, the first
   report of the others, and the per-rank log directory.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys
import tempfile
import time
from dataclasses import replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from flcomm.train.driver import STARTUP_TIMEOUT_S, TrainConfig, TrainResult, _pos_int, check_before_launch, train
from flcomm.train.monitor import (Monitor, describe, first_failure, heartbeat_path, log_path, process_state,
                                  read_heartbeat)

MASTER_ADDR = "127.0.0.1"
_PR_SET_PDEATHSIG = 1
REFUSED_RC = 2  # a rank's exit code for a refusal (bad input, non-finite values); 1: a failure


class LaunchError(RuntimeError):
    """Some rank failed; the message names the first one (see the module doc)."""


def _backend(cfg: TrainConfig) -> str:
    if cfg.backend != "auto":
        return cfg.backend
    return "nccl" if torch.cuda.is_available() and "LOCAL_RANK" in os.environ else "gloo"


def worker_main(cfg: TrainConfig, store: Any = None, monitor: Monitor | None = None) -> TrainResult:
    """One rank: under torchrun (RANK, WORLD_SIZE, MASTER_ADDR/PORT) or, with ``store``,
    inside :func:`launch_local`."""
    backend = _backend(cfg)
    if backend == "nccl" and not torch.cuda.is_available():
        raise RuntimeError("--backend nccl needs CUDA GPUs; none is visible (use gloo on CPU)")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if store is None:
        store = _env_store(rank, world, cfg.timeout_s)
    # NOTE: the start-up timeout until every rank has built its model (train() then sets the
    # default group's timeout to timeout_s: driver._startup_barrier)
    dist.init_process_group(backend, timeout=timedelta(seconds=max(cfg.timeout_s, STARTUP_TIMEOUT_S)),
                            store=store, rank=rank, world_size=world)
    try:
        return train(cfg, monitor=monitor)
    finally:
        dist.destroy_process_group()


def _env_store(rank: int, world: int, timeout_s: float) -> "dist.TCPStore":
    """torchrun's rendezvous store (MASTER_ADDR / MASTER_PORT; the agent's own store when
    torchrun says so), waiting up to the start-up timeout for the ranks to join."""
    # NOTE: env:// would wait only timeout_s for every rank to join, and ranks start (import
    # torch, load CUDA) at different speeds; the collectives keep timeout_s.
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                         is_master=rank == 0 and not agent,
                         timeout=timedelta(seconds=max(timeout_s, STARTUP_TIMEOUT_S)))


def exit_code(e: BaseException) -> int:
    """REFUSED_RC for what a user can fix (bad input, a refused resume, non-finite values)."""
    return REFUSED_RC if isinstance(e, (ValueError, FileNotFoundError, FloatingPointError)) else 1


def die_with_parent(parent_pid: int) -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux); exit now if the
    parent is already gone (it may have died before the request)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # NOTE: not Linux: the launcher's signal forwarding remains
        pass
    if os.getppid() != parent_pid:
        os._exit(1)


def _local_worker(rank: int, world: int, port: int, threads: int, cfg: TrainConfig, parent: int,
                  inherited_fd: int = -1) -> None:
    die_with_parent(parent)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):  # NOTE: not the launcher's (fork)
        signal.signal(sig, signal.SIG_DFL)
    if inherited_fd >= 0:
        os.close(inherited_fd)  # the launcher's listening socket (fork)
    os.environ.update({"MASTER_ADDR": MASTER_ADDR, "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(cfg.ranks_per_node or world)})
    # NOTE: N ranks share the machine's cores: an even split of intra-op threads each.
    torch.set_num_threads(threads)
    mon = Monitor(cfg.log_dir, rank, world)
    try:
        store = dist.TCPStore(MASTER_ADDR, port, world + 1, is_master=False,
                              timeout=timedelta(seconds=max(cfg.timeout_s, STARTUP_TIMEOUT_S)))
        worker_main(cfg, store, mon)
        code = 0
    except BaseException as e:  # noqa: BLE001 - reported through the heartbeat and log file
        if mon.message is None:
            mon.fail(e)
        code = exit_code(e)
    sys.stdout.flush()
    sys.stderr.flush()
    # NOTE: os._exit: after a failure, interpreter shutdown may wait on a collective's thread
    # or a peer that is gone; the report is already on disk.
    os._exit(code)


def listen_socket(addr: str) -> socket.socket:
    """A socket listening on ``addr`` only, on a port the kernel picks (``getsockname()[1]``)."""
    sock = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((addr, 0))
    sock.listen(128)
    return sock


def bound_store(addr: str, world_size: int, timeout: timedelta, sock: socket.socket | None = None) -> "dist.TCPStore":
    """A TCPStore server listening on ``addr`` only (on ``sock`` when given, else on a port
    the kernel picks; read it back with ``.port``)."""
    # NOTE: TCPStore(host, 0, is_master=True) would listen on every interface (its server binds
    # the wildcard address); a socket bound here and handed over listens where we say.
    sock = sock or listen_socket(addr)
    port = sock.getsockname()[1]
    return dist.TCPStore(addr, port, world_size, is_master=True, wait_for_workers=False, timeout=timeout,
                         master_listen_fd=sock.detach())


def _forward_signals(procs: list) -> dict:
    """SIGTERM / SIGHUP / SIGINT to the launcher: terminate the ranks, then die of the signal."""
    def handler(signum: int, _frame: Any) -> None:
        try:
            _stop([p for p in procs if p.pid is not None], grace_s=2.0)
        finally:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    old = {}
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        old[sig] = signal.signal(sig, handler)
    return old


def _stop(procs: list, grace_s: float) -> None:
    for p in procs:
        if p.exitcode is None:
            try:
                p.terminate()
                os.kill(p.pid, signal.SIGCONT)  # NOTE: a stopped (frozen) rank gets SIGTERM only when continued
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.exitcode is None:
            p.kill()
            p.join()


def _settled(log_dir: str, rank: int, proc: Any) -> bool:
    """The rank is gone, stopped (frozen: it will not report), or has reported."""
    rec = read_heartbeat(log_dir, rank)
    return (proc.exitcode is not None or process_state(proc.pid) != "running"
            or (rec is not None and rec.get("state") in ("error", "done")))


def _failure_message(cfg: TrainConfig, procs: list) -> str:
    """Who failed first, how, where, and the first report of the others (module doc)."""
    ranks = list(range(len(procs)))
    got = first_failure(cfg.log_dir, ranks)
    if got is None:
        bad = [r for r, p in enumerate(procs) if p.exitcode not in (0, None)]
        return f"rank(s) {bad} failed without a report (exit codes {[procs[r].exitcode for r in bad]})"
    r, rec = got
    code = procs[r].exitcode
    if rec is not None and rec.get("state") == "error":
        return str(rec.get("msg"))
    if code is not None and code < 0:
        how = f"was killed by {signal.Signals(-code).name}"
    elif code is None:
        state = "frozen (stopped)" if process_state(procs[r].pid) == "stopped" else "hung"
        how = f"stopped making progress ({state}; ended by the launcher)"
    else:
        how = f"exited with code {code} without a report"
    msg = f"rank {r} {how}; last heartbeat at {describe(rec)} (log: {log_path(cfg.log_dir, r)})"
    others = [(q["t"], q) for q in (read_heartbeat(cfg.log_dir, o) for o in ranks if o != r)
              if q is not None and q.get("state") == "error"]
    if others:
        msg += f"; first report of the others: {min(others, key=lambda x: x[0])[1].get('msg')}"
    return msg


def _supervise(cfg: TrainConfig, procs: list, timeout_s: float | None) -> None:
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    settle = None  # after the first failure: when to stop waiting for the others' reports
    while True:
        codes = [p.exitcode for p in procs]
        if all(c == 0 for c in codes):
            return
        if settle is None and any(c not in (None, 0) for c in codes):
            settle = time.monotonic() + cfg.timeout_s + 10.0
        if settle is not None and (time.monotonic() > settle or
                                   all(_settled(cfg.log_dir, r, p) for r, p in enumerate(procs))):
            break
        if deadline is not None and time.monotonic() > deadline:
            _stop(procs, grace_s=2.0)
            raise TimeoutError(f"training did not finish within {timeout_s:.0f} s (logs: {cfg.log_dir})")
        time.sleep(0.1)
    msg = _failure_message(cfg, procs)  # NOTE: before stopping the rest, which changes their state
    _stop(procs, grace_s=2.0)
    raise LaunchError(f"{msg}\nper-rank logs and heartbeats: {cfg.log_dir}")


def launch_local(cfg: TrainConfig, nproc: int, timeout_s: float | None = None,
                 start_method: str = "spawn") -> None:
    """Run ``cfg`` on ``nproc`` local processes with gloo (CPU); see the module doc. Raises
    :class:`LaunchError` naming the rank that failed first; no rank outlives the call.

    ``start_method`` "fork" starts the ranks in a fraction of the time (no fresh interpreter
    importing torch each); only safe from a process that has not used torch's thread pools
    or CUDA, like the command line's. The store's server starts after the fork."""
    import torch.multiprocessing as mp

    _pos_int("nproc", nproc)
    if cfg.backend == "nccl":
        raise ValueError("--nproc launches local CPU processes with gloo; for NCCL use torchrun")
    if start_method not in ("spawn", "fork", "forkserver"):
        raise ValueError(f"start_method must be spawn, fork or forkserver, got {start_method!r}")
    cfg = replace(cfg, backend="gloo", ranks_per_node=cfg.ranks_per_node or nproc,
                  log_dir=cfg.log_dir or tempfile.mkdtemp(prefix="flcomm-run-"))
    check_before_launch(cfg, nproc)
    os.makedirs(cfg.log_dir, exist_ok=True)
    for r in range(nproc):  # NOTE: a previous run's records would confuse who failed first
        path = heartbeat_path(cfg.log_dir, r)
        if os.path.exists(path):
            os.remove(path)
    sock = listen_socket(MASTER_ADDR)
    port, fd = sock.getsockname()[1], sock.fileno()
    threads = max(1, (os.cpu_count() or 1) // nproc)
    ctx = mp.get_context(start_method)
    procs = [ctx.Process(target=_local_worker, daemon=False,
                         args=(r, nproc, port, threads, cfg, os.getpid(), fd if start_method == "fork" else -1))
             for r in range(nproc)]
    old = _forward_signals(procs)
    store = None
    try:
        for p in procs:
            p.start()
        store = bound_store(MASTER_ADDR, nproc + 1, timedelta(seconds=cfg.timeout_s), sock)
        _supervise(cfg, procs, timeout_s)
    finally:
        if any(p.exitcode is None for p in procs if p.pid is not None):
            _stop([p for p in procs if p.pid is not None], grace_s=2.0)
        for sig, h in old.items():
            signal.signal(sig, h)
        if store is None:
            sock.close()
        del store
