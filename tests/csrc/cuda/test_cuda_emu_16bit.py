"""The ops whose 16-bit storage contract (csrc/cuda/common.cuh) is the same for bf16 and fp16, tested once per type:
gpt2core_cuda_emu.OpsBF16 and OpsF16 against float64 numpy references over the ROUNDED inputs, on the odd shapes
of test_cuda_emu_bf16.py (N = 3 * 37 rows, C = 192, vocab 97 padded to 128, ragged element counts), aligned
(vector paths: 8 values per 16-byte access) and misaligned (scalar fallbacks).

Each type comes from its own file, which derives its tolerances: test_cuda_emu_bf16.BF16 (unit roundoff U = 2^-8,
no subnormal term: bf16 has fp32's exponent range) and test_cuda_emu_f16.F16 (U = 2^-11, TINY = 2^-25 absolute
below fp16's normal range). A type gives: cls (the binding class), U, tiny, round (float64/float32 -> the nearest
16-bit value, as float32), rnd (random 16-bit values, never zero), is16, check (|got - ref| <= U |ref| + FP32
terms + tiny for 16-bit outputs) and check_param_copy (how the AdamW step writes the 16-bit weight copy).
"""
from types import SimpleNamespace

import numpy as np
import pytest

import test_cuda_emu_bf16
import test_cuda_emu_f16
# emu: the session fixture that builds and imports gpt2core_cuda_emu
from test_cuda_emu import emu  # noqa: F401
from test_cuda_emu_bf16 import (ADAM, FP32, SHAPES_LN, B, C, N, T, V, Vp, adamw_ref, check_f32,
                                check_layernorm_forward, f32, gelu_grad_ref, gelu_ref, maxT)

TYPES = {"bf16": test_cuda_emu_bf16.BF16, "f16": test_cuda_emu_f16.F16}


@pytest.fixture(scope="module", params=list(TYPES))
def t16(request, emu):  # noqa: F811
    """The type's helpers, make(**options) -> its ops object, and ops[misaligned] with the default options."""
    t = TYPES[request.param]
    if not hasattr(emu, t.cls):
        pytest.skip(f"gpt2core_cuda_emu has no {t.cls} yet (tests/csrc/cuda/cuda_emu/ops_bindings.cpp)")

    def make(**options):
        return getattr(emu, t.cls)("cuda", **options)

    return SimpleNamespace(**vars(t), make=make, ops={False: make(), True: make(misalign=True)})


@pytest.mark.parametrize("mis", [False, True], ids=["aligned", "misaligned"])
def test_encoder(t16, mis):
    ops, rng = t16.ops[mis], np.random.default_rng(1)
    inp = rng.integers(0, V, (B, T)).astype(np.int32)
    inp[1, :5] = inp[0, 3]  # repeated tokens
    wte, wpe = t16.rnd(rng, Vp, C), t16.rnd(rng, maxT, C)
    # two 16-bit values of similar size add exactly in fp32: the output is the true sum rounded once
    exact = wte[inp].astype(np.float64) + wpe[:T][None]
    assert np.array_equal(ops.encoder_forward(inp, wte, wpe), t16.round(exact))
    dwte0, dwpe0, dout = f32(rng, Vp, C), f32(rng, maxT, C), t16.rnd(rng, B, T, C)
    dwte, dwpe = ops.encoder_backward(dwte0, dwpe0, dout, inp)
    flat = dout.reshape(N, C).astype(np.float64)
    rw, aw = dwte0.astype(np.float64), np.abs(dwte0).astype(np.float64)
    np.add.at(rw, inp.ravel(), flat)
    np.add.at(aw, inp.ravel(), np.abs(flat))
    check_f32(dwte, rw, aw)  # fp32 gradients: fp32 sums of exact 16-bit values
    pad = ((0, maxT - T), (0, 0))
    check_f32(dwpe, dwpe0 + np.pad(dout.astype(np.float64).sum(0), pad),
              np.abs(dwpe0) + np.pad(np.abs(dout).sum(0), pad))


