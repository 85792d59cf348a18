"""When an elastic round counts as done (:meth:`Federation._await_round`): once its job's work has
ended on the device, not once the host has issued it (N1 of the GPU review: a stream-ordered job
is host-done while its collectives still run, and a committed generation is then retired under
them); and a round whose transport the watchdog failed is not done, whatever the job says."""

from __future__ import annotations

from flcomm.federated.elastic import Federation


class _Job:
    """A job the host has finished at once, whose device work ends after ``device_polls`` polls."""

    def __init__(self, device_polls: int) -> None:
        self.left, self.polls = device_polls, 0

    def host_done(self, timeout: float = 0.0) -> bool:
        return True

    def is_completed(self) -> bool:
        self.polls += 1
        self.left -= 1
        return self.left < 0

    def wait(self):
        assert self.left < 0, "the round's result was read before its device work ended"
        return "result"


class _Transport:
    failure = None


def _federation(transport) -> Federation:
    fed = Federation.__new__(Federation)
    fed._transport = transport
    fed.decided = lambda name: False
    return fed


def test_a_round_is_done_when_its_device_work_is():
    job = _Job(device_polls=5)
    assert _federation(_Transport())._await_round("r", job, 30.0) == ("result", True)
    assert job.polls >= 6


def test_a_round_on_a_failed_transport_is_not_done():
    t = _Transport()
    t.failure = RuntimeError("the watchdog aborted the communicator")
    job = _Job(device_polls=0)
    assert _federation(t)._await_round("r", job, 30.0) == (None, False)


def test_a_round_whose_device_work_never_ends_fails_at_its_timeout():
    job = _Job(device_polls=10**9)
    assert _federation(_Transport())._await_round("r", job, 0.3) == (None, False)
