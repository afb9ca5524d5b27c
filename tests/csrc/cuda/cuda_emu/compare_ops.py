"""Every op of the emulated CUDA backend against the CPU backend, on random inputs with odd shapes.

Run by tests/csrc/cuda/test_cuda_emu.py in a subprocess per emulator schedule (GPT2CORE_EMU_SCHED=fwd|rev|random:<seed>,
GPT2CORE_EMU_TRACE=<file> recording the launched kernels):

    python tests/csrc/cuda/cuda_emu/compare_ops.py build/emu-py

Prints one JSON object: {op name: normwise error}, where error = max|cuda - cpu| / max|cpu| over every output
of the op (accumulated-into outputs start from random values, so the += contract is checked too).
"""
import json
import os
import sys

import numpy as np

sys.path.insert(0, sys.argv[1])
import gpt2core_cuda_emu as E  # noqa: E402

rng = np.random.default_rng(1234)
cpu, cuda = E.Ops("cpu"), E.Ops("cuda")
errors = {}


def f32(*shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def record(name, got, want):
    got = got if isinstance(got, (tuple, list)) else (got,)
    want = want if isinstance(want, (tuple, list)) else (want,)
    worst = 0.0
    for g, w in zip(got, want):
        if w is None:
            continue
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert g.shape == w.shape, (name, g.shape, w.shape)
        if not np.all(np.isfinite(g)):
            worst = float("inf")
            continue
        denom = max(np.max(np.abs(w)), 1e-30) if w.size else 1.0
        worst = max(worst, float(np.max(np.abs(g - w)) / denom) if w.size else 0.0)
    errors[name] = max(errors.get(name, 0.0), worst)


def both(method, *args):
    return getattr(cuda, method)(*args), getattr(cpu, method)(*args)


B, T, C = 3, 37, 192           # T not a multiple of the 32-row attention tile; C = 3 * 64
N = B * T
V, Vp, maxT = 97, 128, 40

# encoder
inp = rng.integers(0, V, (B, T)).astype(np.int32)
inp[1, :5] = inp[0, 3]          # repeated tokens: the deterministic bucketed dwte sum
wte, wpe = f32(Vp, C), f32(maxT, C)
record("encoder_forward", *both("encoder_forward", inp, wte, wpe))
record("encoder_backward", *both("encoder_backward", f32(Vp, C), f32(maxT, C), f32(B, T, C), inp))

# layernorm
x, w, b = f32(N, C, scale=2.0) + 0.5, f32(C), f32(C)
out, mean, rstd = cpu.layernorm_forward(x, w, b)
record("layernorm_forward", cuda.layernorm_forward(x, w, b), (out, mean, rstd))
record("layernorm_backward", *both("layernorm_backward", f32(N, C), f32(C), f32(C), f32(N, C), x, w, mean, rstd))


def nan(*shape):
    return np.full(shape, np.nan, np.float32)


def record_write(name, method, poisoned, zeroed, *rest):
    """InputGrad::Write: each backend, its input gradient poisoned with NaN, against the CPU backend accumulating
    into zeros (the += contract, checked above): the old contents must be neither read nor kept."""
    want = getattr(cpu, method)(zeroed, *rest)
    for backend in (cuda, cpu):
        record(name + " write", getattr(backend, method)(poisoned, *rest, write=True), want)


record_write("layernorm_backward", "layernorm_backward", nan(N, C), np.zeros((N, C), np.float32), f32(C), f32(C),
             f32(N, C), x, w, mean, rstd)

# matmul (through the seam) with and without bias; OC odd
for OC in (3 * C, 101):
    xin, wt, bias = f32(N, C), f32(OC, C, scale=0.1), f32(OC)
    record("matmul_forward", *both("matmul_forward", xin, wt, bias))
    record("matmul_forward", *both("matmul_forward", xin, wt, None))
    record("matmul_backward", *both("matmul_backward", f32(N, C), f32(OC, C), f32(OC), f32(N, OC), xin, wt))
    record("matmul_backward", *both("matmul_backward", f32(N, C), f32(OC, C), None, f32(N, OC), xin, wt))
    record_write("matmul_backward", "matmul_backward", nan(N, C), np.zeros((N, C), np.float32), f32(OC, C), f32(OC),
                 f32(N, OC), xin, wt)

# dbias from the column-sum kernels where the seam refuses the weight-gradient GEMM's bias-gradient epilogue, as
# cuBLASLt may (the emulator's test knob): the plain GEMM, then reduce.cuh
os.environ["GPT2CORE_EMU_REFUSE_BIAS_GRAD_EPILOGUE"] = "1"
for OC in (3 * C, 101):
    xin, wt = f32(N, C), f32(OC, C, scale=0.1)
    record("matmul_backward bgrad refused", *both("matmul_backward", f32(N, C), f32(OC, C), f32(OC), f32(N, OC), xin,
                                                  wt))
del os.environ["GPT2CORE_EMU_REFUSE_BIAS_GRAD_EPILOGUE"]

# matmul with the GELU epilogues (the MLP): up-projection C -> OC with GELU, then the backward of
# gelu(pre) @ w^T + b (OC -> C). OC = 4C as in the model; OC = 101 is no multiple of 8, which cuBLASLt's GELU
# matrix needs, so the CUDA backend falls back to the separate matmul and GELU kernels there. The unfused rung
# (fused=False) is compared too.
cuda_unfused = E.Ops("cuda", fused=False)
for OC in (4 * C, 101):
    xin, wt, bias = f32(N, C), f32(OC, C, scale=0.1), f32(OC)
    pre = f32(N, OC, scale=2.0)
    act = cpu.gelu_forward(pre.ravel()).reshape(N, OC)
    w2 = f32(C, OC, scale=0.1)
    for prefix, ops in (("", cuda), ("unfused ", cuda_unfused)):
        for bb in (bias, None):
            record(prefix + "matmul_gelu_forward", ops.matmul_gelu_forward(xin, wt, bb),
                   cpu.matmul_gelu_forward(xin, wt, bb))
        for db in (f32(C), None):  # dpre starts random: it is overwritten, not accumulated into
            args = (f32(N, OC), f32(C, OC), db, f32(N, C), pre, act, w2)
            record(prefix + "gelu_matmul_backward", ops.gelu_matmul_backward(*args), cpu.gelu_matmul_backward(*args))

# attention: head sizes 64 (C=192, 3 heads), 16 and 10 (zero-padded in the 64-wide kernels), 128
for (Ca, NH, Ta) in ((192, 3, T), (48, 3, T), (20, 2, 9), (256, 2, 33)):
    qkv = f32(B, Ta, 3 * Ca)
    record(f"attention(hs={Ca // NH})", *both("attention", qkv, f32(B, Ta, Ca), f32(B, Ta, 3 * Ca), NH))

# the other attention paths, selected by the backend's attention option: the materialised ("naive") rung, and
# the attention seam (cuDNN's SDPA on GPUs, its CPU implementation here)
for mode in ("naive", "cudnn"):
    ops = E.Ops("cuda", attention=mode)
    for (Ca, NH, Ta) in ((192, 3, T), (20, 2, 9)):
        args = (f32(B, Ta, 3 * Ca), f32(B, Ta, Ca), f32(B, Ta, 3 * Ca), NH)
        record(f"{mode} attention(hs={Ca // NH})", ops.attention(*args), cpu.attention(*args))

# attention_backward with InputGrad::Write, every path (dqkv poisoned with NaN; the reference accumulates into 0)
for mode in ("auto", "naive", "cudnn"):
    ops = E.Ops("cuda", attention=mode)
    qkv, dout = f32(B, T, 3 * 192), f32(B, T, 192)
    want = cpu.attention(qkv, dout, np.zeros((B, T, 3 * 192), np.float32), 3)
    for backend in (ops, cpu):
        record(f"{mode} attention write", backend.attention(qkv, dout, nan(B, T, 3 * 192), 3, write=True), want)

# the bf16 flash path's tensor-core forward (attention_tc.cuh), run here so the launch trace sees every kernel;
# its numerics are checked against float64 in tests/csrc/cuda/test_cuda_emu_bf16_attention.py
E.OpsBF16("cuda").attention(f32(B, 9, 3 * 192), f32(B, 9, 192), f32(B, 9, 3 * 192), 3)

# gelu, residual (sizes not a multiple of 4: the float4 paths finish with a scalar tail)
g = f32(N * 4 + 3, scale=2.0)
record("gelu_forward", *both("gelu_forward", g))
record("gelu_backward", *both("gelu_backward", f32(g.size), g, f32(g.size)))
record("residual_forward", *both("residual_forward", f32(1001), f32(1001)))

# fused classifier: padded vocab, ignored targets
logits = f32(N, Vp, scale=3.0)
targets = rng.integers(0, V, N).astype(np.int32)
targets[[0, 5, N - 1]] = -1
(l1, s1, n1), (l0, s0, n0) = both("crossentropy_forward", logits, targets, V)
assert n1 == n0 == N - 3, (n1, n0)
record("crossentropy_forward", (l1, s1), (l0, s0))
(l1, s1, n1), (l0, s0, n0) = both("crossentropy_forward", logits, None, V)
assert n1 == n0 == 0
record("crossentropy_forward", (l1, s1), (l0, s0))
record("crossentropy_backward_inplace", *both("crossentropy_backward_inplace", logits, s0, targets, 1.0 / 7, V))
# forward_backward's device-resident loss: the count stays in device memory, dloss = grad_scale / count and the
# mean loss is accumulated there; against the CPU backend and against the host-side forms above
(l1, s1, n1, a1, d1), (l0, s0c, n0, a0, d0) = both("crossentropy_counted", logits, targets, V, 0.25, 1.5)
assert n1 == n0 == N - 3, (n1, n0)
assert abs(a1 - a0) <= 1e-6 * abs(a0) and abs(a0 - (1.5 + 0.25 * l0.sum() / n0)) <= 1e-6 * a0, (a1, a0)
record("crossentropy_counted", (l1, s1, d1), (l0, s0c, d0))
record("crossentropy_counted", d1, cuda.crossentropy_backward_inplace(logits, s0, targets, 0.25 / n0, V))
# with a loss scale in backend memory (dynamic loss scaling): dlogits exactly 2^10 x the unscaled ones (a power of
# two scales without rounding), the loss unscaled
(l2, _, _, a2, d2), (_, _, _, a2c, d2c) = both("crossentropy_counted", logits, targets, V, 0.25, 1.5, False, 2.0**10)
assert np.array_equal(d2, d1 * np.float32(2.0**10)) and np.array_equal(d2c, d0 * np.float32(2.0**10))
assert a2 == a1 and a2c == a0 and np.array_equal(l2, l1)
# the training step's fused pass (count first, then loss, lse and dlogits in one kernel) against the CPU's two ops
(l1, s1, n1, a1, d1) = cuda.crossentropy_counted(logits, targets, V, 0.25, 1.5, fused=True)
assert n1 == n0 and abs(a1 - a0) <= 1e-6 * abs(a0), (n1, n0, a1, a0)
record("crossentropy_fused", (l1, s1, d1), (l0, s0c, d0))
# and with the loss scale: exactly 2^10 x, as the two-op path
d2 = cuda.crossentropy_counted(logits, targets, V, 0.25, 1.5, fused=True, loss_scale=2.0**10)[4]
assert np.array_equal(d2, d1 * np.float32(2.0**10))


# classifier rows of other widths: Vp a multiple of 8 with V not (16-byte vectors, a ragged tail up to V, padded
# vectors written 0), V = Vp, rows wider than the block's 512 vectors, and Vp odd (rows not 16-byte aligned: one
# value per access); targets include the last column and one in the ragged part
def classifier_cases(ops, prefix):
    for (Vc, Vpc, Nc) in ((101, 120, 7), (64, 64, 5), (5001, 5008, 3), (97, 99, 7)):
        lg = f32(Nc, Vpc, scale=3.0)
        tg = rng.integers(0, Vc, Nc).astype(np.int32)
        tg[[0, 1, 2]] = (Vc - 1, Vc - 2, -1)
        (l1, s1, n1), (l0, s0, n0) = ops.crossentropy_forward(lg, tg, Vc), cpu.crossentropy_forward(lg, tg, Vc)
        assert n1 == n0 == Nc - 1, (n1, n0)
        record(prefix + "crossentropy_forward", (l1, s1), (l0, s0))
        args = (lg, s0, tg, 1.0 / 3, Vc)
        record(prefix + "crossentropy_backward_inplace", ops.crossentropy_backward_inplace(*args),
               cpu.crossentropy_backward_inplace(*args))
        (l1, s1, n1, a1, d1), (l0, s0, n0, a0, d0) = (o.crossentropy_counted(lg, tg, Vc, 0.5, 0.0, fused=True)
                                                      for o in (ops, cpu))
        assert n1 == n0 == Nc - 1, (n1, n0)
        record(prefix + "crossentropy_fused", (l1, s1, d1, np.float32(a1)), (l0, s0, d0, np.float32(a0)))


classifier_cases(cuda, "")

# ---- the modern architecture's ops (csrc/model/backend.h; kernels rmsnorm.cuh, rope.cuh, relu2.cuh, classifier.cuh's
# soft-cap; their float64 checks per storage type are in tests/csrc/cuda/test_cuda_emu_modern.py), and the GPT-2 ops
# with the tensors a modern config lacks (null wpe, layernorm bias, matmul bias)


def modern_cases(ops, prefix):
    xr = f32(N, C, scale=2.0) + 0.3
    out, rstd = cpu.rmsnorm_forward(xr)
    record(prefix + "rmsnorm_forward", ops.rmsnorm_forward(xr), (out, rstd))
    a2, b2 = f32(N, C), f32(N, C)
    record(prefix + "residual_rmsnorm_forward", ops.residual_rmsnorm_forward(a2, b2), cpu.residual_rmsnorm_forward(a2, b2))
    args = (f32(N, C), f32(N, C), xr, rstd)
    record(prefix + "rmsnorm_backward", ops.rmsnorm_backward(*args), cpu.rmsnorm_backward(*args))
    want = cpu.rmsnorm_backward(np.zeros((N, C), np.float32), *args[1:])
    record(prefix + "rmsnorm_backward write", ops.rmsnorm_backward(nan(N, C), *args[1:], write=True), want)
    # rotary and QK-norm on qkv: head sizes 64 and 10 (5 pairs: the scalar path), positions from 0, from 1000, and
    # from 3000 (the CUDA backend's table grows from 1024 to 4096 positions)
    for (Ca, NH, Ta, t0) in ((192, 3, T, 0), (20, 2, 9, 1000), (192, 3, 5, 3000)):
        qkv = f32(B, Ta, 3 * Ca)
        for backward in (False, True):
            record(prefix + ("rope_backward" if backward else "rope_forward"),
                   *(o.rope(qkv, NH, t0, 10000.0, backward) for o in (ops, cpu)))
        (q1, r1), (q0, r0) = ops.qk_norm_forward(qkv, NH), cpu.qk_norm_forward(qkv, NH)
        record(prefix + "qk_norm_forward", (q1, r1), (q0, r0))
        args = (f32(B, Ta, 3 * Ca), q0, r0, NH)
        record(prefix + "qk_norm_backward", ops.qk_norm_backward(*args), cpu.qk_norm_backward(*args))
    g2 = f32(N * 4 + 3, scale=2.0)
    record(prefix + "relu2_forward", ops.relu2_forward(g2), cpu.relu2_forward(g2))
    args = (f32(g2.size), g2, f32(g2.size))
    record(prefix + "relu2_backward", ops.relu2_backward(*args), cpu.relu2_backward(*args))
    lg = f32(N, Vp, scale=12.0)
    record(prefix + "softcap_forward", ops.softcap_forward(lg, 15.0), cpu.softcap_forward(lg, 15.0))
    tg = rng.integers(0, V, N).astype(np.int32)
    tg[[0, 5, N - 1]] = (-1, V - 1, -1)
    for fused in (False, True):
        (l1, s1, n1, a1, d1), (l0, s0, n0, a0, d0) = (o.crossentropy_softcap(lg, tg, V, 15.0, 0.5, fused=fused)
                                                      for o in (ops, cpu))
        assert n1 == n0 == N - 2, (n1, n0)
        record(prefix + ("crossentropy_softcap_fused" if fused else "crossentropy_softcap"),
               (l1, s1, d1, np.float32(a1)), (l0, s0, d0, np.float32(a0)))


modern_cases(cuda, "")
# the MLP with relu^2 (no cuBLASLt epilogue: matmul + relu2 kernels; the backward writes dpre in place), with and
# without bias; OC = 4C and an odd OC
for OC in (4 * C, 101):
    xin, wt, bias = f32(N, C), f32(OC, C, scale=0.1), f32(OC)
    pre = f32(N, OC, scale=2.0)
    act = cpu.relu2_forward(pre.ravel()).reshape(N, OC)
    w2 = f32(C, OC, scale=0.1)
    for bb in (bias, None):
        record("matmul_relu2_forward", cuda.matmul_relu2_forward(xin, wt, bb), cpu.matmul_relu2_forward(xin, wt, bb))
    for db in (f32(C), None):
        args = (f32(C, OC), db, f32(N, C), pre, act, w2)
        record("relu2_matmul_backward", cuda.relu2_matmul_backward(*args), cpu.relu2_matmul_backward(*args))
# null tensors: the encoder without wpe (rotary), layernorm without bias
record("encoder_forward no wpe", *both("encoder_forward", inp, wte, None))
record("encoder_backward no wpe", *both("encoder_backward", f32(Vp, C), None, f32(B, T, C), inp))
out, mean, rstd = cpu.layernorm_forward(x, w, None)
record("layernorm_forward no bias", cuda.layernorm_forward(x, w, None), (out, mean, rstd))
record("residual_layernorm_forward no bias", *both("residual_layernorm_forward", f32(N, C), f32(N, C), w, None))
record("layernorm_backward no bias", *both("layernorm_backward", f32(N, C), f32(C), None, f32(N, C), x, w, mean, rstd))

# global norm and AdamW
p = f32(70001)
s1, s0 = both("sum_squares", p)
errors["sum_squares"] = abs(s1 - s0) / s0
pw, gw = f32(5003), f32(5003, scale=1e-2)
m0, v0 = f32(5003, scale=1e-3), np.abs(f32(5003, scale=1e-5))
record("adamw", *both("adamw", pw, gw, m0, v0, 1e-3, 0.9, 0.95, 1e-8, 0.1, 0.5, 1 - 0.9 ** 3, 1 - 0.95 ** 3))
record("adamw", *both("adamw", pw, gw, m0, v0, 1e-3, 0.9, 0.95, 1e-8, 0.0, 1.0, 1 - 0.9, 1 - 0.95))
# the optimizer step with its values in device memory (a graph replays it): norm and clip scale on the device;
# against the CPU backend, and bit for bit against adamw() with the host's clip scale; non-finite: no write
for clip in (0.0, 0.5, 1e9):
    got, want = both("clipped_adamw", pw, gw, m0, v0, 1e-3, 1 - 0.9 ** 3, 1 - 0.95 ** 3, 3, clip)
    norm64 = np.sqrt(np.sum(gw.astype(np.float64) ** 2))
    assert abs(got[0] - want[0]) <= 1e-6 * want[0] and abs(got[0] - norm64) <= 1e-6 * norm64, (got, want)
    record("clipped_adamw", got[1:], want[1:])
    scale = clip / (got[0] + 1e-6) if 0 < clip < got[0] else 1.0
    h = len(pw) // 2
    parts = [cuda.adamw(x, y, a, b, 1e-3, 0.9, 0.95, 1e-8, d, scale, 1 - 0.9 ** 3, 1 - 0.95 ** 3)
             for x, y, a, b, d in ((pw[:h], gw[:h], m0[:h], v0[:h], 0.1), (pw[h:], gw[h:], m0[h:], v0[h:], 0.0))]
    for k in range(3):
        assert np.array_equal(got[1 + k], np.concatenate([parts[0][k], parts[1][k]])), (clip, k)
# loss-scaled gradients (2^12 x): the update divides the scale out and clips by the unscaled norm, the same bits
for clip in (0.0, 0.5):
    got, want = both("clipped_adamw", pw, gw * np.float32(2.0**12), m0, v0, 1e-3, 1 - 0.9 ** 3, 1 - 0.95 ** 3, 3, clip,
                     2.0**12)
    plain = cuda.clipped_adamw(pw, gw, m0, v0, 1e-3, 1 - 0.9 ** 3, 1 - 0.95 ** 3, 3, clip)
    assert got[0] == plain[0] * 2.0**12 and all(np.array_equal(a, b) for a, b in zip(got[1:], plain[1:])), clip
    record("clipped_adamw", got[1:], want[1:])
# the loss scaler's step (model/optimizer.h, GradScaler's rule) on the device against the host's, every branch:
# clean below the interval, growth, growth capped below fp32 overflow, backoff on inf and on NaN
for args in ((2.0**16, 3, 0, 5, 1.5), (2.0**16, 3, 2, 5, 1.5), (2.0**127, 1, 0, 0, 2.0), (2.0**16, 3, 2, 5, np.inf),
             (3.0, 2000, 1999, 0, np.nan), (2.0**-3, 1, 0, 7, 0.0)):
    got, want = both("loss_scale_update", *args)
    assert got[1:] == want[1:] and (got[0] == want[0] or np.isnan(want[0])), (args, got, want)
    record("loss_scale_update", np.array(got[1:], dtype=np.float64), np.array(want[1:], dtype=np.float64))
# ... and both against GradScaler's rule written out (one code path: a wrong overflow check in model/optimizer.h,
# e.g. !isinf so that a NaN sum of squares counts as clean, would pass the comparison above): (scale, clean, skipped)
for backend in (cpu, cuda):
    for sumsq in (np.inf, -np.inf, np.nan):
        assert backend.loss_scale_update(2.0**16, 3, 2, 5, sumsq)[1:] == (2.0**15, 0, 6), (backend, sumsq)
    assert backend.loss_scale_update(2.0**16, 3, 2, 5, 1.0)[1:] == (2.0**17, 0, 5)
    assert backend.loss_scale_update(2.0**16, 3, 1, 5, 1e300)[1:] == (2.0**16, 2, 5)
    assert backend.loss_scale_update(2.0**127, 1, 0, 0, 2.0)[1:] == (2.0**127, 0, 0)  # growth would overflow fp32
for backend in (cuda, cpu):  # the clip rule's finiteness check: a NaN or Inf norm writes nothing, clip or not
    for bad, clip in ((np.nan, 1.0), (np.nan, 0.0), (np.inf, 1.0), (np.inf, 0.0)):
        g_bad = gw.copy()
        g_bad[17] = bad
        got = backend.clipped_adamw(pw, g_bad, m0, v0, 1e-3, 0.1, 0.05, 3, clip)
        assert not np.isfinite(got[0]) and all(np.array_equal(a, b) for a, b in zip(got[1:], (pw, m0, v0))), \
            (backend, bad, clip)

# the memory-bound kernels' one-float-per-thread paths: buffers that are not 16-byte aligned
cuda_unaligned = E.Ops("cuda", misalign=True)
record("unaligned encoder_forward", cuda_unaligned.encoder_forward(inp, wte, wpe), cpu.encoder_forward(inp, wte, wpe))
record("unaligned gelu_forward", cuda_unaligned.gelu_forward(g), cpu.gelu_forward(g))
args = (f32(g.size), g, f32(g.size))
record("unaligned gelu_backward", cuda_unaligned.gelu_backward(*args), cpu.gelu_backward(*args))
args = (f32(1001), f32(1001))
record("unaligned residual_forward", cuda_unaligned.residual_forward(*args), cpu.residual_forward(*args))
out, mean, rstd = cpu.layernorm_forward(x, w, b)
record("unaligned layernorm_forward", cuda_unaligned.layernorm_forward(x, w, b), (out, mean, rstd))
args = (f32(N, C), f32(C), f32(C), f32(N, C), x, w, mean, rstd)
record("unaligned layernorm_backward", cuda_unaligned.layernorm_backward(*args), cpu.layernorm_backward(*args))
# C not a multiple of 4: the scalar path with aligned buffers
x5, w5, b5 = f32(N, 45), f32(45), f32(45)
out, mean, rstd = cpu.layernorm_forward(x5, w5, b5)
record("layernorm_forward", cuda.layernorm_forward(x5, w5, b5), (out, mean, rstd))
args = (f32(N, 45), f32(45), f32(45), f32(N, 45), x5, w5, mean, rstd)
record("layernorm_backward", cuda.layernorm_backward(*args), cpu.layernorm_backward(*args))
args = (pw, gw, m0, v0, 1e-3, 0.9, 0.95, 1e-8, 0.1, 0.5, 1 - 0.9 ** 3, 1 - 0.95 ** 3)
record("unaligned adamw", cuda_unaligned.adamw(*args), cpu.adamw(*args))
l1, s1, _ = cuda_unaligned.crossentropy_forward(logits, targets, V)
l0, s0, _ = cpu.crossentropy_forward(logits, targets, V)
record("unaligned crossentropy_forward", (l1, s1), (l0, s0))
args = (logits, s0, targets, 1.0 / 7, V)
record("unaligned crossentropy_backward_inplace", cuda_unaligned.crossentropy_backward_inplace(*args),
       cpu.crossentropy_backward_inplace(*args))
classifier_cases(cuda_unaligned, "unaligned ")
modern_cases(cuda_unaligned, "unaligned ")

# KV-cache inference (cuda/infer.cuh; float64 references and the whole model in test_cuda_emu_infer.py): the cache write
# and decode attention (mixed positions, slots out of order), the encoder at positions, the row gather, and the
# sampler (greedy, nothing cut, top-k with top-p): the same ids as the CPU's (recorded as the fraction that differ)
kv_slot, kv_pos = np.array([2, 0, 1], np.int32), np.array([9, 0, 30], np.int32)
kc, vc = f32(3, maxT, C), f32(3, maxT, C)
for Tq in (1, 3):
    args = (f32(3, Tq, 3 * C), kc, vc, kv_slot, kv_pos, 3)
    record("attention_kv_forward", *both("attention_kv", *args))
# a cache of 160 positions: the split-key path (attention_kv_split_kernel + attention_kv_combine_kernel, 2 shares)
kc2, vc2 = f32(3, 160, C), f32(3, 160, C)
args = (f32(3, 1, 3 * C), kc2, vc2, kv_slot, np.array([9, 0, 150], np.int32), 3)
record("attention_kv_forward split", *both("attention_kv", *args))
record("encoder_forward_at", *both("encoder_forward_at", inp[:, :4], wte, wpe, kv_pos))
record("gather_rows", *both("gather_rows", f32(7, C), np.array([6, 0, 3], np.int32)))
slog = f32(6, Vp) * 2
for settings in ((1.0, 1, 1.0), (0.9, 0, 1.0), (0.8, 20, 0.9)):
    sargs = [[v] * 6 for v in settings] + [[5] * 6, list(range(6)), [2] * 6]
    ids_gpu, ids_cpu = both("sample_tokens", slog, V, *sargs)
    errors["sample_tokens"] = max(errors.get("sample_tokens", 0.0), float(np.mean(ids_gpu != ids_cpu)))

# FP8 quantisation (cuda/fp8.cuh: the amax and cast kernels), bit for bit against the CPU reference: 0 or inf
# (tests/csrc/cuda/test_fp8.py checks both against numpy and the FP8 Linear ops)
for kind, scale in (("e4m3", 3.0), ("e5m2", 1e-3)):
    x8 = f32(N, C, scale=scale)
    x8[5, 7] = 0.0
    g8, c8 = both("fp8_quantize", x8, kind)
    same = all(np.array_equal(a, b) for a, b in zip(g8, c8))
    errors["fp8_quantize"] = max(errors.get("fp8_quantize", 0.0), 0.0 if same else float("inf"))

# Muon's kernels (cuda/muon.cuh) launch here too, for the every-kernel trace; their numbers are checked against the CPU
# backend in test_cuda_emu_muon.py (its Newton-Schulz runs in bf16: not within this file's 1e-5)
muon_model = E.Model(max_seq_len=40, vocab_size=97, padded_vocab_size=128, n_layer=1, n_head=3, n_embd=192,
                     device="cuda")
mrng = np.random.default_rng(7)
muon_model.flat_params()[:] = (0.02 * mrng.standard_normal(muon_model.num_parameters)).astype(np.float32)
muon_model.params_changed()
muon_model.flat_grads()[:] = mrng.standard_normal(muon_model.num_parameters).astype(np.float32)
muon_norm = muon_model.muon_optimizer_step(lr=1e-3, weight_decay=0.1, step=1, grad_clip=1.0, muon_lr=0.02,
                                           muon_momentum=0.9, muon_weight_decay=0.01)
assert np.isfinite(muon_norm) and np.isfinite(muon_model.flat_params()).all(), "the Muon step wrote non-finite values"

print(json.dumps(errors))