@pytest.mark.parametrize("mis", [False, True], ids=["aligned", "misaligned"])
@pytest.mark.parametrize("N,C", SHAPES_LN)
def test_layernorm(t16, mis, N, C):
    ops, rng = t16.ops[mis], np.random.default_rng(2)
    x, w, b = t16.rnd(rng, N, C, scale=2.0, offset=0.5), t16.rnd(rng, C, offset=1.0), t16.rnd(rng, C)
    m, r = check_layernorm_forward(t16.check, ops, x, w, b)
    # backward, from the reference statistics (fp32 inputs of the op)
    dinp0, dw0, db0, dout = t16.rnd(rng, N, C), f32(rng, C), f32(rng, C), t16.rnd(rng, N, C)
    dinp, dw, db = ops.layernorm_backward(dinp0, dw0, db0, dout, x, w, m.astype(np.float32), r.astype(np.float32))
    gd = dout.astype(np.float64)
    norm = (x - m[:, None]) * r[:, None]
    dnorm = w * gd
    term = (dnorm - dnorm.mean(-1, keepdims=True) - norm * (dnorm * norm).mean(-1, keepdims=True)) * r[:, None]
    mag = (np.abs(dnorm) + np.abs(dnorm).mean(-1, keepdims=True)
           + np.abs(norm) * np.abs(dnorm * norm).mean(-1, keepdims=True)) * r[:, None]
    t16.check(dinp, dinp0 + term, mag + np.abs(dinp0))  # dinp += term, rounded once
    check_f32(dw, dw0 + (norm * gd).sum(0), np.abs(dw0) + np.abs(norm * gd).sum(0))
    check_f32(db, db0 + gd.sum(0), np.abs(db0) + np.abs(gd).sum(0))
    # InputGrad::Write: dinp = term, its NaN contents neither read nor kept
    dinp_w = ops.layernorm_backward(np.full_like(dinp0, np.nan), dw0, db0, dout, x, w, m.astype(np.float32),
                                    r.astype(np.float32), write=True)[0]
    t16.check(dinp_w, term, mag)


@pytest.mark.parametrize("mis", [False, True], ids=["aligned", "misaligned"])
@pytest.mark.parametrize("N,C", SHAPES_LN)
def test_residual_layernorm_forward(t16, mis, N, C):
    ops, rng = t16.ops[mis], np.random.default_rng(3)
    a, b = t16.rnd(rng, N, C, scale=2.0, offset=0.5), t16.rnd(rng, N, C)
    w, bias = t16.rnd(rng, C, offset=1.0), t16.rnd(rng, C)
    res, out, mean, rstd = ops.residual_layernorm_forward(a, b, w, bias)
    assert np.array_equal(res, t16.round(a.astype(np.float64) + b))  # exact fp32 sum, one rounding
    assert np.array_equal(res, ops.residual_forward(a.ravel(), b.ravel()).reshape(N, C))
    out2, mean2, rstd2 = ops.layernorm_forward(res, w, bias)  # the layernorm of the ROUNDED residual, as unfused
    assert np.array_equal(out, out2) and np.array_equal(mean, mean2) and np.array_equal(rstd, rstd2)
    check_layernorm_forward(t16.check, ops, res, w, bias)


