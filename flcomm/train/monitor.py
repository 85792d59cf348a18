"""Where every rank is, and who failed first: per-rank heartbeat files and error reports.

Each rank keeps one small file ``<log_dir>/rank<r>.hb``, rewritten in place (one ``pwrite``)
whenever the rank enters a phase of a step: forward, backward, FedAvg exchange, loss,
evaluation, checkpoint. A record is JSON: pid, host, rank, step, phase, the wall time, and
``state`` ("run", "done" or "error"; an error record also holds the one-line message, which
names the process group the phase talks over and its ranks). The full traceback of a failure goes to
``<log_dir>/rank<r>.log``.

Who failed first (:func:`blame`, one rule for the launcher and the ranks): a rank that stopped
without reporting an error (killed, frozen, hung: "silent") is blamed before any rank that
reported one, since its peers' errors are the consequence, and a rank that reported one before
a rank that was terminated (``state`` "exited": SIGTERM, which torchrun's agent sends to a
node's other workers when one fails); among silent ranks the one with the oldest heartbeat,
among the others the earliest report. The launcher applies it once every rank has settled and
prints that rank and the first report.

Without flcomm's launcher (torchrun, or any env:// launch: :meth:`Monitor.watch`), each rank
decides alone, when it fails: every record also goes to the job's store (key
``flcomm/monitor/rank<r>``) and a thread refreshes its ``alive`` time every
:data:`HEARTBEAT_S`, in the store and the file, while the rank lives (a rank blocked in a
collective still beats). A silent peer is one whose process is gone or stopped (a record of this
host: its pid) or whose ``alive`` is more than :data:`STALE_S` old; the failing rank waits up to
that long for one to show (a killed peer resets the connection at once), reading the store and
its own host's files, each store access bounded by :data:`STORE_TIMEOUT_S`. Its one-line message
ends with "culprit: rank R (step S, phase P) exited" (or "stopped answering", "failed first",
"was terminated"), or says why the culprit could not be determined (the store, on rank 0's
host, unreachable, or no peer silent).

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
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

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
HEARTBEAT_S = 1.0  # a watched rank refreshes its "alive" time this often
STALE_S = 3 * HEARTBEAT_S  # a watched peer not refreshed for this long stopped answering
STORE_TIMEOUT_S = 2.0  # every store access of the monitor (a dead store must not hang the error path)
STORE_KEY = "flcomm/monitor/rank{}"


class InjectedFault(RuntimeError):
    """Raised by ``FLCOMM_FAULT=...:raise`` (tests)."""


class Terminated(RuntimeError):
    """This rank got SIGTERM (:meth:`Monitor.on_sigterm`)."""


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
    got = blame({r: read_heartbeat(log_dir, r) for r in ranks})
    return None if got is None else got[:2]


def blame(recs: dict[int, dict | None], now: float | None = None, host: str | None = None,
          stale_s: float | None = None, ages: dict[int, float] | None = None) -> tuple[int, dict | None, str] | None:
    """Who failed first among ``recs`` (rank -> last record, None: none): (rank, record, how),
    ``how`` one of "exited", "stopped answering", "failed first", "was terminated"; None when
    no rank is to blame (module doc).

    ``now`` None: every rank has settled (the launcher), so a rank still "run" is silent.
    Otherwise a "run" record is silent only when its process is gone or stopped (a record of
    ``host``, this host) or, for a watched rank (``alive`` in the record), when it was not
    refreshed for ``stale_s`` (default :data:`STALE_S`; ``ages``: seconds since each rank's ``alive`` last changed, as
    the caller observed it; else ``now - alive``)."""
    stale_s = STALE_S if stale_s is None else stale_s
    silent, errors, ended = [], [], []
    for r, rec in recs.items():
        state = rec.get("state") if rec is not None else None
        if rec is None and now is None:
            silent.append((0.0, r, "exited"))
        elif state == "error":
            errors.append((rec["t"], r, "failed first"))
        elif state == "exited":
            ended.append((rec["t"], r, "was terminated"))
        elif state == "run":
            age = (ages or {}).get(r, now - float(rec["alive"])) if now is not None and "alive" in rec else None
            how = _silence(rec, now, host, stale_s, age)
            if how:
                silent.append((rec.get("alive", rec["t"]), r, how))
    pick = min(silent) if silent else min(errors) if errors else min(ended) if ended else None
    return None if pick is None else (pick[1], recs[pick[1]], pick[2])


def _silence(rec: dict, now: float | None, host: str | None, stale_s: float, age: float | None) -> str:
    """How the rank of a "run" record went silent ("exited", "stopped answering"), or "";
    ``age``: seconds without a beat (None: unwatched)."""
    state = process_state(int(rec["pid"])) if host is not None and rec.get("host") == host else None
    if state == "dead" or (now is None and state is None):
        return "exited"
    if state == "stopped" or now is None:
        return "stopped answering"
    return "stopped answering" if age is not None and age > stale_s else ""


def culprit(rank: int, rec: dict | None, how: str) -> str:
    """"rank R (step S, phase P) <how>" (:func:`blame`'s answer, for a message)."""
    if rec is None:
        return f"rank {rank} (no heartbeat) {how}"
    return f"rank {rank} ({describe(rec)}) {how}"


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


class _Board:
    """The monitor's own client of the job's store: records in, records out, every access
    bounded by :data:`STORE_TIMEOUT_S`; after one failure it is ``unreachable`` (a store whose
    server died does not come back) and is not asked again."""

    def __init__(self, host: str, port: int, where: str) -> None:
        import torch.distributed as dist

        self.where = f"the store at {host}:{port} ({where})"
        self.error: str | None = None
        self.owner: int | None = None  # the rank whose process serves the store, if one does
        self._lock = threading.RLock()  # NOTE: the SIGTERM handler may come while the main thread holds it
        self._store: Any = None
        try:
            self._store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=STORE_TIMEOUT_S),
                                        wait_for_workers=False)
        except Exception as e:  # noqa: BLE001 - an unreachable store is reported, not raised
            self._failed(e)

    def _failed(self, e: BaseException) -> None:
        self.error = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:200]

    def put(self, rank: int, raw: bytes) -> None:
        with self._lock:
            if self.error is None:
                try:
                    self._store.set(STORE_KEY.format(rank), raw)
                except Exception as e:  # noqa: BLE001
                    self._failed(e)

    def get(self, ranks: list[int]) -> dict[int, dict]:
        """The records of ``ranks`` the store holds ({} once unreachable)."""
        out: dict[int, dict] = {}
        with self._lock:
            if self.error is not None:
                return out
            try:
                for r in ranks:  # NOTE: get() on a missing key would wait for it: check first
                    key = STORE_KEY.format(r)
                    if self._store.check([key]):
                        out[r] = json.loads(self._store.get(key))
            except Exception as e:  # noqa: BLE001
                self._failed(e)
        return out


