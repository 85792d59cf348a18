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
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from flcomm.train.checkpoint import check_before_launch
from flcomm.train.config import TrainConfig, resolve_topology
from flcomm.train.loop import TrainResult, train
from flcomm.train.monitor import (
    FAULT_ENV,
    Monitor,
    describe,
    first_failure,
    heartbeat_path,
    log_path,
    process_state,
    read_heartbeat,
)
from flcomm.train.run import STARTUP_TIMEOUT_S
from flcomm.validate import integer

MASTER_ADDR = "127.0.0.1"
_PR_SET_PDEATHSIG = 1
REFUSED_RC = 2  # a rank's exit code for a refusal (bad input, non-finite values); 1: a failure
LOST_RC = 3  # --elastic: this rank's federation group was dropped from the federation


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
        if monitor is not None:  # NOTE: no launcher gathers the reports: each rank finds the culprit alone
            agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
            monitor.watch(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          "torchrun's agent, on rank 0's node" if agent else "hosted by rank 0",
                          owner=None if agent else 0)
    # NOTE: the start-up timeout until every rank has built its model (train() then sets the
    # default group's timeout to timeout_s: flcomm.train.run._startup_barrier)
    timeout = timedelta(seconds=max(cfg.timeout_s, STARTUP_TIMEOUT_S))
    if cfg.elastic:
        _init_group_world(cfg, backend, store, rank, world, timeout)
    else:
        dist.init_process_group(backend, timeout=timeout, store=store, rank=rank, world_size=world)
    try:
        return train(cfg, monitor=monitor, store=store)
    finally:
        dist.destroy_process_group()


def _init_group_world(cfg: TrainConfig, backend: str, store: Any, rank: int, world: int, timeout: timedelta) -> None:
    """``--elastic``: torch.distributed's world is this rank's federation group, under a store
    prefix of the group and its incarnation (a restarted group gets a fresh one)."""
    local_ws = int(os.environ["LOCAL_WORLD_SIZE"]) if "LOCAL_WORLD_SIZE" in os.environ else None
    topo = resolve_topology(cfg, world, local_ws)
    c = topo.coords(rank)
    # NOTE: every rank of a group counts its own starts; they start together, so they agree
    inc = store.add(f"flcomm/group{c.group}/starts/{c.index}", 1) - 1
    dist.init_process_group(backend, timeout=timeout, rank=c.index, world_size=topo.group_size,
                            store=dist.PrefixStore(f"flcomm/group{c.group}/inc{inc}/", store))


def _env_store(rank: int, world: int, timeout_s: float) -> dist.TCPStore:
    """torchrun's rendezvous store (MASTER_ADDR / MASTER_PORT; the agent's own store when
    torchrun says so), waiting up to the start-up timeout for the ranks to join."""
    # NOTE: env:// would wait only timeout_s for every rank to join, and ranks start (import
    # torch, load CUDA) at different speeds; the collectives keep timeout_s.
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                         is_master=rank == 0 and not agent,
                         timeout=timedelta(seconds=max(timeout_s, STARTUP_TIMEOUT_S)))


def exit_code(e: BaseException) -> int:
    """REFUSED_RC for what a user can fix (bad input, a refused resume, non-finite values);
    LOST_RC for a rank whose federation group an elastic federation dropped."""
    from flcomm.federated.elastic import GroupLostError

    if isinstance(e, GroupLostError):
        return LOST_RC
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
                  inherited_fd: int = -1, restarted: bool = False) -> None:
    die_with_parent(parent)
    if restarted:  # NOTE: an injected fault is for the first incarnation
        os.environ.pop(FAULT_ENV, None)
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


def bound_store(addr: str, world_size: int, timeout: timedelta, sock: socket.socket | None = None) -> dist.TCPStore:
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


def _other_groups_report(cfg: TrainConfig, groups: list[list[int]]) -> str:
    """``--elastic``: the first report from outside the group that failed first (why the
    survivors ended: too few groups left, or a failure of their own), or ``""``."""
    got = first_failure(cfg.log_dir, [r for g in groups for r in g])
    if got is None:
        return ""
    culprit = next(g for g in groups if got[0] in g)
    reports = [q for q in (read_heartbeat(cfg.log_dir, r) for g in groups if g is not culprit for r in g)
               if q is not None and q.get("state") == "error"]
    if not reports:
        return ""
    return f"\nfirst report of the other federation groups: {min(reports, key=lambda q: q['t']).get('msg')}"


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


@dataclass
class LaunchReport:
    """How a local launch ended: every rank's exit code (its last incarnation's), and for an
    elastic run the groups lost and restarted (``--rejoin``)."""

    exit_codes: list[int]
    lost_groups: list[int] = field(default_factory=list)
    restarted_groups: list[int] = field(default_factory=list)