@pytest.mark.parametrize("mis", [False, True], ids=["aligned", "misaligned"])
@pytest.mark.parametrize("refuse", [False, True], ids=["bgrad_epilogue", "bgrad_refused"])
def test_matmul(t16, mis, refuse, monkeypatch):
    """dbias from the dW GEMM's bias-gradient epilogue (which overwrites: the backend adds it into dbias), or, where
    the seam refuses that epilogue (the emulator's test knob, as cuBLASLt may), from the column-sum kernels."""
    if refuse:
        monkeypatch.setenv("GPT2CORE_EMU_REFUSE_BIAS_GRAD_EPILOGUE", "1")
    ops, rng = t16.ops[mis], np.random.default_rng(4)
    for OC in (3 * C, 101):
        x, w, bias = t16.rnd(rng, N, C), t16.rnd(rng, OC, C, scale=0.1), t16.rnd(rng, OC)
        xd, wd = x.astype(np.float64), w.astype(np.float64)
        mag = np.abs(xd) @ np.abs(wd).T  # K = C = 192 exact products summed in fp32
        for bb in (bias, None):
            ref = xd @ wd.T + (0.0 if bb is None else bb)
            t16.check(ops.matmul_forward(x, w, bb), ref, mag + (0.0 if bb is None else np.abs(bb)))
        dinp0, dw0, db0, dout = t16.rnd(rng, N, C), f32(rng, OC, C), f32(rng, OC), t16.rnd(rng, N, OC)
        gd = dout.astype(np.float64)
        for dbias0 in (db0, None):
            dinp, dw, db = ops.matmul_backward(dinp0, dw0, dbias0, dout, x, w)
            t16.check(dinp, dinp0 + gd @ wd, np.abs(dinp0) + np.abs(gd) @ np.abs(wd))  # += rounded once
            dinp_w = ops.matmul_backward(np.full_like(dinp0, np.nan), dw0, dbias0, dout, x, w, write=True)[0]
            t16.check(dinp_w, gd @ wd, np.abs(gd) @ np.abs(wd))  # InputGrad::Write: NaN neither read nor kept
            check_f32(dw, dw0 + gd.T @ xd, np.abs(dw0) + np.abs(gd).T @ np.abs(xd))  # K = N = 111 rows
            assert (db is None) == (dbias0 is None)
            if db is not None:
                check_f32(db, db0 + gd.sum(0), np.abs(db0) + np.abs(gd).sum(0))
                # a second micro-step accumulates into the first's dbias (and dw)
                _, dw2, db2 = ops.matmul_backward(dinp0, dw, db, dout, x, w)
                check_f32(db2, db0 + 2 * gd.sum(0), np.abs(db0) + 2 * np.abs(gd).sum(0))
                check_f32(dw2, dw0 + 2 * (gd.T @ xd), np.abs(dw0) + 2 * (np.abs(gd).T @ np.abs(xd)))


@pytest.mark.parametrize("mis", [False, True], ids=["aligned", "misaligned"])
@pytest.mark.parametrize("n", [N * C, N * C + 5, 13], ids=["NC", "ragged", "tiny"])
def test_gelu_and_residual(t16, mis, n):
    ops, rng = t16.ops[mis], np.random.default_rng(5)
    x = t16.rnd(rng, n, scale=2.0)
    xd = x.astype(np.float64)
    # gelu in fp32 (tanh form): ~1e-7 relative to |x| (cancellation in 1 + tanh for x < 0), then one rounding
    t16.check(ops.gelu_forward(x), gelu_ref(xd), np.abs(xd))
    dinp0, dout = t16.rnd(rng, n), t16.rnd(rng, n)
    g = gelu_grad_ref(xd) * dout
    t16.check(ops.gelu_backward(dinp0, x, dout), dinp0 + g, np.abs(dinp0) + np.abs(g) + np.abs(dout))
    a, b = t16.rnd(rng, n), t16.rnd(rng, n)
    # exact: the fp32 sum of two 16-bit values of these magnitudes is exact, then one rounding
    assert np.array_equal(ops.residual_forward(a, b), t16.round(a.astype(np.float64) + b))


