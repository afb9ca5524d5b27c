"""Muon's Newton-Schulz on the CPU backend (Backend::muon_orthogonalize_batch, reached through _C.newton_schulz) and
the bf16 GEMM under it (csrc/cpu/gemm_bf16.h, _C.gemm_bf16), against float64 numpy written from the published
algorithm (KellerJordan/Muon zeropower_via_newtonschulz5): odd shapes, square, tall (m > n) and wide (m < n), one
matrix and many, float32 and float64, and bf16 products (inputs rounded to bf16 nearest-even, fp32 sums).

Where this CPU has AVX512-BF16 (_C.has_avx512_bf16()) the bf16 GEMM is the VDPBF16PS kernel, else the rounded inputs
go through sgemm; both are checked against the same float64 reference of the rounded inputs."""
import numpy as np
import pytest

from gpt2core import _C

A, B, C = 3.4445, -4.7750, 2.0315
# (batch, rows, cols): square, tall and wide; odd sizes that are not multiples of the kernel's 8 x 32 tile or of its
# k-pairs, exactly one tile (8 x 32, k = 2), one past it, a single row / column
SHAPES = [(3, 24, 24), (2, 96, 24), (2, 24, 96), (1, 37, 53), (4, 53, 37), (2, 1, 5), (1, 5, 1), (2, 8, 32),
          (1, 9, 33), (5, 33, 17)]


def bf16(x):
    """x rounded to bf16 (nearest even), as float64: what the kernel's conversion does (no NaNs here)."""
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32).astype(np.float64)


def ns_ref(G, steps=5, r=lambda v: v):
    """The reference's Newton-Schulz in float64, on X^T when tall; r rounds each product's inputs (bf16)."""
    X = G.astype(np.float64)
    tall = X.shape[0] > X.shape[1]
    if tall:
        X = X.T
    X = X / (np.linalg.norm(X) + 1e-7)
    for _ in range(steps):
        Am = r(X) @ r(X).T
        Bm = B * Am + C * (r(Am) @ r(Am).T)
        X = A * X + r(Bm) @ r(X)
    return X.T if tall else X


def random(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("ta", [False, True])
@pytest.mark.parametrize("tb", [False, True])
@pytest.mark.parametrize("mnk", [(37, 45, 29), (8, 32, 2), (9, 33, 3), (7, 31, 1), (1, 1, 1), (64, 96, 130)])
def test_gemm_bf16_is_the_product_of_the_rounded_inputs(ta, tb, mnk):
    M, N, K = mnk
    rng = np.random.default_rng(M * 1000 + N)
    a = rng.standard_normal((K, M) if ta else (M, K)).astype(np.float32)
    b = rng.standard_normal((N, K) if tb else (K, N)).astype(np.float32)
    got = _C.gemm_bf16(a, b, ta, tb)
    want = (bf16(a).T if ta else bf16(a)) @ (bf16(b).T if tb else bf16(b))
    assert got.shape == (M, N)
    # fp32 sums of exact bf16 products: ~K ulps of fp32 at worst
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * K * np.abs(want).max() + 1e-30)
    # and it is not the unrounded product: the rounding is there (bf16 keeps 8 bits)
    exact = (a.T if ta else a).astype(np.float64) @ (b.T if tb else b).astype(np.float64)
    if K >= 3:
        assert np.abs(got - exact).max() > 1e-5 * np.abs(exact).max()


def test_gemm_bf16_refuses_bad_shapes():
    with pytest.raises(ValueError, match="op\\(a\\) has K=3 columns but op\\(b\\) has 4 rows"):
        _C.gemm_bf16(np.ones((2, 3), np.float32), np.ones((4, 5), np.float32))
    with pytest.raises(ValueError, match="a must be a C-contiguous float32"):
        _C.gemm_bf16(np.ones((2, 3)), np.ones((3, 5), np.float32))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_float_newton_schulz_matches_float64_reference(shape):
    x = random(shape)
    want = np.stack([ns_ref(m) for m in x])
    got32 = _C.newton_schulz(x, 5)
    got64 = _C.newton_schulz(x.astype(np.float64), 5)
    assert got32.dtype == np.float32 and got64.dtype == np.float64
    np.testing.assert_allclose(got64, want, rtol=0, atol=1e-12 * np.abs(want).max())
    # fp32: five iterations of three fp32 GEMMs (~1e-6 each, grown a few times over the iterations)
    np.testing.assert_allclose(got32, want, rtol=0, atol=3e-5 * np.abs(want).max())


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_bf16_newton_schulz_rounds_each_products_inputs(shape):
    """One and two iterations against float64 with every product's inputs rounded to bf16 as the kernel rounds them
    (the sums differ in order only: fp32 rounding, except where an fp32 sum near a bf16 rounding boundary rounds the
    other way in the next product's input: one bf16 ulp of one element); five against the unrounded float64 reference (bf16's 8 bits through fifteen products:
    a few percent of the largest element, the price modded-nanogpt pays for its speed) and the quintic's band."""
    x = random(shape, seed=1)
    for steps in (1, 2):
        got = _C.newton_schulz(x, steps, "bfloat16")
        want = np.stack([ns_ref(m, steps, bf16) for m in x])
        err = np.abs(got - want) / np.abs(want).max()
        # one step: almost every element to fp32 rounding, the few downstream of a flipped bf16 rounding to a few
        # bf16 ulps; two steps: the flips of the first spread through the second's products
        assert err.max() < 5e-3 and (steps > 1 or np.mean(err < 1e-5) > 0.97), (steps, np.mean(err < 1e-5), err.max())
    got = _C.newton_schulz(x, 5, "bfloat16")
    want = np.stack([ns_ref(m) for m in x])
    np.testing.assert_allclose(got, want, rtol=0, atol=0.1 * np.abs(want).max())
    assert np.abs(got - want).max() > 1e-4 * np.abs(want).max()  # bf16 really was used
    if min(shape[1:]) > 1:
        for m in got:
            s = np.linalg.svd(m.astype(np.float64), compute_uv=False)
            assert s.min() > 0.55 and s.max() < 1.3, (shape, s.min(), s.max())


