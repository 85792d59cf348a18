"""``python -m flcomm.train compare``'s parts: the table's "x vs FSDP" column, the one-line summary,
the PNG's title, where it runs (the emulated cluster when this machine can, with the probes
monkeypatched here) and the progress bar, which is off when the output is not a terminal.
A real emulated run: tests/system/test_compare_cli.py."""

from __future__ import annotations

import io
import json
import re
import subprocess

import pytest

from flcomm.comm.base import format_bytes
from flcomm.federated.config import FedAvgConfig
from flcomm.train import compare, netns
from flcomm.train.config import TrainConfig
from flcomm.train.loop import progress_bar
from flcomm.train.metrics import read_metrics

TOKENS = 4096


def _write_run(path, strategy: str, step_times: list[float], evals: dict[int, float], fedavg: dict | None = None):
    """A metrics file as the trainer writes it: config, step records (time_s cumulative), summary."""
    cfg = {"strategy": strategy, "tokens_per_step": TOKENS, "fedavg": fedavg or FedAvgConfig().to_dict()}
    lines, t = [{"config": cfg}], 0.0
    for i, dt in enumerate(step_times, 1):
        t += dt
        rec = {"step": i, "loss": 5.0 - 0.1 * i, "time_s": t, "step_time_s": dt, "exposed_comm_s": 0.0,
               "intergroup_bytes": 100 if strategy.startswith("fl") else 0,
               "internode_bytes": 0 if strategy.startswith("fl") else 5000}
        if i in evals:
            rec["eval_loss"] = evals[i]
        lines.append(rec)
    lines.append({"summary": {"steps": len(step_times)}})
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return str(path)


def _tokens_per_s(step_times: list[float]) -> float:
    """The reference: tokens over time of every step but the first (start-up)."""
    return TOKENS * (len(step_times) - 1) / sum(step_times[1:])


FSDP_T = [3.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]   # t = 3, 4, ..., 10
FL_T = [2.0, 0.25, 0.25, 0.25, 0.25, 0.25, 0.25, 0.25]  # t = 2, 2.25, ..., 3.75


def _rows(tmp_path):
    fl_cfg = FedAvgConfig(sync_every=4, codec="int8").to_dict()
    paths = [_write_run(tmp_path / "fsdp.jsonl", "fsdp", FSDP_T, {2: 4.0, 8: 3.0}),
             _write_run(tmp_path / "fl-fsdp.jsonl", "fl-fsdp", FL_T, {4: 3.5, 8: 3.1}, fl_cfg)]
    runs = [read_metrics(p) for p in paths]
    return compare.add_speedups([compare.summarize(r) for r in runs], runs)


def test_x_vs_fsdp_is_the_tokens_per_s_ratio(tmp_path):
    rows = _rows(tmp_path)
    want = _tokens_per_s(FL_T) / _tokens_per_s(FSDP_T)
    assert rows[0]["vs_fsdp"] == pytest.approx(1.0)
    assert rows[1]["vs_fsdp"] == pytest.approx(want)
    table = compare.format_table(rows).splitlines()
    assert "x vs FSDP" in table[0]
    # the label names the run's E and codec (from the fedavg record)
    fl = next(line for line in table if line.startswith("fl-fsdp"))
    assert fl.startswith("fl-fsdp E=4 int8") and f"{want:.2f}x" in fl.split()
    # no FSDP row: no ratio
    assert compare.add_speedups([dict(rows[1], strategy="hsdp")], [read_metrics(str(tmp_path / "fsdp.jsonl"))]
                                )[0]["vs_fsdp"] is None


