"""The core's opt-in per-op profiler (GPT2Model::set_profile, the `profile` / `op_profile` properties that
scripts/bench.py --profile reads), on the CPU backend: it times every op of forward, loss, backward and optimizer
under its name with the calls the layer loop makes, and it changes no bits (profiling runs AdamW per tensor group,
which must write what the one call over every segment writes). Speed itself is measured by the benchmark, never
asserted here."""
import numpy as np
import pytest

from gpt2core import GPT2, GPT2Config

L = 2
GPT2_CFG = GPT2Config(block_size=16, vocab_size=61, padded_vocab_size=64, n_layer=L, n_head=2, n_embd=32)
MODERN_CFG = GPT2_CFG.replace(position="rope", norm="rmsnorm", qk_norm=True, activation="relu2", bias=False,
                              tie_embeddings=False, zero_init_proj=False, logit_softcap=3.0)
MUON = dict(optimizer="muon", muon_lr=0.02, embedding_lr=0.05, head_lr=0.004)
STEPS, ACCUM = 3, 2


def train(cfg, step_kw, profile, fused):
    """STEPS optimizer steps of ACCUM micro-steps on random tokens (the same for every call); the model and the
    per-step losses."""
    model = GPT2(cfg, seed=3)
    model._m.profile = profile
    rng = np.random.default_rng(0)
    losses = []
    for _ in range(STEPS):
        model.zero_grad()
        for _ in range(ACCUM):
            x, y = (rng.integers(0, cfg.vocab_size, (2, 7), dtype=np.int32) for _ in range(2))
            if fused:
                model._m.forward_backward(x, y, 1.0 / ACCUM)
            else:
                losses.append(model.forward(x, y))
                model.backward(1.0 / ACCUM)
        model.step(lr=1e-2, **step_kw)
    return model, losses


@pytest.mark.parametrize("fused", [False, True], ids=["forward+backward", "forward_backward"])
@pytest.mark.parametrize("recipe", ["gpt2", "modern"])
def test_profile_times_each_op_and_changes_no_bits(recipe, fused):
    cfg, kw = (GPT2_CFG, {}) if recipe == "gpt2" else (MODERN_CFG, MUON)
    plain, plain_losses = train(cfg, kw, False, fused)
    prof, prof_losses = train(cfg, kw, True, fused)
    assert plain._m.op_profile == []  # off: nothing recorded
    # the same bits: profiling times the ops, it does not change them (AdamW per tensor group included)
    assert plain_losses == prof_losses
    assert np.array_equal(plain.flat_params(), prof.flat_params())
    assert np.array_equal(plain._m.flat_grads(), prof._m.flat_grads())
    ops = {name: (sec, calls) for name, sec, calls in prof._m.op_profile}
    assert all(sec >= 0 for sec, _ in ops.values()) and sum(sec for sec, _ in ops.values()) > 0
    per_layer = ["forward.matmul_qkv", "forward.attention", "forward.matmul_attproj", "forward.matmul_fcproj",
                 "backward.matmul_fc", "backward.attention", "backward.matmul_qkv", "backward.matmul_attproj"]
    micro = STEPS * ACCUM
    for name in per_layer:
        assert ops[name][1] == L * micro, name
    assert ops["forward.lm_head"][1] == ops["backward.lm_head"][1] == ops["forward.embedding"][1] == micro
    assert ops["optimizer.grad_norm"][1] == STEPS
    if recipe == "gpt2":
        assert ops["forward.matmul_fc+gelu"][1] == ops["backward.matmul_fcproj+gelu"][1] == L * micro
        assert ops["forward.layernorm"][1] == micro  # the first ln1; the rest are fused with their residual
        assert ops["forward.residual+layernorm"][1] == 2 * L * micro
        assert ops["backward.layernorm"][1] == (2 * L + 1) * micro
        assert ops["optimizer.adamw.embedding"][1] == ops["optimizer.adamw.rest"][1] == STEPS
        assert not any("muon" in n or "rope" in n or "softcap" in n or "rmsnorm" in n for n in ops)
        assert ops["loss.crossentropy" if fused else "loss.crossentropy_backward"][1] == micro
    else:
        for name in ("forward.rope", "forward.qk_norm", "backward.qk_norm", "backward.rope",
                     "forward.matmul_fc+relu2", "backward.matmul_fcproj+relu2"):
            assert ops[name][1] == L * micro, name
        assert ops["forward.residual+rmsnorm"][1] == 2 * L * micro
        assert ops["backward.rmsnorm"][1] == (2 * L + 1) * micro
        assert ops["loss.crossentropy_softcap" if fused else "loss.crossentropy_softcap_backward"][1] == micro
        if not fused:
            assert ops["forward.softcap"][1] == micro
        # AdamW: the embedding and the untied head, each timed apart; the hidden matrices are Muon's
        assert ops["optimizer.adamw.embedding"][1] == ops["optimizer.adamw.head"][1] == STEPS
        assert "optimizer.adamw.rest" not in ops  # no norm gains or biases in this architecture
        n_mats = len(prof.muon_matrix_list())
        assert n_mats == 6 * L  # q, k, v, attproj, fc, fcproj per layer
        assert ops["optimizer.muon_momentum"][1] == STEPS
        assert ops["optimizer.muon_newton_schulz"][1] >= STEPS  # at least one call per step (batched: per shape)
        assert ops["optimizer.muon_apply"][1] >= STEPS
    # set True again: cleared; False: kept as it is
    prof._m.profile = False
    kept = prof._m.op_profile
    prof.zero_grad()
    x = np.ones((1, 4), np.int32)
    prof.forward(x, x)
    assert prof._m.op_profile == kept
    prof._m.profile = True
    assert prof._m.op_profile == []
    prof.forward(x, x)
    assert [n for n, _, _ in prof._m.op_profile][0] == "forward.embedding"
