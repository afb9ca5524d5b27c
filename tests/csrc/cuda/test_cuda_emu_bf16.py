"""bf16 storage (the contract at the top of csrc/cuda/common.cuh) of the CUDA kernels, emulated: the ops of the test class
gpt2core_cuda_emu.OpsBF16 against a float64 numpy reference computed over the bf16-ROUNDED inputs, on odd shapes
(N = 3 * 37 rows, C = 192, vocab 97 padded to 128 with ignored targets, ragged element counts), with 16-byte
aligned buffers (vectorised paths: 8 bf16 per access) and misaligned ones (scalar fallbacks): here crossentropy
and the stochastic rounding of cast_params, and BF16, the bf16 helpers with which test_cuda_emu_16bit.py tests the
ops both 16-bit types share (encoder, layernorm, residual, matmul, GELU, AdamW: its stochastic parameter write is
check_param_copy); and the fused ops in fp32 (Ops). The shapes, references and fp32 check here serve fp16 too.

OpsBF16 takes and returns float32 numpy arrays: inputs the contract types T are rounded to bf16 (nearest even) on
upload, float-typed ones (master weights, gradients of parameters, m, v, mean, rstd, lse) stay fp32.

Tolerances. A bf16 output is one round-to-nearest-even of an fp32 value: error at most half an ulp, i.e. relative
error at most 2^-8 (unit roundoff of the 8-bit significand; 2^-9 only at the top of a binade) -- RNE below. The
fp32 arithmetic before that rounding adds at most ~1e-5 relative to the magnitude of the terms summed (n * 2^-24
for the n <= 192 products of a row; products of two bf16 are exact in fp32) -- FP32 below. fp32 outputs
(statistics, parameter gradients) only carry the FP32 part.
"""
from types import SimpleNamespace

import numpy as np
import pytest

from bf16 import bf16_bits, bf16_neighbours, round_bf16
# emu: the session fixture that builds and imports gpt2core_cuda_emu
from test_cuda_emu import emu, normwise  # noqa: F401

RNE = 2.0 ** -8   # relative error bound of one round to nearest even to bf16 (8-bit significand)
# fp32 accumulation error relative to the magnitude of the summed terms: at worst n * 2^-24 = 1.1e-5 for n = 192;
# random rounding errors grow like sqrt(n) * 2^-24, so it also covers the 2056-wide layernorm rows
FP32 = 1e-5

B, T, C = 3, 37, 192
N = B * T
V, Vp, maxT = 97, 128, 40


@pytest.fixture(scope="module")
def bf16ops(emu):  # noqa: F811
    if not hasattr(emu, "OpsBF16"):
        pytest.skip("gpt2core_cuda_emu has no OpsBF16 yet (tests/csrc/cuda/cuda_emu/ops_bindings.cpp)")
    return {False: emu.OpsBF16("cuda"), True: emu.OpsBF16("cuda", misalign=True)}


def rnd(rng, *shape, scale=1.0, offset=0.0):
    """Random normal values, bf16-rounded, never zero (|x| >= 1e-3 * scale)."""
    x = rng.standard_normal(shape) * scale
    x = np.where(np.abs(x) < 1e-3 * scale, 1e-3 * scale, x) + offset
    return round_bf16(x.astype(np.float32))


def f32(rng, *shape, scale=1.0):
    x = rng.standard_normal(shape) * scale
    return np.where(np.abs(x) < 1e-3 * scale, 1e-3 * scale, x).astype(np.float32)


def is_bf16(x):
    return np.all((np.asarray(x, np.float32).view(np.uint32) & 0xFFFF) == 0)


def check_bf16(got, ref, terms):
    """got: bf16 values; ref: float64 exact result; terms: float64 magnitude of what was summed (same shape or
    broadcastable). |got - ref| <= RNE |ref| + FP32 terms."""
    got = np.asarray(got, np.float64)
    assert got.shape == ref.shape
    assert is_bf16(got), "outputs of a bf16 op must be bf16 values"
    err = np.abs(got - ref)
    bound = RNE * np.abs(ref) + FP32 * terms + 1e-30
    worst = np.max(err / bound)
    assert worst <= 1.0, f"error {worst:.3f} x the bound"


def check_f32(got, ref, terms):
    got = np.asarray(got, np.float64)
    assert got.shape == ref.shape
    assert np.all(np.abs(got - ref) <= FP32 * terms + 1e-30), np.max(np.abs(got - ref) / (terms + 1e-30))


