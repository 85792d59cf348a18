"""A slow federation group, by steps and by time: FedAvg(sync_every=E) against
FedAvg(sync_period_s=T), measured side by side in one run.

W ranks (``--ranks``, default 8) as F federation groups (``--groups``, default 4) of G = W / F
ranks, FL+FSDP: an MLP (``--dim``, ``--layers`` residual blocks of Linear + GELU) with FSDP2
``fully_shard`` per block and on the root over the group's "shard" mesh, synthetic regression
(a fixed random teacher MLP plus noise; each rank draws its own inputs), MSE loss, AdamW. A
"token" here is one sample: ``fed.step(tokens=batch)``.

The pacing floor (as bench/recovery.py's ``--min-step-s``): every rank sleeps so that its step
(forward, backward, optimizer step; not ``fed.step()``) lasts at least ``--step-s`` seconds, and
``slow x --step-s`` on the ranks of the slow group (``--slow-group``, default the last). The
floor is the device's compute; ``fed.step()`` comes on top of it, so waiting at a sync is not
hidden inside the floor.

Rows, each a separate launch of the W ranks, in this order: ``no slow group, by steps``
(``sync_every=E``), ``no slow group, by time`` (``sync_period_s = E x step_s``), then per slow
factor s of ``--slow`` (default ``1.5,3``) ``slow xs, by steps`` and ``slow xs, by time``. Every
row runs R rounds (``--rounds``): by steps R x E steps, by time ``while fed.schedule.events < R``;
then ``fed.finish()``. ``--overlap-steps k`` (default 0: blocking) for every row.

Measured per row (every rank writes a JSON file; the launcher reduces them):

* ``wall s``: the last rank's end (after ``finish()`` and the final evaluation) less the first
  rank's start (a world barrier after FedAvg's construction; by time the deadlines count from
  there: the bench sets the schedule's t0 to the ranks' latest start, since FedAvg agrees on it
  at construction, before its warm-up exchange, which on a loaded machine can be periods
  earlier);
* ``job tok/s``: all ranks' tokens / wall; per group, its ranks' tokens / wall;
* ``step s``: per group, the mean of its ranks' floored steps (what the cost model takes);
* ``wait s``: per group, the seconds inside ``fed.step()`` over the run (the max over its ranks):
  the exchange and, by steps, the wait for the slowest group at each sync (the blocking
  exchange waits there); by time also the per-step group all-reduce of the timed rule;
* ``exposed s``: per group, ``fed.exposed_comm_s`` at the end (max over its ranks);
* ``fed B/rnd``: bytes one rank sent on the fed dim (the mesh's ``CommStats``, tier
  ``inter_group``, ring convention: what flcomm's transports count at issue; the timed mode's
  2 x F tallies included), from after FedAvg's construction (its warm-up exchange excluded) to
  the end, per round, mean over ranks;
* ``--warmup-steps`` (default 2) local steps run before FedAvg is built (FSDP's lazy init, AdamW's
  state), untimed; right after FedAvg's construction (group 0's model on every group) the first
  record: (0 s, 0 tokens, the loss of the held-out batch), the curves' common start;
* after every apply (``fed.num_syncs`` went up in ``fed.step()``) every group evaluates its model on
  one held-out batch (the same for every row and rank; symmetric, so no group alone pauses);
  group 0's rank 0 records (wall time since start, job tokens at the round's start, loss).
  Blocking, the model is then the round's average. With overlap k it is the average plus the
  k local steps made while the exchange ran. Job tokens at a round: by steps W x batch x the
  sync step; by time the sum of ``fed.schedule.rounds``' per-group tokens up to that round;
* ``eval end``: group 0's loss after ``finish()`` (the last round's average, blocking);
* ``pred tok/s``: ``flcomm.costmodel.stragglers.predict_pacing`` with the row's measured mean step
  time per group, ``tokens_per_step = G x batch`` and ``exposed_s`` = the exchange's blocking
  time per round, taken from the first row (no slow group, by steps: every group arrives at the
  same time, so its exposed time per round is the exchange alone; with overlap, 0).

Then, side by side (rows of one run, one machine state):

(a) per slow factor: by time, slow vs no slow, job tokens/s, and the fast groups' tokens/s
    (target: the fast groups lose at most 5%);
(b) per slow factor: by time vs by steps, job tokens/s;
(c) no slow group: by time vs by steps, job tokens/s (target: within 2%) and the final loss;
(d) per row pair: eval loss at equal wall time (the records interpolated linearly at the
    smaller of the two rows' last record times) and at equal job tokens, by time vs by steps.

The load average is printed before and after; figures are labelled "under load" when the
1-minute load was 1 or more before the run. ``--png PATH`` (or ``--out DIR``) plots eval loss
against wall time (matplotlib); ``--out DIR`` writes a results file in bench/results' style,
the PNG and the rows as JSON.

Ranks are local processes on plain loopback gloo, started as bench/overlap.py's ``--nproc`` does
(environment RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT, one process per rank); no network
namespaces, no root. There is no ``--emulated`` (shaped links) mode and no torchft row.

Usage::

    python -m bench.stragglers                                  # 8 ranks, 4 groups, slow 1.5 and 3
    python -m bench.stragglers --ranks 4 --groups 2 --rounds 3 --sync-every 4 --step-s 0.02 --slow 1.5
    python -m bench.stragglers --overlap-steps 1 --out bench/results
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timedelta, timezone
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # `python bench/stragglers.py` from anywhere
    sys.path.insert(0, ROOT)

FAST_LOSS_TARGET = 0.05  # (a): the fast groups lose at most 5% of their tokens/s to a slow group, by time
EQUAL_TARGET = 0.02  # (c): with no slow group, by time is within 2% of by steps


# ---------------------------------------------------------------- pure helpers ----

def parse_slow(s: str) -> list[float]:
    """``--slow 1.5,3`` -> [1.5, 3.0]: slow factors, each >= 1."""
    out = []
    for part in s.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            v = float(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--slow: expected comma-separated numbers, got {s!r}") from None
        if not v >= 1.0 or v != v or v == float("inf"):
            raise argparse.ArgumentTypeError(f"--slow: every factor must be a finite number >= 1, got {part!r}")
        out.append(v)
    if not out:
        raise argparse.ArgumentTypeError(f"--slow: expected at least one factor, got {s!r}")
    return out


def plan_rows(slows: list[float]) -> list[dict[str, Any]]:
    """The rows, in order: no slow group by steps and by time, then each slow factor's pair."""
    rows = []
    for s in [1.0, *[x for x in slows if x != 1.0]]:
        for timed in (False, True):
            what = "no slow group" if s == 1.0 else f"slow x{s:g}"
            rows.append({"label": f"{what}, {'by time' if timed else 'by steps'}", "slow": s, "timed": timed})
    return rows


