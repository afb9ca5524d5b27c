"""fp16 storage (IEEE binary16, the contract at the top of csrc/cuda/common.cuh) of the CUDA kernels, emulated: the
conversions, then the ops of gpt2core_cuda_emu.OpsF16 (Backend<f16>) against a float64 numpy reference computed
over the fp16-ROUNDED inputs (here crossentropy and attention; F16 gives test_cuda_emu_16bit.py what it needs to
test the ops both 16-bit types share), on the odd shapes of test_cuda_emu_bf16.py (whose references this file imports),
aligned (vector paths: 8 fp16 per 16-byte access) and misaligned (scalar fallbacks), and fp16's narrow range:
values whose squares or products overflow 65504 must stay in fp32 (layernorm statistics, softmax, attention
scores) and outputs above it become Inf.

Tolerances, derived from fp16's unit roundoff U = 2^-11 (11 significant bits):
- a stored fp16 output is ONE round to nearest even of an fp32 value v: |fl(v) - v| <= U |v| where v is normal
  (|v| >= 2^-14); in the subnormal range the spacing is 2^-24, so the error is at most TINY = 2^-25 absolute.
  Every fp16 check is |got - ref| <= U |ref| + FP32 * terms + TINY (check_f16).
- the fp32 arithmetic before that rounding: products of two fp16 values are exact in fp32 (11 + 11 <= 24 bits),
  so a K-term dot product or sum carries only fp32 accumulation error, at most K 2^-24 sum|terms| (first order);
  FP32 = 1e-5 (test_cuda_emu_bf16.FP32: the K <= 192 rows here, sqrt(K) growth for the 2056-wide layernorm)
  times the sum of |terms| bounds it. Since the references take the fp16-rounded inputs, input rounding (which
  would add K 2^-11 |x| for raw fp32 inputs) is not part of any bound.
- fp32 outputs (parameter gradients, statistics, master weights, moments) carry only the FP32 part (check_f32).
A kernel that rounded to bf16 (2^-8), truncated instead of rounding (2^-10), or kept a statistic in fp16 would
exceed these bounds by factors of 2 to 8 on most elements.
"""
from types import SimpleNamespace

import numpy as np
import pytest

# emu: the session fixture that builds and imports gpt2core_cuda_emu
from test_cuda_emu import emu  # noqa: F401
from test_cuda_emu_bf16 import FP32, B, N, V, Vp, check_f32, check_layernorm_forward
from test_cuda_emu_bf16_attention import CASES
from test_cuda_emu_bf16_attention import reference as attention_reference

U = 2.0 ** -11     # unit roundoff of fp16 (round to nearest even, normal range)
TINY = 2.0 ** -25  # half the subnormal spacing 2^-24: the absolute error of a rounding below 2^-14
F16_MAX = 65504.0


@pytest.fixture(scope="module")
def f16ops(emu):  # noqa: F811
    return {False: emu.OpsF16("cuda"), True: emu.OpsF16("cuda", misalign=True)}


def r16(x):
    """x rounded to the nearest fp16 (ties to even; numpy's conversion), as float32."""
    return np.asarray(x).astype(np.float16).astype(np.float32)


def rnd(rng, *shape, scale=1.0, offset=0.0):
    """Random normal values, fp16-rounded, never zero (|x| >= 1e-3 * scale)."""
    x = rng.standard_normal(shape) * scale
    return r16(np.where(np.abs(x) < 1e-3 * scale, 1e-3 * scale, x) + offset)


def is_f16(x):
    x = np.asarray(x, np.float32)
    return np.array_equal(r16(x), x, equal_nan=True)


def check_f16(got, ref, terms, extra=0.0):
    """got: fp16 values; ref: the float64 exact result; terms: float64 magnitude of what was summed; extra: any
    further absolute error bound the caller derives."""
    got = np.asarray(got, np.float64)
    assert got.shape == ref.shape
    assert is_f16(got), "outputs of an fp16 op must be fp16 values"
    bound = U * np.abs(ref) + FP32 * terms + extra + TINY
    worst = np.max(np.abs(got - ref) / bound)
    assert worst <= 1.0, f"error {worst:.3f} x the bound"


