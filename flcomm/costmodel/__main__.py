"""Command line of the cost model: ``flcomm-costmodel`` / ``python -m flcomm.costmodel``.
The module docstring of :mod:`flcomm.costmodel.model` is its help text.

Every setting the answer depends on is printed first (``assumptions:``, with where it came
from: a flag, the preset, a default, or an estimate from the model size) and written to
``--json``; ``--recommend`` needs a device memory (``--memory-gb``) and only picks a plan that
fits it."""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from typing import Any

from flcomm.codecs import DENSE_CODECS
from flcomm.costmodel import model as _model
from flcomm.costmodel.assumptions import (
    ASPECT,
    CONVERGENCE_NOTE,
    FSDP_OVERLAP,
    VOCAB,
    Assumption,
    as_json,
    assumptions,
    d_model,
    estimate_activation_bytes,
    estimate_blocks,
    format_assumptions,
    parse_bandwidth,
)
from flcomm.costmodel.model import (
    CLUSTER_PRESETS,
    GBIT,
    Cluster,
    Link,
    Strategy,
    Workload,
    compute_time_from_flops,
    predict_strategies,
)
from flcomm.costmodel.probe import measure_main
from flcomm.costmodel.report import format_table, row_record, sync_every_sweep
from flcomm.costmodel.search import crossover_bandwidth_ratio, crossover_sync_every, recommend
from flcomm.federated.config import FedAvgConfig
from flcomm.validate import integer, number

_TIERS = ("intra", "inter", "group")


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The docstring as written, and each option's default after its help (the ones that are
    derived say how in their help)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        h = action.help or ""
        d = action.default
        if "(default" in h or not action.option_strings or d is None or d is False or d == argparse.SUPPRESS:
            return h
        return f"{h} (default: %(default)s)"


