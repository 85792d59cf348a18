"""FSDP against FL+FSDP on a few local CPU processes: the README's main job.

    python -m flcomm.train compare [--nproc 4 --ranks-per-node 2 --group-size 2 --sync-every 8]
    python -m flcomm.train compare --rate 50mbit        # a slower inter-node link
    python -m flcomm.train compare --no-emulate         # loopback only

Runs each strategy in turn with the same model, data, hyper-parameters and token budget (same
world size, per-rank batch and steps), then prints one row per run (with tokens/s as a multiple
of FSDP's), a one-line summary, and writes the metrics files and a titled PNG (loss against wall
time and tokens) into ``--out-dir``. With 4 ranks as 2 nodes of 2, FSDP shards over both nodes,
so its all-gathers and reduce-scatters cross the inter-node tier every step; FL+FSDP keeps one
group per node and sends only the FedAvg exchange between groups, every E steps.

Steps:
  1. decide where to run (:func:`decide_emulation`): as root with iproute2 (``ip netns``, ``tc``
     with tbf), on the emulated two-tier cluster (:mod:`flcomm.train.netns`: a network namespace
     per node, ``--rate`` between nodes, loopback inside a node); else on loopback, saying so in
     one line (:func:`loopback_note`): every link is then as fast as the others, so expect about
     equal tokens/s, and the point shows only in the inter-node bytes (down to 0 with FL+FSDP);
  2. run each strategy there (:func:`run_config`);
  3. print the table (:func:`format_table`), the summary (:func:`summary_line`) and write the PNG
     titled with the setup (:meth:`Setup.title`).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, replace

from flcomm.comm.base import format_bytes
from flcomm.federated.strategy import Strategy
from flcomm.train import netns
from flcomm.train.config import TrainConfig
from flcomm.train.launch import default_start_method, launch_local
from flcomm.train.metrics import RunMetrics, eval_at_time, read_metrics

COMPARE_DEFAULTS: dict[str, object] = {
    "strategies": "fsdp,fl-fsdp", "out_dir": "flcomm-compare", "nproc": 4,
    "ranks_per_node": 2, "group_size": 2, "model": "tiny", "steps": 48,
    "batch_size": 8, "seq_len": 128, "lr": 3e-3, "eval_every": 16, "eval_batches": 4,
    "rate": "100mbit",
}


@dataclass(frozen=True)
class Setup:
    """Where the comparison runs: ``nodes`` x ``ranks_per_node`` ranks, ``rate`` bit/s between
    emulated nodes (None: loopback), and the settings the title names."""

    nodes: int
    ranks_per_node: int
    rate_bits: float | None
    model: str
    sync_every: int
    codec: str

    @property
    def link(self) -> str:
        return "loopback" if self.rate_bits is None else f"{format_rate(self.rate_bits)} between nodes"

    def where(self) -> str:
        """"on 2 emulated nodes at 100 Mbit/s" or "on loopback (2 nodes x 2 ranks, one machine)"."""
        if self.rate_bits is None:
            return f"on loopback ({self.nodes} nodes x {self.ranks_per_node} ranks, one machine)"
        return f"on {self.nodes} emulated nodes at {format_rate(self.rate_bits)}"

    def title(self, strategies: Sequence[str]) -> str:
        """The PNG's title: the runs and the setup."""
        names = " vs ".join(Strategy.parse(s).value.upper().replace("FL-", "FL+") for s in strategies)
        return (f"{names}: {self.nodes} nodes x {self.ranks_per_node} ranks, {self.link}, model {self.model}, "
                f"E={self.sync_every}, codec {self.codec}")


def format_rate(bits: float) -> str:
    """100e6 -> "100 Mbit/s"."""
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits >= scale:
            return f"{bits / scale:g} {unit}"
    return f"{bits:g} bit/s"


def decide_emulation(requested: bool | None, nodes: int) -> tuple[bool, str | None]:
    """Whether to run on the emulated cluster, and why not (None when it does).

    ``requested`` None (the default) emulates when this machine can (:func:`netns.unavailable`)
    and there are two nodes or more; True insists (RuntimeError saying why it cannot); False
    keeps to loopback."""
    if requested is False:
        return False, "--no-emulate"
    why = "one node: nothing crosses between nodes" if nodes < 2 else netns.unavailable()
    if why is not None and requested:
        raise RuntimeError(f"--emulate: the emulated cluster cannot run here: {why}")
    return why is None, why