def check_param_copy(ops, p, master, seed, offset):
    """The fp16 weight copy an AdamW step writes: the master rounded to nearest even whatever the seed (fp16 does
    not round stochastically: see csrc/cuda/common.cuh), as cast_params writes it."""
    assert np.array_equal(p, r16(master))
    assert np.array_equal(p, ops.cast_params(master, seed, offset))


# fp16 for the ops test_cuda_emu_16bit.py tests over both 16-bit types
F16 = SimpleNamespace(cls="OpsF16", U=U, tiny=TINY, round=r16, rnd=rnd, is16=is_f16, check=check_f16,
                      check_param_copy=check_param_copy)


# --------------------------------------------------------------------------------------------- conversions
def test_f16_conversions_match_numpy_on_every_bit_pattern(emu):  # noqa: F811
    """gpt2::f16_to_float on all 65536 patterns and gpt2::float_to_f16 back (csrc/model/dtypes.h), bit for bit
    against numpy.float16 (IEEE binary16); NaN stays NaN."""
    h = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    want = h.view(np.float16).astype(np.float32)
    got = emu.f16_values(h)
    nan = np.isnan(want)
    assert nan.sum() == 2046 and np.all(np.isnan(got[nan]))
    assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))  # -0, subnormals, Inf exactly
    assert np.array_equal(emu.f16_bits(want[~nan]), h[~nan])
    assert np.all(np.isnan(emu.f16_values(emu.f16_bits(want[nan]))))


def test_f16_values_survive_a_kernel_on_every_bit_pattern(f16ops):
    """__half2float and __float2half_rn in a kernel (NVIDIA's cuda_fp16.h under the emulator), exhaustively: x + (-0)
    is x for every fp16 x (-0 and NaN included), so residual_forward(x, -0) must give back every pattern."""
    x = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
    got = f16ops[False].residual_forward(x, np.full_like(x, -0.0))
    nan = np.isnan(x)
    assert np.array_equal(got[~nan].view(np.uint32), x[~nan].view(np.uint32)) and np.all(np.isnan(got[nan]))


def rounding_cases(rng):
    """float32 values that exercise float -> fp16 rounding: every halfway point between neighbouring finite fp16
    values (ties: must go to the even one), a hair either side of each, random values over fp16's whole range
    (subnormals included), and the edges: 65504, the overflow threshold 65520, 2^-25, Inf, NaN, -0."""
    h = np.arange(0x7BFF, dtype=np.uint16)  # finite non-negative fp16 with a finite successor
    lo = h.view(np.float16).astype(np.float64)
    hi = (h + 1).view(np.float16).astype(np.float64)
    mid = ((lo + hi) / 2).astype(np.float32)  # exact: 12 significant bits
    nudge = np.nextafter(mid, np.float32(np.inf)), np.nextafter(mid, np.float32(0))
    rand = (rng.standard_normal(20000) * np.exp2(rng.uniform(-27, 16, 20000))).astype(np.float32)
    edges = np.array([65504, 65519.996, 65520, 65536, 1e6, 2.0 ** -25, 2.0 ** -25 * 1.0001, 2.0 ** -24, 2.0 ** -26,
                      6.1e-5, 5.96e-8, np.inf, np.nan, -0.0, 0.0], np.float32)
    x = np.concatenate([mid, *nudge, rand, edges])
    return np.concatenate([x, -x])


