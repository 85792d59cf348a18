"""The progress engine: advances communication jobs (all stages of an exchange) without the
training loop calling ``wait()``.

A *job* is a Python function that issues collectives on transports and waits on them, stage by
stage (pack/encode, hop 1, reduce/re-encode, hop 2, decode). :meth:`ProgressEngine.submit`
queues it and returns a :class:`Job`, a :class:`~flcomm.comm.base.Handle`.

* **CPU**: one communication thread per engine, fed by a bounded FIFO queue. Jobs run one after
  another in submission order; every rank submits the same jobs in the same order, so every
  transport sees its collectives in the same order on every rank. Torch ops release the GIL, so
  the thread runs while the main thread computes; it uses ``comm_threads`` intra-op threads (1
  by default) so it does not starve compute.
* **CUDA**: the same thread issues the job inside the engine's communication stream, which first
  waits for the point of the caller's stream where the job was submitted; the job's collectives
  wait in a stream-ordered way. ``Job.wait()`` makes the caller's current stream wait on the
  job's end event (recorded whether the job returned or raised), so the training loop never
  blocks on the wire (only on the host part of a job that has not been issued yet).

Errors: an exception raised by a job is kept and re-raised (as :class:`EngineError`, naming the
rank, the job and the stage it was in) by the job's ``wait()`` or ``check()``. Once a job failed,
the engine fails every later job at once with the same cause: the transports it used are broken,
and a later job would only wait for its timeout (an elastic federation moves to a new lane with
its new transports). ``wait(timeout)`` is bounded: a job still
running after ``timeout`` raises :class:`EngineTimeout` naming its stage.

Lanes: one engine per (device, lane). Jobs of one lane must use transports that no other thread
issues on while the job is queued (FedAvg's exchange uses the "fed" transports, lane
``"exchange"``; hierarchical collectives use lane ``"hierarchical"``): the order of collectives on
a transport is then the program order, on every rank.
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

__all__ = ["EngineError", "EngineTimeout", "Job", "ProgressEngine", "get_engine"]

QUEUE_DEPTH = 8


def _seconds(timeout: timedelta | float | None) -> float | None:
    if isinstance(timeout, timedelta):
        return timeout.total_seconds()
    return None if timeout is None else float(timeout)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class EngineError(RuntimeError):
    """A job of the progress engine failed; ``rank``, ``job`` and ``stage`` say where, and
    ``group`` the mesh dim that stage talks over when the job said it (:attr:`Job.stage_group`)."""

    def __init__(self, message: str, rank: int, job: str, stage: str, group: str | None = None) -> None:
        super().__init__(message)
        self.rank, self.job, self.stage, self.group = rank, job, stage, group


class EngineTimeout(EngineError, TimeoutError):
    """A job did not finish within the caller's timeout."""


class Job:
    """Handle of one submitted job. The job's function sets ``job.stage`` as it goes, so errors
    and timeouts can name the stage (and ``job.stage_group``, the mesh dim a stage talks over
    when it is not the job's usual one: the error's ``group``); ``result`` is what it returned."""

    def __init__(self, name: str, fn: Callable[[Job], Any], rank: int) -> None:
        self.name, self._fn, self.rank = name, fn, rank
        self.stage = "queued"
        self.stage_group: str | None = None
        self.result: Any = None
        self.error: BaseException | None = None
        self.elapsed_s = 0.0
        self.waited = False  # wait() has returned or raised
        self._done = threading.Event()
        self._event: Any = None  # CUDA: recorded on the communication stream at the end
        self._start_event: Any = None  # CUDA: recorded on the caller's stream at submit
        self._device: Any = None

    def _run(self, stream: Any = None) -> None:
        """Run the function (CUDA: inside ``stream``, after the caller's stream reached the
        submit point; the end event is recorded before the job counts as done)."""
        t0 = time.perf_counter()
        try:
            if stream is None:
                self.result = self._fn(self)
            else:
                with torch.cuda.stream(stream):
                    stream.wait_event(self._start_event)
                    try:
                        self.result = self._fn(self)
                    finally:
                        # NOTE: a failed job may have queued kernels before it raised: the end
                        # event orders the caller's recovery (an elastic restore) after them
                        ev = torch.cuda.Event(enable_timing=True)
                        ev.record(stream)
                        self._event = ev
            self.stage = "done"
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            self.error = e
        finally:
            self.elapsed_s = time.perf_counter() - t0
            self._fn = None  # NOTE: drop the closure (and the buffers it holds) once run
            self._done.set()

    def _fail(self, cause: BaseException) -> None:
        self.error = cause
        self._done.set()

    def host_done(self, timeout: float = 0.0) -> bool:
        """The job's function has returned or raised (waits up to ``timeout`` seconds)."""
        return self._done.wait(timeout)

    def seconds(self) -> float:
        """How long the job took, once done: on CUDA from the point of the caller's stream where it
        was submitted to the end of its work on the communication stream (this waits for that
        end); on the CPU its function's run time."""
        if self._event is not None and self._start_event is not None:
            self._event.synchronize()
            return self._start_event.elapsed_time(self._event) / 1e3
        return self.elapsed_s

    def is_completed(self) -> bool:
        if not self._done.is_set():
            return False
        return self._event is None or bool(self._event.query())

    def check(self) -> None:
        """Raise the job's error now if it has failed (never blocks)."""
        if self._done.is_set() and self.error is not None:
            self._raise()

    def _raise(self) -> None:
        e = self.error
        if isinstance(e, EngineError):
            raise e
        raise EngineError(f"rank {self.rank}: {self.name} failed in stage {self.stage!r}: "
                          f"{type(e).__name__}: {e}", self.rank, self.name, self.stage, self.stage_group) from e

    def wait(self, timeout: timedelta | float | None = None) -> Any:
        """Block until the job is done (CPU) or make the current CUDA stream wait for it; re-raise
        its error; return its result. ``timeout`` (seconds or timedelta) bounds the host wait."""
        secs = _seconds(timeout)
        ok = self._done.wait(secs)
        self.waited = True
        if not ok:
            raise EngineTimeout(f"rank {self.rank}: {self.name} did not finish within {secs:g} s "
                                f"(still in stage {self.stage!r})", self.rank, self.name, self.stage, self.stage_group)
        if self._event is not None:  # NOTE: before raising too: see _run
            torch.cuda.current_stream(self._device).wait_event(self._event)
        if self.error is not None:
            self._raise()
        return self.result


