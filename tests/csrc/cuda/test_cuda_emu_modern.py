"""The CUDA kernels of the modern architecture (issue 26), emulated, against float64 numpy references, for each storage
type (fp32, bf16, fp16) with 16-byte aligned buffers (vector paths) and misaligned ones (one value per access):
RMSNorm forward / backward and its fusion with the residual add (csrc/cuda/rmsnorm.cuh), QK-norm in place on the
attention input, rotary embeddings forward / backward (rope.cuh), ReLU^2 forward / backward (relu2.cuh), the soft-capped
fused classifier (classifier.cuh), layernorm without bias and the encoder without position embedding. The kernels are
called through their launchers (tests/csrc/cuda/cuda_emu/modern_ops.cu: gpt2core_cuda_emu.k_*), on buffers poisoned
with NaN before they run, on odd shapes: N = 3 * 37 rows, C = 192 (3 heads of 64) and head sizes 48 and 20 (no
multiple of 16 bytes of pairs: the rotary's scalar path), T = 37 with a position offset, ragged element counts.

Tolerances, from the storage type's unit roundoff U (fp32 2^-24, bf16 2^-8, fp16 2^-11): every output stored in the
storage type is one round to nearest of an fp32 value, |fl(v) - v| <= U |v| (+ 2^-25 absolute below fp16's normal
range); the fp32 arithmetic before it adds at most FP32 = 1e-5 of the magnitude of the terms summed (n 2^-24 for the
n <= 192 terms of a row; tanhf / expf / sqrtf / the rotary table's cos and sin are a few ulps). The references take the
inputs rounded to the storage type, so input rounding is not in the bounds. check() returns the worst error / bound
ratio; WORST collects them per kernel and type (printed by test_report_worst_ratios with -s).
"""
import numpy as np
import pytest

from bf16 import round_bf16
# emu: the session fixture that builds and imports gpt2core_cuda_emu
from test_cuda_emu import emu  # noqa: F401

FP32 = 1e-5
U = {0: 2.0 ** -24, 1: 2.0 ** -8, 2: 2.0 ** -11}
TINY = {0: 0.0, 1: 0.0, 2: 2.0 ** -25}
NAMES = {0: "fp32", 1: "bf16", 2: "fp16"}
DTYPES = [0, 1, 2]
WORST = {}


def rnd_to(dtype, x):
    x = np.asarray(x, np.float32)
    if dtype == 1:
        return round_bf16(x)
    if dtype == 2:
        return x.astype(np.float16).astype(np.float32)
    return x


def rnd(rng, dtype, *shape, scale=1.0, offset=0.0):
    """Random normal values rounded to the storage type, never zero (|x| >= 1e-3 * scale)."""
    x = rng.standard_normal(shape) * scale
    return rnd_to(dtype, np.where(np.abs(x) < 1e-3 * scale, 1e-3 * scale, x) + offset)


def check(name, dtype, got, ref, terms, stored=True):
    """|got - ref| <= U |ref| + FP32 terms (+ TINY) elementwise; stored=False: an fp32 output (statistics), FP32 only.
    Returns the worst ratio of error to bound."""
    got = np.asarray(got, np.float64)
    ref = np.asarray(ref, np.float64)
    assert got.shape == ref.shape, (name, got.shape, ref.shape)
    assert np.all(np.isfinite(got)), f"{name}: non-finite output (a poisoned value left unwritten?)"
    if stored:
        assert np.array_equal(rnd_to(dtype, got), got.astype(np.float32)), f"{name}: not values of the storage type"
    u = U[dtype] if stored else U[0]
    bound = u * np.abs(ref) + FP32 * np.asarray(terms, np.float64) + TINY[dtype] + 1e-30
    worst = float(np.max(np.abs(got - ref) / bound)) if got.size else 0.0
    key = f"{name} {NAMES[dtype]}"
    WORST[key] = max(WORST.get(key, 0.0), worst)
    assert worst <= 1.0, f"{name} ({NAMES[dtype]}): error {worst:.3f} x the bound"
    return worst


B, T, C, NH = 3, 37, 192, 3
N = B * T
EPS = 1e-6
MIS = [False, True]


# --------------------------------------------------------------------------------------------- RMSNorm
def rms_ref(x):
    x = x.astype(np.float64)
    r = 1.0 / np.sqrt((x * x).mean(-1, keepdims=True) + EPS)
    return x * r, r[..., 0]