@pytest.mark.parametrize("ns_dtype", ["float32", "bfloat16"])
def test_a_matrix_has_the_same_bits_alone_and_in_a_batch(ns_dtype):
    """The batched op runs each matrix on one thread: its bits do not depend on the batch it is in (data parallel
    ranks orthogonalise different shares of the matrices) nor on its place in the batch."""
    for shape in [(6, 24, 24), (5, 96, 24), (3, 24, 96)]:
        x = random(shape, seed=2)
        batch = _C.newton_schulz(x, 5, ns_dtype)
        for b in range(shape[0]):
            assert np.array_equal(batch[b], _C.newton_schulz(x[b:b + 1], 5, ns_dtype)[0]), (shape, b)
        assert np.array_equal(batch[::-1], _C.newton_schulz(x[::-1].copy(), 5, ns_dtype))


def test_zero_steps_only_normalises_and_bad_arguments_name_themselves():
    x = random((2, 5, 7))
    got = _C.newton_schulz(x, 0)
    for g, m in zip(got, x):
        np.testing.assert_allclose(g, m / (np.linalg.norm(m.astype(np.float64)) + 1e-7), rtol=1e-6)
    with pytest.raises(ValueError, match="ns_dtype must be 'float32' or 'bfloat16', got 'fp8'"):
        _C.newton_schulz(x, 5, "fp8")
    with pytest.raises(ValueError, match="ns_dtype 'bfloat16' needs a float32 x"):
        _C.newton_schulz(x.astype(np.float64), 5, "bfloat16")
    with pytest.raises(ValueError, match="shape \\(batch, rows, cols\\)"):
        _C.newton_schulz(x[0], 5)


def test_the_models_muon_step_takes_the_precision_by_name():
    """GPT2.step(optimizer="muon", muon_ns_dtype=...): "bfloat16" moves the Muon matrices by an update within bf16's
    few percent of the float32 one (and not equal to it), leaves the AdamW tensors bit for bit; a wrong name is
    refused naming the argument, before anything is written."""
    from gpt2core import GPT2, GPT2Config
    cfg = GPT2Config(block_size=16, vocab_size=100, padded_vocab_size=128, n_layer=2, n_head=3, n_embd=24)
    models = {d: GPT2(cfg, seed=1) for d in ("float32", "bfloat16")}
    rng = np.random.default_rng(0)
    g = rng.standard_normal(models["float32"].flat_grads().size).astype(np.float32)
    before = models["float32"].flat_params().copy()
    for d, m in models.items():
        m.flat_grads()[:] = g
        m.step(lr=1e-3, optimizer="muon", muon_lr=0.05, muon_momentum=0.0, muon_ns_dtype=d)
    p32, p16 = (models[d].flat_params() for d in ("float32", "bfloat16"))
    muon = np.zeros(p32.size, bool)
    for off, r, c, _, _ in models["float32"].muon_matrix_list():
        muon[off:off + r * c] = True
    assert np.array_equal(p32[~muon], p16[~muon])
    d32, d16 = p32[muon] - before[muon], p16[muon] - before[muon]
    assert 0 < np.abs(d16 - d32).max() <= 0.1 * np.abs(d32).max()
    m = GPT2(cfg, seed=1)
    m.flat_grads()[:] = g
    with pytest.raises(ValueError, match="muon_ns_dtype must be 'float32' or 'bfloat16', got 'bf16'"):
        m.step(lr=1e-3, optimizer="muon", muon_ns_dtype="bf16")
    assert np.array_equal(m.flat_params(), before)


def test_newton_schulz_device_argument_is_checked():
    """device names a backend; the CUDA one computes in bf16 only, so other requests name what it needs (and a
    build or machine without a GPU says so, never a crash)."""
    x = random((2, 8, 8))
    with pytest.raises(ValueError, match="device must be"):
        _C.newton_schulz(x, device="gpu")
    with pytest.raises(ValueError, match="ns_dtype='bfloat16'"):
        _C.newton_schulz(x, device="cuda")
    with pytest.raises(ValueError, match="float32 x"):
        _C.newton_schulz(x.astype(np.float64), ns_dtype="bfloat16", device="cuda")
    if _C.cuda_status() != "":
        with pytest.raises(Exception) as e:
            _C.newton_schulz(x, ns_dtype="bfloat16", device="cuda")
        assert "cuda" in str(e.value).lower() or "gpu" in str(e.value).lower()
    np.testing.assert_array_equal(_C.newton_schulz(x, device="cpu"), _C.newton_schulz(x))