def test_float_to_f16_rounds_to_nearest_even(emu, f16ops):  # noqa: F811
    """gpt2::float_to_f16 (the host side) and __float2half_rn in a kernel (NVIDIA's cuda_fp16.h under the
    emulator: cast_params writes the fp16 weight copy with it) agree with numpy's correctly rounded conversion."""
    x = rounding_cases(np.random.default_rng(0))
    with np.errstate(over="ignore"):  # values beyond 65520 round to Inf, as they must
        want = x.astype(np.float16)
    nan = np.isnan(x)
    assert np.array_equal(emu.f16_bits(x)[~nan], want.view(np.uint16)[~nan])
    assert np.all(np.isnan(emu.f16_values(emu.f16_bits(x[nan]))))
    for seed in (0, 77):  # the fp16 copy is rounded to nearest even whatever the step's seed
        got = f16ops[False].cast_params(x, seed, 5)
        assert np.array_equal(got[~nan].view(np.uint32), want.astype(np.float32)[~nan].view(np.uint32))
        assert np.all(np.isnan(got[nan]))


def test_layernorm_of_values_whose_squares_overflow_fp16(f16ops):
    """Inputs near 3e4 (fp16-representable) with spread 2e3: the sum of squares (~1e9 per row) and the variance
    (~4e6) are far beyond 65504, so they must be fp32 (they are: mean/rstd are fp32 and computed in registers)."""
    rng = np.random.default_rng(12)
    x = rnd(rng, 7, 100, scale=2e3, offset=3e4)
    assert np.max(np.abs(x)) < F16_MAX and np.min((x.astype(np.float64) ** 2).sum(-1)) > 1e9
    check_layernorm_forward(check_f16, f16ops[False], x, rnd(rng, 100, offset=1.0), rnd(rng, 100))


def test_outputs_beyond_fp16_range_become_inf(f16ops):
    """fp16's range ends at 65504: a residual sum above the overflow threshold (65520) is +-Inf, not a wrapped
    or saturated value, so the loss scaler's finiteness check sees it; just below it rounds to 65504."""
    a = np.array([40000.0, -40000.0, 32752.0, 30000.0], np.float32)
    got = f16ops[False].residual_forward(a, a)
    assert got[0] == np.inf and got[1] == -np.inf and got[2] == F16_MAX and got[3] == 60000.0


def softmax_xent_ref(logits, targets, V):
    """float64 (lse, per-row loss (0 where ignored), softmax p) over the first V columns."""
    ld = logits.astype(np.float64)[:, :V]
    mx = ld.max(-1, keepdims=True)
    lse = (mx + np.log(np.exp(ld - mx).sum(-1, keepdims=True)))[:, 0]
    valid = targets >= 0
    loss = np.where(valid, lse - ld[np.arange(len(ld)), np.maximum(targets, 0)], 0.0)
    return lse, loss, np.exp(ld - lse[:, None])


@pytest.mark.parametrize("mis", [False, True], ids=["aligned", "misaligned"])
@pytest.mark.parametrize("Nc,V,Vp,scale", [(N, V, Vp, 3.0), (3, 5001, 5008, 3.0), (7, 97, 99, 3.0),
                                           (5, 101, 120, 1e4)], ids=["model", "wide", "odd", "huge-logits"])