def loopback_note(why: str, setup: Setup, rate: str) -> str:
    """The one line printed when the comparison runs on loopback."""
    why = " ".join(why.split(";")[0].split())
    return (f"flcomm.train compare: on loopback, not an emulated cluster ({why}): every link is as "
            f"fast as the others here, so expect about equal tokens/s, and inter-node bytes down to 0 with FL+FSDP; "
            f"as root with iproute2 (ip netns, tc tbf) it runs {setup.nodes} emulated nodes at "
            f"{format_rate(netns.parse_rate(rate))}")


def run_config(base: TrainConfig, strategy: str, metrics: str) -> TrainConfig:
    """``base`` adapted to ``strategy``: the group size only for fl-*, the shard size only for
    the hybrid strategies; everything else is shared."""
    st = Strategy.parse(strategy)
    return replace(base, strategy=st, metrics=metrics,
                   group_size=base.group_size if st.federated else None,
                   shard_size=base.shard_size if st.hybrid else None,
                   checkpoint_dir=None, save_every=0, resume=False)


def summarize(run: RunMetrics) -> dict[str, float | str | None]:
    """One table row: tokens/s over all steps but the first (start-up), mean bytes per step per
    tier, mean exposed communication per step, last eval loss, wall time."""
    steps = run.steps[1:] if len(run.steps) > 1 else run.steps
    n = max(1, len(run.steps))
    t = sum(r["step_time_s"] for r in steps)
    toks = run.config.get("tokens_per_step", 0) * len(steps)
    ev = run.evals()
    return {
        "run": run.label,
        "strategy": run.config.get("strategy"),
        "tokens_per_s": toks / t if t > 0 else float("nan"),
        "intergroup_bytes_per_step": sum(r["intergroup_bytes"] for r in run.steps) / n,
        "internode_bytes_per_step": sum(r["internode_bytes"] for r in run.steps) / n,
        "exposed_comm_s_per_step": sum(r["exposed_comm_s"] for r in run.steps) / n,
        "eval_loss": ev[-1]["eval_loss"] if ev else None,
        "wall_s": run.steps[-1]["time_s"] if run.steps else None,
    }


def add_speedups(rows: list[dict], runs: Sequence[RunMetrics]) -> list[dict]:
    """Each row's tokens/s over the FSDP row's (``vs_fsdp``, None without an FSDP row), and its
    eval loss at the shortest run's wall time (``eval_at_equal_time``, ``equal_time_s``)."""
    base = next((r["tokens_per_s"] for r in rows if r["strategy"] == Strategy.FSDP.value), None)
    t_eq = min((r["wall_s"] for r in rows if r["wall_s"] is not None), default=None)
    for r, run in zip(rows, runs):
        r["vs_fsdp"] = r["tokens_per_s"] / base if base else None
        r["equal_time_s"] = t_eq
        r["eval_at_equal_time"] = eval_at_time(run.steps, t_eq) if t_eq is not None else None
    return rows


def format_table(rows: Sequence[dict]) -> str:
    head = ("run", "tokens/s", "x vs FSDP", "inter-group B/step", "inter-node B/step", "exposed comm s/step",
            "eval loss", "wall s")
    body = [(r["run"], f"{r['tokens_per_s']:.0f}", "-" if r.get("vs_fsdp") is None else f"{r['vs_fsdp']:.2f}x",
             format_bytes(r["intergroup_bytes_per_step"]),
             format_bytes(r["internode_bytes_per_step"]), f"{r['exposed_comm_s_per_step']:.4f}",
             "-" if r["eval_loss"] is None else f"{r['eval_loss']:.4f}",
             "-" if r["wall_s"] is None else f"{r['wall_s']:.1f}") for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w)  # noqa: E731
                                   for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(head), line(["-" * w for w in widths]), *(line(b) for b in body)])


def summary_line(rows: Sequence[dict], setup: Setup) -> str:
    """"FL+FSDP: 3.9x the tokens/s of FSDP on 2 emulated nodes at 100 Mbit/s; eval loss 4.1 vs
    4.6 at equal wall time (20 s)", for the first federated row against the FSDP row (the final
    eval losses and their times when FSDP has no evaluation by the shorter run's end; on loopback
    also the inter-node bytes per step of both)."""
    fsdp = next((r for r in rows if r["strategy"] == Strategy.FSDP.value), None)
    fl = next((r for r in rows if r["strategy"] and Strategy.parse(r["strategy"]).federated), None)
    if fsdp is None or fl is None:
        return f"{len(rows)} runs {setup.where()} (no FSDP and federated pair to compare)"
    name = Strategy.parse(fl["strategy"]).value.upper().replace("FL-", "FL+")
    s = f"{name}: {fl['vs_fsdp']:.1f}x the tokens/s of FSDP {setup.where()}"
    a, b = fl["eval_at_equal_time"], fsdp["eval_at_equal_time"]
    if a is not None and b is not None:
        s += f"; eval loss {a:.3f} vs {b:.3f} at equal wall time ({fl['equal_time_s']:.0f} s)"
    elif fl["eval_loss"] is not None and fsdp["eval_loss"] is not None:
        s += (f"; final eval loss {fl['eval_loss']:.3f} after {fl['wall_s']:.0f} s vs {fsdp['eval_loss']:.3f} "
              f"after {fsdp['wall_s']:.0f} s")
    if setup.rate_bits is None:
        s += (f"; inter-node bytes/step {format_bytes(fsdp['internode_bytes_per_step'])} -> "
              f"{format_bytes(fl['internode_bytes_per_step'])}")
    return s


