"""Loss and gradient-norm outlier detection over a moving window, as llm.c does (llmc/outlier_detector.h).

A training loss or gradient norm far above its recent values is the first sign of a bad batch or of an
instability about to diverge. `OutlierDetector.update(x)` returns the z-score of x against the previous
`window` values,

    z = (x - mean) / std      (mean and population std of the window; NaN until the window is full),

then adds x to the window. llm.c includes x in its own window's statistics; here it is compared with the
values before it, so a single spike is not damped by itself (z of a spike of k sigma is k, not less).
Every value joins the window, skipped or not: a lasting change of level stops being an outlier after
`window` steps instead of skipping every update from then on.
"""
from __future__ import annotations

import math
from collections import deque

import numpy as np

WINDOW = 128  # llm.c's OUTLIER_DETECTOR_WINDOW_SIZE


class OutlierDetector:
    def __init__(self, window: int = WINDOW):
        if int(window) != window or window < 2:
            raise ValueError(f"window must be an integer >= 2, got {window!r}")
        self.window = int(window)
        self.values: deque[float] = deque(maxlen=self.window)

    def zscore(self, x: float) -> float:
        """z of x against the window (NaN until it is full; +-inf for a non-finite x, or any x other than
        the mean of a constant window)."""
        if len(self.values) < self.window:
            return math.nan
        if not math.isfinite(x):
            return math.copysign(math.inf, x) if not math.isnan(x) else math.inf
        w = np.fromiter(self.values, dtype=np.float64, count=len(self.values))
        mean, std = float(w.mean()), float(w.std())  # computed afresh: no running-sum cancellation
        if std == 0.0:
            return 0.0 if x == mean else math.copysign(math.inf, x - mean)
        return (x - mean) / std

    def update(self, x: float) -> float:
        """The z-score of x (see zscore), then x joins the window (non-finite values never do)."""
        z = self.zscore(float(x))
        if math.isfinite(x):
            self.values.append(float(x))
        return z

    def state_dict(self) -> dict:
        """The window (JSON floats round-trip exactly), so that a resumed run flags the same steps."""
        return {"window": self.window, "values": list(self.values)}

    def load_state_dict(self, d: dict) -> None:
        if int(d["window"]) != self.window:
            raise ValueError(f"outlier window was {d['window']}, this detector's is {self.window}")
        self.values = deque((float(v) for v in d["values"]), maxlen=self.window)


__all__ = ["OutlierDetector", "WINDOW"]
