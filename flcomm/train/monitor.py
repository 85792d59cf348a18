"""Where every rank is, and who failed first: per-rank heartbeat files and error reports.

Each rank keeps one small file ``<log_dir>/rank<r>.hb``, rewritten in place (one ``pwrite``)
whenever the rank enters a phase of a step: forward, backward, FedAvg exchange, loss,
evaluation, checkpoint. A record is JSON: pid, host, rank, step, phase, the wall time, and
``state`` ("run", "done" or "error"; an error record also holds the one-line message, which
names the process group the phase talks over and its ranks). The full traceback of a failure goes to
``<log_dir>/rank<r>.log``.

Who failed first (:func:`first_failure`): a rank that stopped without reporting an error
(killed, frozen, hung: "silent") is blamed before any rank that reported one, since its peers'
errors are the consequence; among silent ranks the one with the oldest heartbeat, among
reporting ranks the earliest report. The launcher prints that rank and the first report; a
failing rank names the peer of its group whose process is gone or stopped (same host), else
the peer that reported first.

Fault injection for the fault tests: ``FLCOMM_FAULT="RANK:STEP:PHASE:ACTION"`` (ACTION kill,
freeze, raise or nan) makes rank RANK kill itself (SIGKILL), stop itself (SIGSTOP), raise, or
fill its parameters with NaN when it enters PHASE at STEP, after that phase's heartbeat is written (a checkpoint
fault fires inside the save, after the rank's files are written).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

PHASES = {  # phase -> what talks over which group (for the messages)
    "start": ("start-up (mesh, model, data, resume)", "world"),
    "forward": ("forward (FSDP all-gather)", "shard"),
    "backward": ("backward (FSDP reduce-scatter / all-gather)", "shard"),
    "optimizer": ("gradient norm and clipping (all-reduce)", "shard"),
    "fedavg": ("FedAvg exchange", "fed"),
    "nan-check": ("non-finite check before a FedAvg sync (world all-reduce)", "world"),
    "loss": ("loss all-reduce", "group"),
    "eval": ("evaluation", "world"),
    "checkpoint": ("checkpoint save", "world"),
    "end": ("end of the run", "world"),
    "rejoin": ("waiting to rejoin the federation (elastic)", "fed"),
}
FAULT_ENV = "FLCOMM_FAULT"
_RECORD = 4096  # bytes of one heartbeat record (padded): one pwrite, read whole


class InjectedFault(RuntimeError):
    """Raised by ``FLCOMM_FAULT=...:raise`` (tests)."""


@dataclass(frozen=True)
class Fault:
    rank: int
    step: int
    phase: str
    action: str  # kill | freeze | raise

    @classmethod
    def from_env(cls) -> Fault | None:
        spec = os.environ.get(FAULT_ENV)
        if not spec:
            return None
        try:
            r, s, ph, act = spec.split(":")
            f = cls(int(r), int(s), ph, act)
        except ValueError:
            raise ValueError(f"{FAULT_ENV} must be RANK:STEP:PHASE:ACTION, got {spec!r}") from None
        if f.phase not in PHASES or f.action not in ("kill", "freeze", "raise", "nan"):
            raise ValueError(f"{FAULT_ENV}={spec!r}: phase must be one of {', '.join(PHASES)} and action "
                             "kill, freeze, raise or nan")
        return f

    def fire(self, poison: Callable[[], None] | None = None) -> None:
        if self.action == "nan":
            if poison is not None:
                poison()
        elif self.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.action == "freeze":
            os.kill(os.getpid(), signal.SIGSTOP)
        else:
            raise InjectedFault(f"injected fault at step {self.step}, phase {self.phase}")


def heartbeat_path(log_dir: str, rank: int) -> str:
    return os.path.join(log_dir, f"rank{rank}.hb")


def log_path(log_dir: str, rank: int) -> str:
    return os.path.join(log_dir, f"rank{rank}.log")


def read_heartbeat(log_dir: str, rank: int) -> dict | None:
    try:
        with open(heartbeat_path(log_dir, rank), "rb") as f:
            raw = f.read(_RECORD)
        return json.loads(raw.rstrip(b" \n\0"))
    except (OSError, ValueError):
        return None


def first_failure(log_dir: str, ranks: list[int]) -> tuple[int, dict | None] | None:
    """The rank of ``ranks`` to blame (module doc), with its last record; None when every rank
    finished. Call it once the ranks that could report an error have done so."""
    recs = {r: read_heartbeat(log_dir, r) for r in ranks}
    silent = [(rec["t"] if rec else 0.0, r) for r, rec in recs.items()
              if rec is None or rec.get("state") not in ("error", "done")]
    errors = [(rec["t"], r) for r, rec in recs.items() if rec is not None and rec.get("state") == "error"]
    pick = min(silent) if silent else min(errors) if errors else None
    return None if pick is None else (pick[1], recs[pick[1]])


def process_state(pid: int) -> str:
    """"running", "stopped" (SIGSTOP), "dead" (gone or a zombie) for a process of this host."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "dead"
    return {"T": "stopped", "t": "stopped", "Z": "dead", "X": "dead"}.get(state, "running")


