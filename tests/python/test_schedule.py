"""lr_at: linear warmup, then cosine decay to min_lr (10% of max_lr by default) or constant."""
import math

import pytest

from gpt2core.schedule import lr_at


def expected(step, max_lr, warmup, total, min_lr=None, kind="cosine"):
    """Written from the formula: (step+1)/warmup ramp, then half a cosine period from max_lr down to
    min_lr over the steps warmup..total, then min_lr."""
    min_lr = 0.1 * max_lr if min_lr is None else min_lr
    if step < warmup:
        return max_lr * (step + 1) / warmup
    if kind == "constant":
        return max_lr
    if step >= total:
        return min_lr
    progress = (step - warmup) / (total - warmup)
    return min_lr + (max_lr - min_lr) * (math.cos(math.pi * progress) + 1) / 2


@pytest.mark.parametrize("max_lr,warmup,total,min_lr", [
    (6e-4, 7, 53, None),
    (1.0, 1, 10, 0.0),
    (3e-3, 0, 17, 1e-4),
    (2.5, 13, 14, 0.5),
])
def test_cosine_matches_formula(max_lr, warmup, total, min_lr):
    for step in range(total + 5):
        assert lr_at(step, max_lr, warmup, total, min_lr) == pytest.approx(
            expected(step, max_lr, warmup, total, min_lr), rel=1e-12, abs=1e-15), step


def test_landmarks():
    max_lr, warmup, total = 6e-4, 10, 110
    assert lr_at(0, max_lr, warmup, total) == pytest.approx(max_lr / warmup)
    assert lr_at(warmup - 1, max_lr, warmup, total) == pytest.approx(max_lr)
    assert lr_at(warmup, max_lr, warmup, total) == pytest.approx(max_lr)       # cosine starts at the top
    mid = warmup + (total - warmup) // 2
    assert lr_at(mid, max_lr, warmup, total) == pytest.approx(0.55 * max_lr)  # halfway to 10%
    assert lr_at(total - 1, max_lr, warmup, total) > 0.1 * max_lr
    for step in (total, total + 1, 10 * total):
        assert lr_at(step, max_lr, warmup, total) == pytest.approx(0.1 * max_lr)
    lrs = [lr_at(s, max_lr, warmup, total) for s in range(total + 3)]
    assert all(a < b for a, b in zip(lrs[:warmup], lrs[1:warmup]))              # strictly rising
    assert all(a >= b for a, b in zip(lrs[warmup:], lrs[warmup + 1:]))          # then never rising
    assert all(l > 0 for l in lrs)


def test_constant():
    for step in range(40):
        want = 1e-3 * (step + 1) / 5 if step < 5 else 1e-3
        assert lr_at(step, 1e-3, 5, 20, kind="constant") == pytest.approx(want, rel=1e-12)


def test_unknown_kind_raises():
    with pytest.raises(ValueError, match="linear"):
        lr_at(10, 1e-3, 5, 20, kind="linear")
