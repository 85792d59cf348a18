"""bench/peers.py's measuring parts, each against what it must count by construction: the
synchronizer's retained tensor bytes (an object graph of known tensors), the profiled peak of
allocated bytes (known allocations), the per-row figures from per-rank records (the formulas
of the module docstring), and the table's layout."""

from __future__ import annotations

import torch

from bench import peers


class _Holder:
    def __init__(self, kept, excluded):
        self.kept = kept
        self.view = kept[0][:10]                 # a view: its storage counts once
        self.nested = {"list": [kept[1]], "tuple": (kept[1],)}
        self.excluded = excluded
        self.callback = self._closure(kept[2])

    @staticmethod
    def _closure(t):
        def f():
            return t
        return f


def test_retained_bytes_counts_each_storage_once_and_leaves_out_the_excluded():
    kept = [torch.zeros(1000), torch.zeros(50, dtype=torch.float64), torch.zeros(7, dtype=torch.int8)]
    excluded = torch.zeros(4096)
    h = _Holder(kept, excluded)
    want = 1000 * 4 + 50 * 8 + 7
    assert peers.retained_bytes(h, {excluded.untyped_storage().data_ptr()}) == want
    assert peers.retained_bytes(h, set()) == want + 4096 * 4


def test_peak_allocated_is_the_largest_running_total():
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        a = torch.empty(1 << 18)      # 1 MiB
        b = torch.empty(1 << 19)      # 2 MiB: 3 MiB live
        del a
        c = torch.empty(1 << 17)      # 0.5 MiB: 2.5 MiB live
        del b, c
    assert peers.peak_allocated(prof) == 3 << 20


def _rank(row, node, local, times, tx=(None, None), sync=0, transient=0, rss=100.0, ev=2.0):
    return {"row": row, "rank": node * 2 + local, "node": node, "local": local, "step_times": times,
            "tx_start": tx[0], "tx_end": tx[1], "sync_bytes": sync, "transient_bytes": transient,
            "peak_rss_mb": rss, "eval_loss": ev, "params": 10}


def test_summarize_follows_the_documented_formulas():
    E = 2
    times = [9.0, 9.0, 1.0, 3.0, 1.0, 3.0]      # the first round (E steps) is the warm-up
    rec = {"row": "fl", "sync_every": E, "empty": False,
           "ranks": [_rank("fl", 0, 0, times, (100, 1100), sync=3 << 20, transient=1 << 20, rss=150.0, ev=2.5),
                     _rank("fl", 0, 1, times, sync=2 << 20, ev=3.5),
                     _rank("fl", 1, 0, times, (0, 500), ev=2.0), _rank("fl", 1, 1, times, ev=4.0)]}
    s = peers.summarize(rec, E)
    assert s["step_s"] == 2.0
    assert s["wire_bytes_per_round"] == (1000 + 500) / 2        # 4 timed steps = 2 rounds
    assert s["sync_mb"] == 3.0 and s["transient_mb"] == 1.0
    assert s["peak_rss_mb"] == 150.0
    assert s["eval_loss"] == 3.0


def test_the_table_has_a_column_per_figure_and_dashes_where_none_applies():
    rows = [{"row": "local", "sync_every": 4, "step_s": 0.5, "wire_bytes_per_round": None, "sync_mb": 0.0,
             "peak_rss_mb": 700.0, "eval_loss": 3.0},
            {"row": "tft", "sync_every": 4, "step_s": 0.75, "exposed_per_round_s": 1.0, "wire_bytes_per_round": 2e6,
             "fixed_s": 0.01, "sync_mb": 3.25, "sync_peak_mb": 8.0, "peak_rss_mb": 720.0,
             "rss_over_local_mb": 20.0, "eval_loss": 2.9}]
    lines = peers.table(rows).splitlines()
    assert lines[0].split() == ["row", "E", "step", "s", "exposed/rnd", "wire", "B/rnd", "fixed", "s", "sync", "MB",
                                "peak", "MB", "RSS", "MB", "+RSS", "eval"]
    assert len({len(x) for x in lines}) == 1                     # fixed width
    assert lines[2].split() == ["local", "4", "0.500", "-", "-", "-", "0.00", "-", "700", "-", "3.0000"]
    assert lines[3].split() == ["tft", "4", "0.750", "1.000", "2.000e+06", "0.010", "3.25", "8.00", "720", "+20",
                                "2.9000"]
