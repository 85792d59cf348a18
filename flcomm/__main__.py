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

        info = build_info()
        print(json.dumps(info, indent=2) if args.json else format_info(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
