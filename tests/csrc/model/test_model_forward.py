"""Forward pass of _C.Model / _C.ModelF64 against the float64 numpy GPT-2 (tests/numpy_gpt2.py), the
parameter views, and GPT2.init_weights.

Weights are random with non-trivial LayerNorm weights and biases and large non-zero padded wte rows,
targets contain -1 entries; shapes are odd (conftest.SHAPES).
"""
import math

import numpy as np
import pytest

import numpy_gpt2 as ref
from gpt2core import GPT2, GPT2Config, _C

# float32: ~1e-5 relative (fp32 eps 6e-8 grown through a handful of LayerNorms, GEMMs with K <= 4C and
# a logsumexp over ~100 columns); logits are compared relative to their largest magnitude.
F32_RTOL = 1e-5
# float64: same math in double, different summation order only
F64_RTOL = 1e-10


def _check_forward(pb, cls, params, rtol):
    m = pb.model(cls, params)
    loss = m.forward(pb.idx, pb.targets)
    r_loss, r_logits, r_losses = ref.forward(params, pb.idx, pb.targets, pb.V, pb.NH)
    logits, losses = m.logits(), m.token_losses()
    assert logits.shape == (pb.B, pb.T, pb.Vp) and losses.shape == (pb.B, pb.T)
    assert logits.dtype == losses.dtype == (np.float32 if cls is _C.Model else np.float64)
    assert isinstance(loss, float)
    assert loss == pytest.approx(r_loss, rel=rtol)
    scale = np.abs(r_logits).max()
    np.testing.assert_allclose(logits, r_logits, rtol=rtol, atol=rtol * scale)
    np.testing.assert_allclose(losses, r_losses, rtol=rtol, atol=rtol * r_loss)
    # ignored positions contribute exactly 0; the loss is the mean over the others
    assert np.all(losses[pb.targets == -1] == 0)
    assert loss == pytest.approx(losses.sum(dtype=np.float64) / (pb.targets != -1).sum(), rel=rtol)


def test_forward_f64_matches_numpy(problem):
    _check_forward(problem, _C.ModelF64, problem.params, F64_RTOL)


def test_forward_f32_matches_numpy(problem):
    # the reference runs on the float32-rounded weights, so only arithmetic precision differs
    p32 = {k: v.astype(np.float32).astype(np.float64) for k, v in problem.params.items()}
    _check_forward(problem, _C.Model, p32, F32_RTOL)


def test_padded_columns_are_not_in_the_softmax(padded):
    pb = padded
    m = pb.model()
    loss = m.forward(pb.idx, pb.targets)
    logits = m.logits()
    # the padded logits are real (lm_head computes all Vp columns) and large for these weights ...
    assert np.abs(logits[..., pb.V:]).max() > 1.0
    # ... so a softmax over all Vp columns would give a visibly different loss
    z = logits.reshape(-1, pb.Vp)
    lse_all = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
    t = pb.targets.reshape(-1)
    ok = t != -1
    loss_all = (lse_all[ok] - z[ok, t[ok]]).mean()
    assert abs(loss_all - loss) > 1e-3
    # changing the padded rows of wte changes only the padded logit columns, never the loss
    m.params()["wte"][pb.V:] *= -3.0
    assert m.forward(pb.idx, pb.targets) == loss
    np.testing.assert_array_equal(m.logits()[..., :pb.V], logits[..., :pb.V])


def test_forward_without_targets(problem):
    pb = problem
    m = pb.model()
    loss_t = m.forward(pb.idx, pb.targets)
    logits_t = m.logits()
    assert math.isnan(m.forward(pb.idx))
    np.testing.assert_array_equal(m.logits(), logits_t)
    np.testing.assert_array_equal(m.token_losses(), 0.0)
    assert m.forward(pb.idx, pb.targets) == loss_t


