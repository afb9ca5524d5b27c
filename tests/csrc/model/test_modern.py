"""The modern architecture (GPT2Config's position .. logit_softcap) on the CPU backend: the float64 model with each
field on alone, and with all of them, against the float64 numpy oracle (tests/numpy_gpt2.py, written from the
math) in loss, logits and every gradient; against central finite differences of its own loss; float32 against
float64; the tensors each config has; and the new ops' edge cases (odd T, head sizes 64 and 16, ignored targets,
padded vocab rows, a position offset never used in training).

Each op of the new math is reached through the field that turns it on (rope_forward/backward: position,
rmsnorm_* and the residual fusion: norm, qk_norm_*: qk_norm, relu2_*: activation, softcap_forward and the capped
cross-entropy: logit_softcap), so a wrong op changes the loss or a gradient the oracle checks."""
import math

import numpy as np
import pytest

import numpy_gpt2 as ref
from gpt2core import GPT2, GPT2Config, _C

MODERN = dict(position="rope", norm="rmsnorm", qk_norm=True, activation="relu2", bias=False, tie_embeddings=False,
              logit_softcap=3.0)  # a small cap: the random logits are O(10), so tanh bends them hard
ALONE = [dict(position="rope"), dict(position="rope", rope_base=37.0), dict(norm="rmsnorm"), dict(qk_norm=True),
         dict(activation="relu2"), dict(bias=False), dict(tie_embeddings=False), dict(logit_softcap=3.0)]
ARCHS = ALONE + [MODERN, dict(MODERN, logit_softcap=None, tie_embeddings=True)]
# (B, T, C, NH): T not a multiple of any tile; head sizes 64 and 16
SHAPES = {"hs64": (2, 7, 128, 2), "hs16": (1, 13, 48, 3)}
V, VP, MAXT, L = 61, 64, 16, 2

# float64 against float64 numpy: the same math, another summation order
F64_RTOL = 1e-11
F32_RTOL = 1e-4  # fp32 gradients vs fp64 (as test_model_backward)


def _id(a):
    return ",".join(f"{k}={v}" for k, v in a.items())


def _model_kw(arch):
    kw = dict(arch)
    if "logit_softcap" in kw:
        kw["logit_softcap"] = float(kw["logit_softcap"] or 0.0)
    return kw


class Problem:
    def __init__(self, arch, shape, seed=0):
        rng = np.random.default_rng(seed)
        self.arch, (self.B, self.T, self.C, self.NH) = arch, SHAPES[shape]
        self.params = ref.random_params(rng, MAXT, V, VP, L, self.NH, self.C, arch)
        self.idx = rng.integers(0, V, (self.B, self.T)).astype(np.int32)
        self.targets = rng.integers(0, V, (self.B, self.T)).astype(np.int32)
        self.targets[0, 1] = -1  # an ignored position

    def model(self, cls=_C.ModelF64, params=None):
        m = cls(max_seq_len=MAXT, vocab_size=V, padded_vocab_size=VP, n_layer=L, n_head=self.NH, n_embd=self.C,
                **_model_kw(self.arch))
        views = m.params()
        assert list(views) == list(ref.shapes(MAXT, V, VP, L, self.NH, self.C, self.arch))
        for k, v in (params or self.params).items():
            views[k][...] = v
        for v in views.values():  # poison nothing: every view was written above
            assert np.isfinite(v).all()
        m.params_changed()
        return m

    def oracle(self, params=None):
        p = params or self.params
        loss, logits, losses = ref.forward(p, self.idx, self.targets, V, self.NH, arch=self.arch)
        return loss, logits, ref.backward(p, self.idx, self.targets, V, self.NH, arch=self.arch)


def _grads(m, idx, targets):
    m.zero_grad()
    loss = m.forward(idx, targets)
    logits = m.logits()
    m.backward(1.0)
    return loss, logits, {k: v.copy() for k, v in m.grads().items()}


def _normwise(a, b):
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("arch", ARCHS, ids=_id)
def test_f64_model_matches_the_numpy_oracle(arch, shape):
    pb = Problem(arch, shape)
    loss, logits, grads = _grads(pb.model(), pb.idx, pb.targets)
    r_loss, r_logits, r_grads = pb.oracle()
    assert loss == pytest.approx(r_loss, rel=F64_RTOL)
    np.testing.assert_allclose(logits, r_logits, rtol=F64_RTOL, atol=F64_RTOL * np.abs(r_logits).max())
    assert list(grads) == list(r_grads)
    for k in grads:
        assert np.abs(r_grads[k]).max() > 0, k  # every tensor the config has matters to the loss
        assert _normwise(grads[k], r_grads[k]) < F64_RTOL, k
    cap = arch.get("logit_softcap")
    if cap:  # model.logits() are the capped ones: what generation samples from
        assert np.abs(logits).max() <= cap
        assert np.abs(logits).max() > 0.9 * cap  # and the cap bites


