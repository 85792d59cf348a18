"""The timed schedule of FedAvg (flcomm/federated/pacing.py) on one rank, against the rule as
tests/common/timed_sim.py writes it (no flcomm code there): which step starts each sync event for
a given step time, period and number of fragments; the tokens and steps handed to each fragment;
the refusal of a period shorter than a step, naming both numbers; the state across a resume. The
group's all-reduce is a one-rank transport's (the sum of one)."""

from __future__ import annotations

import pytest
import torch

from flcomm.federated.pacing import WARM_STEPS, StepSchedule, TimedSchedule
from tests.common.timed_sim import event_steps


class OneRank:
    """A transport of one rank: an all-reduce leaves the tensor as it is."""

    size = 1

    def all_reduce(self, t, op="sum"):
        assert op in ("sum", "max"), op
        return t


class Frag:
    def __init__(self, index: int) -> None:
        self.index, self.counts, self.round, self.tallies, self.sync_step = index, None, 0, None, 0


def _schedule(step_s: float, period: float, K: int, start: float = 0.0):
    now = [start]
    ts = TimedSchedule(period, K, clock=lambda: now[0])
    ts.agree_start(OneRank(), None, torch.device("cpu"))
    return ts, now


@pytest.mark.parametrize("step_s,period,K", [(1.0, 4.0, 1), (1.5, 4.0, 1), (0.75, 3.0, 1), (1.0, 4.0, 2),
                                             (1.5, 6.0, 4), (3.0, 3.0, 1)])
def test_events_start_at_the_first_boundary_past_each_deadline(step_s, period, K):
    events = 6
    ts, now = _schedule(step_s, period, K)
    got, n = [], 0
    tokens_seen = [0] * K
    while len(got) < events:
        n += 1
        now[0] = n * step_s
        due = ts.due(n, tokens=n)
        for f in range(K):
            tokens_seen[f] += n
        assert len(due) <= 1
        for f in due:
            assert f == len(got) % K  # event p moves fragment (p - 1) % K
            fr = Frag(f)
            ts.hand(fr)
            assert fr.counts == (tokens_seen[f], fr.counts[1]) and fr.round == len(got) + 1
            tokens_seen[f] = 0
            got.append(n)
    assert got == event_steps([step_s], period, K, events)[0]
    assert ts.events == events


def test_a_fragment_counts_steps_since_its_own_last_sync():
    ts, now = _schedule(1.0, 4.0, 2)
    handed = []
    for n in range(1, 9):
        now[0] = float(n)
        for f in ts.due(n):
            fr = Frag(f)
            ts.hand(fr)
            handed.append((n, f, fr.counts))
    # events every 2 s: fragment 0 at steps 2 and 6, fragment 1 at 4 and 8; 1 token a step
    assert handed == [(2, 0, (2, 2)), (4, 1, (4, 4)), (6, 0, (4, 4)), (8, 1, (4, 4))]


def test_a_period_shorter_than_a_step_is_refused_naming_both():
    ts, now = _schedule(2.0, 3.0, 2)  # T / K = 1.5 s, a step of 2 s
    with pytest.raises(ValueError, match=r"sync_period_s / fragments = 1.5 s is shorter than one step of this "
                                         r"federation group \(2.000 s measured\)"):
        for n in range(1, WARM_STEPS + 1):
            now[0] = 2.0 * n
            ts.due(n)
            ts.step_ended()
    ts, now = _schedule(2.0, 4.0, 2)  # 2 s fits
    for n in range(1, 2 * WARM_STEPS):
        now[0] = 2.0 * n
        ts.due(n)
        ts.step_ended()
    # NOTE: the time inside FedAvg.step() (a sync) does not count, and one slow step among the last
    # five does not decide: steps of 1 s with a 30 s sync after the third, and one 10 s step
    ts, now = _schedule(1.0, 4.0, 2)
    for n in range(1, 12):
        now[0] += 10.0 if n == 6 else 1.0
        ts.due(n)
        now[0] += 30.0 if n == 3 else 0.0
        ts.step_ended()


def test_the_state_resumes_a_period_after_the_restart():
    ts, now = _schedule(1.0, 4.0, 1)
    for n in range(1, 7):
        now[0] = float(n)
        for f in ts.due(n):
            ts.hand(Frag(f))
    sd = ts.state_dict()
    assert sd == {"events": 1, "tokens": [2], "steps": [2]}
    ts2, now2 = _schedule(1.0, 4.0, 1, start=100.0)
    ts2.load_state_dict(sd)
    assert ts2.deadline(ts2.events + 1) == pytest.approx(104.0)
    fr = Frag(0)
    for n in range(7, 11):
        now2[0] = 100.0 + n - 6
        for _ in ts2.due(n):
            ts2.hand(fr)
    assert fr.counts == (6, 6) and fr.round == 2  # the 2 steps before the save count
    with pytest.raises(ValueError, match="the timed schedule's state has 1 fragments' counts, this run 2"):
        _schedule(1.0, 4.0, 2)[0].load_state_dict(sd)


def test_by_steps_fragment_k_syncs_at_its_offset():
    s = StepSchedule(8, 4)
    starts = {n: s.due(n) for n in range(1, 17) if s.predictable(n)}
    assert starts == {2: [1], 4: [2], 6: [3], 8: [0], 10: [1], 12: [2], 14: [3], 16: [0]}
    assert s.events == 8 and s.rounds == []