def interp(xs: list[float], ys: list[float], x: float) -> float | None:
    """``ys`` at ``x``, linear between the points (``xs`` increasing); None outside them."""
    if not xs or x < xs[0] or x > xs[-1]:
        return None
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return ys[-1]


def at_equal(a: list[dict], b: list[dict], key: str) -> tuple[float | None, float | None, float | None]:
    """Two rows' per-round records (dicts with ``key`` and ``loss``) at the smaller of their last
    ``key`` values: (that value, a's loss there, b's loss there)."""
    if not a or not b:
        return None, None, None
    x = min(a[-1][key], b[-1][key])
    return (x, interp([r[key] for r in a], [r["loss"] for r in a], x),
            interp([r[key] for r in b], [r["loss"] for r in b], x))


def reduce_row(ranks: list[dict], row: dict[str, Any], groups: int, rounds: int) -> dict[str, Any]:
    """One row's figures (module docstring) from its ranks' JSON records."""
    start, end = min(r["start"] for r in ranks), max(r["end"] for r in ranks)
    wall = end - start
    by_group: list[list[dict]] = [[r for r in ranks if r["group"] == g] for g in range(groups)]
    group_tokens = [sum(r["tokens"] for r in rs) for rs in by_group]
    rank0 = next(r for r in ranks if r["rank"] == 0)
    return {
        **row,
        "wall_s": wall,
        "job_tokens": sum(group_tokens),
        "job_tokens_per_s": sum(group_tokens) / wall,
        "group_tokens_per_s": [t / wall for t in group_tokens],
        "group_steps": [max(r["steps"] for r in rs) for rs in by_group],
        "group_step_s": [statistics.fmean(r["compute_s"] / r["steps"] for r in rs) for rs in by_group],
        "group_wait_s": [max(r["fed_step_s"] for r in rs) for rs in by_group],
        "group_exposed_s": [max(r["exposed_s"] for r in rs) for rs in by_group],
        "fed_bytes_per_round": statistics.fmean(r["fed_bytes"] for r in ranks) / rounds,
        "sync_events": rank0["sync_events"],
        "records": rank0["records"],
        "eval_end": rank0["final_loss"],
        "eval_spread": max(r["final_loss"] for r in ranks) - min(r["final_loss"] for r in ranks),
    }


