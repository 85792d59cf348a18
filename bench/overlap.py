"""How much of the FedAvg exchange the progress engine hides: compute-only, blocking and
overlapped steps, measured side by side in one run.

Per codec, every rank runs three phases of the same training loop (FL+FSDP, the reference
Transformer, random tokens):

1. compute only: no FedAvg (the groups train on their own);
2. blocking: ``FedAvg(overlap=False)``; the blocking exchange time is FedAvg's exposed time
   per sync (the loop waits for all of it);
3. overlap: ``FedAvg(overlap=True, overlap_steps=k)``.

Columns: mean step time of each phase (after the warm-up steps, the slowest rank; compute
only runs first and last, and the faster of the two counts), the
blocking exchange per sync, ``exposed`` = E * (overlap step - compute step) / blocking exchange
(the issue's definition per sync period), FedAvg's own exposed time under overlap per sync
applied within the timed steps as a fraction of the blocking exchange (the loop's waiting; the
rest of ``exposed`` is the exchange's own work slowing compute down), and overlap step /
compute step. ``fits`` says whether the exchange is
shorter than k compute steps (where the targets apply: exposed <= 10%, overlap <= 1.05x compute).

Usage::

    # local processes on gloo (no shaping)
    python -m bench.overlap --nproc 4 --ranks-per-node 2 --group-size 2 --sync-every 4
    # the emulated two-tier cluster (root; 100 Mbit/s between nodes)
    python -m bench.overlap --emulated --nodes 2 --ranks-per-node 2 --rate 100mbit \\
        --group-size 2 --sync-every 4 --batch-size 2 --json overlap.json
    # under any launcher that sets RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT (torchrun)
    torchrun --nproc-per-node 4 -m bench.overlap --group-size 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


def _phase(a: argparse.Namespace, mesh: Any, codec: str, mode: str) -> dict[str, float]:
    """One phase on this rank: mean step time after the warm-up, and FedAvg's exposed time and
    syncs within the timed window."""
    from flcomm.federated.fedavg import FedAvg
    from flcomm.train.driver import shard_model
    from flcomm.train.model import build_model, lm_loss

    model = build_model(a.model, seed=a.seed)
    if a.model_dim:
        from flcomm.train.model import get_config

        model = build_model(get_config(a.model, dim=a.model_dim), seed=a.seed)
    shard_model(model, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fed = None
    if mode != "compute":
        fed = FedAvg(model, mesh, sync_every=a.sync_every, codec=codec, error_feedback=codec != "none",
                     overlap=mode == "overlap", overlap_steps=a.overlap_steps, bucket_mb=a.bucket_mb,
                     fragments=a.fragments)
    g = torch.Generator().manual_seed(a.seed * 1000 + mesh.rank)
    vocab = model.cfg.vocab_size if hasattr(model, "cfg") else 256
    times: list[float] = []
    exposed0 = syncs0 = 0.0
    for step in range(1, a.warmup + a.steps + 1):
        if step == a.warmup + 1 and fed is not None:
            fed.finish()
            exposed0, syncs0 = fed.exposed_comm_s, fed.num_syncs
        tok = torch.randint(0, vocab, (a.batch_size, a.seq_len + 1), generator=g)
        t0 = time.perf_counter()
        loss = lm_loss(model(tok[:, :-1]), tok[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if fed is not None:
            fed.step()
        if step > a.warmup:
            times.append(time.perf_counter() - t0)
    out = {"step_s": sum(times) / len(times)}
    if fed is not None:
        # NOTE: the syncs applied within the timed steps; a round still in flight at the end is
        # applied by finish() at once, without the compute it would overlap with: left out
        out["exposed_s"] = fed.exposed_comm_s - exposed0
        out["syncs"] = fed.num_syncs - syncs0
        t0 = time.perf_counter()
        fed.finish()
        out["finish_s"] = time.perf_counter() - t0
    return out


def _slowest(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def rank_main(a: argparse.Namespace) -> list[dict[str, Any]]:
    from flcomm.federated.topology import Topology

    dist.init_process_group("gloo", timeout=timedelta(seconds=a.timeout))
    world = dist.get_world_size()
    torch.set_num_threads(a.threads)
    topo = Topology.fl_fsdp(world, a.ranks_per_node, group_size=a.group_size)
    mesh = topo.build("cpu", timeout=timedelta(seconds=a.timeout), hierarchical=False)
    reps = [_measure(a, mesh) for _ in range(a.repeat)]
    dist.destroy_process_group()
    if a.repeat == 1:
        return reps[0]
    # NOTE: per codec, the repetition with the median exposed fraction (a whole, consistent row)
    out = []
    for i in range(len(a.codecs)):
        rows = sorted((rep[i] for rep in reps), key=lambda r: r["exposed_fraction"])
        med = dict(rows[len(rows) // 2])
        med["repeats"] = [{k: r[k] for k in ("exposed_fraction", "overlap_vs_compute", "overlap_vs_blocking")}
                          for r in (rep[i] for rep in reps)]
        out.append(med)
    return out


def _measure(a: argparse.Namespace, mesh: Any) -> list[dict[str, Any]]:
    """One repetition: compute only, then blocking and overlap per codec, then compute only."""
    records = []
    # NOTE: compute-only runs first and last (the machine may be shared): the faster counts
    first = _slowest(_phase(a, mesh, "none", "compute")["step_s"])
    phases = {}
    for codec in a.codecs:
        phases[codec] = (_phase(a, mesh, codec, "blocking"), _phase(a, mesh, codec, "overlap"))
    last = _slowest(_phase(a, mesh, "none", "compute")["step_s"])
    compute = min(first, last)
    for codec in a.codecs:
        blk, ovl = phases[codec]
        blocking_step = _slowest(blk["step_s"])
        exchange = _slowest(blk["exposed_s"] / max(1, blk["syncs"]))
        overlap_step = _slowest(ovl["step_s"])
        ovl_exposed = _slowest(ovl["exposed_s"] / max(1, ovl["syncs"]))
        E, k = a.sync_every, a.overlap_steps
        records.append({
            "codec": codec + ("+ef" if codec != "none" else ""), "E": E, "k": k, "K": a.fragments,
            "compute_step_s": compute, "compute_first_last_s": [first, last],
            "blocking_step_s": blocking_step, "overlap_step_s": overlap_step,
            "blocking_exchange_s": exchange,
            # NOTE: with K fragments there are K exchanges (of 1/K each) per E steps
            "exposed_fraction": E * (overlap_step - compute) / (a.fragments * exchange) if exchange > 0 else 0.0,
            "fedavg_exposed_fraction": ovl_exposed / exchange if exchange > 0 else 0.0,
            "overlap_vs_compute": overlap_step / compute,
            "overlap_vs_blocking": overlap_step / blocking_step,
            "fits": exchange <= k * compute,  # per exchange (one fragment's)
        })
    return records


def format_table(records: list[dict[str, Any]], a: argparse.Namespace) -> str:
    head = (f"{'codec':>8} {'E':>3} {'k':>3} {'compute':>9} {'blocking':>9} {'overlap':>9} {'exchange':>9} "
            f"{'exposed':>8} {'fedavg':>8} {'ovl/cmp':>8} {'ovl/blk':>8} {'fits':>5}")
    rows = [head, "-" * len(head)]
    for r in records:
        rows.append(f"{r['codec']:>8} {r['E']:>3} {r['k']:>3} {r['compute_step_s']:9.3f} {r['blocking_step_s']:9.3f} "
                    f"{r['overlap_step_s']:9.3f} {r['blocking_exchange_s']:9.3f} {r['exposed_fraction']:8.2f} "
                    f"{r['fedavg_exposed_fraction']:8.2f} {r['overlap_vs_compute']:8.3f} "
                    f"{r['overlap_vs_blocking']:8.3f} {str(r['fits']):>5}")
    rows.append("(seconds; step times are means over the timed steps, slowest rank; exchange per sync"
                + (f"; each row the median of {a.repeat} repetitions by exposed fraction, all of them: "
                   + "; ".join(f"{r['codec']} " + ", ".join(f"{x['exposed_fraction']:.2f}" for x in r["repeats"])
                               for r in records) if a.repeat > 1 else "") + ")")
    return "\n".join(rows)


def _own_argv(a: argparse.Namespace) -> list[str]:
    argv = [sys.executable, "-m", "bench.overlap", "--ranks-per-node", str(a.ranks_per_node),
            "--group-size", str(a.group_size), "--sync-every", str(a.sync_every),
            "--overlap-steps", str(a.overlap_steps), "--fragments", str(a.fragments), "--model", a.model,
            "--batch-size", str(a.batch_size), "--seq-len", str(a.seq_len), "--steps", str(a.steps),
            "--warmup", str(a.warmup), "--bucket-mb", str(a.bucket_mb), "--seed", str(a.seed),
            "--threads", str(a.threads), "--timeout", str(a.timeout), "--repeat", str(a.repeat),
            "--codecs", *a.codecs]
    if a.model_dim:
        argv += ["--model-dim", str(a.model_dim)]
    if a.json:
        argv += ["--json", os.path.abspath(a.json)]
    return argv


def launch_local(a: argparse.Namespace) -> int:
    from bench.common import free_port

    port = free_port()
    procs = []
    for r in range(a.nproc):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(a.nproc), LOCAL_RANK=str(r % a.ranks_per_node),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen(_own_argv(a), env=env))
    try:
        rcs = [p.wait(timeout=a.timeout + 120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return max(rcs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=0, help="launch this many local processes (gloo)")
    p.add_argument("--emulated", action="store_true", help="launch on the emulated cluster (root)")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--rate", default="100mbit")
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--group-size", type=int, default=2)
    p.add_argument("--sync-every", type=int, default=4)
    p.add_argument("--overlap-steps", type=int, default=1)
    p.add_argument("--fragments", type=int, default=1, help="streaming fragments K (divides E)")
    p.add_argument("--codecs", nargs="+", default=["none", "int8"])
    p.add_argument("--model", default="small")
    p.add_argument("--model-dim", type=int, default=0, help="override the preset's width")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=12, help="timed steps per phase (a multiple of E)")
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--bucket-mb", type=float, default=4.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="compute intra-op threads per rank")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--repeat", type=int, default=1,
                   help="repeat the whole measurement N times; each codec's row is the median repetition")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        records = rank_main(a)
        if int(os.environ["RANK"]) == 0:
            print(format_table(records, a), flush=True)
            if a.json:
                with open(a.json, "w") as f:
                    json.dump({"config": vars(a), "records": records}, f, indent=1)
        return 0
    if a.emulated:
        cmd = [sys.executable, "-m", "bench.cluster.netns", "run", "--nodes", str(a.nodes),
               "--ranks-per-node", str(a.ranks_per_node), "--rate", a.rate, "--", *_own_argv(a)]
        return subprocess.call(cmd)
    if a.nproc < 1:
        p.error("give --nproc N (local processes), --emulated, or run under torchrun")
    return launch_local(a)


if __name__ == "__main__":
    sys.exit(main())