# --------------------------------------------------------------------------------------------- references
def ln_ref(x, w, b):
    x = x.astype(np.float64)
    m = x.mean(-1, keepdims=True)
    r = 1.0 / np.sqrt(((x - m) ** 2).mean(-1, keepdims=True) + 1e-5)
    return (x - m) * r * w + b, m[:, 0], r[:, 0]


def gelu_ref(x):
    s = np.sqrt(2.0 / np.pi)
    return 0.5 * x * (1.0 + np.tanh(s * (x + 0.044715 * x ** 3)))


def gelu_grad_ref(x):
    s = np.sqrt(2.0 / np.pi)
    th = np.tanh(s * (x + 0.044715 * x ** 3))
    return 0.5 * (1.0 + th) + 0.5 * x * (1.0 - th * th) * s * (1.0 + 3.0 * 0.044715 * x * x)


def check_layernorm_forward(check16, ops, x, w, b):
    """layernorm_forward of a 16-bit ops object against ln_ref; check16: the type's check of 16-bit outputs.
    Returns the reference (mean, rstd)."""
    out, mean, rstd = ops.layernorm_forward(x, w, b)
    ref, m, r = ln_ref(x, w, b)
    # out: one rounding of O(1) values; the fp32 statistics carry FP32 relative error into every output
    check16(out, ref, np.abs(w) * np.abs((x - m[:, None]) * r[:, None]) + np.abs(b))
    check_f32(mean, m, np.abs(x).mean(-1))
    check_f32(rstd, r, r)
    return m, r


def check_param_copy(ops, p, master, seed, offset):
    """The bf16 weight copy an AdamW step writes: the master rounded stochastically (seed 0: to nearest even), to
    one of its two bf16 neighbours, with cast_params' bits for the same (seed, offset + i)."""
    assert is_bf16(p)
    if seed == 0:
        assert np.array_equal(p, round_bf16(master))
    lo, hi = bf16_neighbours(master)
    assert np.all((p == lo) | (p == hi))
    assert np.array_equal(bf16_bits(p), bf16_bits(ops.cast_params(master, seed, offset)))


# bf16 for the ops test_cuda_emu_16bit.py tests over both 16-bit types (tiny = 0: bf16 has fp32's exponent range)
BF16 = SimpleNamespace(cls="OpsBF16", U=RNE, tiny=0.0, round=round_bf16, rnd=rnd, is16=is_bf16, check=check_bf16,
                       check_param_copy=check_param_copy)


# rows: 3 * 37 x 192 (vector path, row cached in registers), 7 x 100 (C not a multiple of 8: scalar path),
# 5 x 2056 (vector path, row too wide for the register cache: re-read per pass)
SHAPES_LN = [(N, C), (7, 100), (5, 2056)]


