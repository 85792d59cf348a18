"""Command line of the reference training driver.

    python -m flcomm.train --strategy fl-fsdp --nproc 4 --ranks-per-node 2 --group-size 2 \\
        --sync-every 8 --steps 200 --metrics runs/fl.jsonl           # N local CPU processes
    torchrun --nproc-per-node 8 --nnodes 4 ... -m flcomm.train --strategy fl-hsdp \\
        --backend nccl --model llama3.1-8b --mixed-precision bf16   # a GPU cluster
    python -m flcomm.train compare                                 # FSDP vs FL+FSDP, table + PNG
    python -m flcomm.train rank CONFIG.json                        # one rank of a recorded config
    python -m flcomm.train plot runs/*.jsonl --out loss.png

Also installed as the console script ``flcomm-train``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from flcomm.codecs import DENSE_CODECS
from flcomm.federated.config import FedAvgConfig
from flcomm.train.config import NAN_POLICIES, STRATEGIES, TRANSPORTS, TrainConfig
from flcomm.train.model import PRESETS

_SUBCOMMANDS = ("train", "compare", "plot", "rank")


def _add_common(p: argparse.ArgumentParser, d: TrainConfig) -> None:
    """Flags shared by ``train`` and ``compare`` (defaults from ``d``)."""
    g = p.add_argument_group("topology")
    g.add_argument("--nproc", type=int, default=None,
                   help="launch N local CPU processes with gloo (default: torchrun's env, else 1)")
    g.add_argument("--ranks-per-node", type=int, default=d.ranks_per_node,
                   help="L, ranks per (emulated) node (default: LOCAL_WORLD_SIZE or the world)")
    g.add_argument("--group-size", type=int, default=d.group_size,
                   help="G, ranks per federation group (fl-*; default: one node)")
    g.add_argument("--shard-size", type=int, default=d.shard_size,
                   help="S, ranks per shard group (hsdp / fl-hsdp; default: one node)")
    g.add_argument("--hierarchical", action=argparse.BooleanOptionalAction, default=d.hierarchical,
                   help="FSDP reduce-scatter / all-gather in two stages (intra-node, then inter-node) "
                        "when the shard group spans nodes")
    h = p.add_argument_group("replicate all-reduce (hsdp, fl-hsdp)")
    h.add_argument("--replicate-codec", default=d.replicate_codec,
                   help=f"the gradients' all-reduce over the R replicas in this codec, through flcomm's hook "
                        f"(FSDP2): {' | '.join(DENSE_CODECS)} (none: FSDP2's own all-reduce)")
    h.add_argument("--replicate-error-feedback", action=argparse.BooleanOptionalAction,
                   default=d.replicate_error_feedback,
                   help="keep what the replicate codec dropped and add it to the next step's gradient")
    FedAvgConfig.add_arguments(p.add_argument_group("FedAvg (fl-fsdp, fl-hsdp)"), d.fedavg)
    e = p.add_argument_group("elastic federation (fl-fsdp, fl-hsdp)")
    e.add_argument("--elastic", action=argparse.BooleanOptionalAction, default=d.elastic,
                   help="a federation group that loses a rank is dropped; the others go on (docs/fault-tolerance.md)")
    e.add_argument("--elastic-grace-s", type=float, default=d.elastic_grace_s,
                   help="how long a membership round waits for a silent rank before its group is out")
    e.add_argument("--min-groups", type=int, default=d.min_groups,
                   help="end the job when fewer federation groups are left")
    e.add_argument("--rejoin", action=argparse.BooleanOptionalAction, default=d.rejoin,
                   help="this is a restarted group: load a survivor's latest checkpoint and join at the next "
                        "sync (--nproc: the launcher restarts a lost group itself with this)")
    m = p.add_argument_group("model and optimization")
    m.add_argument("--model", default=d.model, help=f"preset: {', '.join(PRESETS)}")
    m.add_argument("--vocab-size", type=int, default=d.vocab_size)
    m.add_argument("--init", default=d.init, help="auto | full | meta (meta: build sharded, no full copy)")
    m.add_argument("--mixed-precision", default=d.mixed_precision, help="none | bf16")
    m.add_argument("--steps", type=int, default=d.steps)
    m.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences per rank per step")
    m.add_argument("--seq-len", type=int, default=d.seq_len)
    m.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (AdamW)")
    m.add_argument("--min-lr-ratio", type=float, default=d.min_lr_ratio, help="final lr / peak lr (cosine)")
    m.add_argument("--warmup", type=int, default=d.warmup, help="warm-up steps (default: steps/10, <= 100)")
    m.add_argument("--weight-decay", type=float, default=d.weight_decay)
    m.add_argument("--grad-clip", type=float, default=d.grad_clip, help="0: off")
    m.add_argument("--seed", type=int, default=d.seed)
    a = p.add_argument_group("data and evaluation")
    a.add_argument("--data", default=d.data,
                   help="text file (byte level), .npy or .bin token ids (default: built-in corpus)")
    a.add_argument("--data-dtype", default=d.data_dtype, help="element type of a .bin file (uint16)")
    a.add_argument("--max-tokens", type=int, default=d.max_tokens)
    a.add_argument("--eval-fraction", type=float, default=d.eval_fraction)
    a.add_argument("--eval-every", type=int, default=d.eval_every, help="0: only at the end")
    a.add_argument("--eval-batches", type=int, default=d.eval_batches)
    r = p.add_argument_group("runtime")
    r.add_argument("--backend", default=d.backend, help="auto | gloo | nccl")
    r.add_argument("--transport", default=d.transport,
                   help=f"{' | '.join(TRANSPORTS)}: flcomm's collectives (hierarchical hooks, replicate hook, FedAvg) "
                        "on torch.distributed's process groups or on flcomm's own NCCL communicators")
    r.add_argument("--timeout-s", type=float, default=d.timeout_s,
                   help="timeout of every collective, in seconds (a dead or frozen rank is detected within it)")
    r.add_argument("--nan-policy", default=d.nan_policy,
                   help=f"on a non-finite loss or gradient norm: {' | '.join(NAN_POLICIES)} "
                        "(stop: every rank, naming the step)")
    r.add_argument("--log-dir", default=d.log_dir,
                   help="per-rank heartbeats and tracebacks (default: a new temporary directory)")
    r.add_argument("--progress", action=argparse.BooleanOptionalAction, default=d.progress)


def _config(args: argparse.Namespace, **over: object) -> TrainConfig:
    names = set(TrainConfig.field_names()) - {"fedavg"}
    kw = {k: v for k, v in vars(args).items() if k in names}
    kw.update(over)
    return TrainConfig(**kw, fedavg=FedAvgConfig.from_args(args))


def _train_parser() -> argparse.ArgumentParser:
    d = TrainConfig()
    p = argparse.ArgumentParser(prog="python -m flcomm.train",
                                description="Train the reference Llama-style model with FSDP, HSDP, "
                                            "FL+FSDP or FL+HSDP. Subcommands: compare, plot.")
    p.add_argument("--strategy", default=d.strategy, help=f"{' | '.join(STRATEGIES)}")
    _add_common(p, d)
    o = p.add_argument_group("output")
    o.add_argument("--metrics", default=None, help="JSONL file of per-step metrics")
    o.add_argument("--checkpoint-dir", default=None)
    o.add_argument("--save-every", type=int, default=0, help="0: only at the end")
    o.add_argument("--keep-checkpoints", type=int, default=d.keep_checkpoints)
    o.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    o.add_argument("--allow-data-change", action="store_true",
                   help="resume even though the data differ from the checkpoint's")
    return p


def cmd_train(argv: Sequence[str]) -> int:
    from flcomm.train.launch import default_start_method, launch_local

    args = _train_parser().parse_args(argv)
    cfg = _config(args)
    if args.nproc is None and "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _torchrun_rank(cfg)
    if args.nproc is not None and args.nproc < 1:
        raise ValueError(f"--nproc must be an integer >= 1, got {args.nproc}")
    launch_local(cfg, args.nproc or 1, start_method=default_start_method())
    return 0


_RANK_PROCESS = False  # this process ran a rank under torchrun (see the end of this file)


def _torchrun_rank(cfg: TrainConfig) -> int:
    """One rank under torchrun: its failure becomes one line on stderr (traceback in its log
    file) and an exit code (2: refused, 1: failed)."""
    global _RANK_PROCESS
    _RANK_PROCESS = True
    import tempfile
    from dataclasses import replace

    from flcomm.train.launch import exit_code, worker_main
    from flcomm.train.monitor import Monitor

    run_id = os.environ.get("TORCHELASTIC_RUN_ID", os.environ.get("MASTER_PORT", "run"))
    cfg = replace(cfg, log_dir=cfg.log_dir or os.path.join(tempfile.gettempdir(), f"flcomm-{run_id}"))
    mon = Monitor(cfg.log_dir, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    mon.on_sigterm()
    try:
        worker_main(cfg, monitor=mon)
    except Exception as e:  # noqa: BLE001 - one line here, the traceback in the log file
        if mon.message is None:
            mon.fail(e)
        mon.say()
        return exit_code(e)
    return 0


def cmd_plot(argv: Sequence[str]) -> int:
    from flcomm.train.plot import plot_runs

    p = argparse.ArgumentParser(prog="python -m flcomm.train plot",
                                description="Loss against wall time and tokens for several runs (PNG).")
    p.add_argument("metrics", nargs="+", help="metrics JSONL files")
    p.add_argument("--out", required=True, help="PNG to write")
    p.add_argument("--labels", nargs="*", default=None)
    p.add_argument("--title", default=None)
    args = p.parse_args(argv)
    print(plot_runs(args.metrics, args.out, args.labels, args.title))
    return 0


def cmd_compare(argv: Sequence[str]) -> int:
    from flcomm.train.compare import COMPARE_DEFAULTS, run_compare

    d = TrainConfig(**{k: v for k, v in COMPARE_DEFAULTS.items() if k in TrainConfig.field_names()})
    p = argparse.ArgumentParser(prog="python -m flcomm.train compare",
                                description="FSDP and FL+FSDP side by side: same model, data, "
                                            "hyper-parameters and token budget; a table and a PNG.")
    p.add_argument("--strategies", default=COMPARE_DEFAULTS["strategies"],
                   help="comma-separated strategies to run, in order")
    p.add_argument("--out-dir", default=COMPARE_DEFAULTS["out_dir"], help="metrics and plot go here")
    p.add_argument("--emulate", action=argparse.BooleanOptionalAction, default=None,
                   help="run on the emulated two-tier cluster (network namespaces, tbf-shaped links between "
                        "nodes; needs root and iproute2); default: when this machine can, else loopback")
    p.add_argument("--rate", default=COMPARE_DEFAULTS["rate"],
                   help="emulated link rate between nodes, per node and direction (tc units: 100mbit, 1gbit)")
    _add_common(p, d)
    p.set_defaults(nproc=COMPARE_DEFAULTS["nproc"])
    args = p.parse_args(argv)
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    base = _config(args)
    run_compare(base, strategies, args.nproc, args.out_dir, emulate=args.emulate, rate=args.rate)
    return 0


def cmd_rank(argv: Sequence[str]) -> int:
    """One rank (torchrun's environment) of the config a JSON file records (TrainConfig.to_dict):
    what ``compare`` runs on every rank of the emulated cluster."""
    import json

    p = argparse.ArgumentParser(prog="python -m flcomm.train rank",
                                description="One rank of a recorded TrainConfig, under torchrun's environment "
                                            "(RANK, WORLD_SIZE, MASTER_ADDR, ...).")
    p.add_argument("config", help="JSON file of TrainConfig.to_dict()")
    args = p.parse_args(argv)
    with open(args.config) as f:
        cfg = TrainConfig.from_dict(json.load(f))
    return _torchrun_rank(cfg)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd = argv[0] if argv and argv[0] in _SUBCOMMANDS else "train"
    if argv and argv[0] in _SUBCOMMANDS:
        argv = argv[1:]
    try:
        return {"train": cmd_train, "compare": cmd_compare, "plot": cmd_plot, "rank": cmd_rank}[cmd](argv)
    except (ValueError, FileNotFoundError, RuntimeError, TimeoutError, FloatingPointError) as e:
        print(f"flcomm.train: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    code = main()
    if _RANK_PROCESS:
        # NOTE: as the local launcher's ranks, a rank under torchrun ends with os._exit once its
        # files are written and closed: at interpreter teardown a finished rank could abort
        # ("terminate called without an active exception", a C++ thread of a process group or
        # store destroyed while joinable; seen once in 15 trainer launches on the emulated cluster)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