def test_all_targets_ignored_gives_nan_and_no_gradient(padded):
    pb = padded
    m = pb.model()
    assert math.isnan(m.forward(pb.idx, np.full_like(pb.targets, -1)))
    np.testing.assert_array_equal(m.token_losses(), 0.0)
    m.backward(1.0)
    assert m.grad_norm() == 0.0


def test_causal_and_batch_independent(padded):
    """Changing token (b, t) changes logits only in row b at positions >= t."""
    pb = padded
    m = pb.model()
    m.forward(pb.idx)
    base = m.logits()
    idx = pb.idx.copy()
    b, t = 1, 3
    idx[b, t] = (idx[b, t] + 1) % pb.V
    m.forward(idx)
    changed = np.abs(m.logits() - base).max(-1) > 0
    expect = np.zeros_like(changed)
    expect[b, t:] = True
    np.testing.assert_array_equal(changed, expect)


def test_changing_batch_shape_between_calls(padded):
    """Activations are re-laid out when (B, T) changes; results must not depend on the previous shape."""
    pb = padded
    m = pb.model()
    for B, T in [(3, 7), (1, 1), (2, 11), (3, 7)]:
        idx = pb.rng.integers(0, pb.V, (B, T)).astype(np.int32)
        tgt = pb.rng.integers(-1, pb.V, (B, T)).astype(np.int32)
        tgt[0, 0] = 0  # at least one valid target
        r_loss, r_logits, _ = ref.forward(pb.params, idx, tgt, pb.V, pb.NH)
        assert m.forward(idx, tgt) == pytest.approx(r_loss, rel=F64_RTOL)
        np.testing.assert_allclose(m.logits(), r_logits, rtol=F64_RTOL, atol=1e-10)


# ----------------------------------------------------------------------------- parameter views

@pytest.mark.parametrize("cls", [_C.Model, _C.ModelF64])
def test_views_share_memory_with_the_model(padded, cls):
    pb = padded
    m = pb.model(cls)
    p1, p2, g1, g2 = m.params(), m.params(), m.grads(), m.grads()
    flat_p, flat_g = m.flat_params(), m.flat_grads()
    assert list(p1) == list(ref.NAMES) == _C.param_names()
    offset = 0
    for name in ref.NAMES:
        assert p1[name].shape == pb.params[name].shape
        assert np.shares_memory(p1[name], p2[name]) and np.shares_memory(g1[name], g2[name])
        assert np.shares_memory(p1[name], flat_p) and np.shares_memory(g1[name], flat_g)
        assert not np.shares_memory(p1[name], g1[name])
        assert p1[name].flags.c_contiguous and p1[name].flags.writeable
        np.testing.assert_array_equal(flat_p[offset:offset + p1[name].size], p1[name].reshape(-1))
        offset += p1[name].size
    assert offset == m.num_parameters == flat_p.size

    # writing through a view changes the forward result; writing back restores it
    loss = m.forward(pb.idx, pb.targets)
    old = p1["lnfb"].copy()
    p2["lnfb"] += 0.5
    assert m.forward(pb.idx, pb.targets) != loss
    p1["lnfb"][...] = old
    assert m.forward(pb.idx, pb.targets) == loss
    # grads written by backward show up in views taken before it
    m.zero_grad()
    assert not g1["wte"].any()
    m.backward(1.0)
    assert g1["fcw"].any() and np.shares_memory(g1["fcw"], m.grads()["fcw"])


def test_views_keep_the_model_alive(padded):
    pb = padded
    m = pb.model()
    wte = m.params()["wte"]
    expect = pb.params["wte"].copy()
    del m
    import gc
    gc.collect()
    np.testing.assert_array_equal(wte, expect)  # still valid memory: the view holds the model
    wte[...] = 1.0


