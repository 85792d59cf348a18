"""FSDP, HSDP, FL+FSDP and FL+HSDP end to end, measured side by side and against the cost model.

Every run trains the same model on the same data with the same hyper-parameters and token
budget through the reference driver (``python -m flcomm.train``); only the strategy, codec,
E and overlap change. Steps:

  1. bring up the emulated cluster (``flcomm/train/netns.py``: N namespaces, tbf-shaped
     inter-node links) or, under ``--launcher torchrun``, use the real job;
  2. probe the tiers (``flcomm.costmodel --measure``) and time a compute-only calibration run
     (fl-fsdp with groups of one rank and no sync: the same per-rank work, no communication,
     the same CPU contention);
  3. run each configuration, reading its per-step JSONL; count the bytes the kernel sent on
     each node's shaped interface;
  4. predict each run's step time with :mod:`flcomm.costmodel` from the probed links and the
     calibrated compute time;
  5. print the table (tokens/s, speedups vs FSDP and HSDP, bytes per step per tier, exposed
     communication, eval loss at the end and at equal wall time, predicted step time), write
     ``--json`` (one record per run) and a PNG of eval loss against wall time.

Usage (as root, for the emulated cluster)::

    python bench/strategies.py --nodes 4 --ranks-per-node 2 --rate 100mbit --model small \\
        --steps 40 --json strategies.json --png strategies.png
    python bench/strategies.py ... --runs fsdp hsdp fl-fsdp:E=8:codec=int8 fl-hsdp:E=8:codec=int8 \\
        fl-fsdp:E=8:codec=none fl-fsdp:E=8:codec=int8:overlap
    # a real cluster: the same script on every rank
    torchrun --nnodes 4 --nproc-per-node 8 ... bench/strategies.py --launcher torchrun --json s.json

Run spec: ``strategy[:E=<int>][:codec=<name>[:<option>=<v>...]][:ef][:G=<int>][:S=<int>][:frag=<K>][:overlap]``
``[:hier][:unsharded][:rep=<codec>][:repef]`` (the codec's options follow it, as in its own name:
``codec=topk:d=0.02:bits=2``; ``ef``: FedAvg's error feedback; ``frag``: streaming fragments, 1/K of the
shard every E/K steps; ``hier``:
the driver's ``--hierarchical`` two-stage FSDP collectives; ``unsharded``: FL+HSDP with every
replica exchanging its whole shard instead of 1/R of it; ``rep`` / ``repef``: the driver's
``--replicate-codec`` / ``--replicate-error-feedback``, HSDP's replica all-reduce through
flcomm's hook in that codec, e.g. ``hsdp:rep=int8:repef``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from flcomm import costmodel as cm  # noqa: E402
from flcomm.codecs import CODECS, DENSE_CODECS, get_codec  # noqa: E402
from flcomm.federated.config import AUTO, FedAvgConfig  # noqa: E402
from flcomm.federated.strategy import Strategy  # noqa: E402
from flcomm.train.metrics import eval_at_time  # noqa: E402

DEFAULT_RUNS = ("fsdp", "hsdp", "fl-fsdp:E=8:codec=int8", "fl-hsdp:E=8:codec=int8",
                "fl-fsdp:E=8:codec=none", "fl-fsdp:E=8:codec=int8:overlap")


@dataclass(frozen=True)
class RunSpec:
    strategy: Strategy
    sync_every: int = 8
    codec: str = "none"
    overlap: bool = False
    group_size: int | None = None
    shard_size: int | None = None
    hierarchical: bool = False
    fragments: int = 1
    unsharded: bool = False
    replicate_codec: str = "none"
    replicate_error_feedback: bool = False
    error_feedback: bool = False

    @classmethod
    def parse(cls, text: str) -> RunSpec:
        parts = text.split(":")
        try:
            kw: dict[str, Any] = {"strategy": Strategy.parse(parts[0])}
        except ValueError as e:
            raise ValueError(f"run spec {text!r}: {e}") from None
        last = None  # NOTE: the key of the last part: a codec's options follow it
        for p in parts[1:]:
            flags = {"overlap": "overlap", "hier": "hierarchical", "unsharded": "unsharded",
                     "repef": "replicate_error_feedback", "ef": "error_feedback"}
            if p in flags:
                kw[flags[p]] = True
                last = None
                continue
            key, _, val = p.partition("=")
            if last == "codec" and key not in ("E", "codec", "G", "S", "frag", "rep"):
                kw["codec"] += ":" + p
                continue
            last = key
            try:
                if key == "E":
                    kw["sync_every"] = int(val)
                elif key == "codec":
                    if val.split(":")[0] not in CODECS:
                        raise ValueError
                    kw["codec"] = val
                elif key == "rep":
                    if val not in DENSE_CODECS:
                        raise ValueError
                    kw["replicate_codec"] = val
                elif key == "G":
                    kw["group_size"] = int(val)
                elif key == "S":
                    kw["shard_size"] = int(val)
                elif key == "frag":
                    kw["fragments"] = int(val)
                else:
                    raise ValueError
            except ValueError:
                raise ValueError(f"run spec {text!r}: expected E=<int>, codec=<{'|'.join(CODECS)}>[:<option>=<v>...], "
                                 f"ef, G=<int>, S=<int>, frag=<int>, rep=<{'|'.join(DENSE_CODECS)}>, overlap, hier, "
                                 f"unsharded or repef after the strategy, got {p!r}") from None
        try:
            kw["codec"] = get_codec(kw.get("codec", "none")).spec
        except ValueError as e:
            raise ValueError(f"run spec {text!r}: {e}") from None
        return cls(**kw)

    def __post_init__(self) -> None:
        object.__setattr__(self, "strategy", Strategy.parse(self.strategy))

    def replicate(self) -> dict[str, Any]:
        """The driver's replicate all-reduce settings (TrainConfig fields)."""
        return {"replicate_codec": self.replicate_codec, "replicate_error_feedback": self.replicate_error_feedback}

    @property
    def federated(self) -> bool:
        return self.strategy.federated

    def fedavg(self) -> FedAvgConfig:
        """The FedAvg settings of this run (``overlap``: ``overlap_steps="auto"``)."""
        return FedAvgConfig(sync_every=self.sync_every, codec=self.codec, overlap_steps=AUTO if self.overlap else 0,
                            fragments=self.fragments, sharded_exchange=False if self.unsharded else None,
                            error_feedback=self.error_feedback)

    def label(self) -> str:
        s = self.strategy.value
        if self.federated:
            s += f" E={self.sync_every} {self.codec}" + ("+ef" if self.error_feedback else "")
            s += " ovl" if self.overlap else ""
            s += (f" frag={self.fragments}" if self.fragments > 1 else "") + (" unsharded" if self.unsharded else "")
        if self.replicate_codec != "none":
            s += f" rep={self.replicate_codec}" + ("+ef" if self.replicate_error_feedback else "")
        return s + (" hier" if self.hierarchical else "")

    def slug(self) -> str:
        return self.label().replace(" ", "_").replace("=", "").replace(":", "-")

    def driver_args(self) -> list[str]:
        a = ["--strategy", self.strategy.value]
        if self.federated:
            a += ["--sync-every", str(self.sync_every), "--codec", self.codec,
                  "--overlap-steps", AUTO if self.overlap else "0"]
            if self.error_feedback:
                a += ["--error-feedback"]
            if self.fragments > 1:
                a += ["--fragments", str(self.fragments)]
            if self.unsharded:
                a += ["--no-sharded-exchange"]
        if self.group_size:
            a += ["--group-size", str(self.group_size)]
        if self.shard_size:
            a += ["--shard-size", str(self.shard_size)]
        if self.hierarchical:
            a += ["--hierarchical"]
        if self.replicate_codec != "none":
            a += ["--replicate-codec", self.replicate_codec]
        if self.replicate_error_feedback:
            a += ["--replicate-error-feedback"]
        return a


