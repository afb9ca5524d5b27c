"""Learning-rate schedules: linear warmup, then cosine decay to min_lr (or constant)."""
from __future__ import annotations

import math


def lr_at(step: int, max_lr: float, warmup_steps: int, total_steps: int, min_lr: float | None = None,
          kind: str = "cosine") -> float:
    """LR for optimizer step `step` (0-based).

    warmup: lr = max_lr * (step + 1) / warmup_steps for step < warmup_steps;
    cosine: then min_lr + 0.5 * (1 + cos(pi * r)) * (max_lr - min_lr), r = (step - warmup) / (total - warmup),
    and min_lr after total_steps; min_lr defaults to 10% of max_lr;
    constant: max_lr after warmup.
    """
    if min_lr is None:
        min_lr = 0.1 * max_lr
    if step < warmup_steps:
        return max_lr * (step + 1) / warmup_steps
    if kind == "constant":
        return max_lr
    if kind != "cosine":
        raise ValueError(f"unknown schedule {kind!r} (cosine or constant)")
    if step >= total_steps:
        return min_lr
    r = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * r)) * (max_lr - min_lr)
