"""FP8 helpers for test references (numpy + ml_dtypes, independent of csrc/model/fp8.h): the e4m3 / e5m2 rounding
of the GPU's cvt.rn.satfinite, the per-tensor power-of-two scale, and the float32 inputs that exercise a conversion
(every code, every tie, the boundaries, random bit patterns)."""
import ml_dtypes
import numpy as np

FMT = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}
MAX = {"e4m3": 448.0, "e5m2": 57344.0}
MIN_SUB = {"e4m3": 2.0 ** -9, "e5m2": 2.0 ** -16}
MIN_NORMAL = {"e4m3": 2.0 ** -6, "e5m2": 2.0 ** -14}
KINDS = ("e4m3", "e5m2")


def ref_bits(x, kind) -> np.ndarray:
    """float32 -> fp8 bit patterns (uint8): ml_dtypes' round to nearest even after clamping to the largest finite
    value, which is what cvt.rn.satfinite does (beyond it, infinities included: +-max; NaN stays NaN)."""
    x = np.asarray(x, np.float32)
    with np.errstate(invalid="ignore"):  # NaN inputs: NaN codes, quietly
        return np.clip(x, -MAX[kind], MAX[kind]).astype(FMT[kind]).view(np.uint8)


def decode(bits, kind) -> np.ndarray:
    """fp8 bit patterns -> their values, float64 (exact)."""
    return np.asarray(bits, np.uint8).view(FMT[kind]).astype(np.float64)


def ref_cast(x, kind) -> np.ndarray:
    """What gpt2core.fp8_cast(x, kind) returns: x rounded to fp8, as float32."""
    return decode(ref_bits(x, kind), kind).astype(np.float32)


def ref_scale(amax, kind) -> float:
    """The largest power of two s with amax * s <= max (float64), within [2^-126, 2^126]; 1 for 0, Inf, NaN."""
    amax = float(amax)
    if amax == 0 or not np.isfinite(amax):
        return 1.0
    e = int(np.floor(np.log2(MAX[kind] / amax)))
    while amax * 2.0 ** e > MAX[kind]:
        e -= 1
    while amax * 2.0 ** (e + 1) <= MAX[kind]:
        e += 1
    return 2.0 ** min(126, max(-126, e))


def ref_quantize(x, kind, scale_factor=1.0):
    """x (float32 values) quantised with its current per-tensor scale: (bits, 1 / s, amax). scale_factor multiplies
    the scale (a wrong scale, for checks that a test would see one)."""
    x = np.asarray(x, np.float32)
    amax = np.float32(np.max(np.abs(x))) if x.size else np.float32(0)
    s = ref_scale(amax, kind) * scale_factor
    return ref_bits((x.astype(np.float64) * s).astype(np.float32), kind), 1.0 / s, amax


def codes(kind) -> np.ndarray:
    """All 256 codes' values as float32 (NaNs and, for e5m2, +-Inf included)."""
    return decode(np.arange(256, dtype=np.uint8), kind).astype(np.float32)


def ties(kind) -> np.ndarray:
    """Every midpoint between neighbouring finite codes (exact in float32), the float32 values just either side of
    each, of both signs: subnormal midpoints, and the one between the largest subnormal and the smallest normal."""
    pos = np.sort(decode(np.arange(0x80, dtype=np.uint8), kind))
    pos = pos[np.isfinite(pos)]
    mid = ((pos[:-1] + pos[1:]) / 2).astype(np.float32)
    assert np.array_equal(mid.astype(np.float64), (pos[:-1] + pos[1:]) / 2)  # exact
    x = np.concatenate([mid, np.nextafter(mid, np.float32(np.inf)), np.nextafter(mid, np.float32(0))])
    return np.concatenate([x, -x])


def boundaries(kind) -> np.ndarray:
    """The edges of the format, positive then the same negated: max, just above it, the tie above it, Inf, NaN,
    half the smallest subnormal and its neighbours, subnormal ties, the normal / subnormal edge, float32
    subnormals, zero."""
    mx, ms, mn = MAX[kind], MIN_SUB[kind], MIN_NORMAL[kind]
    ulp_max = mx - decode(ref_bits(np.float32(mx), kind) - 1, kind)  # the gap below max
    f32 = np.float32
    x = np.array([mx, np.nextafter(f32(mx), f32(np.inf)), mx + ulp_max / 2, mx + ulp_max, 2 * mx, 1e30, np.inf,
                  np.finfo(np.float32).max, np.nan, ms, ms / 2, np.nextafter(f32(ms / 2), f32(1)),
                  np.nextafter(f32(ms / 2), f32(0)), 1.5 * ms, 2.5 * ms, mn, mn - ms, mn - ms / 2, mn / 2,
                  np.nextafter(f32(mn), f32(0)), 1e-45, 1e-40, np.finfo(np.float32).tiny, 0.0, 1.0, 1.0625, 1.125],
                 np.float32)
    return np.concatenate([x, -x])


def random_floats(seed, n=200_000) -> np.ndarray:
    """n random float32 bit patterns (every class: NaN, Inf, subnormal, huge) and n values of both signs over the
    binades around the fp8 range."""
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, 2 ** 32, n, dtype=np.uint64).astype(np.uint32).view(np.float32)
    near = (rng.uniform(-1, 1, n) * 2.0 ** rng.integers(-20, 18, n)).astype(np.float32)
    return np.concatenate([bits, near])
