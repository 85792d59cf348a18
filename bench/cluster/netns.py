"""The emulated two-tier cluster's command line: run a command on every rank, measure the tiers,
clean up. The cluster itself (namespaces, tbf-shaped veths, the launcher) is
:mod:`flcomm.train.netns`, which ``python -m flcomm.train compare`` runs on.

Usage (as root)::

    # run a command on every rank (torchrun-style env: RANK, WORLD_SIZE, LOCAL_RANK, ...)
    python -m bench.cluster.netns run --nodes 4 --ranks-per-node 2 --rate 100mbit -- \\
        python -m flcomm.train --backend gloo --strategy fsdp ...
    # the same with each node's ranks on the node's own share of the CPUs
    python -m bench.cluster.netns run --pin --nodes 2 --ranks-per-node 2 --rate 100mbit -- ...
    # measure the shaped (inter-node) vs unshaped (intra-node) bandwidth with gloo all_reduce
    python -m bench.cluster.netns selfcheck --nodes 2 --ranks-per-node 2 --rate 100mbit
    # remove namespaces a killed run left behind
    python -m bench.cluster.netns cleanup
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Callable

from flcomm.train.netns import PREFIX, ClusterError, ClusterSpec, EmulatedCluster, cleanup, list_namespaces


def selfcheck(spec: ClusterSpec, ranks_per_node: int = 2, size_mb: float = 4.0, iters: int = 3,
              timeout: float = 180.0, python: str = sys.executable,
              log: Callable[[str], None] = print, tag: str | None = None) -> dict:
    """Measure the tiers of an emulated cluster with gloo all_reduce and compare the inter-node
    figure with the tbf rate.

    Steps: bring the cluster up; run ``python -m flcomm.costmodel --measure`` on every rank
    (all-reduces inside each node, then across nodes); read its JSON; tear down.
    Returns the measurement plus ``shaped_bits`` and ``inter_over_shaped``. ``tag`` names the
    cluster's namespaces (:class:`EmulatedCluster`; default: a random one).
    """
    if spec.nodes < 2 or ranks_per_node < 2:
        raise ValueError(f"selfcheck needs >= 2 nodes and >= 2 ranks per node to see both tiers, "
                         f"got {spec.nodes} nodes x {ranks_per_node}")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with tempfile.TemporaryDirectory(prefix="flcn-check-") as tmp:
        out = os.path.join(tmp, "measure.json")
        argv = [python, "-m", "flcomm.costmodel", "--measure", "--backend", "gloo",
                "--ranks-per-node", str(ranks_per_node), "--measure-mb", str(size_mb),
                "--measure-iters", str(iters), "--measure-json", out]
        env = {"PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
        with EmulatedCluster(spec, tag=tag) as c:
            c.launch(argv, ranks_per_node, env=env, timeout=timeout, stream_rank0=False,
                     log_dir=os.path.join(tmp, "logs"), cwd=root)
        with open(out) as f:
            res = json.load(f)
    shaped = spec.rate_bits
    inter_bits = res["inter_node"]["bandwidth_Bps"] * 8
    intra_bits = res["intra_node"]["bandwidth_Bps"] * 8
    res["shaped_bits"] = shaped
    res["inter_over_shaped"] = inter_bits / shaped
    res["intra_over_inter"] = intra_bits / inter_bits
    log(f"inter-node (shaped {shaped / 1e6:.0f} Mbit/s): {inter_bits / 1e6:8.1f} Mbit/s per node "
        f"({100 * inter_bits / shaped:.0f}% of the tbf rate)")
    log(f"intra-node (unshaped):            {intra_bits / 1e6:8.1f} Mbit/s per rank "
        f"({intra_bits / inter_bits:.1f}x inter-node)")
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.cluster.netns", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--nodes", type=int, default=2, help="namespaces (nodes)")
        sp.add_argument("--ranks-per-node", type=int, default=2)
        sp.add_argument("--rate", default="100mbit", help="inter-node rate per node and direction (tc units)")
        sp.add_argument("--burst", default="256kb", help="tbf burst (>= 256kb)")
        sp.add_argument("--timeout", type=float, default=600.0, help="seconds before every rank is stopped")

    pr = sub.add_parser("run", help="run a command on every rank (after --)")
    common(pr)
    pr.add_argument("--log-dir", default=None, help="rank<r>.log per rank (default: a temp dir)")
    pr.add_argument("--pin", action="store_true",
                    help="run each node's ranks on the node's own share of the CPUs")
    pr.add_argument("argv", nargs=argparse.REMAINDER, help="-- command ...")
    ps = sub.add_parser("selfcheck", help="measure shaped vs unshaped bandwidth with gloo all_reduce")
    common(ps)
    ps.add_argument("--size-mb", type=float, default=4.0)
    ps.add_argument("--json", default=None, help="write the measurement here")
    sub.add_parser("cleanup", help=f"delete every namespace named {PREFIX}* (left by a killed run)")
    sub.add_parser("list", help=f"list namespaces named {PREFIX}*")
    a = p.parse_args(argv)
    try:
        if a.cmd == "cleanup":
            gone = cleanup()
            print(f"deleted {len(gone)} namespaces" + (f": {' '.join(gone)}" if gone else ""))
            return 0
        if a.cmd == "list":
            print("\n".join(list_namespaces()))
            return 0
        spec = ClusterSpec(a.nodes, a.rate, a.burst)
        if a.cmd == "selfcheck":
            res = selfcheck(spec, a.ranks_per_node, a.size_mb, timeout=a.timeout)
            if a.json:
                with open(a.json, "w") as f:
                    json.dump(res, f, indent=2)
            return 0
        cmd = a.argv[1:] if a.argv and a.argv[0] == "--" else a.argv
        if not cmd:
            p.error("run needs a command after --")
        with EmulatedCluster(spec) as c:
            c.launch(cmd, a.ranks_per_node, timeout=a.timeout, log_dir=a.log_dir, pin=a.pin)
        return 0
    except PermissionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 77
    except (ClusterError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:
        print(f"interrupted ({e}); the cluster was torn down", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
