"""Command line of the cost model: ``flcomm-costmodel`` / ``python -m flcomm.costmodel``.
The module docstring of :mod:`flcomm.costmodel.model` is its help text."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from flcomm.codecs import CODECS
from flcomm.comm.base import format_bytes
from flcomm.costmodel import model as _model
from flcomm.costmodel.model import (
    GBIT,
    PRESETS,
    Cluster,
    Link,
    Prediction,
    Strategy,
    Workload,
    compute_time_from_flops,
    predict_strategies,
)
from flcomm.costmodel.probe import measure_main
from flcomm.costmodel.search import crossover_bandwidth_ratio, crossover_sync_every, recommend


def format_table(preds: Sequence[Prediction]) -> str:
    """Table of predictions with speedups vs FSDP and HSDP (when present)."""
    base = {p.plan.strategy: p for p in preds if not p.plan.strategy.federated}
    fsdp, hsdp = base.get(Strategy.FSDP), base.get(Strategy.HSDP)
    hdr = f"{'plan':<34} {'step s':>9} {'comm s':>9} {'tokens/s':>11} {'vs FSDP':>8} {'vs HSDP':>8} " \
          f"{'inter-node/step':>15} {'inter-group/step':>16} {'mem/rank':>9}"
    lines = [hdr, "-" * len(hdr)]
    for p in preds:
        vs_f = f"{fsdp.step_time_s / p.step_time_s:.2f}x" if fsdp else "-"
        vs_h = f"{hsdp.step_time_s / p.step_time_s:.2f}x" if hsdp else "-"
        lines.append(f"{p.plan.label():<34} {p.step_time_s:9.4g} {p.exposed_comm_s:9.4g} {p.tokens_per_s:11.4g} "
                     f"{vs_f:>8} {vs_h:>8} {format_bytes(p.internode_bytes_per_step):>15} "
                     f"{format_bytes(p.intergroup_bytes_per_step):>16} {format_bytes(p.memory_total):>9}")
    return "\n".join(lines)


def _build(a: argparse.Namespace) -> tuple[Cluster, Workload]:
    if a.cluster_json:
        with open(a.cluster_json) as f:
            cluster = Cluster.from_measurement(json.load(f), a.nodes)
    else:
        missing = [n for n in ("nodes", "ranks_per_node", "intra_gbit", "inter_gbit") if getattr(a, n) is None]
        if missing:
            raise ValueError(f"need --{', --'.join(m.replace('_', '-') for m in missing)} "
                             "(or --cluster-json from --measure, or --preset)")
        cluster = Cluster(a.nodes, a.ranks_per_node, Link.gbit(a.intra_gbit, a.intra_lat_us),
                          Link.gbit(a.inter_gbit, a.inter_lat_us),
                          Link.gbit(a.group_gbit, a.group_lat_us if a.group_lat_us is not None else a.inter_lat_us)
                          if a.group_gbit else None, reduce_scatter_as_all_reduce=a.gloo)
    if a.params is None or a.tokens_per_rank is None:
        raise ValueError("need --params and --tokens-per-rank (or --preset)")
    if a.compute_s is None:
        if a.tflops is None:
            raise ValueError("need --compute-s, or --tflops (with --mfu) to derive it from 6 * N * tokens")
        a.compute_s = compute_time_from_flops(a.params, a.tokens_per_rank, a.tflops * 1e12, a.mfu)
    wl = Workload(a.params, a.tokens_per_rank, a.compute_s, a.param_bytes, a.grad_bytes,
                  a.allgathers_per_step, a.fsdp_units, a.fsdp_overlap,
                  activation_bytes=a.activation_gb * 1e9)
    return cluster, wl


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flcomm-costmodel", description=_model.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), help="fill in a documented setup (flags override)")
    g = p.add_argument_group("cluster")
    g.add_argument("--nodes", type=int)
    g.add_argument("--ranks-per-node", type=int)
    g.add_argument("--intra-gbit", type=float, help="intra-node bus bandwidth per rank, Gbit/s")
    g.add_argument("--inter-gbit", type=float, help="inter-node egress bandwidth per node, Gbit/s")
    g.add_argument("--group-gbit", type=float, help="inter-group bandwidth per node (default: inter-node)")
    g.add_argument("--intra-lat-us", type=float, default=0.0)
    g.add_argument("--inter-lat-us", type=float, default=0.0)
    g.add_argument("--group-lat-us", type=float)
    g.add_argument("--cluster-json", help="links from a --measure result (replaces the flags above)")
    g.add_argument("--gloo", action="store_true",
                   help="collectives as gloo runs them (reduce-scatter = all-reduce); implied by a "
                        "gloo --cluster-json")
    w = p.add_argument_group("workload")
    w.add_argument("--params", type=float, help="model parameters, e.g. 8e9")
    w.add_argument("--tokens-per-rank", type=float, help="tokens per rank per step")
    w.add_argument("--compute-s", type=float, help="compute time per step (s)")
    w.add_argument("--tflops", type=float, help="peak TFLOP/s per rank (derives --compute-s)")
    w.add_argument("--mfu", type=float, default=0.4)
    w.add_argument("--param-bytes", type=int, default=2)
    w.add_argument("--grad-bytes", type=int, default=2)
    w.add_argument("--allgathers-per-step", type=float, default=2.0)
    w.add_argument("--fsdp-overlap", type=float, default=0.0, help="fraction of in-group comm hidden (0-1)")
    w.add_argument("--fsdp-units", type=int, default=1, help="FSDP units (latency counts once per unit)")
    w.add_argument("--activation-gb", type=float, default=0.0, help="activations per rank at the peak (GB)")
    s = p.add_argument_group("plan")
    s.add_argument("--group-size", type=int, help="G (default: one node)")
    s.add_argument("--shard-size", type=int, help="S for HSDP variants (default: one node)")
    s.add_argument("--hsdp-group-size", type=int, help="G of FL+HSDP (default: two shards)")
    s.add_argument("--sync-every", type=int, default=8)
    s.add_argument("--codec", default="none", choices=list(CODECS))
    s.add_argument("--overlap", action="store_true")
    s.add_argument("--hierarchical", action="store_true")
    m = p.add_argument_group("modes")
    m.add_argument("--crossover", action="store_true", help="bandwidth-ratio and E crossovers of the FL plans")
    m.add_argument("--threshold", type=float, default=1.0, help="speedup that counts as paying")
    m.add_argument("--recommend", action="store_true")
    m.add_argument("--max-sync-every", type=int, default=32)
    m.add_argument("--memory-gb", type=float,
                   help="device memory per rank: --recommend never picks a plan that needs more "
                        "(default: the preset's)")
    m.add_argument("--json", help="write the predictions here")
    m.add_argument("--measure", action="store_true", help="probe the tiers of this job (run on every rank)")
    m.add_argument("--backend", default="gloo")
    m.add_argument("--measure-mb", type=float, default=4.0)
    m.add_argument("--measure-iters", type=int, default=3)
    m.add_argument("--measure-json")
    m.add_argument("--measure-timeout", type=float, default=300.0)
    return p


def main(argv: list[str] | None = None) -> int:
    p = make_parser()
    a = p.parse_args(argv)
    if a.preset:
        # NOTE: the preset becomes the defaults and the command line is parsed again, so flags
        # given explicitly win, also when they equal the parser's own default.
        p.set_defaults(**PRESETS[a.preset])
        a = p.parse_args(argv)
    if a.measure:
        return measure_main(a)
    try:
        cluster, wl = _build(a)
        preds = predict_strategies(cluster, wl, a.group_size, a.shard_size, a.sync_every, a.codec, a.overlap,
                                   a.hierarchical, a.hsdp_group_size)
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"cluster: {cluster.nodes} nodes x {cluster.ranks_per_node} ranks; "
          f"intra {cluster.intra.bandwidth / GBIT:.4g} Gbit/s per rank, "
          f"inter-node {cluster.inter_node.bandwidth / GBIT:.4g} Gbit/s per node "
          f"(inter/intra per rank {cluster.bandwidth_ratio:.3g}); compute {wl.compute_s:.4g} s/step, "
          f"{wl.params:.3g} params")
    print(format_table(preds))
    record: dict[str, Any] = {"predictions": [x.as_dict() for x in preds]}
    if a.crossover:
        record["crossover"] = []
        for pr in preds:
            if not pr.plan.strategy.federated:
                continue
            base = "hsdp" if pr.plan.strategy is Strategy.FL_HSDP else "fsdp"
            cb = crossover_bandwidth_ratio(cluster, wl, pr.plan, base, a.threshold)
            ce = crossover_sync_every(cluster, wl, pr.plan, base, a.threshold)
            print(f"{pr.plan.label()} vs {base}: {cb.describe()}; {ce.describe()}")
            record["crossover"].append({"plan": pr.plan.label(), "baseline": base,
                                        "bandwidth_ratio": asdict(cb), "sync_every": asdict(ce)})
    if a.recommend:
        rec = recommend(cluster, wl, max_sync_every=a.max_sync_every,
                        memory_bytes=a.memory_gb * 1e9 if a.memory_gb else None)
        print("recommended:", rec.reason)
        if rec.left_out:
            print("left out:", rec.left_out)
        record["recommendation"] = {"reason": rec.reason, "left_out": rec.left_out, "best": rec.best.as_dict()}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(record, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