def describe(rec: dict | None) -> str:
    if rec is None:
        return "no heartbeat (did not start)"
    what = PHASES.get(rec.get("phase", ""), (rec.get("phase"), None))[0]
    return f"step {rec.get('step')}, phase {what}"


class Monitor:
    """This rank's heartbeat and failure report (see the module doc).

    ``groups`` maps a group name ("shard", "fed", ...) to this rank's ranks in it; it is set
    once the mesh exists (:meth:`set_groups`).
    """

    def __init__(self, log_dir: str | None, rank: int, world_size: int) -> None:
        if log_dir is not None:
            os.makedirs(log_dir, exist_ok=True)
        self.log_dir, self.rank, self.world_size = log_dir, rank, world_size
        self.groups: dict[str, list[int]] = {"world": list(range(world_size))}
        self.step, self.phase = 0, "start"
        self.phase_t = time.time()
        self.fault = Fault.from_env()
        self._host = socket.gethostname()
        self.poison: Callable[[], None] | None = None  # what the "nan" fault does (the driver sets it)
        self._fd = -1 if log_dir is None else os.open(heartbeat_path(log_dir, rank), os.O_WRONLY | os.O_CREAT, 0o644)
        self.message: str | None = None  # the one-line report of this rank's failure
        self._write("run")

    def set_groups(self, groups: dict[str, list[int]]) -> None:
        self.groups.update(groups)

    def enter(self, step: int, phase: str) -> None:
        """This rank now runs ``phase`` of ``step`` (and fires an injected fault there)."""
        self.step, self.phase, self.phase_t = step, phase, time.time()
        self._write("run")
        f = self.fault
        if f is not None and f.rank == self.rank and f.step == step and f.phase == phase and phase != "checkpoint":
            f.fire(self.poison)  # NOTE: a checkpoint fault fires inside the save, after its files are written

    def group_of(self, phase: str) -> tuple[str, list[int]]:
        """The group ``phase`` talks over (FSDP's: "shard", or "replicate" when shards are single
        ranks, as in HSDP with S = 1)."""
        name = PHASES.get(phase, ("", "world"))[1]
        for alt in ("replicate", "group", "world"):
            if name != "shard" or len(self.groups.get(name, [])) > 1:
                break
            name = alt
        return name, self.groups.get(name, self.groups["world"])

    def fail(self, exc: BaseException) -> str:
        """Record a failure of this rank: the traceback into its log file, an error heartbeat;
        returns the one-line message (rank, step, phase, group and ranks, peer, log path)."""
        what = PHASES.get(self.phase, (self.phase, None))[0]
        gname, granks = self.group_of(self.phase)
        peer = self._peer(granks) if self.log_dir is not None else ""
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        msg = (f"rank {self.rank}: step {self.step}, phase {what}, group {gname!r} (ranks {granks}): "
               f"{type(exc).__name__}: {first}"[:600])
        if peer:
            msg += f"; {peer}"
        if self.log_dir is not None:
            path = log_path(self.log_dir, self.rank)
            msg += f" (traceback: {path})"
            with open(path, "a") as f:
                f.write(f"{msg}\n{''.join(traceback.format_exception(exc))}\n")
        self._write("error", msg=msg)
        self.message = msg
        return msg

    def done(self) -> None:
        self.phase = "end"
        self._write("done")

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _peer(self, ranks: list[int]) -> str:
        """The peer of ``ranks`` to blame: one whose process is gone or stopped (when it runs on
        this host), else the one that reported an error first; "" when none is known."""
        for _ in range(5):  # NOTE: a peer's death reaches us (a reset connection) before its exit completes
            found = self._blame(ranks)
            if found:
                return found
            time.sleep(0.2)
        return ""

    def _blame(self, ranks: list[int]) -> str:
        host = socket.gethostname()
        errors, gone = [], []
        for r in ranks:
            rec = read_heartbeat(self.log_dir, r) if r != self.rank else None
            if rec is None or rec.get("state") == "done":
                continue
            if rec.get("state") == "error":
                errors.append((rec["t"], r, rec))
            elif rec.get("host") == host and process_state(int(rec["pid"])) in ("dead", "stopped"):
                gone.append((rec["t"], r, rec))
        if gone:
            _, r, rec = min(gone)
            return f"peer rank {r} is {process_state(int(rec['pid']))} (last seen at {describe(rec)})"
        if errors:
            _, r, rec = min(errors)
            return f"peer rank {r} failed first, at {describe(rec)}"
        return ""

    def _write(self, state: str, **extra: object) -> None:
        if self._fd < 0:
            return
        rec = {"pid": os.getpid(), "host": self._host, "rank": self.rank, "step": self.step, "phase": self.phase,
               "t": time.time(), "state": state, **extra}
        raw = json.dumps(rec).encode()
        if len(raw) >= _RECORD:  # NOTE: a record is read whole: shorten the message, keep JSON valid
            rec["msg"] = str(rec.get("msg", ""))[: _RECORD // 2] + " ..."
            raw = json.dumps(rec).encode()
        os.pwrite(self._fd, raw.ljust(_RECORD, b" "), 0)