class _Noted:
    """A transport that calls ``note()`` before each collective (:meth:`Monitor.noting`)."""

    _COLLECTIVES = frozenset({"all_reduce", "all_gather", "reduce_scatter", "broadcast", "barrier"})

    def __init__(self, inner: Any, note: Callable[[], None]) -> None:
        self._inner, self._note = inner, note

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if name not in self._COLLECTIVES:
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            self._note()
            return attr(*args, **kwargs)

        return call


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
        self.detail: tuple[str, str] | None = None  # the collective running inside the phase (at())
        self.fault = Fault.from_env()
        self._host = socket.gethostname()
        self.poison: Callable[[], None] | None = None  # what the "nan" fault does (the driver sets it)
        self._fd = -1 if log_dir is None else os.open(heartbeat_path(log_dir, rank), os.O_WRONLY | os.O_CREAT, 0o644)
        self.message: str | None = None  # the one-line report of this rank's failure
        self._lock = threading.RLock()  # NOTE: the beating thread rewrites the record; SIGTERM may come inside
        self._rec: dict = {}
        self._board: _Board | None = None
        self._stop = threading.Event()
        self._said = False
        self._write("run")

    def set_groups(self, groups: dict[str, list[int]]) -> None:
        self.groups.update(groups)

    def watch(self, host: str, port: int, where: str, owner: int | None = None) -> None:
        """Decide alone who failed (no launcher gathers the reports; module doc): records also
        go to the store at ``host:port`` (``where`` says whose it is, for the messages; ``owner``:
        the rank whose process serves it, if one does), and a thread refreshes this rank's
        ``alive`` time every :data:`HEARTBEAT_S`."""
        self._board = _Board(host, port, where)
        self._board.owner = owner
        self._write(self._rec.get("state", "run"))
        threading.Thread(target=self._beat, name="flcomm-heartbeat", daemon=True).start()

    def enter(self, step: int, phase: str) -> None:
        """This rank now runs ``phase`` of ``step`` (and fires an injected fault there)."""
        self.step, self.phase, self.phase_t = step, phase, time.time()
        self.detail = None
        self._write("run")
        f = self.fault
        if f is not None and f.rank == self.rank and f.step == step and f.phase == phase and phase != "checkpoint":
            f.fire(self.poison)  # NOTE: a checkpoint fault fires inside the save, after its files are written

    def at(self, what: str, group: str) -> None:
        """The collective now running inside the phase and the group it talks over (a key of
        ``groups``): a failure message names these instead of the phase's usual group."""
        self.detail = (what, group)

    def noting(self, transport: Any, what: str, group: str) -> Any:
        """``transport`` whose collectives first say :meth:`at` (``what``, ``group``)."""
        return _Noted(transport, lambda: self.at(what, group))

    def group_of(self, phase: str) -> tuple[str, list[int]]:
        """The group ``phase`` talks over (FSDP's: "shard", or "replicate" when shards are single
        ranks, as in HSDP with S = 1)."""
        name = PHASES.get(phase, ("", "world"))[1]
        for alt in ("replicate", "group", "world"):
            if name != "shard" or len(self.groups.get(name, [])) > 1:
                break
            name = alt
        return name, self.groups.get(name, self.groups["world"])

    def fail(self, exc: BaseException, state: str = "error") -> str:
        """Record a failure of this rank: the traceback into its log file, an error heartbeat
        (``state`` "exited" for a termination); returns the one-line message (rank, step, phase,
        group and ranks, culprit, log path)."""
        what = PHASES.get(self.phase, (self.phase, None))[0]
        gname, granks = self.group_of(self.phase)
        # NOTE: a failed job's stage that talks over another group than the phase's says which
        stage, stage_group = getattr(exc, "stage", None), getattr(exc, "group", None)
        detail = self.detail or ((stage, stage_group) if stage_group is not None else None)
        if detail is not None:
            what, gname = f"{what} ({detail[0]})", detail[1]
            granks = self.groups.get(gname, granks)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        msg = (f"rank {self.rank}: step {self.step}, phase {what}, group {gname!r} (ranks {granks}): "
               f"{type(exc).__name__}: {first}"[:600])
        if self._board is not None:  # NOTE: at once, so that searching peers count this rank as reporting
            self._write(state, msg=msg)
        who = self._who(self._wait_s(exc, state)) if self.log_dir is not None or self._board is not None else ""
        if who:
            msg += f"; {who}"
        if self.log_dir is not None:
            path = log_path(self.log_dir, self.rank)
            msg += f" (traceback: {path})"
            with open(path, "a") as f:
                f.write(f"{msg}\n{''.join(traceback.format_exception(exc))}\n")
        self._write(state, msg=msg)
        self.message = msg
        return msg

    def say(self) -> None:
        """Print this rank's one-line report on stderr, once."""
        if self.message is not None and not self._said:
            self._said = True
            print(f"flcomm.train: error: {self.message}", file=sys.stderr, flush=True)

    def on_sigterm(self) -> None:
        """SIGTERM (torchrun's agent ends a node's other workers when one fails): record the
        termination ("exited", so that peers do not blame this rank), say the report, and die of
        the signal. Call from the main thread."""
        def handler(signum: int, _frame: Any) -> None:
            if self.message is None:
                self.fail(Terminated(f"terminated by {signal.Signals(signum).name}"), state="exited")
            self.say()
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

        signal.signal(signal.SIGTERM, handler)

    def done(self) -> None:
        self.phase = "end"
        self._write("done")

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def _wait_s(self, exc: BaseException, state: str) -> float:
        """How long to wait for a silent peer to show: a failure of a collective (a peer's
        doing, maybe) with a store to watch, long enough for a peer killed just now to go stale;
        none for this rank's own error or a termination; 1 s otherwise (a killed local peer's
        exit completes a moment after its connection reset)."""
        if self._board is None:
            return 1.0
        peer = isinstance(exc, (RuntimeError, TimeoutError, ConnectionError)) and not isinstance(exc, InjectedFault)
        return STALE_S + 2 * HEARTBEAT_S if peer and state == "error" else 0.0

    def _who(self, wait_s: float) -> str:
        """The culprit clause of the message (:func:`blame` over every peer's record, from the
        store and this host's files), waiting up to ``wait_s`` for a silent peer; "" when
        unwatched and none is found."""
        deadline = time.monotonic() + wait_s
        seen: dict[int, tuple[float, float]] = {}  # rank -> (its alive time, when this rank first saw it)
        while True:
            recs, now = self._records(), time.monotonic()
            for r, rec in recs.items():
                if r not in seen or seen[r][0] != rec.get("alive"):
                    seen[r] = (rec.get("alive"), now)
            # NOTE: a beat's age as seen here, not by the clocks of two hosts (they may differ)
            got = blame(recs, time.time(), self._host, ages={r: now - s for r, (_, s) in seen.items()})
            if (got is not None and got[2] in ("exited", "stopped answering")) or now >= deadline:
                break
            time.sleep(0.2)
        if got is not None:
            return f"culprit: {culprit(*got)}"
        if self._board is None:
            return ""
        b = self._board
        if b.error is not None:
            gone = f"; rank {b.owner} serves it, so it exited or stopped answering" if b.owner is not None else ""
            return (f"the culprit could not be determined: {b.where} is unreachable ({b.error}){gone}, "
                    "and no peer on this host stopped")
        return f"the culprit could not be determined: every peer still answers (heartbeats within {STALE_S:.0f} s)"

    def _records(self) -> dict[int, dict | None]:
        """Every peer's newest record: the store's or this host's file's."""
        peers = [r for r in range(self.world_size) if r != self.rank]
        stored = self._board.get(peers) if self._board is not None else {}
        out: dict[int, dict | None] = {}
        for r in peers:
            recs = [x for x in (stored.get(r), read_heartbeat(self.log_dir, r) if self.log_dir else None) if x]
            out[r] = max(recs, key=lambda x: x.get("alive", x["t"])) if recs else None
        return {r: v for r, v in out.items() if v is not None}

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            self._write(None)

    def _write(self, state: str | None, **extra: object) -> None:
        """A new record (``state``), or with None the last one with a fresh ``alive`` time:
        into the file, and into the store when watched."""
        with self._lock:
            if state is None:
                rec = {**self._rec, "alive": time.time()}
            else:
                rec = {"pid": os.getpid(), "host": self._host, "rank": self.rank, "step": self.step,
                       "phase": self.phase, "t": time.time(), "state": state, **extra}
                if self._board is not None:
                    rec["alive"] = rec["t"]
            self._rec = rec
            raw = json.dumps(rec).encode()
            if len(raw) >= _RECORD:  # NOTE: a record is read whole: shorten the message, keep JSON valid
                rec["msg"] = str(rec.get("msg", ""))[: _RECORD // 2] + " ..."
                raw = json.dumps(rec).encode()
            if self._fd >= 0:
                os.pwrite(self._fd, raw.ljust(_RECORD, b" "), 0)
        if self._board is not None:
            self._board.put(self.rank, raw)
