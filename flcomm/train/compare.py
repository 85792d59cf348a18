"""FSDP against FL+FSDP on a few local CPU processes: the README's main job.

    python -m flcomm.train compare [--nproc 4 --ranks-per-node 2 --group-size 2 --sync-every 8]

Runs each strategy in turn with the same model, data, hyper-parameters and token budget (same
world size, per-rank batch and steps), then prints one row per run and writes the metrics
files and a PNG (loss against wall time and tokens) into ``--out-dir``. With 4 ranks as 2
emulated nodes of 2, FSDP shards over both nodes, so its all-gathers and reduce-scatters cross
the inter-node tier every step; FL+FSDP keeps one group per node and sends only the FedAvg
exchange between groups, every E steps.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace

from flcomm.comm.base import format_bytes
from flcomm.federated.strategy import Strategy
from flcomm.train.config import TrainConfig
from flcomm.train.launch import launch_local
from flcomm.train.metrics import RunMetrics, read_metrics

COMPARE_DEFAULTS: dict[str, object] = {
    "strategies": "fsdp,fl-fsdp", "out_dir": "flcomm-compare", "nproc": 4,
    "ranks_per_node": 2, "group_size": 2, "model": "tiny", "steps": 48,
    "batch_size": 8, "seq_len": 128, "lr": 3e-3, "eval_every": 16, "eval_batches": 4,
}


def run_config(base: TrainConfig, strategy: str, metrics: str) -> TrainConfig:
    """``base`` adapted to ``strategy``: the group size only for fl-*, the shard size only for
    the hybrid strategies; everything else is shared."""
    st = Strategy.parse(strategy)
    return replace(base, strategy=st.value, metrics=metrics,
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
        "tokens_per_s": toks / t if t > 0 else float("nan"),
        "intergroup_bytes_per_step": sum(r["intergroup_bytes"] for r in run.steps) / n,
        "internode_bytes_per_step": sum(r["internode_bytes"] for r in run.steps) / n,
        "exposed_comm_s_per_step": sum(r["exposed_comm_s"] for r in run.steps) / n,
        "eval_loss": ev[-1]["eval_loss"] if ev else None,
        "wall_s": run.steps[-1]["time_s"] if run.steps else None,
    }


def format_table(rows: Sequence[dict]) -> str:
    head = ("run", "tokens/s", "inter-group B/step", "inter-node B/step", "exposed comm s/step",
            "eval loss", "wall s")
    body = [(r["run"], f"{r['tokens_per_s']:.0f}", format_bytes(r["intergroup_bytes_per_step"]),
             format_bytes(r["internode_bytes_per_step"]), f"{r['exposed_comm_s_per_step']:.4f}",
             "-" if r["eval_loss"] is None else f"{r['eval_loss']:.4f}",
             "-" if r["wall_s"] is None else f"{r['wall_s']:.1f}") for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w)  # noqa: E731
                                   for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(head), line(["-" * w for w in widths]), *(line(b) for b in body)])


def run_compare(base: TrainConfig, strategies: Sequence[str], nproc: int, out_dir: str) -> list[dict]:
    """Run every strategy, print the table, write ``out_dir/<strategy>.jsonl`` and
    ``out_dir/compare.png``; return the rows."""
    for s in strategies:
        Strategy.parse(s)
    if not strategies:
        raise ValueError("compare needs at least one strategy")
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for s in strategies:
        path = os.path.join(out_dir, f"{s}.jsonl")
        cfg = run_config(base, s, path)
        print(f"== {s}: {nproc} ranks, {cfg.steps} steps of {nproc * cfg.batch_size * cfg.seq_len} tokens",
              flush=True)
        launch_local(cfg, nproc)
        paths.append(path)
    rows = [summarize(read_metrics(p)) for p in paths]
    print()
    print(format_table(rows))
    try:
        from flcomm.train.plot import plot_runs

        png = plot_runs(paths, os.path.join(out_dir, "compare.png"))
        print(f"\nplot: {png}")
    except RuntimeError as e:  # matplotlib missing
        print(f"\n(no plot: {e})")
    print(f"metrics: {', '.join(paths)}")
    return rows
