"""``python -m flcomm info``: what flcomm was built with and what this machine offers."""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="flcomm", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    pi = sub.add_parser("info", help="versions, native kernels, CUDA/NCCL, GPUs")
    pi.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = p.parse_args(argv)
    if args.cmd == "info":
        from flcomm.info import build_info, format_info

        info = {**build_info(), "transports": transports()}
        print(json.dumps(info, indent=2) if args.json else format_info(info))
    return 0


def transports() -> dict[str, str]:
    """What ``init_fed_mesh(topology, transport=...)`` can use here: ``torch`` (torch.distributed's process
    groups) always; ``native`` (flcomm's own NCCL communicators) when an NcclTransport can be
    built (:func:`flcomm.comm.nccl.nccl_available`), else why not."""
    # NOTE: here, not in flcomm.info, which the transports' layer sits above
    from flcomm.comm.nccl import nccl_available

    ok, why = nccl_available()
    return {"torch": "available (torch.distributed process groups)",
            "native": f"available ({why})" if ok else f"unavailable: {why}"}


if __name__ == "__main__":
    sys.exit(main())
