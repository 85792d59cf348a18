"""FedAvg's exposed_comm_s accounting (:class:`ExposedTime`) counts a late exchange once, on a fake
clock and fake CUDA events; with events it counts the compute stream's wait, not the host's."""

from __future__ import annotations

import pytest


class _Clock:
    def __init__(self) -> None:
        self.host = 0.0  # host seconds
        self.device = 0.0  # where the compute stream is, in seconds

    def __call__(self) -> float:
        return self.host


class _Event:
    """A fake CUDA event: recorded at the compute stream's time (which a host wait lets run dry,
    i.e. catch up with the host)."""

    def __init__(self, clock: _Clock) -> None:
        self.at = clock.device

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True  # NOTE: a completed event (the fold test makes some incomplete)

    def elapsed_time(self, end: _Event) -> float:
        return (end.at - self.at) * 1e3  # ms, as CUDA events


def _window(acc, clock: _Clock, host_wait: float, stream_wait: float) -> None:
    """One apply: the host waits ``host_wait`` s for the job, the compute stream ``stream_wait``
    s for the job's end event (from the first event)."""
    tok = acc.begin()
    clock.host += host_wait
    clock.device += stream_wait
    acc.end(tok)


@pytest.mark.parametrize("events", [True, False], ids=["cuda-events", "cpu-host-time"])
def test_a_late_exchange_is_counted_once(events):
    from flcomm.federated.exposure import ExposedTime

    clock = _Clock()
    acc = ExposedTime(events=events, clock=clock, new_event=lambda: _Event(clock))
    # a late exchange: the host waits 2 s and the compute stream, run dry, waits as long
    _window(acc, clock, 2.0, 2.0)
    assert acc.seconds == pytest.approx(2.0)
    # two more late ones and an exchange that was on time (no wait anywhere)
    for w in (0.5, 1.25, 0.0):
        _window(acc, clock, w, w)
    assert acc.seconds == pytest.approx(3.75)
    acc.reset(1.0)
    assert acc.seconds == 1.0


def test_cuda_accounting_counts_the_stream_not_the_host():
    """The host waited for the job's host part while the compute stream still had work queued
    (it stalls only 0.25 s): the stream's time counts; a stream stall without a host wait too."""
    from flcomm.federated.exposure import ExposedTime

    clock = _Clock()
    acc = ExposedTime(events=True, clock=clock, new_event=lambda: _Event(clock))
    _window(acc, clock, 1.0, 0.25)
    _window(acc, clock, 0.0, 0.5)
    assert acc.seconds == pytest.approx(0.75)


def test_a_run_that_never_reads_the_seconds_keeps_a_bounded_list_of_events():
    """S1: completed windows are folded in as they pile up (no sync), incomplete ones are kept
    in order, and the total is what reading every window would give."""
    from flcomm.federated import exposure
    from flcomm.federated.exposure import ExposedTime

    clock = _Clock()
    made: list[_Event] = []

    def new_event() -> _Event:
        made.append(_Event(clock))
        return made[-1]

    acc = ExposedTime(events=True, clock=clock, new_event=new_event)
    n = 3 * exposure._FOLD_AT
    for _ in range(n):
        _window(acc, clock, 0.01, 0.01)
    assert len(acc._pending) <= exposure._FOLD_AT + 1
    late = made[-2:]  # the last window's events: not completed yet
    for e in late:
        e.query = lambda: False
    _window(acc, clock, 0.5, 0.5)
    late[1].query = lambda: True
    assert acc.seconds == pytest.approx(0.01 * n + 0.5)
    assert acc._pending == []