def test_summary_line_and_title(tmp_path):
    rows = _rows(tmp_path)
    setup = compare.Setup(2, 2, 100e6, "tiny", 4, "int8")
    # equal wall time: the shorter run's end
    t_eq = sum(FL_T)
    assert rows[0]["equal_time_s"] == rows[1]["equal_time_s"] == pytest.approx(t_eq)
    assert rows[0]["eval_at_equal_time"] is None  # FSDP's first evaluation is at t = 4 s
    line = compare.summary_line(rows, setup)
    want = _tokens_per_s(FL_T) / _tokens_per_s(FSDP_T)
    assert line.startswith(f"FL+FSDP: {want:.1f}x the tokens/s of FSDP on 2 emulated nodes at 100 Mbit/s; ")
    assert "final eval loss 3.100 after 4 s vs 3.000 after 10 s" in line and "\n" not in line
    # with an FSDP evaluation before the shorter run's end: the losses at equal wall time
    rows[0]["eval_at_equal_time"], rows[1]["eval_at_equal_time"] = 4.2, 3.1
    assert "eval loss 3.100 vs 4.200 at equal wall time (4 s)" in compare.summary_line(rows, setup)
    loop = compare.Setup(2, 2, None, "tiny", 4, "int8")
    assert "on loopback (2 nodes x 2 ranks, one machine)" in compare.summary_line(rows, loop)
    assert f"inter-node bytes/step {format_bytes(5000)} -> {format_bytes(0)}" in compare.summary_line(rows, loop)
    assert setup.title(["fsdp", "fl-fsdp"]) == ("FSDP vs FL+FSDP: 2 nodes x 2 ranks, 100 Mbit/s between nodes, "
                                                "model tiny, E=4, codec int8")
    assert loop.title(["fsdp", "fl-fsdp"]).startswith("FSDP vs FL+FSDP: 2 nodes x 2 ranks, loopback, ")
    assert compare.format_rate(1e9) == "1 Gbit/s" and compare.format_rate(12.5e6) == "12.5 Mbit/s"


def _probes(monkeypatch, uid: int = 0, tools: tuple[str, ...] = ("ip", "tc"), netns_rc: int = 0):
    monkeypatch.setattr(netns.os, "geteuid", lambda: uid)
    monkeypatch.setattr(netns.shutil, "which", lambda t: f"/usr/sbin/{t}" if t in tools else None)
    monkeypatch.setattr(netns, "_run", lambda cmd, check=True: subprocess.CompletedProcess(cmd, netns_rc, "", "no"))


def test_emulates_when_root_with_the_tools(monkeypatch):
    _probes(monkeypatch)
    assert compare.decide_emulation(None, 2) == (True, None)
    assert compare.decide_emulation(True, 2) == (True, None)
    assert compare.decide_emulation(False, 2) == (False, "--no-emulate")
    assert compare.decide_emulation(None, 1) == (False, "one node: nothing crosses between nodes")


@pytest.mark.parametrize("probe, says", [({"uid": 1000}, "needs root"), ({"tools": ("ip",)}, "`tc`"),
                                         ({"tools": ()}, "`ip`"), ({"netns_rc": 1}, "`ip netns list` failed")])
def test_falls_back_to_loopback_in_one_line(monkeypatch, probe, says):
    _probes(monkeypatch, **probe)
    on, why = compare.decide_emulation(None, 2)
    assert not on and says in why
    with pytest.raises(RuntimeError, match=f"--emulate: the emulated cluster cannot run here: .*{re.escape(says)}"):
        compare.decide_emulation(True, 2)
    note = compare.loopback_note(why, compare.Setup(2, 2, None, "tiny", 8, "none"), "100mbit")
    assert "\n" not in note and says in note
    assert "expect about equal tokens/s" in note and "inter-node bytes down to 0 with FL+FSDP" in note
    assert "2 emulated nodes at 100 Mbit/s" in note


