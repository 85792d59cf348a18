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

from flcomm.federated.config import FedAvgConfig
from flcomm.train.config import DATA, ELASTIC, FEDAVG, MODEL, OUTPUT, REPLICATE, RUNTIME, TOPOLOGY, TrainConfig

_SUBCOMMANDS = ("train", "compare", "plot", "rank")
_COMMON = (TOPOLOGY, REPLICATE, FEDAVG, ELASTIC, MODEL, DATA, RUNTIME)  # the flag groups of train and compare


def _add_common(p: argparse.ArgumentParser, d: TrainConfig) -> None:
    """Flags shared by ``train`` and ``compare`` (defaults from ``d``): ``--nproc``, then
    TrainConfig's but ``--strategy`` and the output group."""
    g = p.add_argument_group(TOPOLOGY)
    g.add_argument("--nproc", type=int, default=None,
                   help="launch N local CPU processes with gloo (default: torchrun's env, else 1)")
    TrainConfig.add_arguments(p, d, groups=_COMMON, into={TOPOLOGY: g})


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
    TrainConfig.add_arguments(p, d, groups=(None,))  # --strategy
    _add_common(p, d)
    TrainConfig.add_arguments(p, d, groups=(OUTPUT,))
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
