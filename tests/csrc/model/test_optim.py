"""AdamW (_C adamw_update and GPT2.step with clipping) against a numpy AdamW with PyTorch semantics
(numpy_gpt2.adamw): decoupled weight decay lr*wd*p on 2-D tensors only, bias correction, eps outside
the square root."""
import math

import numpy as np
import pytest

import numpy_gpt2 as ref
from gpt2core import GPT2, GPT2Config, _C

DECAYS = {"wte", "wpe", "qkvw", "attprojw", "fcw", "fcprojw"}  # config.h param_decays

# The core receives lr, betas, eps, wd and grad_scale as float32 and forms 1 - beta and the bias
# corrections in float32: relative errors ~3e-7 in the update, so updates (p_new - p_old) are
# compared at 1e-5 for ModelF64. For Model, p_new itself is float32-rounded (|p| ~ 1, updates ~1e-2).
UPD_RTOL_F64 = 1e-5


def _random_grads(rng, shapes):
    """Gradients of mixed magnitude, including tiny ones (~1e-8) where eps placement decides the step."""
    g = {}
    for k, s in shapes.items():
        x = rng.standard_normal(s) * np.exp(rng.uniform(-3, 1, s))
        tiny = rng.random(s) < 0.1
        x[tiny] = rng.standard_normal(int(tiny.sum())) * 1e-8
        g[k] = x
    return g


def _assert_step_matches(p_new, p_old, p_ref, name, rtol):
    d, dr = p_new - p_old, p_ref - p_old
    np.testing.assert_allclose(d, dr, rtol=rtol, atol=rtol * np.abs(dr).max(), err_msg=name)


def test_adamw_update_matches_numpy_f64(padded):
    pb = padded
    m = pb.model()
    lr, wd, b1, b2, eps = 1e-2, 0.1, 0.9, 0.95, 1e-8
    shapes = {k: v.shape for k, v in pb.params.items()}
    P = {k: v.copy() for k, v in pb.params.items()}
    M = {k: np.zeros(s) for k, s in shapes.items()}
    V = {k: np.zeros(s) for k, s in shapes.items()}
    for step in range(1, 6):
        g = _random_grads(pb.rng, shapes)
        scale = 0.5 if step == 3 else 1.0
        old = {k: v.copy() for k, v in m.params().items()}
        for k in ref.NAMES:
            m.grads()[k][...] = g[k]
            ref.adamw(P[k], g[k] * scale, M[k], V[k], step, lr, b1, b2, eps, wd if k in DECAYS else 0.0)
        m.adamw_update(lr=lr, beta1=b1, beta2=b2, eps=eps, weight_decay=wd, step=step, grad_scale=scale)
        for k in ref.NAMES:
            _assert_step_matches(m.params()[k], old[k], P[k], k, UPD_RTOL_F64)
            # m = b1 m + (1 - b1) g can cancel: compare relative to the tensor's largest moment
            np.testing.assert_allclose(m.adam_m()[k], M[k], rtol=1e-6, atol=1e-6 * np.abs(M[k]).max(), err_msg=k)
            np.testing.assert_allclose(m.adam_v()[k], V[k], rtol=1e-6, err_msg=k)
            np.testing.assert_array_equal(m.grads()[k], g[k])  # grad_scale is applied on the fly
        P = {k: v.copy() for k, v in m.params().items()}  # no drift of the reference between steps


def test_adamw_update_matches_numpy_f32(padded):
    pb = padded
    p32 = {k: v.astype(np.float32).astype(np.float64) for k, v in pb.params.items()}
    m = pb.model(_C.Model, p32)
    shapes = {k: v.shape for k, v in p32.items()}
    P = {k: v.copy() for k, v in p32.items()}
    M = {k: np.zeros(s) for k, s in shapes.items()}
    V = {k: np.zeros(s) for k, s in shapes.items()}
    for step in range(1, 4):
        g = {k: v.astype(np.float32).astype(np.float64) for k, v in _random_grads(pb.rng, shapes).items()}
        for k in ref.NAMES:
            m.grads()[k][...] = g[k]
            ref.adamw(P[k], g[k], M[k], V[k], step, 1e-2, weight_decay=0.1 if k in DECAYS else 0.0)
        m.adamw_update(lr=1e-2, step=step)  # defaults: betas 0.9/0.95, eps 1e-8, wd 0.1
        for k in ref.NAMES:
            # float32 parameters: each step rounds p (~1) to 6e-8; updates are ~1e-2
            np.testing.assert_allclose(m.params()[k], P[k], rtol=1e-6, atol=1e-6, err_msg=k)


def test_eps_is_outside_the_square_root(padded):
    """A gradient of 1e-8 with eps 1e-8 moves by lr * 1e-8 / (1e-8 + 1e-8) = lr / 2 on step 1."""
    m = padded.model()
    m.zero_grad()
    m.grads()["lnfb"][...] = 1e-8
    before = m.params()["lnfb"].copy()
    m.adamw_update(lr=1e-3, eps=1e-8, weight_decay=0.0, step=1)
    np.testing.assert_allclose(before - m.params()["lnfb"], 0.5e-3, rtol=1e-5)


