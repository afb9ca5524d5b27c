"""The optimizer's arguments checked before they reach the core: finite, in range, and representable in float32
(one NaN or Inf in a hyper-parameter would turn every weight into NaN in a single step)."""
from __future__ import annotations

import math
import numbers

from .. import cli


def check_step_args(lr, weight_decay, beta1, beta2, eps, grad_clip) -> None:
    """ValueError naming the argument unless every AdamW hyperparameter is a finite real number in its range:
    lr >= 0, weight_decay >= 0, 0 <= beta1, beta2 < 1, eps > 0, grad_clip >= 0 or None (no clipping). One
    NaN or Inf here would turn every weight into NaN in a single step."""
    for name, v in (("lr", lr), ("weight_decay", weight_decay), ("beta1", beta1), ("beta2", beta2), ("eps", eps),
                    ("grad_clip", 0.0 if grad_clip is None else grad_clip)):
        _STEP_CHECKS[name].check(v, name)


# the core computes the update in float32: each hyper-parameter must survive the rounding (lr=1e39 is inf there,
# eps=1e-50 is 0, beta2=0.999999999 is 1.0), else one step turns every weight into NaN
_STEP_CHECKS = {
    "lr": cli.Float(0, float32=True, what="a finite number in [0, inf) representable in float32"),
    "weight_decay": cli.Float(0, float32=True, what="a finite number in [0, inf) representable in float32"),
    "beta1": cli.Float(0, 1, hi_open=True, float32=True, what="a finite number in [0, 1) in float32"),
    "beta2": cli.Float(0, 1, hi_open=True, float32=True, what="a finite number in [0, 1) in float32"),
    "eps": cli.Float(0, lo_open=True, float32=True, what="a finite number in (0, inf) representable in float32"),
    "grad_clip": cli.Float(0, float32=True, what="a finite number in [0, inf) (0 or None: off) in float32"),
}


def _grad_scale(v) -> float:
    return cli.Float(what="a finite number").check(v, "grad_scale")


def check_muon_args(muon_lr, muon_momentum, muon_weight_decay, muon_ns_steps) -> None:
    """ValueError naming the argument unless Muon's settings are in range: muon_lr >= 0, 0 <= muon_momentum < 1,
    muon_weight_decay >= 0 (finite), muon_ns_steps an integer in [0, 100]."""
    ranges = {"muon_lr": (muon_lr, 0.0, math.inf, "[0, inf)"), "muon_momentum": (muon_momentum, 0.0, 1.0, "[0, 1)"),
              "muon_weight_decay": (muon_weight_decay, 0.0, math.inf, "[0, inf)")}
    for name, (v, lo, hi, text) in ranges.items():
        if not (isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v) and lo <= v < hi):
            raise ValueError(f"{name} must be a finite number in {text}, got {v!r}")
    if isinstance(muon_ns_steps, bool) or not isinstance(muon_ns_steps, numbers.Integral) or \
            not 0 <= muon_ns_steps <= 100:
        raise ValueError(f"muon_ns_steps must be an integer in [0, 100], got {muon_ns_steps!r}")


def check_group_lrs(optimizer, embedding_lr, head_lr) -> None:
    """ValueError naming the argument unless the AdamW group LRs are None or in range (as lr), and only given with
    optimizer="muon" (under AdamW alone every tensor takes lr)."""
    for name, v in (("embedding_lr", embedding_lr), ("head_lr", head_lr)):
        if v is None:
            continue
        if optimizer != "muon":
            raise ValueError(f"{name} is a group LR of optimizer='muon' (with {optimizer!r} every tensor takes lr)")
        _STEP_CHECKS["lr"].check(v, name)


def check_loss_scale_args(init, interval) -> None:
    """ValueError naming the argument unless the loss scaler's initial scale is a finite number > 0 and its growth
    interval an integer >= 1."""
    if isinstance(init, bool) or not isinstance(init, numbers.Real) or not (math.isfinite(init) and init > 0):
        raise ValueError(f"loss_scale_init must be a finite number > 0 (e.g. 65536 = 2**16), got {init!r}")
    if isinstance(interval, bool) or not isinstance(interval, numbers.Integral) or not 1 <= interval < 2**31:
        raise ValueError(f"loss_scale_interval must be an integer >= 1 (steps without overflow before the scale "
                         f"doubles), got {interval!r}")