def rms_grad_ref(dy, x, r, from_out=False):
    """dx of y = x * r (no gain) given dy; r the (fp32) statistics the kernel saved. from_out: x is y."""
    dy, x, r = dy.astype(np.float64), x.astype(np.float64), r.astype(np.float64)[..., None]
    n = x if from_out else x * r
    dot = (dy * n).mean(-1, keepdims=True)
    return r * (dy - n * dot), r * (np.abs(dy) + np.abs(n) * np.abs(dy * n).mean(-1, keepdims=True))


@pytest.mark.parametrize("mis", MIS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Cn", [192, 45])
def test_rmsnorm(emu, dtype, mis, Cn):  # noqa: F811
    rng = np.random.default_rng(10 + dtype)
    x = rnd(rng, dtype, N, Cn, scale=2.0, offset=0.3)
    _, out, rstd = emu.k_rmsnorm_forward(dtype, x, None, EPS, misalign=mis)
    ref, r = rms_ref(x)
    check("rmsnorm_forward rstd", dtype, rstd, r, r, stored=False)
    check("rmsnorm_forward", dtype, out, ref, np.abs(ref))
    # fused with the residual add: residual = a + b rounded once, then the norm of the ROUNDED residual (bit for bit
    # the unfused pair: compared with the forward above run on the returned residual)
    a, b = rnd(rng, dtype, N, Cn), rnd(rng, dtype, N, Cn)
    res, out2, rstd2 = emu.k_rmsnorm_forward(dtype, a, b, EPS, misalign=mis)
    check("residual_rmsnorm_forward residual", dtype, res, a.astype(np.float64) + b, np.abs(a) + np.abs(b))
    _, out1, rstd1 = emu.k_rmsnorm_forward(dtype, res, None, EPS, misalign=mis)
    assert np.array_equal(out2, out1) and np.array_equal(rstd2, rstd1)
    # backward, accumulating into random values and written over a poisoned buffer
    dout, dinp0 = rnd(rng, dtype, N, Cn), rnd(rng, dtype, N, Cn)
    g, terms = rms_grad_ref(dout, x, rstd)
    got = emu.k_rmsnorm_backward(dtype, dinp0, dout, x, rstd, True, misalign=mis)
    check("rmsnorm_backward", dtype, got, g + dinp0, terms + np.abs(dinp0))
    got = emu.k_rmsnorm_backward(dtype, np.full_like(dinp0, np.nan), dout, x, rstd, False, misalign=mis)
    check("rmsnorm_backward write", dtype, got, g, terms)


def test_rmsnorm_gradient_is_the_derivative(emu):  # noqa: F811
    """The backward formula against central differences of the float64 forward (so a formula wrong in both the
    kernel and rms_grad_ref would not pass): fp32 kernel, 2e-6 of the largest gradient (FP32 rounding of the kernel;
    differences with h = 1e-6 are accurate to ~1e-10)."""
    rng = np.random.default_rng(3)
    x, dy = rnd(rng, 0, 4, 45, offset=0.2), rnd(rng, 0, 4, 45)
    _, _, rstd = emu.k_rmsnorm_forward(0, x, None, EPS)
    got = emu.k_rmsnorm_backward(0, np.zeros_like(x), dy, x, rstd, True)
    num = np.zeros((4, 45))
    h = 1e-6
    for i in range(4):
        for j in range(45):
            xp, xm = x.astype(np.float64), x.astype(np.float64)
            xp[i, j] += h
            xm[i, j] -= h
            num[i, j] = ((rms_ref(xp)[0] - rms_ref(xm)[0]) * dy).sum() / (2 * h)
    assert np.max(np.abs(got - num)) <= 2e-6 * np.max(np.abs(num))


# --------------------------------------------------------------------------------------------- QK-norm
@pytest.mark.parametrize("mis", MIS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Cq,NHq", [(192, 3), (40, 2), (96, 2)])
def test_qknorm(emu, dtype, mis, Cq, NHq):  # noqa: F811
    rng = np.random.default_rng(20 + dtype)
    HS = Cq // NHq
    qkv = rnd(rng, dtype, N, 3 * Cq, scale=1.5, offset=0.1)
    got, rstd = emu.k_qknorm_forward(dtype, qkv, NHq, EPS, misalign=mis)
    heads = qkv.reshape(N, 3, NHq, HS)
    ref, r = rms_ref(heads[:, :2])
    check("qknorm_forward rstd", dtype, rstd, r.reshape(-1), r.reshape(-1), stored=False)
    g = got.reshape(N, 3, NHq, HS)
    check("qknorm_forward", dtype, g[:, :2], ref, np.abs(ref))
    assert np.array_equal(g[:, 2], heads[:, 2]), "v must be untouched"
    # backward in place on dqkv, from the forward's output (what attention read) and rstd
    dqkv = rnd(rng, dtype, N, 3 * Cq)
    dg = emu.k_qknorm_backward(dtype, dqkv, got, rstd, NHq, misalign=mis).reshape(N, 3, NHq, HS)
    d = dqkv.reshape(N, 3, NHq, HS)
    want, terms = rms_grad_ref(d[:, :2], g[:, :2], rstd.reshape(N, 2, NHq), from_out=True)
    check("qknorm_backward", dtype, dg[:, :2], want, terms)
    assert np.array_equal(dg[:, 2], d[:, 2]), "dv must be untouched"


# --------------------------------------------------------------------------------------------- rotary
def rope_ref(qkv, NHr, pos0, base, backward=False):
    Bq, Tq, C3 = qkv.shape
    Cq = C3 // 3
    HS = Cq // NHr
    h = HS // 2
    x = qkv.astype(np.float64).reshape(Bq, Tq, 3, NHr, HS)
    inv = base ** (-np.arange(h) / h)
    ang = (pos0 + np.arange(Tq))[:, None] * inv[None, :]  # (T, h)
    c, s = np.cos(ang)[None, :, None, None, :], np.sin(ang)[None, :, None, None, :]
    if backward:
        s = -s
    x1, x2 = x[:, :, :2, :, :h], x[:, :, :2, :, h:]
    out = x.copy()
    out[:, :, :2, :, :h] = x1 * c - x2 * s
    out[:, :, :2, :, h:] = x2 * c + x1 * s
    terms = np.zeros_like(x)
    terms[:, :, :2, :, :h] = np.abs(x1 * c) + np.abs(x2 * s)
    terms[:, :, :2, :, h:] = np.abs(x2 * c) + np.abs(x1 * s)
    return out.reshape(qkv.shape), terms.reshape(qkv.shape), np.cos(ang), np.sin(ang)


@pytest.mark.parametrize("mis", MIS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Cr,NHr", [(192, 3), (40, 2), (96, 2)])  # head sizes 64, 20 (10 pairs: scalar), 48
def test_rope(emu, dtype, mis, Cr, NHr):  # noqa: F811
    rng = np.random.default_rng(30 + dtype)
    maxT, pos0, base = 1100, 1100 - T, 10000.0  # the last positions of a long table: large angles
    qkv = rnd(rng, dtype, B, T, 3 * Cr)
    for backward in (False, True):
        got, table = emu.k_rope(dtype, qkv, NHr, maxT, pos0, base, backward, misalign=mis)
        ref, terms, c, s = rope_ref(qkv, NHr, pos0, base, backward)
        name = "rope_backward" if backward else "rope_forward"
        check(name, dtype, got, ref, terms)
        v = slice(2 * Cr, 3 * Cr)
        assert np.array_equal(got[..., v], qkv[..., v]), "v must be untouched"
        # the table: cos and sin of the double-precision angles, rounded once to fp32
        h = Cr // NHr // 2
        full = np.arange(maxT)[:, None] * (base ** (-np.arange(h) / h))[None, :]
        assert np.array_equal(table[:, :h], np.cos(full).astype(np.float32))
        assert np.array_equal(table[:, h:], np.sin(full).astype(np.float32))
    # backward undoes forward (a rotation's transpose is its inverse), up to the two roundings
    fwd, _ = emu.k_rope(dtype, qkv, NHr, maxT, pos0, base, False, misalign=mis)
    back, _ = emu.k_rope(dtype, fwd, NHr, maxT, pos0, base, True, misalign=mis)
    assert np.max(np.abs(back - qkv)) <= (4 * U[dtype] + 4 * FP32) * np.max(np.abs(qkv))


# --------------------------------------------------------------------------------------------- ReLU^2
@pytest.mark.parametrize("mis", MIS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_relu2(emu, dtype, mis):  # noqa: F811
    rng = np.random.default_rng(40 + dtype)
    n = N * 4 + 3  # not a multiple of the 16-byte vector: a ragged tail
    x = rnd(rng, dtype, n, scale=2.0)
    x[:5] = 0.0  # the kink
    xd = x.astype(np.float64)
    ref = np.maximum(xd, 0.0) ** 2
    check("relu2_forward", dtype, emu.k_relu2_forward(dtype, x, misalign=mis), ref, ref)
    dout, dinp0 = rnd(rng, dtype, n), rnd(rng, dtype, n)
    g = 2.0 * np.maximum(xd, 0.0) * dout
    got = emu.k_relu2_backward(dtype, dinp0, x, dout, True, misalign=mis)
    check("relu2_backward", dtype, got, g + dinp0, np.abs(g) + np.abs(dinp0))
    got = emu.k_relu2_backward(dtype, np.full_like(x, np.nan), x, dout, False, misalign=mis)
    check("relu2_backward write", dtype, got, g, np.abs(g))
    got = emu.k_relu2_backward(dtype, np.full_like(x, np.nan), x, dout, False, inplace=True, misalign=mis)
    check("relu2_backward in place", dtype, got, g, np.abs(g))


# --------------------------------------------------------------------------------------------- soft-capped classifier
def ce_ref(c, targets, Vc, dloss, grad_factor):
    """float64 loss, lse and dlogits of the capped logits c (N, Vp); grad_factor (N, V): d c / d z."""
    Nc = c.shape[0]
    valid = targets >= 0
    z = c.astype(np.float64)[:, :Vc]
    mx = z.max(-1, keepdims=True)
    lse = (mx + np.log(np.exp(z - mx).sum(-1, keepdims=True)))[:, 0]
    loss = np.where(valid, lse - z[np.arange(Nc), np.maximum(targets, 0)], 0.0)
    p = np.exp(z - lse[:, None])
    ref = p.copy()
    ref[np.arange(Nc), np.maximum(targets, 0)] -= 1.0
    ref = np.where(valid[:, None], ref * dloss * grad_factor, 0.0)
    return loss, lse, ref, (p + 1.0) * dloss


@pytest.mark.parametrize("mis", MIS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Nc,Vc,Vpc", [(N, 97, 128), (5, 5001, 5008), (7, 97, 99)])
def test_softcap_classifier(emu, dtype, mis, Nc, Vc, Vpc):  # noqa: F811
    """softcap_forward (in place), crossentropy_forward of the capped logits and crossentropy_backward with the cap's
    derivative from the capped values (the two-op path: eval, and the unfused step), and the fused pass that caps the
    raw logits as it reads them. Statistics: tanhf and expf a few ulps of |c| <= cap, sums as the uncapped
    classifier's (test_cuda_emu_bf16.test_crossentropy): FP32 of |lse| + cap. dlogits: one rounding of the gradient;
    expf(c - lse) is accurate to |c - lse| 2^-24 relative, 1 - t^2 to ~2^-22 absolute: FP32 of (p + 1) dloss."""
    rng = np.random.default_rng(50 + dtype)
    cap, gs = 15.0, 0.5
    logits = rnd(rng, dtype, Nc, Vpc, scale=12.0)  # many beyond the cap: tanh saturates
    targets = rng.integers(0, Vc, Nc).astype(np.int32)
    targets[[0, 1, 2]] = (Vc - 1, Vc - 2, -1)
    valid = targets >= 0
    dloss = gs / valid.sum()
    th = np.tanh(logits.astype(np.float64) / cap)
    for mode in (0, 1, 2):
        losses, lse_g, count, capped, d = emu.k_classifier(dtype, mode, logits, targets, Vc, cap, gs, misalign=mis)
        assert count == valid.sum()
        if mode == 2:  # fused: capped in fp32 from the raw logits
            c, factor = cap * th, 1.0 - th[:, :Vc] ** 2
        else:  # the capped logits as stored (rounded to the storage type), and the derivative from them
            check("softcap_forward", dtype, capped, cap * th, cap * np.abs(th))
            c = capped.astype(np.float64)
            factor = 1.0 - (c[:, :Vc] / cap) ** 2
        loss, lse, ref, gterms = ce_ref(c, targets, Vc, dloss, factor)
        sterms = np.abs(lse) + cap
        check("softcap crossentropy lse", dtype, lse_g, lse, sterms, stored=False)
        check("softcap crossentropy loss", dtype, losses, loss, np.where(valid, sterms, 0.0), stored=False)
        if mode:
            name = "softcap crossentropy_fused" if mode == 2 else "softcap crossentropy_backward"
            check(name, dtype, d[:, :Vc], ref, gterms)
            assert np.all(d[:, Vc:] == 0.0) and np.all(d[~valid] == 0.0)


def test_softcap_gradient_is_the_derivative(emu):  # noqa: F811
    """dlogits of the capped loss against central differences of the float64 loss: the cap's derivative is in."""
    rng = np.random.default_rng(5)
    cap, Vc = 3.0, 11
    logits = rnd(rng, 0, 2, 16, scale=4.0)
    targets = np.array([3, 10], np.int32)

    def loss(lg):
        z = cap * np.tanh(lg[:, :Vc] / cap)
        mx = z.max(-1, keepdims=True)
        lse = mx[:, 0] + np.log(np.exp(z - mx).sum(-1))
        return (lse - z[np.arange(2), targets]).mean()

    d = emu.k_classifier(0, 2, logits, targets, Vc, cap, 1.0)[4]
    num = np.zeros((2, 16))
    h = 1e-6
    for i in range(2):
        for j in range(Vc):
            lp, lm = logits.astype(np.float64), logits.astype(np.float64)
            lp[i, j] += h
            lm[i, j] -= h
            num[i, j] = (loss(lp) - loss(lm)) / (2 * h)
    assert np.max(np.abs(d - num)) <= 1e-6 * np.max(np.abs(num)), np.max(np.abs(d - num))


# --------------------------------------------------------------------------------------------- no bias, no wpe
@pytest.mark.parametrize("mis", MIS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_layernorm_without_bias(emu, dtype, mis):  # noqa: F811
    rng = np.random.default_rng(60 + dtype)
    x, w = rnd(rng, dtype, N, C, scale=2.0, offset=0.5), rnd(rng, dtype, C, offset=1.0)
    dout, dinp0, dw0 = rnd(rng, dtype, N, C), rnd(rng, dtype, N, C), rnd(rng, 0, C)
    out, mean, rstd, dinp, dw = emu.k_layernorm_nobias(dtype, x, w, dout, dinp0, dw0, misalign=mis)
    xd = x.astype(np.float64)
    m = xd.mean(-1, keepdims=True)
    r = 1.0 / np.sqrt(((xd - m) ** 2).mean(-1, keepdims=True) + 1e-5)
    n = (xd - m) * r
    # x - mean cancels: its fp32 rounding is relative to |x| + |mean|, not to the difference
    check("layernorm_forward no bias", dtype, out, n * w, (np.abs(xd) + np.abs(m)) * r * np.abs(w))
    check("layernorm_forward no bias rstd", dtype, rstd, r[:, 0], r[:, 0], stored=False)
    dn = dout * w.astype(np.float64)
    g = (dn - dn.mean(-1, keepdims=True) - n * (dn * n).mean(-1, keepdims=True)) * r
    na = (np.abs(xd) + np.abs(m)) * r  # |norm| as the fp32 rounding sees it
    gterms = (np.abs(dn) + np.abs(dn).mean(-1, keepdims=True) + na * np.abs(dn * na).mean(-1, keepdims=True)) * r
    check("layernorm_backward no bias", dtype, dinp, g + dinp0, gterms + np.abs(dinp0))
    wg = (n * dout).sum(0)
    check("layernorm_backward no bias dw", dtype, dw, wg + dw0, (na * np.abs(dout)).sum(0) + np.abs(dw0), stored=False)


@pytest.mark.parametrize("mis", MIS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_encoder_without_position_embedding(emu, dtype, mis):  # noqa: F811
    rng = np.random.default_rng(70 + dtype)
    Vpe = 128
    inp = rng.integers(0, 97, N).astype(np.int32)
    inp[:5] = inp[7]  # repeated tokens
    wte, dout, dwte0 = rnd(rng, dtype, Vpe, C), rnd(rng, dtype, N, C), rnd(rng, 0, Vpe, C)
    out, dwte = emu.k_encoder_nowpe(dtype, inp, wte, dout, dwte0, misalign=mis)
    assert np.array_equal(out, wte[inp])
    want = dwte0.astype(np.float64)
    np.add.at(want, inp, dout.astype(np.float64))
    terms = np.abs(dwte0).astype(np.float64)
    np.add.at(terms, inp, np.abs(dout).astype(np.float64))
    check("encoder_backward no wpe", dtype, dwte, want, terms, stored=False)


def test_report_worst_ratios():
    """Prints the worst error / bound ratio per kernel and type of the tests above (run with -s)."""
    for k in sorted(WORST):
        print(f"{k:48s} {WORST[k]:.3f}")
