"""Muon on the emulated CUDA backend (cuda/muon.cuh: momentum, normalise, bf16 Newton-Schulz through the matmul
seam, apply) against the CPU backend's fp32 Muon (the reference the CPU tests check against float64 numpy,
tests/python/test_muon.py), fp32 and bf16 models, on the same weights and gradients.

Tolerances: the CUDA Newton-Schulz keeps its iterate, the Gram matrix and B in bf16 (8 significant bits; the
products accumulate in fp32 and are rounded once), so the orthogonalised update differs from the fp32 one by a
bf16 roundings (2^-9 relative) that the quintic amplifies by up to a = 3.4445 per iteration in the directions of
the small singular values (random square gradients have many): we allow 1e-1 normwise (max abs error over max
abs) and 6e-2 in the Frobenius norm on each matrix's update (measured: 3.7e-2 and 3.0e-2 at worst), check that
the device's own update has its singular values in the band around 1, and allow 1e-6 on the momentum and on the AdamW tensors (same fp32 math). A wrong
coefficient, a missing transpose or scale gives errors of order 1.
"""
import numpy as np
import pytest

from test_cuda_emu import CFG, emu, init_params, normwise  # noqa: F401  (emu: fixture)

MUON = ("qkvw", "attprojw", "fcw", "fcprojw")


def step_both(emu, cls, steps=2):
    rng = np.random.default_rng(4)
    ref = emu.Model(**CFG, device="cpu")
    dev = getattr(emu, cls)(**CFG, device="cuda")
    init_params(ref, 1)
    for k, v in dev.params().items():
        v[...] = ref.params()[k]
    dev.params_changed()
    updates = []
    for s in range(steps):
        g = rng.standard_normal(ref.num_parameters).astype(np.float32)
        before, dev_before = ref.flat_params().copy(), dev.flat_params().copy()
        for m in (ref, dev):
            m.flat_grads()[:] = g
        # the embeddings (wte, wpe) at their own AdamW LR (LrGroup, the adamw kernel's per-segment group)
        kw = dict(lr=1e-3, weight_decay=0.1, step=s + 1, grad_clip=1.0, muon_lr=0.02, muon_momentum=0.9,
                  muon_weight_decay=0.01, embedding_lr=5e-3, head_lr=2e-4)
        nr, nd = ref.muon_optimizer_step(**kw), dev.muon_optimizer_step(**kw)
        assert nd == pytest.approx(nr, rel=1e-6)
        updates.append((before, ref.flat_params().copy(), dev_before, dev.flat_params().copy()))
    return ref, dev, updates


@pytest.mark.parametrize("cls", ["Model", "ModelBF16"])
def test_emulated_cuda_muon_step_matches_cpu(emu, cls):
    ref, dev, updates = step_both(emu, cls)
    mats = ref.muon_matrices
    assert mats == dev.muon_matrices
    lr, wd = np.float32(0.02), np.float32(0.01)
    for before, r, dev_before, d in updates:
        for off, rows, cols, name, layer in mats:
            sl = slice(off, off + rows * cols)
            du, ru = d[sl] - dev_before[sl], r[sl] - before[sl]
            err = normwise(du, ru)
            fro = float(np.linalg.norm(du - ru) / np.linalg.norm(ru))
            assert err <= 1e-1 and fro <= 6e-2, (name, layer, rows, cols, err, fro)
            # the device's orthogonalised update itself: its singular values in the quintic's band around 1, but
            # for the few smallest of a random square gradient, which five steps do not lift (as in fp32)
            scale = max(1.0, rows / cols) ** 0.5
            X = (dev_before[sl].astype(np.float64) * (1 - float(lr) * float(wd)) - d[sl]) / (float(lr) * scale)
            sv = np.linalg.svd(X.reshape(rows, cols), compute_uv=False)
            assert sv.max() < 1.3 and np.mean((sv > 0.5) & (sv < 1.3)) > 0.95, (name, layer, sv.min(), sv.max())
    rp, dp = ref.params(), dev.params()
    for name in rp:
        if name not in MUON:  # AdamW, fp32 on both
            assert normwise(dp[name], rp[name]) <= 1e-6, name
    for name in MUON:  # the momentum: fp32 elementwise on both (from the same clipped gradients)
        assert normwise(dev.adam_m()[name], ref.adam_m()[name]) <= 1e-6, name


def test_emulated_cuda_muon_skips_a_non_finite_step(emu):
    dev = emu.Model(**CFG, device="cuda")
    init_params(dev, 2)
    before = dev.flat_params().copy()
    dev.flat_grads()[:] = 1.0
    dev.flat_grads()[7] = np.nan
    norm = dev.muon_optimizer_step(lr=1e-3, step=1, grad_clip=1.0, muon_lr=0.02)
    assert not np.isfinite(norm)
    np.testing.assert_array_equal(dev.flat_params(), before)
    assert not np.any(dev.adam_m()["fcw"])


# ------------------------------------------------------------------------------------- batched Newton-Schulz
# (batch, rows, cols): square, wide, tall; sizes whose n and k*k are not multiples of the 128-element slot
# (cuda/muon.cuh) and one that is exactly (128 = 8 x 16, k*k = 64: one slot, and 16 x 16 = 256: two), single rows
NS_SHAPES = [(3, 24, 24), (2, 24, 96), (4, 96, 24), (5, 7, 13), (3, 13, 7), (2, 8, 16), (3, 16, 16), (2, 1, 9),
             (1, 37, 53)]
A_, B_, C_ = 3.4445, -4.7750, 2.0315


def bf16(x):
    """x rounded to bf16 (nearest even), as float64."""
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32).astype(np.float64)


def ns_bf16_ref(G, steps=5):
    """cuda/muon.cuh's Newton-Schulz in float64, rounding to bf16 where it stores: X, A = X X^T, B = b A rounded
    then B + c A A rounded, Y = a X rounded then Y + B X rounded (on X^T when tall)."""
    X = G.astype(np.float64)
    tall = X.shape[0] > X.shape[1]
    if tall:
        X = X.T
    X = bf16(X / (np.float32(np.sqrt(np.sum(X * X))) + 1e-7))
    for _ in range(steps):
        Am = bf16(X @ X.T)
        Bm = bf16(C_ * (Am @ Am) + bf16(B_ * Am))
        X = bf16(Bm @ X + bf16(A_ * X))
    return X.T if tall else X


@pytest.mark.parametrize("shape", NS_SHAPES)
def test_emulated_cuda_newton_schulz_batched_is_each_matrix_alone(emu, shape):
    """Backend::muon_orthogonalize_batch on the emulated CUDA backend (one strided-batched product per step over
    the matrices' padded slots, scratch poisoned): each matrix bitwise what muon_orthogonalize gives it alone and
    what it gets in a smaller batch (the data-parallel ranks' shares), and within bf16's rounding of the float64
    reference that rounds where the kernels store."""
    x = np.random.default_rng(sum(shape)).standard_normal(shape).astype(np.float32)
    ops = emu.Ops("cuda")
    batched = ops.newton_schulz(x)
    alone = ops.newton_schulz(x, per_matrix=True)
    assert np.isfinite(batched).all()
    np.testing.assert_array_equal(batched, alone)
    if shape[0] > 1:
        np.testing.assert_array_equal(ops.newton_schulz(x[1:]), batched[1:])
    for b in range(shape[0]):
        want = ns_bf16_ref(x[b])
        # fp32 sums against float64 ones may flip a bf16 rounding, which later iterations carry (measured: 8.6e-4 at worst)
        assert normwise(batched[b], want) < 5e-3, (b, normwise(batched[b], want))
