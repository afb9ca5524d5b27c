"""Progress on long waits: tqdm bars on stderr, and elapsed time / ETA for the training log line.

Bars are shown only when asked for and when stderr is a terminal (tqdm's ``disable=None``): logs
redirected to a file, CI and notebooks stay free of carriage-return noise.
"""
from __future__ import annotations

import sys

from tqdm import tqdm


def bar(iterable=None, enabled: bool = True, **kw) -> tqdm:
    """A tqdm bar on stderr, silent unless `enabled` and stderr is a terminal. A silent bar still
    accepts update() / set_postfix(), so callers need no second code path."""
    return tqdm(iterable, disable=None if enabled else True, file=sys.stderr, dynamic_ncols=True, **kw)


def hms(seconds: float) -> str:
    """1:02:03 (hours) or 2:03 (minutes:seconds)."""
    s = int(round(seconds))
    h, m, s = s // 3600, s // 60 % 60, s % 60
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def eta(elapsed: float, done: int, todo: int) -> str:
    """'elapsed 1:05 | eta 12:00': the remaining `todo` steps at the mean time of the `done` so far
    (evaluations included, so the estimate covers them at the rate they occurred)."""
    left = elapsed / done * todo if done > 0 else float("nan")
    return f"elapsed {hms(elapsed)} | eta {hms(left) if left == left else '?'}"