def test_each_field_changes_the_math():
    """The oracle's fields are not no-ops: each one alone moves the loss away from GPT-2's on the same weights
    (where the weights exist in both)."""
    base = Problem({}, "hs16")
    gpt2_loss = ref.forward(base.params, base.idx, base.targets, V, base.NH)[0]
    for arch in ALONE:
        p = {k: v for k, v in base.params.items() if k in ref.shapes(MAXT, V, VP, L, base.NH, base.C, arch)}
        if "lm_head" in ref.shapes(MAXT, V, VP, L, base.NH, base.C, arch):
            p["lm_head"] = base.params["wte"] * 1.5
        loss = ref.forward(p, base.idx, base.targets, V, base.NH, arch=arch)[0]
        assert abs(loss - gpt2_loss) > 1e-3, arch


FD_EPS = 1e-5
FD_RTOL = 1e-8


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_modern_f64_gradients_match_finite_differences(shape):
    """All fields on: analytic gradients of the float64 model against central differences of its own loss, at a
    few random elements of every tensor (and the largest-gradient one), relative to the tensor's largest gradient."""
    pb = Problem(MODERN, shape, seed=3)
    m = pb.model()
    _, _, grads = _grads(m, pb.idx, pb.targets)
    rng = np.random.default_rng(1)
    n = _C.get_num_threads()
    _C.set_num_threads(1)
    worst = 0.0
    try:
        views = m.params()
        for name, g in grads.items():
            flat = views[name].reshape(-1)
            picks = list(rng.choice(flat.size, 4, replace=False)) + [int(np.abs(g).argmax())]
            for i in picks:
                orig = flat[i]
                flat[i] = orig + FD_EPS
                up = m.forward(pb.idx, pb.targets)
                flat[i] = orig - FD_EPS
                down = m.forward(pb.idx, pb.targets)
                flat[i] = orig
                fd = (up - down) / (2 * FD_EPS)
                err = abs(fd - g.reshape(-1)[i]) / np.abs(g).max()
                worst = max(worst, err)
                assert err < FD_RTOL, (name, i, fd, g.reshape(-1)[i])
    finally:
        _C.set_num_threads(n)
    assert worst > 0  # the comparison compared something


@pytest.mark.parametrize("arch", [MODERN, dict(MODERN, norm="layernorm", bias=True)], ids=_id)
def test_f32_model_matches_f64(arch):
    pb = Problem(arch, "hs64")
    p32 = {k: v.astype(np.float32).astype(np.float64) for k, v in pb.params.items()}
    l64, lg64, g64 = _grads(pb.model(_C.ModelF64, p32), pb.idx, pb.targets)
    l32, lg32, g32 = _grads(pb.model(_C.Model, p32), pb.idx, pb.targets)
    assert l32 == pytest.approx(l64, rel=1e-5)
    # the real columns elementwise; the padded ones (sums with heavy cancellation, never in the loss) normwise
    np.testing.assert_allclose(lg32[..., :V], lg64[..., :V], rtol=1e-5, atol=1e-5 * np.abs(lg64).max())
    assert _normwise(lg32, lg64) < 1e-5
    for k in g64:
        assert _normwise(g32[k], g64[k]) < F32_RTOL, k


def test_recompute_activation_with_relu2_is_bit_identical():
    pb = Problem(MODERN, "hs16")
    m1, m2 = pb.model(_C.Model), pb.model(_C.Model)
    m2.recompute_gelu = True
    a, b = _grads(m1, pb.idx, pb.targets), _grads(m2, pb.idx, pb.targets)
    assert a[0] == b[0]
    for k in a[2]:
        np.testing.assert_array_equal(a[2][k], b[2][k])


