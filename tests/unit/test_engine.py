"""The progress engine (flcomm/comm/engine.py) on CPU: jobs run in submission order on one
communication thread while the caller goes on; errors and timeouts come back at wait()/check()
naming the rank and the stage; a failed job fails the later ones at once; the thread's intra-op
threads are capped without touching the caller's."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from flcomm.comm.base import Handle
from flcomm.comm.engine import EngineError, EngineTimeout, ProgressEngine

pytestmark = pytest.mark.timeout(60)


def test_jobs_run_in_order_without_blocking_the_caller():
    eng = ProgressEngine("cpu", lane="test")
    order: list[int] = []
    gate = threading.Event()

    def job(i: int):
        def run(j):
            j.stage = f"step {i}"
            if i == 0:
                gate.wait(10)  # the first job holds the thread until the caller releases it
            order.append(i)
            return i * i
        return run

    t0 = time.perf_counter()
    jobs = [eng.submit(job(i), f"job {i}") for i in range(5)]
    submitted = time.perf_counter() - t0
    assert not any(j.is_completed() for j in jobs)  # nothing ran while the first is held
    assert submitted < 1.0
    gate.set()
    assert [j.wait(10) for j in jobs] == [0, 1, 4, 9, 16]
    assert order == [0, 1, 2, 3, 4]
    assert all(isinstance(j, Handle) and j.is_completed() and j.waited for j in jobs)
    eng.close()


def test_error_names_rank_job_and_stage_and_fails_later_jobs():
    eng = ProgressEngine("cpu", lane="test")

    def bad(j):
        j.stage = "bucket 1/3: reduce, re-encode, hop 2"
        raise ConnectionError("peer closed the connection")

    first = eng.submit(bad, "exchange of step 4")
    with pytest.raises(EngineError, match=r"rank 0: exchange of step 4 failed in stage 'bucket 1/3: reduce, "
                                          r"re-encode, hop 2': ConnectionError: peer closed") as ei:
        first.wait(10)
    assert ei.value.stage.startswith("bucket 1/3") and ei.value.rank == 0
    with pytest.raises(EngineError):
        first.check()  # non-blocking re-raise
    later = eng.submit(lambda j: 1, "exchange of step 8")
    with pytest.raises(EngineError, match=r"exchange of step 8 not run: an earlier job \(exchange of step 4\) "
                                          r"failed in stage 'bucket 1/3"):
        later.wait(10)


def test_wait_timeout_names_the_stage():
    eng = ProgressEngine("cpu", lane="test")
    release = threading.Event()

    def slow(j):
        j.stage = "hop 1"
        release.wait(10)

    job = eng.submit(slow, "slow exchange")
    job.check()  # still running: nothing to raise
    t0 = time.perf_counter()
    with pytest.raises(EngineTimeout, match=r"slow exchange did not finish within 0.2 s \(still in stage 'hop 1'\)"):
        job.wait(0.2)
    assert time.perf_counter() - t0 < 2.0
    release.set()
    job.wait(10)
    eng.close()


def test_comm_thread_caps_its_intra_op_threads_only():
    before = torch.get_num_threads()
    eng = ProgressEngine("cpu", lane="test", comm_threads=1)
    assert eng.submit(lambda j: torch.get_num_threads(), "threads").wait(10) == 1
    assert torch.get_num_threads() == before
    eng.close()


@pytest.mark.gpu
def test_cuda_job_is_stream_ordered_without_host_blocking():
    eng = ProgressEngine("cuda", lane="test-cuda")
    eng.submit(lambda j: torch.zeros(1, device="cuda"), "warm-up").wait(60)  # context, stream
    x = torch.ones(1 << 20, device="cuda")

    def run(j):
        torch.cuda._sleep(500_000_000)  # a long kernel on the communication stream
        x.mul_(2)
        return x

    job = eng.submit(run, "sleep then double")
    job.wait(60)  # the host waits for the issue only; the caller's stream waits for the rest
    assert not job.is_completed()  # the kernel is still running: nobody blocked on it
    y = x + 1  # on the caller's stream, ordered after the job's end event
    torch.cuda.synchronize()
    assert job.is_completed()
    assert torch.equal(y, torch.full_like(x, 3.0))
    eng.close()


@pytest.mark.gpu
def test_failed_cuda_job_orders_the_callers_stream_after_its_kernels():
    """A job that queued kernels and then raised: wait() raises, and the caller's stream is
    ordered after those kernels (an elastic restore must not race them)."""
    eng = ProgressEngine("cuda", lane="test-cuda-fail")
    eng.submit(lambda j: torch.zeros(1, device="cuda"), "warm-up").wait(60)
    x = torch.ones(1 << 20, device="cuda")

    def run(j):
        torch.cuda._sleep(500_000_000)  # a long kernel on the communication stream
        x.mul_(2)
        raise RuntimeError("the wire broke after queueing")

    job = eng.submit(run, "sleep, double, fail")
    with pytest.raises(EngineError, match="the wire broke"):
        job.wait(60)
    x.add_(1)  # the caller's recovery, on its own stream
    torch.cuda.synchronize()
    assert torch.equal(x, torch.full_like(x, 3.0))  # (1 * 2) + 1: after the job's kernels
    eng.close()


def test_interpreter_exit_lets_queued_jobs_finish(tmp_path):
    """A script that ends while an engine job is still running exits after the job, not in the
    middle of it (a daemon thread cut off inside a collective can abort the process)."""
    import subprocess
    import sys

    done = tmp_path / "done"
    script = (
        "import time\n"
        "from flcomm.comm.engine import get_engine\n"
        f"work = lambda job: (time.sleep(0.5), open({str(done)!r}, 'w').close())\n"
        "get_engine('cpu', 'exit-test').submit(work, 'slow')\n"
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert done.exists(), "the job was cut off at interpreter exit"
