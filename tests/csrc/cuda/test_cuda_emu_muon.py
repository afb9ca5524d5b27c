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