def predict(row: dict[str, Any], a: argparse.Namespace, exposed_s: float) -> float:
    """The cost model's job tokens/s for the row's measured step times (module docstring)."""
    from flcomm.costmodel.stragglers import predict_pacing
    from flcomm.federated.config import FedAvgConfig

    kw = {"sync_period_s": a.sync_every * a.step_s} if row["timed"] else {"sync_every": a.sync_every}
    cfg = FedAvgConfig(overlap_steps=a.overlap_steps, **kw)
    G = a.ranks // a.groups
    try:
        return predict_pacing(cfg, row["group_step_s"], G * a.batch_size,
                              exposed_s=0.0 if a.overlap_steps else exposed_s).job_tokens_per_s
    except ValueError:
        return float("nan")


def ratios(rows: list[dict[str, Any]], slow_group: int) -> list[str]:
    """Lines (a)-(d) of the module docstring."""
    by = {(r["slow"], r["timed"]): r for r in rows}
    out = []
    base_t, base_s = by.get((1.0, True)), by.get((1.0, False))
    fast = [g for g in range(len(rows[0]["group_tokens_per_s"])) if g != slow_group] if rows else []
    for s in sorted({r["slow"] for r in rows if r["slow"] != 1.0}):
        t, st = by.get((s, True)), by.get((s, False))
        if t and base_t:
            fr = [t["group_tokens_per_s"][g] / base_t["group_tokens_per_s"][g] for g in fast]
            worst = min(fr)
            cut = 100 * (1 - worst)
            out.append(f"(a) slow x{s:g}, by time vs no slow group by time: job tok/s "
                       f"{t['job_tokens_per_s'] / base_t['job_tokens_per_s']:.3f}x; fast groups' tok/s "
                       + ", ".join(f"{x:.3f}x" for x in fr)
                       + (f" (the worst loses {cut:.1f}%" if cut > 0 else f" (none loses; the worst gains {-cut:.1f}%")
                       + f"; target: a loss of at most {100 * FAST_LOSS_TARGET:.0f}%: "
                       + ("met" if 1 - worst <= FAST_LOSS_TARGET else "NOT met") + ")")
        if t and st:
            out.append(f"(b) slow x{s:g}: by time vs by steps, job tok/s "
                       f"{t['job_tokens_per_s'] / st['job_tokens_per_s']:.3f}x "
                       f"({t['job_tokens_per_s']:.0f} vs {st['job_tokens_per_s']:.0f})")
    if base_t and base_s:
        q = base_t["job_tokens_per_s"] / base_s["job_tokens_per_s"]
        out.append(f"(c) no slow group: by time vs by steps, job tok/s {q:.3f}x (target within "
                   f"{100 * EQUAL_TARGET:.0f}%: {'met' if abs(q - 1) <= EQUAL_TARGET else 'NOT met'}); "
                   f"final eval loss {base_t['eval_end']:.4f} vs {base_s['eval_end']:.4f}")
    for s in sorted({r["slow"] for r in rows}):
        t, st = by.get((s, True)), by.get((s, False))
        if not (t and st):
            continue
        what = "no slow group" if s == 1.0 else f"slow x{s:g}"
        x, lt, ls = at_equal(t["records"], st["records"], "t")
        n, nt, ns = at_equal(t["records"], st["records"], "tokens")
        if x is not None and n is not None:
            out.append(f"(d) {what}: eval loss at equal wall time {x:.2f} s: by time {_f(lt)}, by steps {_f(ls)}; "
                       f"at equal job tokens {n:.0f}: by time {_f(nt)}, by steps {_f(ns)}")
    return out


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.4f}"