def _supervise_elastic(cfg: TrainConfig, procs: list, timeout_s: float | None, restart: Any) -> LaunchReport:
    """``--elastic``: ranks of a lost group end on their own (LOST_RC or their error); the job
    goes on while a group is complete. With ``restart`` (``--rejoin``) a group all of whose
    ranks ended while others run is restarted once (``restart(ranks)`` returns the new
    processes, which rejoin at the survivors' next sync). At the
    end, ranks still stopped (frozen) are killed. Raises :class:`LaunchError` when fewer than
    ``min_groups`` groups finished."""
    G = resolve_topology(cfg, len(procs), cfg.ranks_per_node).group_size
    groups = [list(range(f, f + G)) for f in range(0, len(procs), G)]
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    lost: set[int] = set()
    restarted: list[int] = []

    def ended(r: int) -> bool:
        return procs[r].exitcode is not None or process_state(procs[r].pid) == "stopped"

    while True:
        for f, ranks in enumerate(groups):
            if any(procs[r].exitcode not in (None, 0) for r in ranks) and all(ended(r) for r in ranks):
                lost.add(f)
                running = any(procs[r].exitcode is None and not ended(r) for g in groups for r in g)
                if restart is not None and f not in restarted and running:
                    _stop([procs[r] for r in ranks], grace_s=2.0)
                    for r, p in zip(ranks, restart(ranks)):
                        procs[r] = p
                    restarted.append(f)
        if all(ended(r) for r in range(len(procs))):
            break
        if deadline is not None and time.monotonic() > deadline:
            _stop(procs, grace_s=2.0)
            raise TimeoutError(f"training did not finish within {timeout_s:.0f} s (logs: {cfg.log_dir})")
        time.sleep(0.1)
    _stop([p for p in procs if p.exitcode is None], grace_s=2.0)  # NOTE: frozen ranks
    codes = [p.exitcode for p in procs]
    finished = [f for f, ranks in enumerate(groups) if all(codes[r] == 0 for r in ranks)]
    if len(finished) < cfg.min_groups or not finished:
        raise LaunchError(f"{_failure_message(cfg, procs)}{_other_groups_report(cfg, groups)}\n"
                          f"only federation groups {finished} finished "
                          f"(--min-groups {cfg.min_groups}); per-rank logs and heartbeats: {cfg.log_dir}")
    report = LaunchReport(codes, sorted(lost), restarted)
    print(f"flcomm.train: elastic run finished with federation groups {finished}; lost {report.lost_groups}, "
          f"restarted {restarted} (logs: {cfg.log_dir})", file=sys.stderr, flush=True)
    return report


def default_start_method() -> str:
    """How the command line starts local ranks: ``FLCOMM_START_METHOD``, else fork on Linux.

    NOTE: fork: the command line's process has not touched torch's thread pools or CUDA, and a
    fresh interpreter importing torch per rank costs seconds of start-up per rank."""
    return os.environ.get("FLCOMM_START_METHOD", "fork" if sys.platform == "linux" else "spawn")


def launch_local(cfg: TrainConfig, nproc: int, timeout_s: float | None = None,
                 start_method: str = "spawn") -> LaunchReport:
    """Run ``cfg`` on ``nproc`` local processes with gloo (CPU); see the module doc. Raises
    :class:`LaunchError` naming the rank that failed first; no rank outlives the call.

    ``start_method`` "fork" starts the ranks in a fraction of the time (no fresh interpreter
    importing torch each); only safe from a process that has not used torch's thread pools
    or CUDA, like the command line's. The store's server starts after the fork."""
    import torch.multiprocessing as mp

    integer("nproc", nproc, 1)
    if cfg.backend == "nccl":
        raise ValueError("--nproc launches local CPU processes with gloo; for NCCL use torchrun")
    if start_method not in ("spawn", "fork", "forkserver"):
        raise ValueError(f"start_method must be spawn, fork or forkserver, got {start_method!r}")
    cfg = replace(cfg, backend="gloo", ranks_per_node=cfg.ranks_per_node or nproc,
                  log_dir=cfg.log_dir or tempfile.mkdtemp(prefix="flcomm-run-"))
    check_before_launch(cfg, nproc)
    # NOTE: --rejoin given to the launcher means "restart a lost group"; the first ranks start normally
    restart_lost, cfg = cfg.rejoin, replace(cfg, rejoin=False)
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

    def restart(ranks: list[int]) -> list:
        # NOTE: spawned (a fork now would copy the launcher's store server); resuming from a
        # survivor's checkpoint, admitted at the survivors' next sync
        again = replace(cfg, rejoin=True)
        new = [mp.get_context("spawn").Process(target=_local_worker, daemon=False,
                                               args=(r, nproc, port, threads, again, os.getpid(), -1, True))
               for r in ranks]
        for p in new:
            p.start()
        return new

    old = _forward_signals(procs)
    store = None
    try:
        for p in procs:
            p.start()
        store = bound_store(MASTER_ADDR, nproc + 1, timedelta(seconds=cfg.timeout_s), sock)
        if cfg.elastic:
            return _supervise_elastic(cfg, procs, timeout_s, restart if restart_lost else None)
        _supervise(cfg, procs, timeout_s)
        return LaunchReport([p.exitcode for p in procs])
    finally:
        if any(p.exitcode is None for p in procs if p.pid is not None):
            _stop([p for p in procs if p.pid is not None], grace_s=2.0)
        for sig, h in old.items():
            signal.signal(sig, h)
        if store is None:
            sock.close()
        del store
