"""The reference trainer's documented rules, written independently of flcomm.train."""

from __future__ import annotations

import math


def schedule(step: int, lr: float, warmup: int, steps: int, min_lr_ratio: float) -> float:
    """The documented LR schedule of 1-based ``step``: linear warm-up to lr over ``warmup``
    steps, then cosine decay to ``min_lr_ratio lr`` at the last step."""
    if step <= warmup:
        return lr * step / warmup
    lo = lr * min_lr_ratio
    return lo + (lr - lo) * (1 + math.cos(math.pi * (step - warmup) / (steps - warmup))) / 2
