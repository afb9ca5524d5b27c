"""attention_bound.py (the tensor-core attention's bound from the precision) on its own, without a device: a numpy
model of the kernel's arithmetic (fp32 scores and softmax, P rounded to the storage type before P V, dS before its
products, sums in a shuffled order, outputs rounded) stays within it, and outputs one storage rounding off (2 u |ref|
on one element) or a dropped key do not: the bound is neither vacuous nor missing a term the kernels have."""
import numpy as np
import pytest

import attention_bound
from test_cuda_emu_attention_tc import to_bits
from test_cuda_emu_bf16_attention import reference


def rnd(x, dtype):
    return to_bits(np.asarray(x, np.float64), dtype)[1]


def model_kernel(qkv, dout, dqkv_in, NH, dtype, rng):
    """Forward and backward as the kernels round (fp32 arithmetic, 16-bit P / dS / outputs), sums over keys in a
    random order."""
    f = np.float32
    Bq, T, C3 = qkv.shape
    C = C3 // 3
    hs = C // NH
    scale = f(1.0 / np.sqrt(hs))
    heads = lambda a: a.reshape(Bq, T, NH, hs).transpose(0, 2, 1, 3).astype(f)  # noqa: E731
    rows = lambda a: a.transpose(0, 2, 1, 3).reshape(Bq, T, -1)  # noqa: E731
    q, k, v = (heads(qkv[:, :, i * C:(i + 1) * C]) for i in range(3))
    perm = rng.permutation(T)
    s = np.where(np.tril(np.ones((T, T), bool)), (q @ k.transpose(0, 1, 3, 2)) * scale, -np.inf).astype(f)
    P = np.exp(s - s.max(-1, keepdims=True)).astype(f)
    P = (P / P[..., perm].sum(-1, keepdims=True)).astype(f)
    P16 = rnd(P, dtype).astype(f)
    out = rnd(rows(P16[..., perm] @ v[:, :, perm, :]), dtype)
    do, o = heads(dout), heads(out)
    D = (do * o).sum(-1, keepdims=True)
    dS = rnd(P * (do @ v.transpose(0, 1, 3, 2) - D), dtype).astype(f)
    dq = (dS[..., perm] @ k[:, :, perm, :]) * scale
    dk = (dS.transpose(0, 1, 3, 2)[..., perm] @ q[:, :, perm, :]) * scale
    dv = P16.transpose(0, 1, 3, 2)[..., perm] @ do[:, :, perm, :]
    grad = np.concatenate([rows(x) for x in (dq, dk, dv)], axis=-1)
    return out, rnd(dqkv_in.astype(f) + grad, dtype)


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_a_model_of_the_kernels_passes_and_real_errors_do_not(dtype):
    rng = np.random.default_rng(3)
    B, T, C, NH = 2, 70, 128, 2
    qkv = to_bits(rng.standard_normal((B, T, 3 * C)), dtype)[1]
    dout = to_bits(rng.standard_normal((B, T, C)), dtype)[1]
    dqkv = to_bits(rng.standard_normal((B, T, 3 * C)), dtype)[1]
    out, dq = model_kernel(qkv, dout, dqkv, NH, dtype, rng)
    ref_out, ref_dq, _, _ = reference(qkv, dout, dqkv, NH, True, out)
    fwd, bwd, _ = attention_bound.bounds(qkv, dout, dqkv, out, NH, dtype)
    r_out = attention_bound.ratio(out, ref_out, fwd, dtype)
    r_dq = attention_bound.ratio(dq, ref_dq, bwd, dtype)
    assert r_out <= 1.0 and r_dq <= 1.0, (r_out, r_dq)
    u = attention_bound.UNIT[dtype]
    # one element two roundings off (what a wrong rounding mode, or a value rounded twice, would give) fails
    i = np.unravel_index(np.argmax(np.abs(ref_out)), ref_out.shape)
    bad = out.copy()
    bad[i] += 2.5 * u * (abs(ref_out[i]) + fwd[i] / u)
    assert attention_bound.ratio(bad, ref_out, fwd, dtype) > 1.0
    # the last position's q, k, v dropped (what a tile that is never loaded gives) fails
    out2, _ = model_kernel(np.where(np.arange(T)[None, :, None] == T - 1, 0.0, qkv), dout, dqkv, NH, dtype, rng)
    assert attention_bound.ratio(out2, ref_out, fwd, dtype) > 1.0
    assert np.isinf(attention_bound.ratio(np.full_like(out, np.nan), ref_out, fwd, dtype))