@pytest.mark.parametrize("mis", [False, True], ids=["aligned", "misaligned"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_gelu_epilogues(t16, mis, fused):
    """matmul_gelu_forward and gelu_matmul_backward (the MLP; GELU in cuBLASLt's epilogues when fused, else the
    separate matmul and GELU kernels; misaligned buffers take the separate kernels too)."""
    ops, rng, U, tiny = t16.make(misalign=mis, fused=fused), np.random.default_rng(10), t16.U, t16.tiny
    OC = 4 * C
    x, w, bias = t16.rnd(rng, N, C), t16.rnd(rng, OC, C, scale=0.1), t16.rnd(rng, OC)
    xd, wd = x.astype(np.float64), w.astype(np.float64)
    mag = np.abs(xd) @ np.abs(wd).T + np.abs(bias)
    pre, out = ops.matmul_gelu_forward(x, w, bias)
    pre_ref = xd @ wd.T + bias
    t16.check(pre, pre_ref, mag)
    # gelu of the fp32 pre-activation (fused) or of its 16-bit rounding (unfused): |gelu'| < 1.2 carries pre's
    # error into out, which is then rounded once more (1e-30: no division by zero where tiny is 0)
    ref = gelu_ref(pre_ref)
    assert t16.is16(out)
    bound = U * np.abs(ref) + 1.2 * (U * np.abs(pre_ref) + FP32 * mag + tiny) + FP32 * np.abs(pre_ref) + tiny + 1e-30
    assert np.max(np.abs(out - ref) / bound) <= 1.0
    # backward of gelu(pre) @ w2^T + b2 (4C -> C); dpre starts random and is overwritten
    p, w2 = t16.rnd(rng, N, OC, scale=2.0), t16.rnd(rng, C, OC, scale=0.1)
    act = ops.gelu_forward(p.ravel()).reshape(N, OC)
    dpre0, dw0, db0, dout = t16.rnd(rng, N, OC), f32(rng, C, OC), f32(rng, C), t16.rnd(rng, N, C)
    gd, w2d = dout.astype(np.float64), w2.astype(np.float64)
    dpre, dw, db = ops.gelu_matmul_backward(dpre0, dw0, db0, dout, p, act, w2)
    acc, g = gd @ w2d, gelu_grad_ref(p.astype(np.float64))
    # fused: acc * gelu' rounded once; unfused: acc rounded first (U |acc| |gelu'|), then the product. gelu' in
    # fp32 is off by ~1e-7 absolute (0 instead of 1e-10 where tanh saturates, cancellation near its zero): FP32 |acc|
    assert t16.is16(dpre)
    ref = acc * g
    bound = (U * np.abs(ref) + np.abs(g) * (U * np.abs(acc) + FP32 * (np.abs(gd) @ np.abs(w2d)) + tiny)
             + FP32 * np.abs(acc) + tiny + 1e-30)
    assert np.max(np.abs(dpre - ref) / bound) <= 1.0
    ad = act.astype(np.float64)
    check_f32(dw, dw0 + gd.T @ ad, np.abs(dw0) + np.abs(gd).T @ np.abs(ad))
    check_f32(db, db0 + gd.sum(0), np.abs(db0) + np.abs(gd).sum(0))
    dpre2, dw2, db2 = ops.gelu_matmul_backward(dpre0, dw0, None, dout, p, act, w2)
    assert db2 is None and np.array_equal(dpre2, dpre) and np.array_equal(dw2, dw)


@pytest.mark.parametrize("mis", [False, True], ids=["aligned", "misaligned"])
@pytest.mark.parametrize("n", [N * C + 3, 7], ids=["ragged", "tiny"])
def test_adamw_master_weights(t16, mis, n):
    """fp32 master weights and moments as in fp32 AdamW; the 16-bit copy as the type's check_param_copy says."""
    ops, rng = t16.ops[mis], np.random.default_rng(7)
    master0, grad = f32(rng, n, scale=0.05), f32(rng, n)
    m0, v0 = f32(rng, n, scale=0.1), np.abs(f32(rng, n, scale=0.1))  # a later step: smooth in the gradient
    wr, mr, vr = adamw_ref(master0, grad, m0, v0, **ADAM)
    for seed, offset in ((0, 0), (1234, 0), (99, 1 << 33)):
        p, master, m, v = ops.adamw(master0, grad, m0, v0, **ADAM, seed=seed, offset=offset)
        # fp32 master/m/v: a few fp32 roundings of each O(1) quantity of the update
        check_f32(m, mr, np.abs(mr) + np.abs(grad))
        check_f32(v, vr, vr + grad.astype(np.float64) ** 2)
        check_f32(master, wr, np.abs(wr) + ADAM["lr"] * 10)
        t16.check_param_copy(ops, p, master, seed, offset)
