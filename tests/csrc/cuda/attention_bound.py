"""The error bound of the tensor-core attention (csrc/cuda/attention_tc.cuh) derived from the precision alone, for
any order of accumulation: what the GPU test (test_cuda_gpu.py) judges the kernels by, and what the emulator test
(test_cuda_emu_attention_tc.py) checks the same kernels against besides its own tighter bound.

Why not the emulator test's bound: that one, u (|ref| + extra) + 1e-5 max|ref|, passes under the emulator with a
worst ratio of 0.96; its absolute 1e-5 max|ref| term is headroom measured for the emulator's accumulation order
(round-to-nearest fp32, the kernel's loop order). A GPU's mma.sync accumulates in an order and with a rounding NVIDIA
does not specify (measured: truncation, no guard bits; Fasi, Higham, Mikaitis, Pranesh, "Numerical behavior of NVIDIA
tensor cores", PeerJ Comput. Sci. 7:e330, 2021), so its fp32 error may be larger than the emulator's and the old
bound would be flaky there.

Derivation. Notation: u = the storage type's unit roundoff (bf16 2^-8, fp16 2^-11: round to nearest even);
u_a = 2^-23, the fp32 accumulation's unit roundoff taken for truncation (twice round-to-nearest's 2^-24);
gamma(n) = n u_a / (1 - n u_a), the bound of a sum of n terms in any order and any rounding that is faithful
(Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., Lemma 3.1 and eq. (3.5)): |fl(sum x_i) - sum x_i|
<= gamma(n) sum |x_i|. Inputs are the stored (rounded) 16-bit q, k, v, dout; the float64 reference computes with
them exactly. Per head, with scale = hs^-1/2 and n = T (the keys of a row, <= T) + hs + 4 (the longest chain:
a score's hs products, its scaling by scale log2(e), the row's T terms, two rescalings):

  scores:   s = scale q.k in fp32: |ds| <= gamma(n) a,   a = max over the row of scale sum |q||k|
  P:        exp2 approximations (ex2.approx, relative error <= 2^-22 each) in the online softmax: one per term and
            one per 64-key tile rescaling; the row sum l (<= T terms). Relative error of P (before its rounding
            to the storage type): dP <= 2 gamma(n) (1 + a) + (T / 64 + 2) 2^-21 =: g
  forward:  out = fl16(sum_j P_ij v_j): P rounded to the storage type (u), the products accumulated (gamma(n)),
            the result stored (u):
              |out - ref| <= u |ref| + (1 + u)^2 (u + g) P|v|                                         (1)
  backward: dV = P^T dO and dQ, dK from dS = P (dP - D), dP = dO v^T, D = rowsum(dO * out_stored) (hs terms each):
            dS is rounded to the storage type (u) after an fp32 error of g |dS| + gamma(n) E,
            E = P (|dO| |v|^T + rowsum(|dO| |out|)); dQ = scale dS K, dK = scale dS^T Q, dV accumulate gamma(n);
            dqkv = fl16(dqkv_in + grad) (fp32 add, then stored: u):
              |dqkv - ref| <= u |ref| + (1 + u)^2 [(u + g) G + gamma(n) scale (E |K|, E^T |Q|, 0)]
                              + u_a (|dqkv_in| + G)                                                 (2)
            with G = (scale |dS| |K|, scale |dS|^T |Q|, P^T |dO|) the products' absolute values (reference.grad_abs).
  fp16 only: values below 2^-14 are subnormal in the storage type, rounded with an absolute error <= 2^-25
            instead of u times the value: P and dS add 2^-25 sum_j |v_j| to (1) and 2^-25 (scale sum |K|, scale sum
            |Q|, sum |dO|) to (2); a stored out or dqkv element adds 2^-25 to (1) and (2) (a gradient of a key only
            the last query sees can be ~1e-6: subnormal, with a relative rounding error up to 1%).

The bound is a worst case, not a fit: it holds whatever the GPU's accumulation order and rounding (faithful within
u_a), and nothing in it was measured on the emulator. Its dominant terms (u |ref|, u P|v|, u G) are the storage
rounding, which no order changes; the fp32 part is g ~ 1e-4 at T = 130, hs = 64 against u = 3.9e-3 (bf16) or
4.9e-4 (fp16).
"""
import numpy as np

UNIT = {"f16": 2.0**-11, "bf16": 2.0**-8}
U_ACC = 2.0**-23
SUBNORMAL_ABS = {"f16": 2.0**-25, "bf16": 0.0}


