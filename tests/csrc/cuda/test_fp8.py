"""FP8 (issue 49) without a GPU, against independent references (ml_dtypes for the rounding, float64 numpy for
the rest):

- csrc/model/fp8.h's float -> fp8 conversion as bit patterns (round to nearest even, subnormals, NaN kept,
  saturation as cvt.rn.satfinite) over every code, every tie between neighbouring codes, the boundaries and random
  float32 bit patterns, against ml_dtypes (tests/fp8.py) and against NVIDIA's own host implementation of the
  conversion (cuda_fp8.h); the values through the binding: tests/csrc/test_fp8_cast.py;
- the per-tensor power-of-two scale (fp8_scale);
- the amax + cast kernels of csrc/cuda/fp8.cuh (emulated) and the CPU backend's reference of them: q, its
  transpose and meta = [1 / s, amax], bit for bit;
- the FP8 Linear forward and backward (Backend::fp8_linear_*: the emulated CUDA backend through the cuBLASLt
  seam's FP8 path, and the CPU reference) against float64 numpy of the same quantisation, exact up to the fp32
  summation order; q, qt and meta exactly. The inputs span many binades, so that a wrong scale changes the result
  beyond the tolerance (checked: the reference itself moves when its scale does; too large saturates the largest
  values, much too small flushes the smallest to zero).

Tolerances: products of fp8 values are exact in fp32, so the only differences are fp32 summation order (k terms:
k * 2^-24 of the sum of |products|) and, for bf16 outputs, one rounding (2^-8 relative).
"""
import numpy as np
import pytest

from bf16 import round_bf16 as bf16
from fp8 import KINDS, MAX, boundaries, codes, decode, random_floats, ref_bits, ref_quantize, ref_scale, ties
from test_cuda_emu import emu  # noqa: F401  (fixture)


def wide_range(rng, shape, binades, top=1.0):
    """Random values of both signs, log-uniform over `binades` binades below `top` (never zero), rounded to bf16."""
    mag = top * 2.0 ** -rng.uniform(0, binades, shape)
    return bf16(mag * rng.choice([-1.0, 1.0], shape))


# ------------------------------------------------------------------------------------------ the conversion
def inputs(kind):
    return {"every code": codes(kind), "ties": ties(kind), "boundaries": boundaries(kind),
            "random": random_floats(5 + len(kind))}