def test_optimizer_state_views(padded):
    m = padded.model()
    mv, vv = m.adam_m(), m.adam_v()
    assert all(not mv[k].any() and not vv[k].any() for k in ref.NAMES)
    for k in ref.NAMES:
        m.grads()[k][...] = 1.0
    m.adamw_update(lr=1e-3, step=1)
    np.testing.assert_allclose(m.adam_m()["qkvw"], 0.1, rtol=1e-6)  # (1 - beta1) * g
    assert np.shares_memory(mv["qkvw"], m.adam_m()["qkvw"]) and mv["qkvw"][0, 0, 0] != 0


# ----------------------------------------------------------------------------- GPT2.init_weights

INIT_CFG = GPT2Config(block_size=32, vocab_size=250, padded_vocab_size=256, n_layer=3, n_head=4, n_embd=64)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_init_weights(dtype):
    model = GPT2(INIT_CFG, seed=7, dtype=dtype)
    p = model.params
    L, V = INIT_CFG.n_layer, INIT_CFG.vocab_size
    for name in ref.NAMES:
        assert p[name].dtype == np.dtype(dtype)
    for name in ("wte", "wpe", "qkvw", "fcw", "attprojw", "fcprojw"):
        x = p[name][:V] if name == "wte" else p[name]
        std = 0.02 / math.sqrt(2 * L) if name in ("attprojw", "fcprojw") else 0.02
        # >= 6k samples each: the sample std is within ~1.5% of the true one; 6% leaves no flakes
        assert x.std() == pytest.approx(std, rel=0.06), name
        assert abs(x.mean()) < 4 * std / math.sqrt(x.size), name
        assert np.count_nonzero(x) == x.size, name
    for name in ("ln1b", "qkvb", "attprojb", "ln2b", "fcb", "fcprojb", "lnfb"):
        assert not p[name].any(), name
    for name in ("ln1w", "ln2w", "lnfw"):
        assert np.all(p[name] == 1.0), name
    assert not p["wte"][V:].any()
    assert model.step_count == 0


def test_init_is_seeded():
    a, b, c = GPT2(INIT_CFG, seed=1), GPT2(INIT_CFG, seed=1), GPT2(INIT_CFG, seed=2)
    for name in ref.NAMES:
        np.testing.assert_array_equal(a.params[name], b.params[name])
    for name in ("wte", "wpe", "qkvw", "attprojw", "fcw", "fcprojw"):
        assert not np.array_equal(a.params[name], c.params[name]), name
    # re-initialising restores the seeded weights after they were changed
    a.params["qkvw"] += 1.0
    a.init_weights(1)
    np.testing.assert_array_equal(a.params["qkvw"], b.params["qkvw"])


def test_gpt2_wrapper_forward_matches_reference(padded):
    pb = padded
    cfg = GPT2Config(block_size=pb.maxT, vocab_size=pb.V, padded_vocab_size=pb.Vp, n_layer=pb.L,
                     n_head=pb.NH, n_embd=pb.C)
    model = GPT2(cfg, dtype="float64", init=False)
    for k, v in pb.params.items():
        model.params[k][...] = v
    r_loss, r_logits, r_losses = ref.forward(pb.params, pb.idx, pb.targets, pb.V, pb.NH)
    # int64 and non-contiguous inputs are converted by the wrapper
    idx64 = np.asfortranarray(pb.idx.astype(np.int64))
    loss, logits = model.forward(idx64, pb.targets.tolist(), return_logits=True)
    assert loss == pytest.approx(r_loss, rel=F64_RTOL)
    np.testing.assert_allclose(logits, r_logits, rtol=F64_RTOL, atol=1e-10)
    np.testing.assert_allclose(model.token_losses(), r_losses, rtol=F64_RTOL, atol=1e-12)
    # a 1-D sequence is a batch of one
    loss1 = model.forward(pb.idx[1], pb.targets[1])
    assert loss1 == pytest.approx(ref.forward(pb.params, pb.idx[1:2], pb.targets[1:2], pb.V, pb.NH)[0],
                                  rel=F64_RTOL)
