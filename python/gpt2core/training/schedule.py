"""Learning-rate schedules (linear warmup, then cosine decay, constant, or warmup-stable-decay) and Muon's momentum
warm-up."""
from __future__ import annotations

import math

SCHEDULES = ("cosine", "constant", "wsd")


def lr_at(step: int, max_lr: float, warmup_steps: int, total_steps: int, min_lr: float | None = None,
          kind: str = "cosine", cooldown_frac: float = 0.4) -> float:
    """LR for optimizer step `step` (0-based).

    warmup: lr = max_lr * (step + 1) / warmup_steps for step < warmup_steps;
    cosine: then min_lr + 0.5 * (1 + cos(pi * r)) * (max_lr - min_lr), r = (step - warmup) / (total - warmup),
    and min_lr after total_steps; min_lr defaults to 10% of max_lr;
    constant: max_lr after warmup;
    wsd (warmup-stable-decay, Hu et al. 2024 "MiniCPM" and modded-nanogpt's records): max_lr until the last
    cooldown_frac of the total steps, then a straight line down to min_lr at total_steps:
    lr = min_lr + (max_lr - min_lr) * (total - step) / cooldown_steps in the cool-down, cooldown_steps =
    round(cooldown_frac * total); min_lr after total_steps.
    """
    if min_lr is None:
        min_lr = 0.1 * max_lr
    if step < warmup_steps:
        return max_lr * (step + 1) / warmup_steps
    if kind == "constant":
        return max_lr
    if kind == "wsd":
        if not 0.0 <= cooldown_frac <= 1.0:
            raise ValueError(f"cooldown_frac must be in [0, 1], got {cooldown_frac!r}")
        if step >= total_steps:
            return min_lr
        cooldown = round(cooldown_frac * total_steps)
        left = total_steps - step  # 1 .. total
        if left > cooldown:
            return max_lr
        return min_lr + (max_lr - min_lr) * left / cooldown
    if kind != "cosine":
        raise ValueError(f"unknown schedule {kind!r} ({', '.join(SCHEDULES)})")
    if step >= total_steps:
        return min_lr
    r = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * r)) * (max_lr - min_lr)


def muon_momentum_at(step: int, momentum: float, warmup_steps: int, start: float = 0.85) -> float:
    """Muon's momentum for optimizer step `step` (0-based): a linear warm-up from `start` to `momentum` over
    warmup_steps steps, then `momentum` (modded-nanogpt's rule: 0.85 -> 0.95 over the first 300 steps)."""
    if warmup_steps <= 0 or step >= warmup_steps:
        return momentum
    frac = step / warmup_steps
    return (1.0 - frac) * min(start, momentum) + frac * momentum