@pytest.mark.parametrize("cls", [_C.Model, _C.ModelF64])
def test_weight_decay_only_on_2d_tensors(padded, cls):
    """Zero gradients: Adam's direction is 0, so 2-D tensors shrink by exactly (1 - lr*wd) and the
    others (biases, LayerNorm weights, even though stacked (L, C)) do not move at all."""
    m = padded.model(cls)
    m.zero_grad()
    before = {k: v.copy() for k, v in m.params().items()}
    lr, wd = 0.05, 0.2
    m.adamw_update(lr=lr, weight_decay=wd, step=1)
    rtol = 1e-6 if cls is _C.Model else 1e-8  # lr, wd arrive as float32: ~1e-9 relative
    for k in ref.NAMES:
        if k in DECAYS:
            np.testing.assert_allclose(m.params()[k], before[k] * (1 - lr * wd), rtol=rtol, err_msg=k)
            assert not np.array_equal(m.params()[k], before[k]), k
        else:
            np.testing.assert_array_equal(m.params()[k], before[k], err_msg=k)


# ----------------------------------------------------------------------------- GPT2.step

def _gpt2(pb, dtype="float64"):
    cfg = GPT2Config(block_size=pb.maxT, vocab_size=pb.V, padded_vocab_size=pb.Vp, n_layer=pb.L,
                     n_head=pb.NH, n_embd=pb.C)
    model = GPT2(cfg, dtype=dtype, init=False)
    for k, v in pb.params.items():
        model.params[k][...] = v
    return model


@pytest.mark.parametrize("clip", [0.05, 0.0, 1e9])
def test_step_clips_then_adamw(padded, clip):
    """Two steps (so the clip factor matters through the moments, not only through eps); the returned
    norm is the pre-clip one; the update is AdamW on grads * clip / (norm + 1e-6) when norm > clip."""
    pb = padded
    model = _gpt2(pb)
    P = {k: v.copy() for k, v in pb.params.items()}
    M = {k: np.zeros_like(v) for k, v in P.items()}
    V = {k: np.zeros_like(v) for k, v in P.items()}
    lr, wd, eps = 3e-3, 0.1, 1e-3  # a large eps so the clip scale shows in step 1 as well
    for step in (1, 2):
        model.zero_grad()
        idx = pb.idx if step == 1 else pb.idx[::-1].copy()
        model.forward(idx, pb.targets)
        model.backward()
        g = {k: v.copy() for k, v in model.grads.items()}
        norm = math.sqrt(sum(float(np.sum(v * v)) for v in g.values()))
        scale = clip / (norm + 1e-6) if 0 < clip < norm else 1.0
        if clip == 0.05:
            assert scale < 0.5  # the test really clips
        for k in ref.NAMES:
            ref.adamw(P[k], g[k] * scale, M[k], V[k], step, lr, 0.9, 0.95, eps, wd if k in DECAYS else 0.0)
        old = {k: v.copy() for k, v in model.params.items()}
        got = model.step(lr=lr, weight_decay=wd, eps=eps, grad_clip=clip)
        assert got == pytest.approx(norm, rel=1e-12)
        assert model.step_count == step
        for k in ref.NAMES:
            _assert_step_matches(model.params[k], old[k], P[k], k, UPD_RTOL_F64)
        P = {k: v.copy() for k, v in model.params.items()}


def test_clipping_changes_the_update(padded):
    """Guard for the test above: with these settings, clipped and unclipped updates differ."""
    pb = padded
    a, b = _gpt2(pb), _gpt2(pb)
    for m in (a, b):
        m.forward(pb.idx, pb.targets)
        m.backward()
    a.step(lr=3e-3, eps=1e-3, grad_clip=0.05)
    b.step(lr=3e-3, eps=1e-3, grad_clip=0.0)
    assert np.abs(a.params["fcw"] - b.params["fcw"]).max() > 1e-5


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_step_with_non_finite_grad_raises_and_keeps_weights(padded, dtype, bad):
    pb = padded
    model = _gpt2(pb, dtype)
    model.forward(pb.idx, pb.targets)
    model.backward()
    model.grads["ln2b"][1, 3] = bad
    before = {k: v.copy() for k, v in model.params.items()}
    m_state, v_state = model.opt_state()
    with pytest.raises(FloatingPointError, match="step 1"):
        model.step(lr=1e-3)
    for k in ref.NAMES:
        np.testing.assert_array_equal(model.params[k], before[k], err_msg=k)
        assert not m_state[k].any() and not v_state[k].any()
    assert model.step_count == 0


def test_step_norm_matches_numpy_f32(padded):
    pb = padded
    model = _gpt2(pb, "float32")
    model.forward(pb.idx, pb.targets)
    model.backward()
    expect = math.sqrt(sum(float(np.sum(v.astype(np.float64) ** 2)) for v in model.grads.values()))
    assert model.step(lr=1e-3, grad_clip=1.0) == pytest.approx(expect, rel=1e-12)