def gamma(n):
    return n * U_ACC / (1 - n * U_ACC)


def bounds(qkv, dout, dqkv_in, out_stored, NH, dtype):
    """(bound on |out - ref|, bound on |dqkv - ref|, bound on |lse - ref|) per element, eqs. (1) and (2) (and for
    lse, fp32: g (1 + |lse|)), for inputs already rounded to the storage type (float64 arrays: qkv (B, T, 3C), dout (B, T, C), dqkv_in (B, T, 3C), out_stored (B, T, C)); the
    |ref| terms are left to the caller (ratio())."""
    u = UNIT[dtype]
    sub = SUBNORMAL_ABS[dtype]
    qkv, dout, dqkv_in, out_stored = (np.asarray(a, np.float64) for a in (qkv, dout, dqkv_in, out_stored))
    Bq, T, C3 = qkv.shape
    C = C3 // 3
    hs = C // NH
    scale = 1.0 / np.sqrt(hs)
    heads = lambda a: a.reshape(Bq, T, NH, hs).transpose(0, 2, 1, 3)  # noqa: E731  (B, NH, T, hs)
    rows = lambda a: a.transpose(0, 2, 1, 3).reshape(Bq, T, -1)  # noqa: E731
    q, k, v = (heads(qkv[:, :, i * C:(i + 1) * C]) for i in range(3))
    do, o = heads(dout), heads(out_stored)
    causal = np.tril(np.ones((T, T), bool))
    s = np.where(causal, scale * q @ k.transpose(0, 1, 3, 2), -np.inf)
    P = np.exp(s - s.max(-1, keepdims=True))
    P /= P.sum(-1, keepdims=True)
    a = np.max(np.where(causal, scale * np.abs(q) @ np.abs(k).transpose(0, 1, 3, 2), 0.0), axis=-1, keepdims=True)
    n = T + hs + 4
    g = 2 * gamma(n) * (1 + a) + (T / 64 + 2) * 2.0**-21  # (B, NH, T, 1): per query row
    grow = (1 + u) ** 2
    mask = causal.astype(np.float64)
    # (1)
    fwd = grow * (u + g) * (P @ np.abs(v)) + sub * (mask @ np.abs(v)) + sub
    # (2)
    D = (do * o).sum(-1, keepdims=True)
    dS = P * (do @ v.transpose(0, 1, 3, 2) - D)
    aS = np.abs(dS)
    E = P * (np.abs(do) @ np.abs(v).transpose(0, 1, 3, 2) + (np.abs(do) * np.abs(o)).sum(-1, keepdims=True))
    G = (scale * aS @ np.abs(k), scale * aS.transpose(0, 1, 3, 2) @ np.abs(q), P.transpose(0, 1, 3, 2) @ np.abs(do))
    # dK's and dV's rows are keys: the worst g of the query rows that see the key
    g_key = np.max(np.where(causal, np.broadcast_to(g, P.shape), 0.0), axis=-2)[..., None]
    parts = (
        grow * ((u + g) * G[0] + gamma(n) * scale * E @ np.abs(k)) + sub * scale * mask @ np.abs(k),
        grow * ((u + g_key) * G[1] + gamma(n) * scale * E.transpose(0, 1, 3, 2) @ np.abs(q))
        + sub * scale * mask.T @ np.abs(q),
        grow * (u + g_key) * G[2] + sub * mask.T @ np.abs(do),
    )
    Gsum = np.concatenate([rows(x) for x in G], axis=-1)
    bwd = np.concatenate([rows(x) for x in parts], axis=-1) + U_ACC * (np.abs(dqkv_in) + Gsum) + sub
    # lse = m + log(l) in fp32: the scores' error plus the row sum's and the log's, relative to 1 + |lse|
    lse = (s.max(-1, keepdims=True) + np.log(np.exp(s - s.max(-1, keepdims=True)).sum(-1, keepdims=True)))
    lse_bound = (g * (1 + np.abs(lse)))[..., 0]  # (B, NH, T)
    return rows(fwd), bwd, lse_bound


def ratio(got, ref, extra_bound, dtype):
    """max |got - ref| / (u |ref| + extra_bound): <= 1 passes; inf when got has a NaN/inf."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    if not np.all(np.isfinite(got)):
        return float("inf")
    return float(np.max(np.abs(got - ref) / (UNIT[dtype] * np.abs(ref) + extra_bound)))