@dataclass
class RunResult:
    spec: RunSpec
    metrics_path: str
    config: dict[str, Any]
    steps: list[dict[str, Any]]
    wall_s: float
    tx_bytes: int | None = None          # kernel counters, all nodes' shaped interfaces
    record: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------- statistics ----

def timed_steps(steps: list[dict[str, Any]], warmup: int) -> list[dict[str, Any]]:
    """Steps that count for throughput: those after ``warmup``. The driver's ``step_time_s``
    stops before evaluation, so evaluation steps count too.

    NOTE: a warm-up of E steps leaves out the first exchange (one-time set-up: buckets,
    codec buffers); with ``steps = warmup + k * E`` the timed steps hold exactly k exchanges,
    so their mean is the amortized step time."""
    out = [r for r in steps if r["step"] > warmup]
    if not out:
        raise ValueError(f"no timed steps left after {warmup} warm-up steps; run more steps")
    return out


def effective_allgathers(model: str) -> float:
    """All-gathers per step weighted by parameters: decoder blocks reshard after forward (2),
    the root (embeddings, norm, head) does not (1)."""
    from flcomm.train.model import get_config

    cfg = get_config(model)
    total = cfg.num_params()
    block = dataclasses.replace(cfg, n_layers=2).num_params() - dataclasses.replace(cfg, n_layers=1).num_params()
    root = total - cfg.n_layers * block
    return (2 * (total - root) + root) / total