def test_crossentropy(f16ops, mis, Nc, V, Vp, scale):
    """Softmax and loss in fp32 from fp16 logits; huge-logits: |logits| ~ 1e4, whose exponentials and spread
    overflow any 16-bit arithmetic. The gradient (softmax - onehot) * dloss is stored in fp16 with dloss =
    grad_scale / count: a loss scale of 1024 keeps most of the tiny probabilities of a 5001-way softmax above
    fp16's subnormal range (unscaled they would round to 0: the TINY term)."""
    ops, rng = f16ops[mis], np.random.default_rng(6)
    logits = rnd(rng, Nc, Vp, scale=scale)
    targets = rng.integers(0, V, Nc).astype(np.int32)
    targets[[0, 1]] = (V - 1, V - 2)
    targets[2] = -1  # ignored
    valid = targets >= 0
    lse, loss, p = softmax_xent_ref(logits, targets, V)
    losses, lse_g, nvalid = ops.crossentropy_forward(logits, targets, V)
    assert nvalid == int(valid.sum())
    # fp32 statistics: lse - logit cancels, so bound by |lse| + max|logit| (as in test_cuda_emu_bf16)
    biggest = np.abs(logits[:, :V]).max(-1).astype(np.float64)
    check_f32(lse_g, lse, np.abs(lse) + biggest)
    check_f32(losses, loss, np.where(valid, np.abs(lse) + biggest, 0.0))
    for grad_scale in (1.0, 1024.0):
        dloss = grad_scale / valid.sum()
        d = ops.crossentropy_backward_inplace(logits, lse.astype(np.float32), targets, dloss, V)
        ref = p.copy()
        ref[np.arange(Nc), np.maximum(targets, 0)] -= 1.0
        ref = np.where(valid[:, None], ref * dloss, 0.0)
        # one rounding of an fp32 value; that value: FP32 (p + 1) dloss for the arithmetic on O(1) numbers, plus
        # x - lse formed in fp32 from numbers of size |x| + |lse| (a few roundings of 2^-24 each: 4 2^-24 (|x| +
        # |lse|) absolute in the exponent), which expf turns into that much relative error of p (only matters for
        # the huge logits)
        x_lse = np.abs(logits[:, :V].astype(np.float64)) + np.abs(lse)[:, None]
        extra = np.where(valid[:, None], 4 * 2.0 ** -24 * x_lse * p * dloss, 0.0)
        check_f16(d[:, :V], ref, (p + 1.0) * dloss, extra)
        assert np.all(d[:, V:] == 0.0) and np.all(d[~valid] == 0.0)
        # the training step's fused pass (count, then losses, lse and dlogits in one kernel): the same bounds
        l_f, lse_f, n_f, acc, d_f = ops.crossentropy_counted(logits, targets, V, grad_scale, 0.0, fused=True)
        assert n_f == valid.sum() and abs(acc - grad_scale * loss.sum() / n_f) <= FP32 * grad_scale * np.sum(
            np.abs(lse) + biggest) / n_f
        check_f32(lse_f, lse, np.abs(lse) + biggest)
        check_f32(l_f, loss, np.where(valid, np.abs(lse) + biggest, 0.0))
        check_f16(d_f[:, :V], ref, (p + 1.0) * dloss, extra)
        assert np.all(d_f[:, V:] == 0.0) and np.all(d_f[~valid] == 0.0)


# --------------------------------------------------------------------------------------------- attention
_CASE = {case[0]: case for case in CASES}  # test_cuda_emu_bf16_attention's (name, C, NH, T, misalign)
ATT_CASES = [_CASE["hs=64"], ("hs=16 T=70", 192, 12, 70, False), _CASE["hs=10"], _CASE["hs=128"],
             _CASE["misaligned hs=64"]]
ATT_ABS = 1e-5      # fp32 arithmetic, relative to the tensor's largest value (test_cuda_emu_bf16_attention.ABS)
ATT_ABS_SEAM = 5e-5  # the seam's CPU backward sums in another order (test_cuda_emu_bf16_attention.ABS_SEAM)