def format_table(rows: list[dict[str, Any]]) -> str:
    def lst(v: list[float], spec: str) -> str:
        return "/".join(format(x, spec) for x in v)

    head = (f"{'row':<24} {'wall s':>7} {'rounds':>6} {'job tok/s':>9} {'pred tok/s':>10} {'group tok/s':>23} "
            f"{'group step s':>23} {'group steps':>15} {'wait s':>23} {'exposed s':>23} {'fed B/rnd':>10} "
            f"{'eval end':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['label']:<24} {r['wall_s']:7.2f} {r['sync_events']:6d} {r['job_tokens_per_s']:9.0f} "
                     f"{r.get('pred_tokens_per_s', float('nan')):10.0f} {lst(r['group_tokens_per_s'], '.0f'):>23} "
                     f"{lst(r['group_step_s'], '.3f'):>23} {lst(r['group_steps'], 'd'):>15} "
                     f"{lst(r['group_wait_s'], '.2f'):>23} {lst(r['group_exposed_s'], '.2f'):>23} "
                     f"{r['fed_bytes_per_round']:10.3e} {r['eval_end']:8.4f}")
    lines.append("(per group: group 0/1/...; wait s: seconds inside fed.step(), max over the group's ranks; "
                 "fed B/rnd: bytes one rank sent on the fed dim per round, mean over ranks; eval end: group 0's; "
                 "largest spread of eval end over the ranks: "
                 + (f"{max(r['eval_spread'] for r in rows):.1e})" if rows else "-)"))
    return "\n".join(lines)


def uptime() -> str:
    """``uptime``'s line, or the load averages alone where it is missing (as bench/kernels.py)."""
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "load average: " + ", ".join(f"{v:.2f}" for v in os.getloadavg())