class ProgressEngine:
    """Runs jobs in submission order (module docstring).

    Args:
        device: where the jobs' tensors live; ``cuda`` runs jobs on a communication stream.
        lane: a name, for messages and the thread's name.
        comm_threads: intra-op threads of the communication thread (CPU).
        depth: bound of the queue; ``submit`` blocks while it is full.
    """

    def __init__(self, device: torch.device | str = "cpu", lane: str = "exchange",
                 comm_threads: int = 1, depth: int = QUEUE_DEPTH) -> None:
        self.device = torch.device(device)
        self.lane = lane
        self.comm_threads = int(comm_threads)
        self._queue: queue.Queue[Job | None] = queue.Queue(maxsize=depth)
        self._thread: threading.Thread | None = None
        self._failed: Job | None = None
        self._lock = threading.Lock()
        self.stream = torch.cuda.Stream(device=self.device) if self.device.type == "cuda" else None

    def __repr__(self) -> str:
        return f"ProgressEngine(device={self.device}, lane={self.lane!r})"

    def submit(self, fn: Callable[[Job], Any], name: str) -> Job:
        """Queue ``fn(job)``; returns its :class:`Job`."""
        job = Job(name, fn, _rank())
        if self._failed is not None:
            self._refuse(job)
            return job
        if self.stream is not None:
            # NOTE: the job reads what the caller's stream produced: its stream waits for it
            job._device = self.device
            job._start_event = torch.cuda.Event(enable_timing=True)
            job._start_event.record(torch.cuda.current_stream(self.device))
        self._ensure_thread()
        self._queue.put(job)
        return job

    def _refuse(self, job: Job) -> None:
        f = self._failed
        assert f is not None
        job.stage = "not started"
        job._fail(EngineError(f"rank {job.rank}: {job.name} not run: an earlier job ({f.name}) failed "
                              f"in stage {f.stage!r}: {type(f.error).__name__}: {f.error}",
                              job.rank, job.name, "not started"))

    def _ensure_thread(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, daemon=True,
                                                name=f"flcomm-{self.lane}-{self.device}")
                self._thread.start()

    def _loop(self) -> None:
        torch.set_num_threads(self.comm_threads)  # NOTE: per thread: compute keeps its own
        if self.stream is not None:
            torch.cuda.set_device(self.device)
        while True:
            job = self._queue.get()
            if job is None:
                return
            if self._failed is not None:
                self._refuse(job)
                continue
            job.stage = "started"
            job._run(self.stream)
            if job.error is not None:
                self._failed = job
            del job  # NOTE: keep nothing alive while waiting for the next job

    def close(self, timeout_s: float | None = None) -> None:
        """Stop the thread once the queued jobs are done (a later ``submit`` starts a new one);
        ``timeout_s`` bounds the wait (None: no bound)."""
        with self._lock:
            t, self._thread = self._thread, None
        if t is not None and t.is_alive():
            self._queue.put(None)
            t.join(timeout_s)


_ENGINES: dict[tuple[str, str], ProgressEngine] = {}
_ENGINES_LOCK = threading.Lock()
EXIT_JOIN_S = 10.0  # how long interpreter exit waits for an engine's queued jobs


@atexit.register
def _close_engines() -> None:
    """At interpreter exit, let every engine's thread finish its jobs and return (at most
    EXIT_JOIN_S each). NOTE: a daemon thread still inside a collective when the interpreter
    finalizes runs into the C++ teardown of its process group: a process that ended its script
    normally could then abort ("terminate called without an active exception")."""
    with _ENGINES_LOCK:
        engines = list(_ENGINES.values())
    for eng in engines:
        eng.close(EXIT_JOIN_S)


def get_engine(device: torch.device | str = "cpu", lane: str = "exchange") -> ProgressEngine:
    """The process's engine of ``lane`` on ``device`` (created on first use)."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    key = (str(dev), lane)
    with _ENGINES_LOCK:
        eng = _ENGINES.get(key)
        if eng is None:
            eng = _ENGINES[key] = ProgressEngine(dev, lane)
        return eng