# ---------------------------------------------------------------- running ----

def _driver_argv(a: argparse.Namespace, extra: list[str], metrics: str) -> list[str]:
    return [sys.executable, "-m", "flcomm.train", *extra, "--backend", "gloo", "--model", a.model,
            "--steps", str(a.steps), "--batch-size", str(a.batch_size), "--seq-len", str(a.seq_len),
            "--lr", str(a.lr), "--seed", str(a.seed), "--eval-every", str(a.eval_every),
            "--eval-batches", str(a.eval_batches), "--ranks-per-node", str(a.ranks_per_node),
            "--metrics", metrics, "--no-progress", *a.driver_extra]


def run_emulated(a: argparse.Namespace, specs: list[RunSpec], out_dir: str, log) -> tuple[dict, list[RunResult], float]:
    """Steps 1-3 on the emulated cluster: measure, calibrate, run every spec."""
    from flcomm.train.netns import ClusterError, ClusterSpec, EmulatedCluster

    results: list[RunResult] = []
    env = {"PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with EmulatedCluster(ClusterSpec(a.nodes, a.rate)) as c:
        mpath = os.path.join(out_dir, "measure.json")
        log(f"[1/3] probing the tiers ({a.nodes} nodes x {a.ranks_per_node} ranks, {a.rate})")
        c.launch([sys.executable, "-m", "flcomm.costmodel", "--measure", "--ranks-per-node", str(a.ranks_per_node),
                  "--measure-mb", str(a.measure_mb), "--measure-json", mpath], a.ranks_per_node,
                 env=env, cwd=ROOT, timeout=a.timeout, stream_rank0=False,
                 log_dir=os.path.join(out_dir, "logs", "measure"))
        with open(mpath) as f:
            measured = json.load(f)
        log("[2/3] compute-only calibration run (groups of one rank, no sync)")
        cal_path = os.path.join(out_dir, "calibration.jsonl")
        cal = ["--strategy", "fl-fsdp", "--group-size", "1", "--sync-every", str(10 ** 9)]
        c.launch(_driver_argv(a, cal, cal_path), a.ranks_per_node, env=env, cwd=ROOT, timeout=a.timeout,
                 stream_rank0=False, log_dir=os.path.join(out_dir, "logs", "calibration"))
        compute_s = _compute_time(cal_path, a.warmup)
        log(f"      compute {compute_s:.3f} s/step")
        for i, spec in enumerate(specs):
            path = os.path.join(out_dir, f"{i:02d}_{spec.slug()}.jsonl")
            log(f"[3/3] run {i + 1}/{len(specs)}: {spec.label()}")
            tx0 = sum(c.tx_bytes())
            t0 = time.perf_counter()
            try:
                c.launch(_driver_argv(a, spec.driver_args(), path), a.ranks_per_node, env=env, cwd=ROOT,
                         timeout=a.timeout, stream_rank0=False, log_dir=os.path.join(out_dir, "logs", spec.slug()))
            except ClusterError as e:
                # NOTE: one broken configuration should not cost the others' results
                log(f"      FAILED, left out of the table: {e}")
                continue
            wall = time.perf_counter() - t0
            results.append(_read(spec, path, wall, sum(c.tx_bytes()) - tx0))
    return measured, results, compute_s


def run_torchrun(a: argparse.Namespace, specs: list[RunSpec], out_dir: str,
                 log) -> tuple[dict, list[RunResult], float] | None:
    """Steps 1-3 inside a torchrun job: every rank runs this; returns on rank 0 only."""
    from datetime import timedelta

    import torch.distributed as dist

    from flcomm.train.config import TrainConfig
    from flcomm.train.loop import train

    dist.init_process_group(a.backend, timeout=timedelta(seconds=a.timeout))
    rank = dist.get_rank()
    L = int(os.environ.get("LOCAL_WORLD_SIZE", a.ranks_per_node))
    a.ranks_per_node, a.nodes = L, dist.get_world_size() // L
    try:
        measured = cm.measure_tiers(L, nbytes=int(a.measure_mb * (1 << 20)))
        base = dict(model=a.model, steps=a.steps, batch_size=a.batch_size, seq_len=a.seq_len, lr=a.lr,
                    seed=a.seed, eval_every=a.eval_every, eval_batches=a.eval_batches, ranks_per_node=L,
                    backend=a.backend, progress=False)
        cal_path = os.path.join(out_dir, "calibration.jsonl")
        train(TrainConfig(strategy="fl-fsdp", group_size=1, fedavg=FedAvgConfig(sync_every=10 ** 9), metrics=cal_path,
                          **base))
        results = []
        for i, spec in enumerate(specs):
            path = os.path.join(out_dir, f"{i:02d}_{spec.slug()}.jsonl")
            if rank == 0:
                log(f"run {i + 1}/{len(specs)}: {spec.label()}")
            t0 = time.perf_counter()
            train(TrainConfig(strategy=spec.strategy.value, fedavg=spec.fedavg(), group_size=spec.group_size,
                              shard_size=spec.shard_size, hierarchical=spec.hierarchical, metrics=path,
                              **spec.replicate(), **base))
            if rank == 0:
                results.append(_read(spec, path, time.perf_counter() - t0, None))
        if rank != 0:
            return None
        return measured, results, _compute_time(cal_path, a.warmup)
    finally:
        dist.destroy_process_group()


def save_runs(out_dir: str, a: argparse.Namespace, got: tuple[dict, list[RunResult], float]) -> None:
    """What ``--reanalyse`` needs: the probe, the calibration and each run's spec and files."""
    measured, results, compute_s = got
    with open(os.path.join(out_dir, "runs.json"), "w") as f:
        json.dump({"args": {k: v for k, v in vars(a).items()}, "measured": measured, "compute_s": compute_s,
                   "runs": [{"spec": dataclasses.asdict(r.spec), "metrics": r.metrics_path, "wall_s": r.wall_s,
                             "tx_bytes": r.tx_bytes} for r in results]}, f, indent=2)


def load_runs(out_dir: str, a: argparse.Namespace) -> tuple[dict, list[RunResult], float]:
    path = os.path.join(out_dir, "runs.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--reanalyse needs {path} (written by a previous run)")
    with open(path) as f:
        d = json.load(f)
    for k in ("nodes", "ranks_per_node", "rate", "model", "warmup"):
        setattr(a, k, d["args"][k])
    return d["measured"], [_read(RunSpec(**r["spec"]), r["metrics"], r["wall_s"], r["tx_bytes"]) for r in d["runs"]], \
        d["compute_s"]


def _compute_time(path: str, warmup: int) -> float:
    from flcomm.train.metrics import read_metrics

    return statistics.median(r["step_time_s"] for r in timed_steps(read_metrics(path).steps, warmup))


def _read(spec: RunSpec, path: str, wall: float, tx: int | None) -> RunResult:
    from flcomm.train.metrics import read_metrics

    m = read_metrics(path)
    if not m.steps:
        raise RuntimeError(f"run {spec.label()} wrote no step records to {path}")
    return RunResult(spec, path, m.config, m.steps, wall, tx)


# ---------------------------------------------------------------- analysis ----

def analyse(a: argparse.Namespace, measured: dict, results: list[RunResult], compute_s: float) -> list[dict[str, Any]]:
    """Steps 4-5: one record per run, with the cost model's prediction and the speedups."""
    from flcomm.train.model import get_config

    # NOTE: a probe written before the backend was recorded: it ran on this run's backend
    cluster = cm.Cluster.from_measurement({"backend": getattr(a, "backend", "gloo"), **measured})
    units = get_config(a.model).n_layers + 1
    records = []
    for r in results:
        cfgd = r.config
        timed = timed_steps(r.steps, a.warmup)
        step_t = statistics.fmean(x["step_time_s"] for x in timed)
        tokens_per_step = cfgd["tokens_per_step"]
        # NOTE: the root FSDP unit keeps its parameters from forward to backward, so it is
        # all-gathered once per step, the decoder blocks twice: a parameter-weighted count.
        wl = cm.Workload(params=cfgd["num_params"], tokens_per_rank=tokens_per_step / cfgd["world_size"],
                         compute_s=compute_s, param_bytes=4, grad_bytes=4,
                         allgathers_per_step=effective_allgathers(a.model), fsdp_units=units)
        plan = cm.Plan(r.spec.strategy, cfgd["group_size"], cfgd["shard_size"], r.spec.fedavg(), r.spec.hierarchical,
                       r.spec.replicate_codec)
        pred = cm.predict(cluster, wl, plan)
        steps_n = len(r.steps)
        rec = {
            "strategy": r.spec.strategy.value, "codec": r.spec.codec if r.spec.federated else "none",
            "sync_every": r.spec.sync_every if r.spec.federated else 1, "overlap": r.spec.overlap,
            "hierarchical": r.spec.hierarchical, "label": r.spec.label(), **r.spec.replicate(),
            "nodes": a.nodes, "ranks_per_node": a.ranks_per_node, "group_size": cfgd["group_size"],
            "shard_size": cfgd["shard_size"], "internode_gbit": cm_gbit(a.rate),
            "model": a.model, "params": cfgd["num_params"], "steps": steps_n,
            "tokens_per_step": tokens_per_step,
            "tokens_per_s": tokens_per_step / step_t, "step_time_s": step_t,
            "internode_bytes_per_step": statistics.fmean(x["internode_bytes"] for x in timed),
            "intergroup_bytes_per_step": statistics.fmean(x["intergroup_bytes"] for x in timed),
            "exposed_comm_s": statistics.fmean(x["exposed_comm_s"] for x in timed),
            "comm_s_estimate": step_t - compute_s,
            "eval_loss": next((x["eval_loss"] for x in reversed(r.steps) if x.get("eval_loss") is not None), None),
            "wall_s": r.steps[-1]["time_s"],
            "compute_s_calibrated": compute_s,
            "predicted_step_time_s": pred.step_time_s,
            "predicted_tokens_per_s": pred.tokens_per_s,
            "predicted_internode_bytes_per_step": pred.internode_bytes_per_step,
            "predicted_intergroup_bytes_per_step": pred.intergroup_bytes_per_step,
            "prediction_error": pred.step_time_s / step_t - 1,
            "wire_tx_bytes_per_rank_step": (r.tx_bytes / steps_n / (a.nodes * a.ranks_per_node))
            if r.tx_bytes is not None else None,
            "metrics": r.metrics_path,
        }
        records.append(rec)
    t_equal = min(rec["wall_s"] for rec in records)
    for rec, r in zip(records, results):
        rec["equal_time_s"] = t_equal
        rec["eval_loss_at_equal_time"] = eval_at_time(r.steps, t_equal)
    # NOTE: the baselines are FSDP and HSDP as torch runs them (no replicate codec)
    base = {rec["strategy"]: rec for rec in records
            if rec["strategy"] in ("fsdp", "hsdp") and rec["replicate_codec"] == "none"}
    for rec in records:
        for b in ("fsdp", "hsdp"):
            rec[f"speedup_vs_{b}"] = rec["tokens_per_s"] / base[b]["tokens_per_s"] if b in base else None
            rec[f"predicted_speedup_vs_{b}"] = (base[b]["predicted_step_time_s"] / rec["predicted_step_time_s"]
                                                if b in base else None)
    return records


def cm_gbit(rate: str) -> float:
    from flcomm.train.netns import parse_rate

    return parse_rate(rate) / 1e9


def format_table(records: list[dict[str, Any]]) -> str:
    def f(v: Any, fmt: str, unit: str = "") -> str:
        return "-" if v is None else format(v, fmt) + unit

    hdr = (f"{'run':<22} {'tok/s':>8} {'vsFSDP':>7} {'vsHSDP':>7} {'step s':>7} {'pred s':>7} {'err':>6} "
           f"{'inter-node B/step':>17} {'inter-group B/step':>18} {'wire B/step':>12} {'exposed s':>9} "
           f"{'eval end':>8} {'eval@T':>7}")
    lines = [hdr, "-" * len(hdr)]
    for r in records:
        label = r["label"]
        lines.append(f"{label:<22} {r['tokens_per_s']:8.0f} {f(r['speedup_vs_fsdp'], '.2f', 'x'):>7} "
                     f"{f(r['speedup_vs_hsdp'], '.2f', 'x'):>7} {r['step_time_s']:7.3f} "
                     f"{r['predicted_step_time_s']:7.3f} "
                     f"{100 * r['prediction_error']:+5.0f}% {r['internode_bytes_per_step']:17.3e} "
                     f"{r['intergroup_bytes_per_step']:18.3e} {f(r['wire_tx_bytes_per_rank_step'], '12.3e')} "
                     f"{r['exposed_comm_s']:9.3f} {f(r['eval_loss'], '8.4f')} "
                     f"{f(r['eval_loss_at_equal_time'], '7.4f')}")
    if records:
        lines.append(f"eval@T: eval loss at the shortest run's wall time T = {records[0]['equal_time_s']:.1f} s "
                     "(linear between evaluations); wire B/step: bytes the nodes' shaped interfaces sent "
                     "(kernel counters) per rank and step, including evaluation and start-up")
    return "\n".join(lines)


def plot(records: list[dict[str, Any]], results: list[RunResult], out: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for i, (rec, r) in enumerate(zip(records, results)):
        ev = [(x["time_s"], x["eval_loss"]) for x in r.steps if x.get("eval_loss") is not None]
        if ev:
            ax.plot(*zip(*ev), "o-", color=f"C{i}", ms=4, label=f"{r.spec.label()} ({rec['tokens_per_s']:.0f} tok/s)")
    ax.axvline(records[0]["equal_time_s"], color="grey", ls=":", lw=1)
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("eval loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--launcher", choices=("emulated", "torchrun"), default="emulated")
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--rate", default="100mbit", help="inter-node rate per node (emulated)")
    p.add_argument("--runs", nargs="+", default=list(DEFAULT_RUNS), help="run specs (see above)")
    p.add_argument("--model", default="small")
    p.add_argument("--steps", type=int, default=40, help="warm-up plus a multiple of E")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=8)
    p.add_argument("--eval-batches", type=int, default=2)
    p.add_argument("--warmup", type=int, default=8, help="steps left out of the timing (E: skips the first exchange)")
    p.add_argument("--measure-mb", type=float, default=4.0)
    p.add_argument("--backend", default="gloo")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per launched run")
    p.add_argument("--out-dir", default=None, help="metrics and logs (default: a temp dir)")
    p.add_argument("--json", default=None)
    p.add_argument("--png", default=None)
    p.add_argument("--reanalyse", metavar="OUT_DIR", default=None,
                   help="skip running: analyse the runs recorded in OUT_DIR/runs.json again")
    p.add_argument("--driver-extra", nargs=argparse.REMAINDER, default=[],
                   help="further flags for python -m flcomm.train (last)")
    a = p.parse_args(argv)
    try:
        specs = [RunSpec.parse(s) for s in a.runs]
    except ValueError as e:
        p.error(str(e))
    out_dir = a.out_dir or tempfile.mkdtemp(prefix="flcomm-strategies-")
    os.makedirs(out_dir, exist_ok=True)

    def log(s: str) -> None:
        print(s, file=sys.stderr, flush=True)

    try:
        if a.reanalyse:
            got = load_runs(a.reanalyse, a)
        elif a.launcher == "emulated":
            got = run_emulated(a, specs, out_dir, log)
        else:
            got = run_torchrun(a, specs, out_dir, log)
            if got is None:
                return 0
    except PermissionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 77
    measured, results, compute_s = got
    if not a.reanalyse:
        save_runs(out_dir, a, got)
    records = analyse(a, measured, results, compute_s)
    print(format_table(records))
    print(f"links probed: intra {measured['intra_node']['bandwidth_Bps'] * 8 / 1e6:.0f} Mbit/s per rank, "
          f"inter-node {measured['inter_node']['bandwidth_Bps'] * 8 / 1e6:.1f} Mbit/s per node; "
          f"compute {compute_s:.3f} s/step (calibration run); metrics in {out_dir}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"measured": measured, "records": records}, f, indent=2)
    if a.png:
        plot(records, results, a.png, f"{a.model}, {a.nodes} nodes x {a.ranks_per_node} ranks, {a.rate} between nodes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