def attention_errors(emu, variant, C, NH, T_, misalign, rng, qkv_scale=1.0, score_err=0.0, write=False):  # noqa: F811
    """Worst ratios of |got - ref| to its bound for (out, dqkv) of one random case. Bound per element:
    U (|ref| + extra) + ABS max|ref| + 2 score_err P_terms: one rounding of each output (dqkv accumulates:
    dqkv_in + grad rounded once); extra: flash, P |v| and the backward's products with |P| and |dS| (the
    tensor-core kernel rounds P and dS to the 16-bit type; the CUDA-core kernel that serves fp16 until then keeps
    them fp32, inside the same bound); cudnn, |grad| (the seam's output is rounded before it is added); score_err:
    an absolute error bound of the fp32 scores (and of the logsumexp), which exp() turns into that much relative
    error of every P, carried by the same P terms. write: the backward with InputGrad::Write, dqkv given as NaN
    (neither read nor kept: the reference accumulates into zeros)."""
    qkv = rnd(rng, B, T_, 3 * C, scale=qkv_scale)
    dout, dqkv = rnd(rng, B, T_, C), rnd(rng, B, T_, 3 * C) * (not write)
    given = np.full_like(dqkv, np.nan) if write else dqkv
    out, dq = emu.OpsF16("cuda", misalign=misalign, attention=variant).attention(qkv, dout, given, NH, write=write)
    assert is_f16(out) and is_f16(dq) and np.all(np.isfinite(out)) and np.all(np.isfinite(dq))
    flash = variant != "naive"  # flash and the cudnn seam take D from the stored fp16 out
    ref_out, ref_dq, pv_abs, grad_abs = attention_reference(qkv, dout, dqkv, NH, flash, out)
    extra_out = pv_abs if variant == "flash" else 0.0
    extra_dq = {"flash": grad_abs, "naive": 0.0, "cudnn": np.abs(ref_dq - dqkv)}[variant]
    worst = []
    for got, ref, extra, p_terms, abs_ in ((out, ref_out, extra_out, pv_abs, ATT_ABS),
                                           (dq, ref_dq, extra_dq, grad_abs,
                                            ATT_ABS_SEAM if variant == "cudnn" else ATT_ABS)):
        bound = U * (np.abs(ref) + extra) + abs_ * np.max(np.abs(ref)) + 2 * score_err * p_terms
        worst.append(float(np.max(np.abs(got - ref) / bound)))
    return worst


@pytest.mark.parametrize("variant", ["flash", "naive", "cudnn"])  # cudnn: the seam's CPU implementation here
def test_f16_attention_matches_float64_reference(emu, variant):  # noqa: F811
    """Causal attention forward and backward in fp16 storage (scores, softmax, logsumexp and D in fp32), each of
    the backend's rungs, against test_cuda_emu_bf16_attention's float64 reference over the fp16-rounded inputs."""
    rng = np.random.default_rng(2025)
    for name, C, NH, T_, misalign in ATT_CASES:
        worst = attention_errors(emu, variant, C, NH, T_, misalign, rng)
        assert max(worst) <= 1.0, (name, worst)
    worst = attention_errors(emu, variant, *ATT_CASES[0][1:], rng, write=True)
    assert max(worst) <= 1.0, ("write", worst)


@pytest.mark.parametrize("variant", ["flash", "naive"])
def test_f16_attention_scores_beyond_fp16_range(emu, variant):  # noqa: F811
    """q, k of size ~40 (fp16 values) with head size 64: q.k reaches ~1e5 before scaling and ~1.5e4 after, so
    scores, their exponentials and sums must be fp32 (in fp16 they would be Inf and the outputs NaN). The fp32
    scores carry accumulation error up to (HS + 4) 2^-24 max scale |q|.|k| (HS products, then the scale, the
    row max and the logsumexp), the score_err of attention_errors."""
    rng = np.random.default_rng(2026)
    C, NH, T_, qkv_scale = 192, 3, 37, 40.0
    hs = C // NH
    probe = rnd(np.random.default_rng(2026), B, T_, 3 * C, scale=qkv_scale)  # the same draw as the case's qkv
    q, k = np.abs(probe[..., :C]).astype(np.float64), np.abs(probe[..., C:2 * C]).astype(np.float64)
    dots = np.einsum("bthd,bshd->bhts", q.reshape(B, T_, NH, hs), k.reshape(B, T_, NH, hs)) / np.sqrt(hs)
    assert dots.max() * np.sqrt(hs) > 65504  # the unscaled products do overflow fp16
    score_err = (hs + 4) * 2.0 ** -24 * dots.max()
    worst = attention_errors(emu, variant, C, NH, T_, False, rng, qkv_scale, score_err)
    assert max(worst) <= 1.0, worst