def test_forward_backward_fused_softcap_matches_forward_then_backward():
    """forward_backward (crossentropy_softcap_forward_backward on the raw logits) == forward + backward."""
    pb = Problem(MODERN, "hs64")
    m1, m2 = pb.model(), pb.model()
    loss, _, g1 = _grads(m1, pb.idx, pb.targets)
    m2.zero_grad()
    m2.forward_backward(pb.idx, pb.targets, 1.0)
    assert m2.take_loss() == pytest.approx(loss, rel=1e-14)
    for k, g in m2.grads().items():
        assert _normwise(g, g1[k]) < 1e-13, k


def test_all_targets_ignored_gives_zero_gradients():
    pb = Problem(MODERN, "hs16")
    m = pb.model()
    m.zero_grad()
    assert math.isnan(m.forward(pb.idx, np.full_like(pb.targets, -1)))
    m.backward(1.0)
    assert all(not g.any() for g in m.grads().values())


# ------------------------------------------------------------------ the config: tensors, counts, FLOPs

@pytest.mark.parametrize("arch", ARCHS + [{}], ids=_id)
def test_params_are_exactly_the_configs_tensors(arch):
    cfg = GPT2Config(block_size=MAXT, vocab_size=V, padded_vocab_size=VP, n_layer=L, n_head=2, n_embd=32, **arch)
    m = GPT2(cfg, dtype="float64")
    shapes = {k: v.shape for k, v in m.params.items()}
    assert shapes == cfg.param_shapes() == ref.shapes(MAXT, V, VP, L, 2, 32, arch)
    assert list(m.grads) == list(shapes)
    assert m.num_parameters == cfg.num_parameters() == sum(math.prod(s) for s in shapes.values())
    assert ("wpe" in shapes) == (cfg.position == "learned")
    assert ("lm_head" in shapes) == (not cfg.tie_embeddings)
    assert any(k.endswith("b") and k != "wte" for k in shapes) == cfg.bias
    # the flat buffer is the tensors back to back in this order
    flat = m.flat_params()
    off = 0
    for k, p in m.params.items():
        assert np.shares_memory(flat[off:off + p.size], p)
        off += p.size
    assert off == flat.size


def test_d12_counts_and_flops():
    gpt2, modern = GPT2Config(), GPT2Config.modern(12, 768)
    assert gpt2.num_parameters() == 124_475_904
    assert gpt2.flops_per_token() == 6 * (124_475_904 - 1024 * 768) + 6 * 12 * 768 * 1024
    L, C, Vp = 12, 768, 50304
    # no wpe, no norm gains or biases, no linear biases, an untied head of Vp x C
    assert modern.num_parameters() == 2 * Vp * C + L * 12 * C * C
    # the matmuls: the 12 L C^2 of the blocks and the head; the embedding lookup costs none
    assert modern.flops_per_token() == 6 * (L * 12 * C * C + Vp * C) + 6 * L * C * 1024
    assert modern.head_size == 128 and modern.n_head == 6
    assert GPT2Config.modern(4, 256, n_head=4).head_size == 64


def test_config_validation_names_the_field():
    for kw, word in [(dict(position="alibi"), "position"), (dict(norm="batchnorm"), "norm"),
                     (dict(activation="swiglu"), "activation"), (dict(qk_norm=1), "qk_norm"),
                     (dict(logit_softcap=0.0), "logit_softcap"), (dict(logit_softcap=float("inf")), "logit_softcap"),
                     (dict(rope_base=1.0), "rope_base"), (dict(n_embd=30, n_head=2, position="rope"), "even head")]:
        with pytest.raises(ValueError, match=word):
            GPT2Config(**kw)
    with pytest.raises(ValueError, match="position"):
        _C.ModelF64(max_seq_len=8, vocab_size=10, padded_vocab_size=10, n_layer=1, n_head=1, n_embd=8,
                    position="alibi")


def test_gpt2_default_is_unchanged_by_the_fields():
    """GPT-2 (every field default) gives the bits it gave before: the same as a model built without them."""
    cfg = GPT2Config(block_size=MAXT, vocab_size=V, padded_vocab_size=VP, n_layer=L, n_head=2, n_embd=32)
    a = GPT2(cfg, seed=5)
    b = _C.Model(max_seq_len=MAXT, vocab_size=V, padded_vocab_size=VP, n_layer=L, n_head=2, n_embd=32)
    for k, v in b.params().items():
        v[...] = a.params[k]
    rng = np.random.default_rng(0)
    x, y = (rng.integers(0, V, (2, 9)).astype(np.int32) for _ in range(2))
    assert a.forward(x, y) == b.forward(x, y)
    assert list(a.params) == list(_C.param_names())