def _bandwidth(text: str) -> float:
    try:
        return parse_bandwidth(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flcomm-costmodel", description=_model.__doc__, formatter_class=_HelpFormatter)
    p.add_argument("--preset", choices=sorted(CLUSTER_PRESETS), help="fill in a documented setup (flags override)")
    g = p.add_argument_group("cluster (bandwidths: 400GB/s, 3200Gbit/s, 100gbit, or a bare number in Gbit/s)")
    g.add_argument("--nodes", type=int, help="nodes")
    g.add_argument("--ranks-per-node", type=int, help="ranks (GPUs) per node, L")
    g.add_argument("--intra-bw", "--intra-gbit", dest="intra_bw", type=_bandwidth, metavar="BW",
                   help="intra-node bus bandwidth per rank")
    g.add_argument("--inter-bw", "--inter-gbit", dest="inter_bw", type=_bandwidth, metavar="BW",
                   help="inter-node egress bandwidth per node (all its NICs together)")
    g.add_argument("--group-bw", "--group-gbit", dest="group_bw", type=_bandwidth, metavar="BW",
                   help="inter-group bandwidth per node (default: the inter-node one)")
    g.add_argument("--intra-lat-us", type=float, default=0.0, help="intra-node latency per ring step, us")
    g.add_argument("--inter-lat-us", type=float, default=0.0, help="inter-node latency per ring step, us")
    g.add_argument("--group-lat-us", type=float, help="inter-group latency, us (default: --inter-lat-us)")
    g.add_argument("--cluster-json", help="links from a --measure result (replaces the flags above)")
    g.add_argument("--gloo", action="store_true",
                   help="collectives as gloo runs them (reduce-scatter = all-reduce); implied by a "
                        "gloo --cluster-json")
    w = p.add_argument_group("workload")
    w.add_argument("--params", type=float, help="model parameters, e.g. 8e9")
    w.add_argument("--tokens-per-rank", type=float, help="tokens per rank per step")
    w.add_argument("--compute-s", type=float,
                   help="compute time per step, s (default: 6 N tokens / (--tflops x --mfu))")
    w.add_argument("--tflops", type=float, help="peak TFLOP/s per rank (derives --compute-s)")
    w.add_argument("--mfu", type=float, default=0.4, help="model FLOP utilization for --tflops")
    w.add_argument("--param-bytes", type=int, default=2, help="bytes per all-gathered parameter element")
    w.add_argument("--grad-bytes", type=int, default=2, help="bytes per reduce-scattered gradient element")
    w.add_argument("--allgathers-per-step", type=float, default=2.0, help="parameter all-gathers per step")
    w.add_argument("--fsdp-overlap", type=float,
                   help="fraction of in-group comm hidden behind compute, 0-1 (default: "
                        f"{FSDP_OVERLAP['nccl']:g} with NCCL, {FSDP_OVERLAP['gloo']:g} with --gloo)")
    w.add_argument("--fsdp-units", type=int,
                   help="FSDP units; collectives are issued once per unit (default: --layers + 1 for the root)")
    w.add_argument("--layers", type=int,
                   help=f"transformer blocks (default: estimated from --params with d_model = {ASPECT} x blocks)")
    w.add_argument("--activation-gb", type=float,
                   help="activations per rank at the peak, GB (default: estimated, activation checkpointing "
                        "per block)")
    w.add_argument("--vocab", type=int, default=VOCAB, help="vocabulary, for the logits of the activation estimate")
    w.add_argument("--state-bytes", type=float, default=16.0,
                   help="sharded training state per parameter, bytes (bf16 + fp32 master + Adam)")
    s = p.add_argument_group("plan")
    s.add_argument("--group-size", type=int, help="G (default: one node)")
    s.add_argument("--shard-size", type=int, help="S for HSDP variants (default: one node)")
    s.add_argument("--hsdp-group-size", type=int, help="G of FL+HSDP (default: two shards)")
    s.add_argument("--hierarchical", action="store_true", help="in-group collectives intra-node first")
    s.add_argument("--replicate-codec", default="none",
                   help=f"codec of the HSDP rows' gradient all-reduce over the replicas (the trainer's flag): "
                        f"{' | '.join(DENSE_CODECS)}")
    FedAvgConfig.add_arguments(p.add_argument_group("FedAvg of the table's FL rows (the trainer's flags)"))
    m = p.add_argument_group("modes")
    m.add_argument("--crossover", action="store_true", help="bandwidth-ratio and E crossovers of the FL plans")
    m.add_argument("--threshold", type=float, default=1.0, help="speedup that counts as paying")
    m.add_argument("--recommend", action="store_true", help="search strategy, G, S, E, codec, overlap")
    m.add_argument("--max-sync-every", type=int, default=32, help="largest E --recommend considers")
    m.add_argument("--memory-gb", type=float,
                   help="device memory per rank, GB: --recommend needs it and never picks a plan that needs "
                        "more; 'inf' ranks without a check (default: the preset's)")
    m.add_argument("--json", help="write the assumptions, predictions and recommendation here")
    m.add_argument("--measure", action="store_true", help="probe the tiers of this job (run on every rank)")
    m.add_argument("--backend", default="gloo", help="--measure's backend")
    m.add_argument("--measure-mb", type=float, default=4.0, help="--measure's buffer, MB")
    m.add_argument("--measure-iters", type=int, default=3, help="--measure's timed iterations")
    m.add_argument("--measure-json", help="where --measure writes the tiers")
    m.add_argument("--measure-timeout", type=float, default=300.0, help="--measure's timeout, s")
    return p


def _preset_defaults(name: str) -> dict[str, Any]:
    """The preset as parser defaults (its ``*_gbit`` in bytes/s for ``--*-bw``)."""
    d = dict(CLUSTER_PRESETS[name])
    for t in _TIERS:
        if f"{t}_gbit" in d:
            d[f"{t}_bw"] = d.pop(f"{t}_gbit") * GBIT
    return d


def _given(argv: list[str] | None) -> set[str]:
    """The dests given on the command line."""
    q = make_parser()
    for act in q._actions:  # NOTE: argparse has no public way to tell a given flag from its default
        act.default = argparse.SUPPRESS
    return set(vars(q.parse_args(argv)))


@dataclass
class _Setup:
    cluster: Cluster
    workload: Workload
    memory_bytes: float | None     # None: not checked
    assumptions: list[Assumption]


class _Sources:
    """Where each value came from: a flag, the preset, a default or an estimate."""

    def __init__(self, a: argparse.Namespace, given: set[str]) -> None:
        self.given, self.preset = given, set(CLUSTER_PRESETS.get(a.preset, {}) if a.preset else ())
        self.name = a.preset
        self.preset |= {f"{t}_bw" for t in _TIERS if f"{t}_gbit" in self.preset}

    def of(self, *dests: str, otherwise: str = "default") -> str:
        if any(d in self.given for d in dests):
            return "flag"
        if any(d in self.preset for d in dests):
            return f"preset {self.name}"
        return otherwise

    def has(self, dest: str) -> bool:
        """``dest`` came from the command line or the preset."""
        return self.of(dest, otherwise="") != ""


def _cluster(a: argparse.Namespace, src: _Sources, sources: dict, how: dict) -> Cluster:
    if a.cluster_json:
        with open(a.cluster_json) as f:
            c = Cluster.from_measurement(json.load(f), a.nodes)
        sources.update({k: f"measured ({a.cluster_json})" for k in
                        ("intra_node", "inter_node", "inter_group", "reduce_scatter_as_all_reduce")})
        return c
    missing = [n for n in ("nodes", "ranks_per_node", "intra_bw", "inter_bw") if getattr(a, n) is None]
    if missing:
        raise ValueError(f"need --{', --'.join(m.replace('_', '-') for m in missing)} "
                         "(or --cluster-json from --measure, or --preset)")
    group_lat = a.group_lat_us if a.group_lat_us is not None else a.inter_lat_us
    c = Cluster(a.nodes, a.ranks_per_node, Link(a.intra_bw, a.intra_lat_us * 1e-6),
                Link(a.inter_bw, a.inter_lat_us * 1e-6),
                Link(a.group_bw, group_lat * 1e-6) if a.group_bw else None, reduce_scatter_as_all_reduce=a.gloo)
    sources.update(intra_node=src.of("intra_bw", "intra_lat_us"), inter_node=src.of("inter_bw", "inter_lat_us"),
                   inter_group=src.of("group_bw", "group_lat_us"), reduce_scatter_as_all_reduce=src.of("gloo"))
    if not a.group_bw:
        how["inter_group"] = "the inter-node fabric"
    return c


def _workload(a: argparse.Namespace, c: Cluster, src: _Sources, sources: dict, how: dict) -> Workload:
    if a.params is None or a.tokens_per_rank is None:
        raise ValueError("need --params and --tokens-per-rank (or --preset)")
    compute_s = a.compute_s
    if compute_s is None:
        if a.tflops is None:
            raise ValueError("need --compute-s, or --tflops (with --mfu) to derive it from 6 * N * tokens")
        compute_s = compute_time_from_flops(a.params, a.tokens_per_rank, a.tflops * 1e12, a.mfu)
        how["compute_s"] = f"6 x N x tokens / ({a.tflops:g} TFLOP/s x MFU {a.mfu:g} [{src.of('mfu')}])"
    sources["compute_s"] = src.of("compute_s", "tflops")
    blocks = integer("--layers", a.layers, 1) if a.layers is not None else estimate_blocks(a.params)
    units = a.fsdp_units if a.fsdp_units is not None else blocks + 1
    if not src.has("fsdp_units"):
        sources["fsdp_units"] = "derived" if src.has("layers") else "estimated"
        how["fsdp_units"] = (f"{blocks} blocks (--layers) + the root" if src.has("layers") else
                             f"{blocks} blocks + the root; blocks from N with d_model = {ASPECT} x blocks")
    overlap = a.fsdp_overlap
    if overlap is None:
        overlap = FSDP_OVERLAP["gloo" if c.reduce_scatter_as_all_reduce else "nccl"]
        how["fsdp_overlap"] = f"NCCL on GPUs: {FSDP_OVERLAP['nccl']:g}, gloo: {FSDP_OVERLAP['gloo']:g}"
    act = None if a.activation_gb is None else number("activation_gb", a.activation_gb, 0) * 1e9
    if act is None:
        act = estimate_activation_bytes(a.params, blocks, a.tokens_per_rank, a.vocab)
        sources["activation_bytes"] = "estimated"
        how["activation_bytes"] = (f"checkpointing per block: {blocks} blocks of d_model "
                                   f"{d_model(a.params, blocks):.0f}, {a.tokens_per_rank:g} tokens, fp32 "
                                   f"logits over a vocabulary of {a.vocab} [{src.of('vocab')}]")
    for key, dest in (("fsdp_overlap", "fsdp_overlap"), ("activation_bytes", "activation_gb")):
        sources.setdefault(key, src.of(dest))
    for key, dest in (("param_bytes", "param_bytes"), ("grad_bytes", "grad_bytes"), ("fsdp_units", "fsdp_units"),
                      ("allgathers_per_step", "allgathers_per_step"), ("state_bytes_per_param", "state_bytes")):
        sources.setdefault(key, src.of(dest))
    return Workload(a.params, a.tokens_per_rank, compute_s, a.param_bytes, a.grad_bytes, a.allgathers_per_step,
                    units, overlap, state_bytes_per_param=a.state_bytes, activation_bytes=act)


def _build(a: argparse.Namespace, given: set[str]) -> _Setup:
    src, sources, how = _Sources(a, given), {}, {}
    cluster = _cluster(a, src, sources, how)
    wl = _workload(a, cluster, src, sources, how)
    memory = None
    if a.memory_gb is not None and a.memory_gb != math.inf:
        memory = number("memory_gb", a.memory_gb, 0, lo_open=True) * 1e9
    sources["memory_limit_bytes"] = src.of("memory_gb")
    if a.memory_gb == math.inf:
        how["memory_limit_bytes"] = "--memory-gb inf"
    sources["replicate_codec"] = src.of("replicate_codec")
    return _Setup(cluster, wl, memory, assumptions(cluster, wl, memory, sources, how, a.replicate_codec))


def _recommend(a: argparse.Namespace, setup: _Setup):
    if a.memory_gb is None:
        raise ValueError("--recommend needs --memory-gb, the device memory per rank (e.g. 80 for an 80 GB GPU), "
                         "so that it never picks a plan that does not fit; --memory-gb inf ranks plans "
                         "without a memory check")
    return recommend(setup.cluster, setup.workload, max_sync_every=a.max_sync_every,
                     memory_bytes=setup.memory_bytes if setup.memory_bytes is not None else math.inf)


def _crossovers(a: argparse.Namespace, setup: _Setup, preds: list) -> list[dict]:
    out = []
    for pr in preds:
        if not pr.plan.strategy.federated:
            continue
        base = "hsdp" if pr.plan.strategy is Strategy.FL_HSDP else "fsdp"
        cb = crossover_bandwidth_ratio(setup.cluster, setup.workload, pr.plan, base, a.threshold)
        ce = crossover_sync_every(setup.cluster, setup.workload, pr.plan, base, a.threshold)
        print(f"{pr.plan.label()} vs {base}: {cb.describe()}; {ce.describe()}")
        out.append({"plan": pr.plan.label(), "baseline": base, "bandwidth_ratio": asdict(cb),
                    "sync_every": asdict(ce)})
    return out


def main(argv: list[str] | None = None) -> int:
    p = make_parser()
    a = p.parse_args(argv)
    if a.preset:
        # NOTE: the preset becomes the defaults and the command line is parsed again, so flags
        # given explicitly win, also when they equal the parser's own default.
        p.set_defaults(**_preset_defaults(a.preset))
        a = p.parse_args(argv)
    if a.measure:
        return measure_main(a)
    try:
        setup = _build(a, _given(argv))
        c, wl, mem = setup.cluster, setup.workload, setup.memory_bytes
        preds = predict_strategies(c, wl, a.group_size, a.shard_size, FedAvgConfig.from_args(a), a.hierarchical,
                                   a.hsdp_group_size, a.replicate_codec)
        rec = _recommend(a, setup) if a.recommend else None
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    base = {pr.plan.strategy: pr for pr in preds if not pr.plan.strategy.federated}
    fsdp, hsdp = base.get(Strategy.FSDP), base.get(Strategy.HSDP)
    sweep = sync_every_sweep(c, wl, rec.best) if rec else []
    print(f"cluster: {c.nodes} nodes x {c.ranks_per_node} ranks (inter/intra bandwidth per rank "
          f"{c.bandwidth_ratio:.3g}); {wl.params:.3g} params, {wl.tokens_per_rank:g} tokens per rank per step")
    print(format_assumptions([x for x in setup.assumptions if x.key != "convergence"]))
    print(format_table([("", pr) for pr in preds], wl, fsdp, hsdp, mem, sweep))
    record: dict[str, Any] = {"assumptions": as_json(setup.assumptions), "notes": [CONVERGENCE_NOTE],
                              "predictions": [row_record(x, fsdp, hsdp, mem) for x in preds]}
    if a.crossover:
        record["crossover"] = _crossovers(a, setup, preds)
    if rec:
        print("recommended:", rec.reason)
        if rec.left_out:
            print("left out:", rec.left_out)
        record["recommendation"] = {"reason": rec.reason, "left_out": rec.left_out, "memory_limit_bytes": mem,
                                    "best": row_record(rec.best, fsdp, hsdp, mem),
                                    "sync_every_sweep": [row_record(x, fsdp, hsdp, mem) for _, x in sweep]}
    print(f"note: {CONVERGENCE_NOTE}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(record, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