def test_compare_without_root_says_so_once_then_runs_on_loopback(monkeypatch, tmp_path, capsys):
    """run_compare end to end with the launcher replaced by one that writes the metrics files."""
    _probes(monkeypatch, uid=1000)
    launched, titles = [], []

    def fake_launch(cfg, nproc, start_method):
        launched.append((cfg.strategy, nproc, cfg.ranks_per_node))
        times = FSDP_T if cfg.strategy == "fsdp" else FL_T
        _write_run(tmp_path / f"{cfg.strategy}.jsonl", cfg.strategy, times, {8: 3.0})

    monkeypatch.setattr(compare, "launch_local", fake_launch)
    import flcomm.train.plot as plot

    monkeypatch.setattr(plot, "plot_runs", lambda paths, out, title=None: titles.append(title) or out)
    base = TrainConfig(ranks_per_node=2, group_size=2, steps=8)
    rows = compare.run_compare(base, ["fsdp", "fl-fsdp"], 4, str(tmp_path))
    out = capsys.readouterr().out.splitlines()
    assert launched == [("fsdp", 4, 2), ("fl-fsdp", 4, 2)]
    assert sum("not an emulated cluster" in line for line in out) == 1 and "needs root" in out[0]
    assert out[-1].startswith(f"FL+FSDP: {rows[1]['vs_fsdp']:.1f}x the tokens/s of FSDP on loopback")
    assert titles == ["FSDP vs FL+FSDP: 2 nodes x 2 ranks, loopback, model tiny, E=8, codec none"]
    with pytest.raises(ValueError, match="rate must look like 100mbit"):
        compare.run_compare(base, ["fsdp"], 4, str(tmp_path), rate="fast")
    with pytest.raises(ValueError, match="--nproc 3 is not a multiple of --ranks-per-node 2"):
        compare.run_compare(base, ["fsdp"], 3, str(tmp_path))


def test_config_round_trips_through_its_record():
    cfg = TrainConfig(strategy="fl-fsdp", group_size=2, fedavg=FedAvgConfig(sync_every=4, codec="int8"), steps=7)
    assert TrainConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


class _Stream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.mark.parametrize("out_tty, err_tty", [(False, False), (False, True), (True, False)])
def test_no_progress_bar_unless_on_a_terminal(monkeypatch, out_tty, err_tty):
    monkeypatch.setattr("sys.stdout", _Stream(out_tty))
    monkeypatch.setattr("sys.stderr", _Stream(err_tty))
    assert progress_bar(10, 0, "fsdp") is None


def test_progress_bar_on_a_terminal_uses_a_thread_lock(monkeypatch):
    import multiprocessing.synchronize as mps

    from tqdm import tqdm

    monkeypatch.setattr("sys.stdout", _Stream(True))
    monkeypatch.setattr("sys.stderr", _Stream(True))
    bar = progress_bar(10, 3, "fsdp")
    try:
        assert bar is not None and bar.n == 3 and bar.total == 10
        locks = getattr(tqdm.get_lock(), "locks", [tqdm.get_lock()])
        assert not any(isinstance(lk, mps.SemLock) for lk in locks), locks
    finally:
        bar.close()


def test_a_cluster_that_cannot_come_up_falls_back_unless_asked_for(monkeypatch, tmp_path, capsys):
    """Root and the tools present, but the kernel refuses the tbf qdisc: known only when the
    cluster is brought up; the default falls back to loopback with the reason, --emulate fails."""
    _probes(monkeypatch)

    class NoTbf:
        def __init__(self, spec):
            self.spec = spec

        def __enter__(self):
            raise netns.ClusterError("`tc qdisc add ... tbf` failed (exit 2): Error: Specified qdisc kind is unknown.")

        def __exit__(self, *exc):
            return None

    monkeypatch.setattr(netns, "EmulatedCluster", NoTbf)
    launched = []

    def fake_launch(cfg, nproc, start_method):
        launched.append(cfg.strategy)
        _write_run(tmp_path / f"{cfg.strategy}.jsonl", cfg.strategy, FSDP_T, {8: 3.0})

    monkeypatch.setattr(compare, "launch_local", fake_launch)
    base = TrainConfig(ranks_per_node=2, group_size=2, steps=8, progress=False)
    with pytest.raises(netns.ClusterError, match="qdisc kind is unknown"):
        compare.run_compare(base, ["fsdp"], 4, str(tmp_path), emulate=True)
    assert launched == []
    monkeypatch.setattr("flcomm.train.plot.plot_runs", lambda paths, out, title=None: out)
    compare.run_compare(base, ["fsdp"], 4, str(tmp_path))
    out = capsys.readouterr().out.splitlines()
    assert launched == ["fsdp"]
    assert out[0].startswith("flcomm.train compare: on loopback, not an emulated cluster (`tc qdisc add")
