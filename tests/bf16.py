"""bf16 helpers for test references (numpy only, float32/float64): bf16 is the top 16 bits of an IEEE fp32."""
import numpy as np


def round_bf16(x) -> np.ndarray:
    """x rounded to the nearest bf16 value (ties to even), returned as float32 (exactly representable).

    Same as __float2bfloat16_rn for finite values; NaN stays NaN, +-Inf stays +-Inf, values above the largest
    bf16 round to Inf as in IEEE.
    """
    x = np.ascontiguousarray(np.asarray(x, dtype=np.float32))
    u = x.view(np.uint32).astype(np.uint64)
    lsb = (u >> 16) & 1
    r = ((u + 0x7FFF + lsb) >> 16) << 16  # add half an ulp (minus one, plus the kept lsb: ties to even)
    out = r.astype(np.uint32).view(np.float32).reshape(x.shape)
    return np.where(np.isnan(x), x, out).astype(np.float32)


def bf16_bits(x) -> np.ndarray:
    """The 16-bit patterns (uint16) of values that are exactly bf16 (e.g. outputs of an OpsBF16 op)."""
    x = np.ascontiguousarray(np.asarray(x, dtype=np.float32))
    u = x.view(np.uint32)
    assert np.all((u & 0xFFFF) == 0), "not a bf16 value"
    return (u >> 16).astype(np.uint16)


def bf16_neighbours(x) -> tuple:
    """(lower, upper): the bf16 values just below-or-equal / just above-or-equal each finite float32 x, toward
    zero and away from zero in magnitude (equal when x is exactly bf16), as float32."""
    x = np.ascontiguousarray(np.asarray(x, dtype=np.float32))
    u = x.view(np.uint32)
    down = (u & np.uint32(0xFFFF0000)).view(np.float32)  # truncation: toward zero
    exact = (u & 0xFFFF) == 0
    up_bits = ((u.astype(np.uint64) & 0xFFFF0000) + 0x10000).astype(np.uint32)
    up = np.where(exact, u, up_bits).view(np.float32)  # away from zero
    return down.reshape(x.shape), up.reshape(x.shape)