# (rows, V, Vp): the model's shape; Vp a multiple of 8 with V not (8-bf16 vectors, a ragged tail up to V, padded
# vectors written 0); V = Vp; rows wider than the block's 512 vectors; Vp odd (rows not 16-byte aligned: one value
# per access). Misaligned buffers take the one-value path for every shape.
@pytest.mark.parametrize("mis", [False, True], ids=["aligned", "misaligned"])
@pytest.mark.parametrize("Nc,V,Vp", [(N, V, Vp), (7, 101, 120), (5, 64, 64), (3, 5001, 5008), (7, 97, 99)])
def test_crossentropy(bf16ops, mis, Nc, V, Vp):
    ops, rng = bf16ops[mis], np.random.default_rng(6)
    N = Nc
    logits = rnd(rng, N, Vp, scale=3.0)
    targets = rng.integers(0, V, N).astype(np.int32)
    targets[[0, 1]] = (V - 1, V - 2)  # the last column, and one in the ragged part
    targets[[2, N // 2, N - 1]] = -1  # ignored
    ld = logits.astype(np.float64)[:, :V]
    mx = ld.max(-1, keepdims=True)
    lse = (mx + np.log(np.exp(ld - mx).sum(-1, keepdims=True)))[:, 0]
    valid = targets >= 0
    loss = np.where(valid, lse - ld[np.arange(N), np.maximum(targets, 0)], 0.0)
    losses, lse_g, nvalid = ops.crossentropy_forward(logits, targets, V)
    assert nvalid == int(valid.sum())
    # fp32 softmax statistics: each thread sums at most 16 exp terms, then a 9-level tree (~25 * 2^-24 relative to
    # the sum, absolute in lse); lse - logit cancels, so bound by |lse| + |logit|
    check_f32(lse_g, lse, np.abs(lse) + np.abs(ld).max(-1))
    check_f32(losses, loss, np.where(valid, np.abs(lse) + np.abs(ld).max(-1), 0.0))
    assert np.all(losses[~valid] == 0.0)
    losses2, _, n2 = ops.crossentropy_forward(logits, None, V)
    assert n2 == 0 and np.all(losses2 == 0.0)
    dloss = 1.0 / valid.sum()
    d = ops.crossentropy_backward_inplace(logits, lse.astype(np.float32), targets, dloss, V)
    p = np.exp(ld - lse[:, None])
    ref = p.copy()
    ref[np.arange(N), np.maximum(targets, 0)] -= 1.0
    ref = np.where(valid[:, None], ref * dloss, 0.0)
    # RNE of the gradient; expf(x - lse) in fp32 is accurate to ~|x - lse| * 2^-24 relative (x, lse <= ~20)
    check_bf16(d[:, :V], ref, (p + 1.0) * dloss)
    assert np.all(d[:, V:] == 0.0) and np.all(d[~valid] == 0.0)


# --------------------------------------------------------------------------------------------- AdamW, rounding
ADAM = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, decay=0.1, grad_scale=0.5, bc1=1 - 0.9 ** 3, bc2=1 - 0.95 ** 3)


def adamw_ref(w, g, m, v, lr, beta1, beta2, eps, decay, grad_scale, bc1, bc2):
    w, g, m, v = (np.asarray(a, np.float64) for a in (w, g, m, v))
    g = g * grad_scale
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    return w - lr * ((m / bc1) / (np.sqrt(v / bc2) + eps) + decay * w), m, v


def test_stochastic_rounding(bf16ops):
    ops = bf16ops[False]
    n = 1 << 16
    # 1 + 2^-9 is 1/4 of the way from 1 to the next bf16 value (1 + 2^-7)
    x = np.full(n, 1.0 + 2.0 ** -9, np.float32)
    for sign in (1.0, -1.0):
        r = ops.cast_params(sign * x, 42, 0).astype(np.float64)
        lo, hi = sign * 1.0, sign * (1.0 + 2.0 ** -7)
        assert np.all((r == lo) | (r == hi)), "always one of the two neighbouring bf16 values"
        # unbiased: E[r] = x. Per-sample std = ulp * sqrt(p (1 - p)) = 2^-7 * sqrt(3/16) = 3.4e-3, so the mean of
        # 2^16 samples has std 1.3e-5; round to nearest has bias 2^-9 = 2e-3 (150 x that std). Bound: 1e-4 (7.5 std).
        assert abs(r.mean() - sign * x[0]) < 1e-4
        assert abs(np.mean(r == hi) - 0.25) < 0.01
        assert np.all(round_bf16(sign * x) == lo)  # what RNE would do
    # random values: neighbours, unbiased over many values in aggregate
    rng = np.random.default_rng(8)
    y = f32(rng, n, scale=3.0)
    r = ops.cast_params(y, 7, 0)
    lo, hi = bf16_neighbours(y)
    assert np.all((r == lo) | (r == hi))
    ulp = np.abs(hi.astype(np.float64) - lo)
    frac = np.where(ulp > 0, np.abs(y.astype(np.float64) - lo) / np.where(ulp > 0, ulp, 1), 0)
    up = r == hi
    assert abs(np.mean(up[ulp > 0]) - np.mean(frac[ulp > 0])) < 0.01  # P(up) = distance to lower / ulp
    # pure function of (value, seed, index): repeatable, index = offset + i, seed changes the draw
    assert np.array_equal(bf16_bits(ops.cast_params(y, 7, 0)), bf16_bits(r))
    k = 1001
    assert np.array_equal(bf16_bits(ops.cast_params(y[k:], 7, k)), bf16_bits(r[k:]))
    assert np.array_equal(bf16_bits(bf16ops[True].cast_params(y, 7, 0)), bf16_bits(r))  # misaligned: same bits
    assert not np.array_equal(bf16_bits(ops.cast_params(y, 8, 0)), bf16_bits(r))
    # seed 0 = round to nearest even; exact bf16 values, +-Inf and NaN pass through
    assert np.array_equal(ops.cast_params(y, 0, 0), round_bf16(y))
    special = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, 1.0, -2.5], np.float32)
    s = ops.cast_params(special, 5, 0)
    assert np.isnan(s[2]) and np.array_equal(s[[0, 1, 3, 5, 6]], special[[0, 1, 3, 5, 6]])
    assert np.signbit(s[4])