@pytest.mark.parametrize("kind", KINDS)
def test_conversion_bits(emu, kind):  # noqa: F811
    """model/fp8.h's float_to_fp8 gives ml_dtypes' bits (clamped as satfinite) for every input class, NaN inputs a
    NaN code; every finite code converts to itself (-0 included), e5m2's infinities to +-max."""
    for what, x in inputs(kind).items():
        got, want = emu.float_to_fp8(x, kind), ref_bits(x, kind)
        nan = np.isnan(x)
        assert np.isnan(decode(got[nan], kind)).all(), what
        bad = (got != want) & ~nan
        assert not bad.any(), f"{what} {kind}: {x[bad][:5]} -> {got[bad][:5]} want {want[bad][:5]}"
    vals = codes(kind)
    finite = np.isfinite(vals)
    assert np.array_equal(emu.float_to_fp8(vals[finite], kind), np.arange(256, dtype=np.uint8)[finite])
    assert (emu.float_to_fp8(ties(kind)[: len(ties(kind)) // 6], kind) % 2 == 0).all()  # ties: the even code


@pytest.mark.parametrize("kind", KINDS)
def test_nvidias_host_conversion_agrees(emu, kind):  # noqa: F811
    """cuda_fp8.h's __nv_cvt_float_to_fp8(x, __NV_SATFINITE, ...) (NVIDIA's host code for what the device's
    cvt.rn.satfinite computes) gives the same bits as model/fp8.h, NaN inputs aside (both give a NaN code)."""
    for what, x in inputs(kind).items():
        ours, theirs = emu.float_to_fp8(x, kind), emu.nv_float_to_fp8(x, kind)
        nan = np.isnan(x)
        assert np.isnan(decode(theirs[nan], kind)).all() and np.isnan(decode(ours[nan], kind)).all()
        bad = (ours != theirs) & ~nan
        assert not bad.any(), f"{what}: {x[bad][:5]}: ours {ours[bad][:5]} NVIDIA's {theirs[bad][:5]}"


@pytest.mark.parametrize("kind", KINDS)
def test_fp8_scale(emu, kind):  # noqa: F811
    rng = np.random.default_rng(9)
    mx = MAX[kind]
    amaxes = [1.0, mx, np.nextafter(np.float32(mx), np.float32(np.inf)), np.nextafter(np.float32(mx), np.float32(0)),
              mx / 2, mx * 2, 0.0, np.inf, np.nan, 1e-45, 1e-38, 3e38, 1.75, 1.7499999, 1.7500001]
    amaxes += list((rng.uniform(0, 1, 500) * 2.0 ** rng.integers(-60, 60, 500)).astype(np.float32))
    for a in amaxes:
        got, want = emu.fp8_scale(float(np.float32(a)), kind), ref_scale(np.float32(a), kind)
        assert got == want, (a, got, want)
        if 0 < a < np.inf and 2.0 ** -126 < want < 2.0 ** 126:
            assert mx / 2 < np.float32(a) * want <= mx  # the largest such power of two


# ------------------------------------------------------------------------------------------ kernels and ops
def backends(emu):
    """(name, Ops) of every backend with the FP8 ops: the emulated CUDA backend (bf16 model: FP8 matmuls run in
    bf16 models; its quantise kernels also in an fp32 one) and the CPU reference (fp32)."""
    return {"cuda-bf16": emu.OpsBF16("cuda"), "cuda-f32": emu.Ops("cuda"), "cpu": emu.Ops("cpu")}


@pytest.mark.parametrize("shape", [(1, 1), (31, 33), (32, 32), (33, 64), (64, 31), (65, 96)])
def test_quantize_kernels_bit_for_bit(emu, shape):  # noqa: F811
    """The amax reduction and the cast (with its transpose) of csrc/cuda/fp8.cuh, emulated, and the CPU reference:
    q, qt and meta = [1 / s, amax] exactly as numpy, on tiles of 32 and one past, for both formats and every choice
    of layouts (a layout not asked for stays poisoned)."""
    rng = np.random.default_rng(shape[0] * 100 + shape[1])
    x = wide_range(rng, shape, 24, top=float(rng.uniform(0.5, 300)))
    for name, ops in backends(emu).items():
        for kind in KINDS:
            bits, inv, amax = ref_quantize(x, kind)
            for want_q, want_qt in ((True, True), (True, False), (False, True)):
                q, qt, meta = ops.fp8_quantize(x, kind, q=want_q, qt=want_qt)
                what = f"{name} {kind} {shape} q={want_q} qt={want_qt}"
                assert meta[1] == amax and meta[0] == np.float32(inv), (what, meta, amax, inv)
                assert np.array_equal(q, bits) if want_q else (q == 0xFF).all(), what
                assert np.array_equal(qt, bits.T) if want_qt else (qt == 0xFF).all(), what


def test_quantize_special_tensors(emu):  # noqa: F811
    """Boundaries of the scale: an all-zero tensor (amax 0: s = 1, all codes 0), one with an Inf (s = 1, saturated)
    and one with a NaN (amax NaN, s = 1, the NaN kept where it was)."""
    rng = np.random.default_rng(3)
    for name, ops in backends(emu).items():
        zeros = np.zeros((16, 32), np.float32)
        q, qt, meta = ops.fp8_quantize(zeros, "e4m3")
        assert (q == 0).all() and (qt == 0).all() and list(meta) == [1.0, 0.0], name
        x = wide_range(rng, (16, 32), 8)
        x[3, 5] = np.inf
        q, _, meta = ops.fp8_quantize(x, "e5m2")
        assert meta[0] == 1.0 and meta[1] == np.inf and np.array_equal(q, ref_bits(x, "e5m2")), name
        x[3, 5] = np.nan
        q, _, meta = ops.fp8_quantize(x, "e4m3")
        assert meta[0] == 1.0 and np.isnan(meta[1]), name
        assert np.isnan(decode(q[3, 5], "e4m3")) and np.array_equal(np.delete(q.ravel(), 3 * 32 + 5),
                                                                   np.delete(ref_bits(x, "e4m3").ravel(), 3 * 32 + 5))


# Linear shapes: C, OC multiples of 16 (cuBLASLt's FP8 kernels); N a multiple of 16 in backward (dW's k), any N
# forward. Tile multiples (32) and one step past them.
LINEAR_SHAPES = [(16, 16, 16), (48, 32, 64), (64, 96, 48), (32, 48, 112)]


def linear_inputs(rng, N, C, OC):
    x = wide_range(rng, (N, C), 20, top=4.0)
    w = wide_range(rng, (OC, C), 20, top=0.1)
    bias = bf16(rng.normal(0, 0.1, OC))
    dout = wide_range(rng, (N, OC), 36, top=1e-3)
    return x, w, bias, dout


def deq(bits, inv, kind):
    return decode(bits, kind) * inv


def sum_tol(a, b, k):
    """fp32 summation-order bound for a @ b with k terms: k * 2^-24 * (|a| @ |b|)."""
    return k * 2.0 ** -24 * (np.abs(a) @ np.abs(b))


@pytest.mark.parametrize("N,C,OC", LINEAR_SHAPES + [(37, 32, 16), (1, 16, 32)])
def test_fp8_linear_forward(emu, N, C, OC):  # noqa: F811
    rng = np.random.default_rng(N * 7 + C * 3 + OC)
    x, w, bias, _ = linear_inputs(rng, N, C, OC)
    xb, xinv, xamax = ref_quantize(x, "e4m3")
    wb, winv, wamax = ref_quantize(w, "e4m3")
    a, b = deq(xb, xinv, "e4m3"), deq(wb, winv, "e4m3")
    for with_bias in (True, False):
        want = a @ b.T + (bias if with_bias else 0)
        tol = sum_tol(a, b.T, C) + 1e-30
        # the test can fail: a scale too large saturates, one much too small flushes the small values to zero,
        # either moves the reference beyond the tolerance (and q, meta are compared exactly anyway)
        for f in (2.0, 2.0 ** -10):
            xb2, xinv2, _ = ref_quantize(x, "e4m3", f)
            assert (np.abs(deq(xb2, xinv2, "e4m3") @ b.T + (bias if with_bias else 0) - want) > 4 * tol).any()
        for name, ops in backends(emu).items():
            if name == "cuda-f32":
                continue  # FP8 matmuls run in bf16 models (checked below)
            out, (xq, xqt, xmeta), (wq, wqt, wmeta) = ops.fp8_linear_forward(x, w, bias if with_bias else None)
            what = f"{name} ({N}, {C}, {OC}) bias={with_bias}"
            assert np.array_equal(xq, xb) and np.array_equal(xqt, xb.T) and list(xmeta) == [xinv, xamax], what
            assert np.array_equal(wq, wb) and np.array_equal(wqt, wb.T) and list(wmeta) == [winv, wamax], what
            # the output: one rounding (bf16, or fp32 after the bias add)
            t = tol + (2.0 ** -8 if name == "cuda-bf16" else 2.0 ** -23) * np.abs(want)
            bad = np.abs(out - want) > t
            assert not bad.any(), f"{what}: {np.argwhere(bad)[:3].tolist()} {out[bad][:3]} vs {want[bad][:3]}"


def test_fp8_linear_needs_a_bf16_cuda_model(emu):  # noqa: F811
    rng = np.random.default_rng(1)
    x, w, bias, _ = linear_inputs(rng, 16, 16, 16)
    with pytest.raises(ValueError, match="FP8 matmuls run in bf16 models"):
        emu.Ops("cuda").fp8_linear_forward(x, w, bias)
    with pytest.raises(ValueError, match="FP8 matmuls run in bf16 models"):
        emu.OpsF16("cuda").fp8_linear_forward(x, w, bias)


@pytest.mark.parametrize("N,C,OC", LINEAR_SHAPES)
@pytest.mark.parametrize("write", [False, True])
def test_fp8_linear_backward(emu, N, C, OC, write):  # noqa: F811
    rng = np.random.default_rng(N * 11 + C * 5 + OC + write)
    x, w, _, dout = linear_inputs(rng, N, C, OC)
    dinp0 = np.full((N, C), np.nan, np.float32) if write else bf16(rng.normal(0, 1e-3, (N, C)))
    dw0 = rng.normal(0, 1e-2, (OC, C)).astype(np.float32)
    db0 = rng.normal(0, 1e-2, OC).astype(np.float32)
    xb, xinv, _ = ref_quantize(x, "e4m3")
    wb, winv, _ = ref_quantize(w, "e4m3")
    gb, ginv, gamax = ref_quantize(dout, "e5m2")
    a, b, g = deq(xb, xinv, "e4m3"), deq(wb, winv, "e4m3"), deq(gb, ginv, "e5m2")
    want_dinp = g @ b + (0 if write else dinp0)
    want_dw = dw0 + g.T @ a
    want_db = db0 + dout.astype(np.float64).sum(0)
    tol_dinp, tol_dw = sum_tol(g, b, OC) + 1e-30, sum_tol(g.T, a, N) + 1e-30
    # the test can fail: a wrong scale for dout moves both gradients (too large: saturation; e5m2's 30 binades need
    # one far too small before the flushed values show through the fp32 tolerance; q and meta are compared exactly)
    for f in (2.0, 2.0 ** -20):
        gb2, ginv2, _ = ref_quantize(dout, "e5m2", f)
        g2 = deq(gb2, ginv2, "e5m2")
        assert (np.abs(g2 @ b - g @ b) > 4 * tol_dinp).any() and (np.abs(g2.T @ a - g.T @ a) > 4 * tol_dw).any()
    for name, ops in backends(emu).items():
        if name == "cuda-f32":
            continue
        dinp, dw, db, (gq, gqt, gmeta) = ops.fp8_linear_backward(dinp0, dw0, db0, dout, x, w, write=write)
        what = f"{name} ({N}, {C}, {OC}) write={write}"
        assert np.array_equal(gq, gb) and np.array_equal(gqt, gb.T) and list(gmeta) == [ginv, gamax], what
        t = tol_dinp + (2.0 ** -8 * np.abs(want_dinp) if name == "cuda-bf16" else 2.0 ** -24 * np.abs(want_dinp))
        for got, want, tt, label in ((dinp, want_dinp, t, "dinp"),
                                     (dw, want_dw, tol_dw + 2.0 ** -24 * np.abs(want_dw), "dw"),
                                     (db, want_db, N * 2.0 ** -24 * np.abs(dout).sum(0) + 2.0 ** -24 * np.abs(want_db),
                                      "dbias")):
            bad = ~(np.abs(got - want) <= tt)
            assert not bad.any(), f"{what} {label}: {np.argwhere(bad)[:3].tolist()} {got[bad][:3]} vs {want[bad][:3]}"
    # without a bias gradient
    dinp, dw, db, _ = backends(emu)["cuda-bf16"].fp8_linear_backward(dinp0, dw0, None, dout, x, w, write=write)
    assert db is None and not (np.abs(dw - want_dw) > tol_dw + 2.0 ** -24 * np.abs(want_dw)).any()