def _launch_emulated(cluster: netns.EmulatedCluster, cfg: TrainConfig, nproc: int) -> None:
    """Run ``cfg`` on every rank of ``cluster`` (``python -m flcomm.train rank CONFIG``, torchrun's
    environment per rank), rank 0's output on this terminal."""
    from flcomm.train.checkpoint import check_before_launch

    log_dir = tempfile.mkdtemp(prefix="flcomm-run-")
    cfg = replace(cfg, backend="gloo", log_dir=log_dir)
    check_before_launch(cfg, nproc)
    path = os.path.join(log_dir, f"{cfg.strategy.value}.config.json")
    with open(path, "w") as f:
        json.dump(cfg.to_dict(), f)
    # NOTE: the ranks import this flcomm, and split the cores as launch_local's ranks do
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {"PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p),
           "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // nproc))}
    cluster.launch([sys.executable, "-m", "flcomm.train", "rank", path], cfg.ranks_per_node, env=env,
                   timeout=max(1800.0, cfg.timeout_s), log_dir=os.path.join(log_dir, "stdout"))


def run_compare(base: TrainConfig, strategies: Sequence[str], nproc: int, out_dir: str,
                emulate: bool | None = None, rate: str = "100mbit") -> list[dict]:
    """Steps 1-3 of the module doc; writes ``out_dir/<strategy>.jsonl`` and
    ``out_dir/compare.png``; returns the rows."""
    for s in strategies:
        Strategy.parse(s)
    if not strategies:
        raise ValueError("compare needs at least one strategy")
    netns.parse_rate(rate)
    L = base.ranks_per_node or nproc
    if nproc % L:
        raise ValueError(f"--nproc {nproc} is not a multiple of --ranks-per-node {L}")
    base = replace(base, ranks_per_node=L)
    on, why = decide_emulation(emulate, nproc // L)
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, f"{s}.jsonl") for s in strategies]
    with contextlib.ExitStack() as stack:
        cluster = None
        if on:
            try:
                cluster = stack.enter_context(netns.EmulatedCluster(netns.ClusterSpec(nproc // L, rate)))
            except netns.ClusterError as e:  # NOTE: e.g. no tbf in this kernel: known only now
                if emulate:
                    raise
                on, why = False, str(e)
        setup = Setup(nproc // L, L, netns.parse_rate(rate) if on else None, base.model, base.fedavg.sync_every,
                      base.fedavg.codec)
        if not on:
            print(loopback_note(why or "", setup, rate), flush=True)
        for s, path in zip(strategies, paths):
            cfg = run_config(base, s, path)
            print(f"== {s}: {nproc} ranks {setup.where()}, {cfg.steps} steps of "
                  f"{nproc * cfg.batch_size * cfg.seq_len} tokens", flush=True)
            if cluster is not None:
                _launch_emulated(cluster, cfg, nproc)
            else:
                launch_local(cfg, nproc, start_method=default_start_method())
    return _report(paths, setup, strategies, out_dir)


def _report(paths: Sequence[str], setup: Setup, strategies: Sequence[str], out_dir: str) -> list[dict]:
    """Step 3: the table, the PNG and the summary line; returns the rows."""
    runs = [read_metrics(p) for p in paths]
    rows = add_speedups([summarize(r) for r in runs], runs)
    print()
    print(format_table(rows))
    try:
        from flcomm.train.plot import plot_runs

        png = plot_runs(paths, os.path.join(out_dir, "compare.png"), title=setup.title(strategies))
        print(f"\nplot: {png}")
    except RuntimeError as e:  # matplotlib missing
        print(f"\n(no plot: {e})")
    print(f"metrics: {', '.join(paths)}")
    print(summary_line(rows, setup))
    return rows

