"""Backward pass: ModelF64 gradients against central finite differences of its own float64 loss and
against the numpy backprop of tests/numpy_gpt2.py; float32 gradients against float64 ones;
accumulation, grad_scale, ignored targets and the padded vocab rows."""
import numpy as np
import pytest

import numpy_gpt2 as ref
from gpt2core import _C

FD_EPS = 1e-5    # central differences: truncation ~eps^2 * f''' ~1e-10, rounding ~1e-16 / eps ~1e-11
FD_RTOL = 1e-6
F32_RTOL = 1e-4  # fp32 gradients vs fp64: ~1e-6 measured; 1e-4 leaves room for BLAS/thread variation


def _grads(m, idx, targets, scale=1.0):
    m.zero_grad()
    loss = m.forward(idx, targets)
    m.backward(scale)
    return loss, {k: v.copy() for k, v in m.grads().items()}


@pytest.fixture()
def one_thread():
    """The finite-difference loops run ~100 tiny forwards: on one thread they cost well under a
    millisecond each even when other processes load the machine (OpenMP barriers do not). Gradients
    are still computed with the default thread count."""
    n = _C.get_num_threads()
    yield lambda: _C.set_num_threads(1)
    _C.set_num_threads(n)


def _loss_at(m, name, delta, idx, targets):
    view = m.params()[name]
    orig = view.copy()
    view += delta
    try:
        return m.forward(idx, targets)
    finally:
        view[...] = orig


def test_f64_grads_match_finite_differences_directional(problem, one_thread):
    """<grad, d> against (L(p + eps d) - L(p - eps d)) / 2 eps along a random direction, every tensor."""
    pb = problem
    m = pb.model()
    _, g = _grads(m, pb.idx, pb.targets)
    one_thread()
    for name in ref.NAMES:
        d = pb.rng.standard_normal(g[name].shape)
        d /= np.linalg.norm(d)
        fd = (_loss_at(m, name, FD_EPS * d, pb.idx, pb.targets)
              - _loss_at(m, name, -FD_EPS * d, pb.idx, pb.targets)) / (2 * FD_EPS)
        an = float((g[name] * d).sum())
        assert an == pytest.approx(fd, rel=FD_RTOL, abs=1e-9), name


def test_f64_grads_match_finite_differences_elements(problem, one_thread):
    """Three single elements per tensor: the largest-gradient one and two random ones."""
    pb = problem
    m = pb.model()
    _, g = _grads(m, pb.idx, pb.targets)
    one_thread()
    for name in ref.NAMES:
        flat = g[name].reshape(-1)
        picks = [int(np.abs(flat).argmax())] + list(pb.rng.integers(0, flat.size, 2))
        for i in picks:
            e = np.zeros(flat.size)
            e[i] = FD_EPS
            e = e.reshape(g[name].shape)
            fd = (_loss_at(m, name, e, pb.idx, pb.targets) - _loss_at(m, name, -e, pb.idx, pb.targets)) / (2 * FD_EPS)
            assert flat[i] == pytest.approx(fd, rel=FD_RTOL, abs=1e-9), (name, np.unravel_index(i, g[name].shape))
    # position rows beyond T get nothing; wte rows of tokens never seen still get the lm_head gradient
    assert not g["wpe"][pb.T:].any()
    unseen = np.setdiff1d(np.arange(pb.V), pb.idx)
    assert np.abs(g["wte"][unseen]).min() > 0


def test_f64_grads_match_numpy_backprop(problem):
    pb = problem
    m = pb.model()
    _, g = _grads(m, pb.idx, pb.targets)
    r = ref.backward(pb.params, pb.idx, pb.targets, pb.V, pb.NH)
    for name in ref.NAMES:
        np.testing.assert_allclose(g[name], r[name], rtol=1e-9, atol=1e-12 * np.abs(r[name]).max(), err_msg=name)


def test_f32_grads_match_f64(problem):
    pb = problem
    p32 = {k: v.astype(np.float32).astype(np.float64) for k, v in pb.params.items()}
    _, g32 = _grads(pb.model(_C.Model, p32), pb.idx, pb.targets)
    _, g64 = _grads(pb.model(_C.ModelF64, p32), pb.idx, pb.targets)
    for name in ref.NAMES:
        assert g32[name].dtype == np.float32
        err = np.linalg.norm(g32[name] - g64[name]) / np.linalg.norm(g64[name])
        assert err < F32_RTOL, (name, err)


