"""fp8_cast (csrc/model/fp8.h through the binding in csrc/bindings.cpp): float32 rounded to FP8 e4m3 / e5m2 as the
GPU's cvt.rn.satfinite does, against ml_dtypes (tests/fp8.py): every one of the 256 codes of each format, every tie
between neighbouring codes and the float32 values either side of it, the boundaries (the largest finite value, just
above it, Inf, NaN, half the smallest subnormal, the subnormal / normal edge, signed zeros) and random float32 bit
patterns; bad arguments raise a ValueError naming the argument."""
import numpy as np
import pytest

import gpt2core
from gpt2core import _C

from fp8 import KINDS, MAX, MIN_SUB, boundaries, codes, random_floats, ref_cast, ties


def check(x, kind, what):
    x = np.asarray(x, np.float32)
    got, want = _C.fp8_cast(x, kind), ref_cast(x, kind)
    assert got.dtype == np.float32 and got.shape == x.shape, what
    bad = ~((got == want) | (np.isnan(got) & np.isnan(want)))
    assert not bad.any(), f"{what} {kind}: {x[bad][:5]} -> {got[bad][:5]}, want {want[bad][:5]}"
    assert np.array_equal(np.signbit(got[~np.isnan(x)]), np.signbit(want[~np.isnan(x)])), f"{what}: signs"
    return got


@pytest.mark.parametrize("kind", KINDS)
def test_every_code_is_kept(kind):
    vals = codes(kind)
    got = check(vals, kind, "every code")
    finite = np.isfinite(vals)
    assert np.array_equal(got[finite], vals[finite]) and np.isnan(got[np.isnan(vals)]).all()
    if kind == "e5m2":  # the format's infinities saturate
        assert list(got[np.isinf(vals)]) == [MAX[kind], -MAX[kind]]


@pytest.mark.parametrize("kind", KINDS)
def test_ties_round_to_even(kind):
    check(ties(kind), kind, "ties")


@pytest.mark.parametrize("kind", KINDS)
def test_boundaries(kind):
    x = boundaries(kind)
    got = check(x, kind, "boundaries")
    n, mx, ms = len(x) // 2, MAX[kind], MIN_SUB[kind]
    assert got[1] == mx and got[2] == mx and got[6] == mx and got[n + 6] == -mx  # saturation, Inf included
    assert got[10] == 0 and not np.signbit(got[10]) and np.signbit(got[n + 10])  # half the smallest subnormal
    assert got[11] == ms and got[13] == 2 * ms and got[14] == 2 * ms  # ties between subnormals go to even
    assert np.isnan(got[8]) and np.isnan(got[n + 8])


@pytest.mark.parametrize("kind", KINDS)
def test_random_float32(kind):
    check(random_floats(11 + len(kind)), kind, "random")


def test_any_shape_and_layout():
    x = np.arange(48, dtype=np.float32).reshape(2, 4, 6)[:, ::2, 1:] * 3.3
    got = _C.fp8_cast(x, "e4m3")
    assert got.shape == x.shape and got.flags.c_contiguous and np.array_equal(got, ref_cast(x, "e4m3"))
    assert _C.fp8_cast(np.array(300.0, np.float32), "e5m2").shape == ()
    assert _C.fp8_cast(np.zeros(0, np.float32), "e5m2").shape == (0,)


def test_bad_arguments_name_the_argument():
    with pytest.raises(ValueError, match="kind must be 'e4m3' or 'e5m2', got 'e3m4'"):
        _C.fp8_cast(np.ones(3, np.float32), "e3m4")
    with pytest.raises(ValueError, match="x must be a float32 numpy array, got dtype float64"):
        _C.fp8_cast(np.ones(3), "e4m3")
    with pytest.raises(ValueError, match="x must be a float32 numpy array, got dtype int32"):
        _C.fp8_cast(np.ones(3, np.int32), "e4m3")
    with pytest.raises(ValueError, match="x must be a float32 numpy array"):
        _C.fp8_cast([1.0, 2.0], "e5m2")


def test_the_public_function_is_the_binding():
    x = np.array([1.0, 460.0, -1e-3, np.inf], np.float32)
    assert np.array_equal(gpt2core.fp8_cast(x, "e4m3"), _C.fp8_cast(x, "e4m3"))
    assert list(gpt2core.fp8_cast(x, "e4m3")) == [1.0, 448.0, -0.001953125, 448.0]
    with pytest.raises(ValueError, match="kind must be"):
        gpt2core.fp8_cast(x, "fp8")
