"""How much of the FedAvg exchange the progress engine hides: compute-only, blocking and
overlapped steps, measured side by side in one run.

Per codec, every rank runs the same training loop (FL+FSDP, the reference Transformer, random
tokens) in two parts:

1. blocking: ``FedAvg(overlap_steps=0)``; the blocking exchange time is FedAvg's exposed time per
   sync (the loop waits for all of it);
2. compute only and overlap in turns, on one model: blocks of ``(B + 1) * E`` steps (B =
   ``--block-syncs``) without FedAvg and with ``FedAvg(overlap_steps=k)`` (``auto``, the default:
   the warm-up blocks run until FedAvg has chosen k, and the table shows its choice), C O C O
   ... C, ``--repeat`` overlapped blocks. An overlapped block ends with ``finish()``, untimed, so
   the exchange its last step starts does not reach into the next block; the exchanges applied
   within the block (B per block with one fragment) are what it measured. Its extra time over
   the mean of the compute blocks right before and after, per exchange, is the exposed time.

Why blocks of one model: per-step times on a shared 2-core machine scatter by about 10% and the
machine's speed drifts over tens of seconds, more than the 10% target of the issue is of an int8
exchange per step. Side by side in blocks of a few seconds, the drift cancels to first order
(phases of separate runs, compared before, mostly measured the drift), and the rows give the
mean over the overlapped blocks with its standard error.

Columns: mean step time of compute only (the compute blocks), of blocking, and of overlap (compute
plus the exposed time of one exchange per E / K steps, as in steady training), the blocking
exchange per sync, ``exposed`` = the exposed time per exchange / the blocking exchange (the
issue's E * (overlap step - compute step) / exchange), FedAvg's own exposed time per exchange as
a fraction of the blocking exchange (the loop's waiting; the rest of ``exposed`` is the
exchange's work slowing compute down), ``cpu/xchg`` = the CPU seconds one exchange adds to a
rank's process (all its threads: the engine's, gloo's, the kernel's work for its sockets; the
overlapped block's CPU time less its steps' compute-only CPU time, mean over ranks), and overlap
step / compute step. ``fits`` says whether
the exchange is shorter than k compute steps (where the targets apply: exposed <= 10%, overlap
<= 1.05x compute). The starts of the blocks' last exchanges are timed but their exchanges are
not: that errs toward more exposed time.

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
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from flcomm.federated.config import AUTO, parse_overlap_steps
from flcomm.federated.mesh import init_fed_mesh

AUTO_WARMUP_BLOCKS = 6  # overlapped warm-up blocks at most, until "auto" has chosen


def _build(a: argparse.Namespace, mesh: Any, codec: str, overlap: bool) -> tuple[Any, ...]:
    """The model (sharded), its optimizer, its FedAvg and a token source (the compute-only steps
    run the same model without ``fed.step()``)."""
    from flcomm.federated.fedavg import FedAvg
    from flcomm.train.model import build_model, get_config
    from flcomm.train.run import shard_model

    model = build_model(get_config(a.model, dim=a.model_dim) if a.model_dim else a.model, seed=a.seed)
    shard_model(model, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fed = FedAvg(model, mesh, sync_every=a.sync_every, codec=codec, error_feedback=codec != "none",
                 overlap_steps=a.overlap_steps if overlap else 0, bucket_cap_mb=a.bucket_mb, fragments=a.fragments)
    g = torch.Generator().manual_seed(a.seed * 1000 + mesh.rank)
    vocab = model.cfg.vocab_size if hasattr(model, "cfg") else 256
    return model, opt, fed, lambda: torch.randint(0, vocab, (a.batch_size, a.seq_len + 1), generator=g)


def _steps(model: Any, opt: Any, fed: Any, tokens: Any, n: int) -> tuple[float, float]:
    """``n`` training steps (with ``fed.step()`` after each when ``fed`` is given): their total
    time on this rank, and the process's CPU seconds over them (all its threads)."""
    from flcomm.train.model import lm_loss

    total, cpu0 = 0.0, time.process_time()
    for _ in range(n):
        tok = tokens()
        t0 = time.perf_counter()
        loss = lm_loss(model(tok[:, :-1]), tok[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if fed is not None:
            fed.step()
        total += time.perf_counter() - t0
    return total, time.process_time() - cpu0


def _blocking(a: argparse.Namespace, mesh: Any, codec: str) -> dict[str, float]:
    """The blocking phase: mean step time after the warm-up, and the exchange per sync (FedAvg's
    exposed time: the loop waits for all of it)."""
    model, opt, fed, tokens = _build(a, mesh, codec, overlap=False)
    _steps(model, opt, fed, tokens, a.warmup)
    fed.finish()
    exposed0, syncs0 = fed.exposed_comm_s, fed.num_syncs
    step = _steps(model, opt, fed, tokens, a.steps)[0] / a.steps
    return {"step_s": _slowest(step),
            "exchange_s": _slowest((fed.exposed_comm_s - exposed0) / max(1, fed.num_syncs - syncs0))}


def _interleaved(a: argparse.Namespace, mesh: Any, codec: str) -> list[dict[str, float]]:
    """Compute-only and overlapped blocks of one model in turns, C O C O ... C (module
    docstring): per overlapped block, its time, the mean of the compute blocks around it, the
    exchanges applied within it and FedAvg's exposed time (each the slowest rank's)."""
    model, opt, fed, tokens = _build(a, mesh, codec, overlap=True)
    n = (a.block_syncs + 1) * a.sync_every

    def overlapped() -> dict[str, float]:
        exposed0, syncs0 = fed.exposed_comm_s, fed.num_syncs
        t, cpu = _steps(model, opt, fed, tokens, n)
        out = {"time_s": _slowest(t), "applied": fed.num_syncs - syncs0,
               "fedavg_s": _slowest(fed.exposed_comm_s - exposed0), "cpu_s": _mean(cpu)}
        fed.finish()  # NOTE: untimed: the block's last start does not reach into the next block
        return out

    _steps(model, opt, None, tokens, a.warmup)
    overlapped()  # NOTE: warm-up: the first exchange allocates its staging and plans
    for _ in range(AUTO_WARMUP_BLOCKS):  # NOTE: overlap_steps "auto": until it has chosen its k
        if fed.auto_overlap is None or fed.auto_overlap.chosen is not None:
            break
        overlapped()
    computes, cpus = [], []

    def compute_only() -> None:
        t, cpu = _steps(model, opt, None, tokens, n)
        computes.append(_slowest(t))
        cpus.append(_mean(cpu))

    compute_only()
    blocks = []
    for _ in range(a.repeat):
        o = overlapped()
        compute_only()
        blocks.append({**o, "k": fed.overlap_steps, "compute_step_s": (computes[-2] + computes[-1]) / (2 * n),
                       "compute_cpu_step_s": (cpus[-2] + cpus[-1]) / (2 * n),
                       "compute_around_s": [computes[-2] / n, computes[-1] / n], "steps": n})
    return blocks


def _reduced(x: float, op: Any) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=op)
    return float(t)


def _slowest(x: float) -> float:
    return _reduced(x, dist.ReduceOp.MAX)


def _mean(x: float) -> float:
    return _reduced(x, dist.ReduceOp.SUM) / dist.get_world_size()


def rank_main(a: argparse.Namespace) -> list[dict[str, Any]]:
    from flcomm.federated.strategy import Strategy

    dist.init_process_group("gloo", timeout=timedelta(seconds=a.timeout))
    world = dist.get_world_size()
    torch.set_num_threads(a.threads)
    topo = Strategy.FL_FSDP.topology(world, a.ranks_per_node, group_size=a.group_size)
    mesh = init_fed_mesh(topo, "cpu", timeout=timedelta(seconds=a.timeout), node_tiers=False)
    records = _measure(a, mesh)
    dist.destroy_process_group()
    return records


def _measure(a: argparse.Namespace, mesh: Any) -> list[dict[str, Any]]:
    """Per codec: the blocking phase, then the interleaved blocks (module docstring)."""
    return [summarize(a, codec, _blocking(a, mesh, codec), _interleaved(a, mesh, codec)) for codec in a.codecs]


def summarize(a: argparse.Namespace, codec: str, blk: dict[str, float],
              blocks: list[dict[str, float]]) -> dict[str, Any]:
    """One codec's row from its blocking phase and its overlapped blocks (module docstring)."""
    exchange = blk["exchange_s"]
    k = blocks[-1].get("k", a.overlap_steps)  # NOTE: "auto": FedAvg's choice
    reps = []
    for b in blocks:
        # NOTE: the compute-only time of the block's steps is taken out, the rest is spread over
        # the exchanges applied within it (one per E / K steps in steady training)
        applied = max(1, b["applied"])
        per_exchange = (b["time_s"] - b["steps"] * b["compute_step_s"]) / applied
        cpu = (b["cpu_s"] - b["steps"] * b["compute_cpu_step_s"]) / applied
        reps.append({**b, "overhead_per_exchange_s": per_exchange, "cpu_per_exchange_s": cpu,
                     "exposed_fraction": per_exchange / exchange if exchange > 0 else 0.0,
                     "fedavg_exposed_fraction": b["fedavg_s"] / applied / exchange if exchange > 0 else 0.0})
    mean = {k: statistics.fmean(r[k] for r in reps)
            for k in ("compute_step_s", "overhead_per_exchange_s", "exposed_fraction", "fedavg_exposed_fraction",
                      "cpu_per_exchange_s")}
    overlap_step = mean["compute_step_s"] + mean["overhead_per_exchange_s"] * a.fragments / a.sync_every
    return {
        "codec": codec + ("+ef" if codec != "none" else ""), "E": a.sync_every, "k": k,
        "k_asked": a.overlap_steps,
        "K": a.fragments, **mean, "overlap_step_s": overlap_step, "blocking_step_s": blk["step_s"],
        "blocking_exchange_s": exchange,
        "exposed_fraction_se": statistics.stdev(r["exposed_fraction"] for r in reps) / len(reps) ** 0.5
        if len(reps) > 1 else float("nan"),
        "overlap_vs_compute": overlap_step / mean["compute_step_s"],
        "overlap_vs_blocking": overlap_step / blk["step_s"],
        "fits": exchange <= k * mean["compute_step_s"],  # per exchange (one fragment's)
        "repeats": reps,
    }


def format_table(records: list[dict[str, Any]], a: argparse.Namespace) -> str:
    head = (f"{'codec':>8} {'E':>3} {'k':>3} {'compute':>9} {'blocking':>9} {'overlap':>9} {'exchange':>9} "
            f"{'exposed':>13} {'fedavg':>8} {'cpu/xchg':>9} {'ovl/cmp':>8} {'ovl/blk':>8} {'fits':>5}")
    rows = [head, "-" * len(head)]
    for r in records:
        exposed = f"{r['exposed_fraction']:.3f}" + (f"+-{r['exposed_fraction_se']:.3f}" if a.repeat > 1 else "")
        rows.append(f"{r['codec']:>8} {r['E']:>3} {r['k']:>3} {r['compute_step_s']:9.3f} {r['blocking_step_s']:9.3f} "
                    f"{r['overlap_step_s']:9.3f} {r['blocking_exchange_s']:9.3f} {exposed:>13} "
                    f"{r['fedavg_exposed_fraction']:8.2f} {r['cpu_per_exchange_s']:9.3f} "
                    f"{r['overlap_vs_compute']:8.3f} {r['overlap_vs_blocking']:8.3f} {str(r['fits']):>5}")
    rows.append(f"(seconds, slowest rank; exchange per sync; exposed: mean +- standard error over {a.repeat} "
                "overlapped blocks, each: "
                + "; ".join(f"{r['codec']} " + ", ".join(f"{x['exposed_fraction']:.2f}" for x in r["repeats"])
                            for r in records) + ")")
    return "\n".join(rows)


def _own_argv(a: argparse.Namespace) -> list[str]:
    argv = [sys.executable, "-m", "bench.overlap", "--ranks-per-node", str(a.ranks_per_node),
            "--group-size", str(a.group_size), "--sync-every", str(a.sync_every),
            "--overlap-steps", str(a.overlap_steps), "--fragments", str(a.fragments), "--model", a.model,
            "--batch-size", str(a.batch_size), "--seq-len", str(a.seq_len), "--steps", str(a.steps),
            "--warmup", str(a.warmup), "--bucket-mb", str(a.bucket_mb), "--seed", str(a.seed),
            "--threads", str(a.threads), "--timeout", str(a.timeout), "--repeat", str(a.repeat),
            "--block-syncs", str(a.block_syncs),
            "--codecs", *a.codecs]
    if a.model_dim:
        argv += ["--model-dim", str(a.model_dim)]
    if a.json:
        argv += ["--json", os.path.abspath(a.json)]
    return argv


def launch_local(a: argparse.Namespace) -> int:
    from bench.common import free_port, wait_ranks

    port = free_port()
    procs = []
    for r in range(a.nproc):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(a.nproc), LOCAL_RANK=str(r % a.ranks_per_node),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen(_own_argv(a), env=env))
    return max(wait_ranks(procs, a.timeout + 120))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=0, help="launch this many local processes (gloo)")
    p.add_argument("--emulated", action="store_true", help="launch on the emulated cluster (root)")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--rate", default="100mbit")
    p.add_argument("--pin", action="store_true", help="emulated: each node's ranks on the node's own CPUs")
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--group-size", type=int, default=2)
    p.add_argument("--sync-every", type=int, default=4)
    p.add_argument("--overlap-steps", type=parse_overlap_steps, default=AUTO,
                   help="k of the overlapped blocks, or auto (FedAvg measures it; the table's k is its choice)")
    p.add_argument("--fragments", type=int, default=1, help="streaming fragments K (divides E)")
    p.add_argument("--codecs", nargs="+", default=["none", "int8"])
    p.add_argument("--model", default="small")
    p.add_argument("--model-dim", type=int, default=0, help="override the preset's width")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=12, help="timed steps of the blocking phase (a multiple of E)")
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--bucket-mb", type=float, default=4.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="compute intra-op threads per rank")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--repeat", type=int, default=6,
                   help="overlapped blocks per codec, each between two compute-only blocks (rows: the mean)")
    p.add_argument("--block-syncs", type=int, default=2,
                   help="B: exchanges per overlapped block of (B + 1) * E steps")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    for name in ("repeat", "block_syncs", "steps"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        records = rank_main(a)
        if int(os.environ["RANK"]) == 0:
            print(format_table(records, a), flush=True)
            if a.json:
                with open(a.json, "w") as f:
                    json.dump({"config": vars(a), "records": records}, f, indent=1)
        return 0
    if a.emulated:
        cmd = [sys.executable, "-m", "bench.cluster.netns", "run", *(["--pin"] if a.pin else []),
               "--nodes", str(a.nodes), "--ranks-per-node", str(a.ranks_per_node), "--rate", a.rate,
               "--", *_own_argv(a)]
        return subprocess.call(cmd)
    if a.nproc < 1:
        p.error("give --nproc N (local processes), --emulated, or run under torchrun")
    return launch_local(a)


if __name__ == "__main__":
    sys.exit(main())