@pytest.mark.parametrize("cls", [_C.Model, _C.ModelF64])
def test_padded_wte_grad_rows_are_exactly_zero(padded, cls):
    pb = padded
    m = pb.model(cls)
    # padded token rows are non-zero (conftest) and the grads buffer starts dirty
    m.grads()["wte"][...] = 0.0
    for _ in range(2):
        m.forward(pb.idx, pb.targets)
        m.backward(1.0)
    g = m.grads()["wte"]
    assert np.all(g[pb.V:] == 0.0)
    assert np.all(np.abs(g[:pb.V]).max(1) > 0)


# fp32: the second backward adds to partial sums that cancel (wte = lm_head + embedding parts): ~1e-5
@pytest.mark.parametrize("cls,rtol", [(_C.Model, 2e-5), (_C.ModelF64, 1e-12)])
def test_backward_accumulates_and_scales(padded, cls, rtol):
    pb = padded
    m = pb.model(cls)
    _, g1 = _grads(m, pb.idx, pb.targets)
    # a second forward + backward without zero_grad adds the same gradient again
    m.forward(pb.idx, pb.targets)
    m.backward(1.0)
    for name in ref.NAMES:
        np.testing.assert_allclose(m.grads()[name], 2 * g1[name], rtol=rtol, atol=rtol * np.abs(g1[name]).max(),
                                   err_msg=name)
    # grad_scale multiplies the gradient
    _, g3 = _grads(m, pb.idx, pb.targets, scale=-2.5)
    for name in ref.NAMES:
        np.testing.assert_allclose(g3[name], -2.5 * g1[name], rtol=rtol, atol=rtol * np.abs(g1[name]).max(),
                                   err_msg=name)
    # zero_grad clears everything
    m.zero_grad()
    assert m.grad_norm() == 0.0 and not m.flat_grads().any()


def test_ignored_targets_are_excluded_from_loss_and_gradient(padded):
    """With S the ignored positions, N tokens in all and n = N - |S| valid ones:
    N * loss(all) = n * loss(S ignored) + |S| * loss(only S), and the same for gradients.
    Holds only if -1 targets contribute nothing and the mean divides by the number of valid targets."""
    pb = padded
    m = pb.model()
    full = pb.targets.copy()
    full[full == -1] = 7
    S = np.zeros(full.shape, dtype=bool)
    S[0, 1] = S[2, 6] = S[1, 0] = True
    masked = np.where(S, -1, full).astype(np.int32)
    only_s = np.where(S, full, -1).astype(np.int32)
    N, k = full.size, int(S.sum())
    l_all, g_all = _grads(m, pb.idx, full)
    l_m, g_m = _grads(m, pb.idx, masked)
    l_s, g_s = _grads(m, pb.idx, only_s)
    assert N * l_all == pytest.approx((N - k) * l_m + k * l_s, rel=1e-12)
    assert l_m != pytest.approx(l_all, rel=1e-6)  # the identity above is not trivially satisfied
    for name in ref.NAMES:
        np.testing.assert_allclose(N * g_all[name], (N - k) * g_m[name] + k * g_s[name], rtol=1e-9,
                                   atol=1e-12 * np.abs(g_all[name]).max(), err_msg=name)


def test_grad_norm_matches_numpy(padded):
    pb = padded
    for cls in (_C.Model, _C.ModelF64):
        m = pb.model(cls)
        _, g = _grads(m, pb.idx, pb.targets)
        expect = np.sqrt(sum(np.sum(v.astype(np.float64) ** 2) for v in g.values()))
        assert m.grad_norm() == pytest.approx(expect, rel=1e-12)


def test_backward_needs_a_forward_with_targets(padded):
    pb = padded
    m = pb.model()
    with pytest.raises(RuntimeError, match="forward"):
        m.backward(1.0)
    m.forward(pb.idx)
    with pytest.raises(RuntimeError, match="forward"):
        m.backward(1.0)
    m.forward(pb.idx, pb.targets)
    m.backward(1.0)
    with pytest.raises(RuntimeError, match="forward"):  # one backward per forward (logits became dlogits)
        m.backward(1.0)