# --------------------------------------------------------------------------------------------- fp32 fused ops
def test_gelu_epilogues_fp32(emu):  # noqa: F811
    """matmul_gelu_forward / gelu_matmul_backward in fp32: the CPU backend (the default implementation: the
    separate ops), the emulated CUDA backend fused (GELU in the matmul epilogues) and unfused, against float64
    (1e-5 normwise, see test_cuda_emu.py)."""
    rng = np.random.default_rng(11)
    OC = 4 * C
    x, w, bias = f32(rng, N, C), f32(rng, OC, C, scale=0.1), f32(rng, OC)
    p, w2 = f32(rng, N, OC, scale=2.0), f32(rng, C, OC, scale=0.1)
    act = gelu_ref(p.astype(np.float64)).astype(np.float32)
    dpre0, dw0, db0, dout = f32(rng, N, OC), f32(rng, C, OC), f32(rng, C), f32(rng, N, C)
    pre_ref = x.astype(np.float64) @ w.astype(np.float64).T + bias
    gd = dout.astype(np.float64)
    dpre_ref = (gd @ w2.astype(np.float64)) * gelu_grad_ref(p.astype(np.float64))
    dw_ref, db_ref = dw0 + gd.T @ act.astype(np.float64), db0 + gd.sum(0)
    for dev, fused in (("cpu", "1"), ("cuda", "1"), ("cuda", "0")):
        ops = emu.Ops(dev, fused=fused == "1")
        pre, out = ops.matmul_gelu_forward(x, w, bias)
        assert normwise(pre, pre_ref) <= 1e-5 and normwise(out, gelu_ref(pre_ref)) <= 1e-5, (dev, fused)
        dpre, dw, db = ops.gelu_matmul_backward(dpre0, dw0, db0, dout, p, act, w2)
        for got, want in ((dpre, dpre_ref), (dw, dw_ref), (db, db_ref)):
            assert normwise(got, want) <= 1e-5, (dev, fused)
        if dev == "cuda":  # fused: the matmul seam (cuBLASLt) only, no GELU kernel; unfused: the GELU kernels
            n0 = emu.launch_count()
            ops.matmul_gelu_forward(x, w, bias)
            ops.gelu_matmul_backward(dpre0, dw0, None, dout, p, act, w2)
            assert (emu.launch_count() - n0 == 0) == (fused == "1")


@pytest.mark.parametrize("mis", [False, True], ids=["aligned", "misaligned"])
@pytest.mark.parametrize("N,C", SHAPES_LN)
def test_residual_layernorm_forward_fp32(emu, mis, N, C):  # noqa: F811
    if not hasattr(emu.Ops, "residual_layernorm_forward"):
        pytest.skip("gpt2core_cuda_emu.Ops has no residual_layernorm_forward yet (tests/csrc/cuda/cuda_emu/ops_bindings.cpp)")
    rng = np.random.default_rng(9)
    a, b = f32(rng, N, C, scale=2.0) + 0.5, f32(rng, N, C)
    w, bias = f32(rng, C) + 1.0, f32(rng, C)
    ops = emu.Ops("cuda", misalign=mis)
    res, out, mean, rstd = ops.residual_layernorm_forward(a, b, w, bias)
    res2 = ops.residual_forward(a.ravel(), b.ravel()).reshape(N, C)
    out2, mean2, rstd2 = ops.layernorm_forward(res2, w, bias)
    # the fused kernel does the unfused kernels' fp32 arithmetic on the same values: bit for bit
    for got, want in ((res, res2), (out, out2), (mean, mean2), (rstd, rstd2)):
        assert np.array_equal(got, want)
    ref, m, r = ln_ref(a.astype(np.float64) + b, w, bias)
    assert np.max(np.abs(out - ref)) <= 1e-5 * np.max(np.abs(ref))  # and the math (fp32, see test_cuda_emu.py)