def test_modern_init():
    cfg = GPT2Config.modern(2, 64, n_head=2, block_size=32, vocab_size=V, padded_vocab_size=VP)
    m = GPT2(cfg, seed=1)
    for k in ("attprojw", "fcprojw", "lm_head"):
        assert not m.params[k].any(), k
    for k in ("wte", "qkvw", "fcw"):
        assert m.params[k].std() > 0.01, k
    # without zero_init_proj the same seed draws the same other tensors, and the projections are random
    m2 = GPT2(cfg.replace(zero_init_proj=False), seed=1)
    np.testing.assert_array_equal(m.params["qkvw"], m2.params["qkvw"])
    assert m2.params["lm_head"][:V].std() > 0.01 and not m2.params["lm_head"][V:].any()
    # it trains: a few steps on a repeated batch lower the loss
    rng = np.random.default_rng(0)
    x, y = (rng.integers(0, V, (2, 16)).astype(np.int32) for _ in range(2))
    first = m.forward(x, y)
    for _ in range(5):
        m.zero_grad()
        m.forward(x, y)
        m.backward()
        m.step(lr=1e-2)
    assert m.forward(x, y) < first - 0.1
    out = m.generate(x[:, :3], 4, seed=0)
    assert out.shape == (2, 7) and (out >= 0).all() and (out < V).all()


@pytest.mark.parametrize("hs,T,t0", [(64, 7, 0), (16, 13, 0), (64, 5, 1000), (16, 3, 77777)])
def test_rope_op_against_numpy_with_a_position_offset(hs, T, t0):
    """Backend::rope_forward / rope_backward at position offset t0 (the KV cache's; training passes 0) against the
    rotation of numpy_gpt2 at positions t0 .. t0+T-1, q and k rotated, v untouched; backward is the transpose
    (<rope(x), y> == <x, rope^T(y)>) and the inverse (rope^T(rope(x)) == x)."""
    rng = np.random.default_rng(hs + T)
    NH, B = 3, 2
    C = NH * hs
    qkv = rng.standard_normal((B, T, 3 * C))
    out = _C.rope(qkv, NH, t0=t0, base=500.0)
    cos, sin = ref.rope_tables(t0 + T, hs, 500.0)
    cos, sin = cos[t0:], sin[t0:]
    for j in range(2 * NH):  # q heads then k heads
        x = qkv[..., j * hs:(j + 1) * hs]
        # atol: theta = t * base^(-2i/hs) near t = 77777 carries ~1e-11 of rounding (numpy's pow vs libm's)
        np.testing.assert_allclose(out[..., j * hs:(j + 1) * hs], ref.rope(x, cos, sin), rtol=0, atol=1e-10)
    np.testing.assert_array_equal(out[..., 2 * C:], qkv[..., 2 * C:])
    assert np.abs(out[..., :2 * C] - qkv[..., :2 * C]).max() > 0.1
    y = rng.standard_normal(qkv.shape)
    back = _C.rope(y, NH, t0=t0, base=500.0, inverse=True)
    assert np.vdot(out[..., :2 * C], y[..., :2 * C]) == pytest.approx(np.vdot(qkv[..., :2 * C], back[..., :2 * C]),
                                                                       rel=1e-12)
    np.testing.assert_allclose(_C.rope(out, NH, t0=t0, base=500.0, inverse=True), qkv, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="even size"):
        _C.rope(rng.standard_normal((1, 2, 3 * 15)), 3)


def test_kv_cache_inference_runs_the_modern_architecture():
    """GPT2Config.modern (as its init makes it: zero-initialised projections) runs generate through the KV cache,
    with the ids of the uncached path (the full forward's soft-capped logits, sampled on the host). The KV path's
    logits against the full forward and the numpy oracle, field by field: tests/python/test_inference.py."""
    from gpt2core import inference
    cfg = GPT2Config.modern(2, 32, n_head=2, block_size=16, vocab_size=V, padded_vocab_size=VP)
    m = GPT2(cfg, seed=0)
    assert m._m.kv_supported and m._inference_engine(1, 16).__class__ is inference.KVEngine
    x = np.array([[1, 2, 3]], dtype=np.int32)
    a, b = m.generate(x, 5, seed=3), m.generate(x, 5, seed=3)
    assert a.shape == (1, 8) and np.array_equal(a, b) and (a < V).all()
    m._inference_engine = lambda n, t: inference.ForwardEngine(m, n, t)
    np.testing.assert_array_equal(m.generate(x, 5, seed=3), a)
