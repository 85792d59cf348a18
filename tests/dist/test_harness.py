"""The distributed test harness (tests/common/dist.py) itself: it fails fast and names the rank, the
collectives time out long before the harness, the ranks see the caller's environment, and the
forkserver they are forked from is safe to fork (one thread, no CUDA)."""

from __future__ import annotations

import os
import re
import time

import pytest

from tests.common.dist import collective_timeout, run_distributed, run_parts

SLOW_S = 300.0  # what a rank blocked in a collective would wait: far beyond every bound below
BOUND_S = 30.0  # the first error reaches the test within this (it takes well under a second)


def _blocked_or_raising(rank: int, world: int) -> None:
    """Rank 0 blocks in an all-reduce that rank 1 never joins; rank 1 raises once rank 0 is in it."""
    import torch
    import torch.distributed as dist

    from tests.common import dist as tdist

    if rank == 0:
        tdist.STORE.set("pid0", str(os.getpid()))
        dist.all_reduce(torch.ones(1))
        return
    tdist.STORE.wait(["pid0"])
    time.sleep(0.2)  # NOTE: rank 0 is in the all-reduce by now
    raise ValueError(f"boom at {time.time()!r}, rank 0 is pid {int(tdist.STORE.get('pid0'))}")


def _first_part_fails(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError(f"boom at {time.time()!r}")
    _all_reduce(rank, world)


def _all_reduce(rank: int, world: int) -> float:
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return float(t)


def _parts(rank: int, world: int) -> dict:
    return run_parts(rank, world, (("first", _first_part_fails, ()), ("second", _all_reduce, ())))


def _reported_after(exc: BaseException) -> float:
    raised = float(re.search(r"boom at ([0-9.]+)", str(exc)).group(1))
    return time.time() - raised


def test_a_raising_rank_fails_the_run_at_once_naming_it_while_its_peer_waits_in_a_collective():
    with pytest.raises(AssertionError) as info:
        run_distributed(_blocked_or_raising, 2, timeout=SLOW_S, collective_timeout_s=SLOW_S)
    msg = str(info.value)
    assert _reported_after(info.value) < BOUND_S, msg
    assert msg.startswith("rank 1 of 2 failed (ranks [0] still running, killed)"), msg
    assert "ValueError: boom" in msg and "_blocked_or_raising" in msg, msg  # the rank's traceback
    pid0 = int(re.search(r"rank 0 is pid (\d+)", msg).group(1))
    assert not os.path.exists(f"/proc/{pid0}"), "the blocked rank outlived the run"


def test_a_part_that_fails_ends_the_run_before_the_next_part():
    """run_parts: the failed part is reported, with its rank; the peer does not wait out its
    collective, and no later part starts."""
    with pytest.raises(AssertionError) as info:
        run_distributed(_parts, 2, timeout=SLOW_S, collective_timeout_s=SLOW_S)
    msg = str(info.value)
    assert _reported_after(info.value) < BOUND_S, msg
    assert msg.startswith("rank 1 of 2 failed") and "part 'first' failed on rank 1" in msg, msg
    assert "ValueError: boom" in msg, msg


def _dies(rank: int, world: int) -> None:
    if rank == 1:
        os._exit(3)
    _all_reduce(rank, world)


def test_a_rank_that_dies_fails_the_run_with_its_exit_code():
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"ranks \[1\] died with exit codes \[3\]"):
        run_distributed(_dies, 2, timeout=SLOW_S)
    assert time.monotonic() - t0 < SLOW_S / 2  # NOTE: not the harness's limit


def _stuck(rank: int, world: int) -> None:
    if rank == 1:
        time.sleep(SLOW_S)
    _all_reduce(rank, world)


def test_collectives_time_out_long_before_the_harness():
    """A peer that stops talking: the rank waiting on it raises at the process groups' timeout
    (naming the collective), not at the harness's limit."""
    with pytest.raises(AssertionError, match=r"(?s)rank 0 of 2 failed.*[Tt]imed out"):
        run_distributed(_stuck, 2, timeout=SLOW_S, collective_timeout_s=2.0)
    for t in (60, 120, 400, 800):
        assert collective_timeout(t) <= t / 4 + 30 and collective_timeout(t) < t


def _probe(rank: int, world: int) -> dict:
    import torch

    with open(f"/proc/{os.getppid()}/status") as f:
        threads = int(re.search(r"Threads:\s+(\d+)", f.read()).group(1))
    return {"env": os.environ.get("FLCOMM_HARNESS_PROBE"), "parent_threads": threads,
            "bad_fork": torch.cuda._is_in_bad_fork(), "parent": os.getppid()}


def test_ranks_see_the_callers_environment_and_fork_from_a_safe_server(monkeypatch):
    monkeypatch.delenv("FLCOMM_HARNESS_PROBE", raising=False)
    assert [r["env"] for r in run_distributed(_probe, 2)] == [None, None]
    # NOTE: set after the forkserver started (the call above): it must still reach the ranks
    monkeypatch.setenv("FLCOMM_HARNESS_PROBE", "set by the test")
    res = run_distributed(_probe, 2)
    assert [r["env"] for r in res] == ["set by the test"] * 2, res
    for r in res:
        assert r["parent"] != os.getpid(), r  # forked from the forkserver, not from the test
        assert r["parent_threads"] == 1 and not r["bad_fork"], r


class _Config:
    def __init__(self, markexpr: str) -> None:
        self.markexpr, self.deselected = markexpr, []
        self.hook = self

    def getoption(self, name: str) -> str:
        assert name == "markexpr"
        return self.markexpr

    def pytest_deselected(self, items) -> None:
        self.deselected += items


class _Item:
    def __init__(self, name: str, *marks: str) -> None:
        self.name, self.keywords = name, {name: 1, **{m: 1 for m in marks}}


@pytest.mark.parametrize("markexpr,env,kept", [("", None, ["fast"]), ("", "1", ["fast", "slow"]),
                                                ("slow", None, ["fast", "slow"]),
                                                ("not slow", None, ["fast", "slow"])])
def test_slow_tests_run_only_when_asked(monkeypatch, markexpr, env, kept):
    """conftest: ``slow`` tests are deselected unless ``-m`` names the marker or FLCOMM_SLOW=1
    (``-m "not slow"`` then deselects them itself)."""
    from tests.common.markers import deselect_slow

    if env is None:
        monkeypatch.delenv("FLCOMM_SLOW", raising=False)
    else:
        monkeypatch.setenv("FLCOMM_SLOW", env)
    items, config = [_Item("fast"), _Item("slow", "slow")], _Config(markexpr)
    deselect_slow(config, items)
    assert [i.name for i in items] == kept
    assert [i.name for i in config.deselected] == [n for n in ("fast", "slow") if n not in kept]
