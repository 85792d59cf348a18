"""What the GPU tests and probes share: the figures they record for tools/gpu_check.sh, and the
clock rate torch.cuda._sleep is sized from."""

from __future__ import annotations

import json
import os


def figure(test: str, **values) -> None:
    """Record a probe's figures for tools/gpu_check.sh (one JSON line per call to the file named
    by FLCOMM_GPU_FIGURES; nothing without it)."""
    path = os.environ.get("FLCOMM_GPU_FIGURES")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"test": test, **values}) + "\n")


# NOTE: torch.cuda._sleep spins for a number of GPU clock cycles; ~2e9 per second on an H200
# (1.98 GHz boost). The probes size their sleeps from this and measure what they rely on.
CYCLES_PER_S = 2_000_000_000