def plot(rows: list[dict[str, Any]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for i, r in enumerate(rows):
        xs = [x["t"] for x in r["records"]]
        ys = [x["loss"] for x in r["records"]]
        ax.plot(xs, ys, "o-" if r["timed"] else "s--", color=f"C{i // 2}", ms=4,
                label=f"{r['label']} ({r['job_tokens_per_s']:.0f} tok/s)")
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("eval loss (MSE, held-out batch)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT,
                              timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def results_markdown(a: argparse.Namespace, argv: list[str], load_before: str, load_after: str, table: str,
                     lines: list[str], png: str | None, under_load: bool) -> str:
    import torch

    date = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    G = a.ranks // a.groups
    out = [
        "# A slow federation group: syncing by steps against syncing by time",
        "",
        "`bench/stragglers.py`; the feature: [docs/stragglers.md](../../docs/stragglers.md).",
        "",
        "| | |",
        "|---|---|",
        f"| date | {date} |",
        f"| commit | `{git_commit()}` |",
        f"| torch | {torch.__version__} |",
        f"| machine | {os.cpu_count()}-core CPU, {a.ranks} local gloo ranks on loopback = {a.groups} groups x {G} |",
        f"| model | MLP dim {a.dim}, {a.layers} blocks, FL+FSDP (FSDP2 per block), AdamW, batch {a.batch_size}, "
        f"E = {a.sync_every}, T = {a.sync_every * a.step_s:g} s, R = {a.rounds}, k = {a.overlap_steps} |",
        f"| load average | before: {load_before}; after: {load_after}"
        + (" (under load: the 1-minute load was 1 or more)" if under_load else "") + " |",
        "",
        "```bash",
        "python -m bench.stragglers " + " ".join(shlex.quote(x) for x in argv),
        "```",
        "",
        "```",
        table,
        *lines,
        "```",
    ]
    if png:
        out += ["", f"![eval loss against wall time]({os.path.basename(png)})"]
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------- one rank ----

def _mlp(dim: int, layers: int, seed: int) -> Any:
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(dim, dim)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + torch.nn.functional.gelu(self.fc(x))

    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(dim, dim)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.out = nn.Linear(dim, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.inp(x)
            for b in self.blocks:
                h = b(h)
            return self.out(h)

    torch.manual_seed(seed)
    return MLP()


def schedule(fed: Any) -> Any:
    """FedAvg's sync schedule (its ``events``, ``rounds`` and, by time, ``t0``)."""
    return fed.schedule


def worker(a: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from flcomm.federated.fedavg import FedAvg
    from flcomm.federated.mesh import init_fed_mesh
    from flcomm.federated.strategy import Strategy

    torch.set_num_threads(a.threads)
    timeout = timedelta(seconds=a.timeout)
    dist.init_process_group("gloo", timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    G = world // a.groups
    topo = Strategy.FL_FSDP.topology(world, G, group_size=G)
    mesh = init_fed_mesh(topo, "cpu", timeout=timeout, node_tiers=False)
    group = mesh.coords.group
    model = _mlp(a.dim, a.layers, a.seed)
    for b in model.blocks:
        fully_shard(b, mesh=mesh.device_mesh["shard"])
    fully_shard(model, mesh=mesh.device_mesh["shard"])
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
    teacher = _mlp(a.dim, 1, a.seed + 7)  # NOTE: the same teacher and held-out batch on every rank and row
    for p in teacher.parameters():
        p.requires_grad_(False)
    held = torch.Generator().manual_seed(12345)
    ex = torch.randn(a.eval_size, a.dim, generator=held)
    ey = teacher(ex) + 0.01 * torch.randn(a.eval_size, 1, generator=held)
    gen = torch.Generator().manual_seed(a.seed * 1000 + rank + 1)
    floor = a.step_s * (a.slow if group == a.slow_group else 1.0)

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(a.batch_size, a.dim, generator=gen)
        with torch.no_grad():
            y = teacher(x) + 0.01 * torch.randn(a.batch_size, 1, generator=gen)
        return x, y

    @torch.no_grad()
    def eval_loss() -> float:
        return float(torch.nn.functional.mse_loss(model(ex), ey))

    for _ in range(a.warmup_steps):  # NOTE: FSDP's lazy init and AdamW's state, before FedAvg and the clock
        x, y = batch()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    sched = {"sync_period_s": a.sync_every * a.step_s} if a.timed else {"sync_every": a.sync_every}
    fed = FedAvg(model, mesh, inner_optimizer=opt, overlap_steps=a.overlap_steps, **sched)
    # NOTE: group 0's model on every group now (FedAvg's broadcast): the curves' common first point
    records: list[dict] = [{"t": 0.0, "tokens": 0, "loss": eval_loss(), "step": 0}]
    fed_bytes0 = mesh.stats.bytes("inter_group")
    steps = 0
    compute_s = fed_s = 0.0
    dist.barrier()
    start = time.time()
    if a.timed:
        # NOTE: FedAvg agrees on t0 at construction, before its warm-up exchange and this barrier (on a
        # loaded machine seconds before the loop, several periods T): its first events would then be
        # caught up one per step. The deadlines count from the loop's start instead, as in a run whose
        # loop follows the construction at once (FedAvg has no call for it: the schedule's t0 is set)
        t = torch.tensor([start], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        schedule(fed).t0 = float(t.item())
    sch = schedule(fed)
    while (sch.events < a.rounds) if a.timed else (steps < a.rounds * a.sync_every):
        t0 = time.perf_counter()
        x, y = batch()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        time.sleep(max(0.0, floor - (time.perf_counter() - t0)))  # NOTE: the pacing floor (module docstring)
        t1 = time.perf_counter()
        compute_s += t1 - t0
        applied = fed.num_syncs
        fed.step(tokens=a.batch_size)
        fed_s += time.perf_counter() - t1
        steps += 1
        if fed.num_syncs > applied:
            loss = eval_loss()  # NOTE: every group evaluates (FSDP: all of its ranks), so none alone pauses
            tokens = (sum(sum(r.tokens) for r in sch.rounds) if a.timed
                      else world * a.batch_size * (steps - a.overlap_steps))
            records.append({"t": time.time() - start, "tokens": tokens, "loss": loss, "step": steps})
    t_fin = time.perf_counter()
    fed.finish()
    fed_s += time.perf_counter() - t_fin
    final = eval_loss()
    end = time.time()
    if a.overlap_steps and len(records) - 1 < fed.num_syncs:  # NOTE: the last apply came in finish()
        tokens = sum(sum(r.tokens) for r in sch.rounds) if a.timed else world * a.batch_size * steps
        records.append({"t": end - start, "tokens": tokens, "loss": final, "step": steps})
    rec = {"rank": rank, "group": group, "steps": steps, "tokens": steps * a.batch_size, "compute_s": compute_s,
           "fed_step_s": fed_s, "exposed_s": fed.exposed_comm_s,
           "fed_bytes": mesh.stats.bytes("inter_group") - fed_bytes0, "sync_events": sch.events,
           "records": records, "final_loss": final, "start": start, "end": end}
    with open(os.path.join(a.out, f"rank{rank}.json"), "w") as f:
        json.dump(rec, f)
    dist.barrier()
    dist.destroy_process_group()
    return 0


# ---------------------------------------------------------------- the launcher ----

def _worker_argv(a: argparse.Namespace, row: dict[str, Any], out: str) -> list[str]:
    argv = [sys.executable, "-m", "bench.stragglers", "worker", "--groups", str(a.groups),
            "--slow", str(row["slow"]), "--slow-group", str(a.slow_group), "--sync-every", str(a.sync_every),
            "--step-s", str(a.step_s), "--rounds", str(a.rounds), "--overlap-steps", str(a.overlap_steps),
            "--batch-size", str(a.batch_size), "--dim", str(a.dim), "--layers", str(a.layers), "--lr", str(a.lr),
            "--seed", str(a.seed), "--eval-size", str(a.eval_size), "--warmup-steps", str(a.warmup_steps),
            "--threads", str(a.threads),
            "--timeout", str(a.timeout), "--out", out]
    return argv + (["--timed"] if row["timed"] else [])


def launch_row(a: argparse.Namespace, row: dict[str, Any], out: str) -> list[dict]:
    """The W ranks of one row as local processes (as bench/overlap.py's ``--nproc``); their records."""
    from bench.common import free_port, wait_ranks

    os.makedirs(out, exist_ok=True)
    port = free_port()
    procs, logs = [], []
    for r in range(a.ranks):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(a.ranks), LOCAL_RANK=str(r),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        log = open(os.path.join(out, f"rank{r}.log"), "w")
        logs.append(log)
        procs.append(subprocess.Popen(_worker_argv(a, row, out), env=env, cwd=ROOT, stdout=log,
                                      stderr=subprocess.STDOUT))
    try:
        rcs = wait_ranks(procs, a.timeout + 120)
    finally:
        for log in logs:
            log.close()
    if any(rcs):
        first = rcs.index(next(rc for rc in rcs if rc))
        with open(os.path.join(out, f"rank{first}.log")) as f:
            last = (f.read().strip().splitlines() or [""])[-1]
        raise RuntimeError(f"{row['label']}: exit codes {rcs}; rank {first}'s last line: {last}; logs in {out}")
    ranks = []
    for r in range(a.ranks):
        with open(os.path.join(out, f"rank{r}.json")) as f:
            ranks.append(json.load(f))
    return ranks


def check_args(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    if a.groups < 2 or a.ranks % a.groups:
        p.error(f"--groups: expected at least 2 groups that divide --ranks {a.ranks}, got {a.groups}")
    if not 0 <= a.slow_group < a.groups:
        p.error(f"--slow-group: expected a group in [0, {a.groups}), got {a.slow_group}")
    if a.step_s <= 0 or a.rounds < 1 or a.sync_every < 1:
        p.error("--step-s, --rounds and --sync-every must be above 0")
    if not 0 <= a.overlap_steps <= a.sync_every:
        p.error(f"--overlap-steps: expected k in [0, E = {a.sync_every}], got {a.overlap_steps}")
    if max(a.slow) * a.step_s >= a.sync_every * a.step_s:
        p.error(f"--slow: the slowest step ({max(a.slow):g} x {a.step_s:g} s) must be shorter than the period "
                f"E x step-s = {a.sync_every * a.step_s:g} s")


def _add_shared(p: argparse.ArgumentParser) -> None:
    p.add_argument("--groups", type=int, default=4, help="federation groups F (G = ranks / F)")
    p.add_argument("--slow-group", type=int, default=None, help="the slowed group (default: the last)")
    p.add_argument("--sync-every", type=int, default=8, help="E; by time T = E x --step-s")
    p.add_argument("--step-s", type=float, default=0.05, help="the pacing floor of a fast group's step (s)")
    p.add_argument("--rounds", type=int, default=10, help="R rounds per row (by steps R x E steps)")
    p.add_argument("--overlap-steps", type=int, default=0, help="k (0: blocking)")
    p.add_argument("--batch-size", type=int, default=16, help="samples (tokens) per rank and step")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4, help="residual blocks (one FSDP2 unit each)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-size", type=int, default=256, help="samples of the held-out batch")
    p.add_argument("--warmup-steps", type=int, default=2,
                   help="untimed local steps before FedAvg is built (FSDP's lazy init, AdamW's state)")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per collective; a row gets that + 120")


def parse_args(argv: list[str]) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    p = argparse.ArgumentParser(prog="python -m bench.stragglers", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=8, help="W local gloo ranks")
    p.add_argument("--slow", type=parse_slow, default=parse_slow("1.5,3"),
                   help="slow factors, comma-separated (each adds a by-steps and a by-time row)")
    _add_shared(p)
    p.add_argument("--out", default=None, metavar="DIR",
                   help="write stragglers_<machine>_<date>.md, its PNG and the rows' JSON here")
    p.add_argument("--png", default=None, help="plot eval loss against wall time here")
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--keep", default=None, metavar="DIR", help="keep the ranks' records and logs here")
    a = p.parse_args(argv)
    if a.slow_group is None:
        a.slow_group = a.groups - 1
    return p, a


def bench(argv: list[str]) -> int:
    p, a = parse_args(argv)
    check_args(p, a)
    load0, before = os.getloadavg()[0], uptime()
    under_load = load0 >= 1.0
    print(f"# uptime before: {before}", flush=True)
    work = a.keep or tempfile.mkdtemp(prefix="flcomm-stragglers-")
    rows, failed = [], []
    plan = plan_rows(a.slow)
    for i, row in enumerate(plan):
        print(f"[{i + 1}/{len(plan)}] {row['label']}", file=sys.stderr, flush=True)
        try:
            ranks = launch_row(a, row, os.path.join(work, f"{i:02d}"))
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
            # NOTE: one failed row does not cost the others' results (as bench/peers.py)
            print(f"      FAILED, left out of the table: {e}", file=sys.stderr, flush=True)
            failed.append(f"{row['label']}: {e}")
            continue
        rows.append(reduce_row(ranks, row, a.groups, a.rounds))
    if not rows:
        print("no row finished:\n" + "\n".join(failed))
        return 1
    base = next((r for r in rows if r["slow"] == 1.0 and not r["timed"]), None)
    exposed = max(base["group_exposed_s"]) / a.rounds if base else 0.0  # NOTE: the exchange per round
    for r in rows:
        r["pred_tokens_per_s"] = predict(r, a, exposed)
    after = uptime()
    label = " (under load: the 1-minute load was >= 1 before the run)" if under_load else ""
    G = a.ranks // a.groups
    title = (f"bench.stragglers: {a.ranks} ranks = {a.groups} groups x {G}, E = {a.sync_every}, "
             f"T = {a.sync_every * a.step_s:g} s, step {a.step_s:g} s, R = {a.rounds}, k = {a.overlap_steps}")
    print(title + label)
    table = format_table(rows)
    lines = ratios(rows, a.slow_group)
    lines.append(f"pred tok/s: predict_pacing with the measured step s per group, exposed "
                 f"{0.0 if a.overlap_steps else exposed:.3f} s per round (the no-slow by-steps row's exchange"
                 + ("" if base else "; that row failed: 0") + ")")
    lines += [f"FAILED (left out): {f}" for f in failed]
    print(table)
    for line in lines:
        print(line)
    print(f"# uptime after: {after}")
    print(f"# records in {work}")
    png = a.png
    stem = None
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        stem = os.path.join(a.out, f"stragglers_cpu-{os.cpu_count()}core_"
                                   f"{datetime.now(timezone.utc).strftime('%Y-%m-%d')}")
        png = png or stem + ".png"
    if png:
        try:
            plot(rows, png, title)
            print(f"# plot: {png}")
        except ImportError:
            print("# no matplotlib: no plot", file=sys.stderr)
            png = None
    if a.json or stem:
        with open(a.json or stem + ".json", "w") as f:
            json.dump({"args": vars(a), "load_before": before, "load_after": after, "rows": rows}, f, indent=1)
    if stem:
        with open(stem + ".md", "w") as f:
            f.write(results_markdown(a, argv, before, after, title + label + "\n" + table, lines, png, under_load))
        print(f"# results: {stem}.md")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:
        w = argparse.ArgumentParser(prog="bench.stragglers worker")
        _add_shared(w)
        w.add_argument("--slow", type=float, default=1.0, help="this row's slow factor")
        w.add_argument("--timed", action="store_true")
        w.add_argument("--out", required=True)
        return worker(w.parse_args(argv[1:]))
    return bench(argv)


if __name__ == "__main__":
    sys.exit(main())
