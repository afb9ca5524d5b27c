"""bf16 mixed precision, whole model, on the emulated CUDA backend (gpt2core_cuda_emu, see test_cuda_emu.py).

The bf16 model (ModelBF16) keeps fp32 master weights, fp32 gradients, fp32 AdamW moments and fp32 statistics
(layernorm mean/rstd, attention logsumexp, losses); the ops read a bf16 copy of the weights and read and write
bf16 activations. The reference is the float64 CPU model on the same weights.

Tolerances: bf16 keeps 8 significant bits, so every stored activation carries a relative rounding error of up
to 2^-8 ~ 3.9e-3 (half that on average). A forward through this 2-layer model stores ~15 activations in a chain,
and backward as many again, with errors that add roughly like a random walk (sqrt(15) x 3.9e-3 ~ 1.5e-2): we
allow 1e-2 normwise on logits and 2e-2 on each gradient tensor (the backward chain is twice as long and
accumulates dres in bf16), and 2e-3 relative on the mean loss and on the losses of five training steps (a mean
over 109 tokens averages the per-token errors down). Measured: logits 3.1e-3, gradients 7.1e-3 at worst, loss
1.4e-5, five-step losses 9e-5. Anything systematically wrong (a wrong scale, a
missing term, fp32 state stored in bf16) shows up as errors of order 1.
"""
import numpy as np
import pytest

from test_cuda_emu import CFG, batch, emu, grad_errors, init_params, normwise, train_step  # noqa: F401  (emu: fixture)


def f64_reference(emu, seed):
    m = emu.ModelF64(**CFG, device="cpu")
    init_params(m, seed)
    return m


def bf16_model(emu, seed, **options):
    m = emu.ModelBF16(**CFG, device="cuda", **options)
    init_params(m, seed)
    m.params_changed()
    return m


def test_bf16_model_is_cuda_only_and_reports_its_memory(emu):
    with pytest.raises(ValueError, match="bf16 mixed precision needs device='cuda'"):
        emu.ModelBF16(**CFG, device="cpu")
    m = emu.ModelBF16(**CFG, device="cuda")
    assert m.dtype == "bfloat16" and emu.Model(**CFG, device="cuda").dtype == "float32"
    assert m.params()["wte"].dtype == np.float32  # the master weights
    f = emu.Model(**CFG, device="cuda").memory_bytes(3, 37)
    h = m.memory_bytes(3, 37)
    n = m.num_parameters
    assert h["params"] == n * (2 + 4)  # bf16 copy + fp32 master
    assert h["grads"] == f["grads"] == 4 * n and h["optimizer"] == f["optimizer"] == 8 * n
    assert 0.5 * f["activations"] < h["activations"] < 0.6 * f["activations"]  # mostly halved (stats stay fp32)


def test_bf16_forward_backward_match_float64(emu):
    idx, tgt = batch()
    ref, m = f64_reference(emu, 0), bf16_model(emu, 0)
    loss_r, loss_m = ref.forward(idx, tgt), m.forward(idx, tgt)
    assert abs(loss_m - loss_r) <= 2e-3 * abs(loss_r), (loss_m, loss_r)
    assert normwise(m.logits(), ref.logits()) <= 1e-2
    assert m.logits().dtype == np.float32 and m.token_losses().dtype == np.float32
    errs = grad_errors(ref, m, idx, tgt)
    assert max(errs.values()) <= 2e-2, errs
    # padded vocab rows get exactly zero gradient in bf16 too
    assert not np.any(m.grads()["wte"][CFG["vocab_size"]:])
    assert abs(m.grad_norm() - ref.grad_norm()) <= 2e-2 * ref.grad_norm()


def test_bf16_adamw_updates_fp32_master_and_rounds_the_copy_stochastically(emu):
    """One step on the same gradients: the fp32 master weights and moments follow fp32 AdamW exactly as the
    fp32 CUDA model does it (same kernel math, so within 1e-6 of the update); the ops' bf16 copy is one of the
    two bf16 neighbours of each master weight (stochastic rounding)."""
    idx, tgt = batch()
    m = bf16_model(emu, 0)
    m.zero_grad()
    m.forward(idx, tgt)
    m.backward()
    g = {k: v.copy() for k, v in m.grads().items()}
    before = {k: v.copy() for k, v in m.params().items()}
    f = emu.Model(**CFG, device="cuda")  # fp32 AdamW on the same weights and gradients
    for k, v in f.params().items():
        v[...] = before[k]
    for k, v in f.grads().items():
        v[...] = g[k]
    lr = 1e-3
    m.adamw_update(lr=lr, step=1, grad_scale=0.7)
    f.adamw_update(lr=lr, step=1, grad_scale=0.7)
    for k in before:
        assert np.array_equal(m.params()[k], f.params()[k]), k
        assert np.array_equal(m.adam_m()[k], f.adam_m()[k]), k
        assert np.array_equal(m.adam_v()[k], f.adam_v()[k]), k
    assert m.param_round_seed == 1


def test_bf16_five_steps_lower_the_loss_like_float64(emu):
    losses = {}
    for name, make in (("f64", f64_reference), ("bf16", bf16_model)):
        m = make(emu, 3)
        idx, tgt = batch(1)
        losses[name] = np.array([train_step(m, idx, tgt, step)[0] for step in range(1, 6)])
    lr_, lb = losses["f64"], losses["bf16"]
    assert np.all(np.diff(lb) < 0) and lb[-1] < lb[0] - 0.1, lb
    np.testing.assert_allclose(lb, lr_, rtol=2e-3)


def test_bf16_resume_is_bit_exact(emu):
    """Master weights, moments and the step restore the bf16 copy bit for bit (the copy is a function of the
    master weights and the step's rounding seed), so 3 + resume + 2 steps = 5 steps exactly."""
    idx, tgt = batch(4)
    a = bf16_model(emu, 7)
    full = [train_step(a, idx, tgt, s)[0] for s in range(1, 6)]
    b = bf16_model(emu, 7)
    part = [train_step(b, idx, tgt, s)[0] for s in range(1, 4)]
    c = emu.ModelBF16(**CFG, device="cuda")  # a fresh process would build this from a checkpoint
    for get in ("params", "adam_m", "adam_v"):
        for k, v in getattr(c, get)().items():
            v[...] = getattr(b, get)()[k]
    c.param_round_seed = 3  # the restored step (GPT2.step_count does this)
    part += [train_step(c, idx, tgt, s)[0] for s in range(4, 6)]
    assert part == full
    # without the seed the copy is rounded to nearest instead: a different (still valid) model
    d = emu.ModelBF16(**CFG, device="cuda")
    for k, v in d.params().items():
        v[...] = b.params()[k]
    d.params_changed()
    d.forward(idx, tgt)
    c.forward(idx, tgt)
    assert not np.array_equal(d.logits(), c.logits())


def test_bf16_sharded_update_equals_the_full_update(emu):
    """ZeRO-1 shape: AdamW over two halves of the flat parameters (adamw_update_range, as two ranks would),
    then the copy rebuilt from the master weights with the step's seed, gives exactly the bf16 weights (seen
    through the logits) of one full update."""
    idx, tgt = batch(5)
    full, shard = bf16_model(emu, 9), bf16_model(emu, 9)
    for m in (full, shard):
        m.zero_grad()
        m.forward(idx, tgt)
        m.backward()
    full.adamw_update(lr=1e-3, step=1)
    n = shard.num_parameters
    half = n // 2 + 5
    for lo, hi in ((0, half), (half, n)):
        mm, vv = np.zeros(hi - lo, np.float32), np.zeros(hi - lo, np.float32)
        shard.adamw_update_range(lo, hi, mm, vv, lr=1e-3, step=1)
    shard.params_changed()  # what the all-gather of master weights does
    full.forward(idx, tgt)
    shard.forward(idx, tgt)
    assert np.array_equal(full.logits(), shard.logits())


def test_bf16_fused_and_unfused_training_steps_agree(emu):
    """fused=True (default: fused residual + layernorm, GELU in the matmul epilogues) against False (the
    separate kernels) on the bf16 model, stored and recomputed GELU: within the tolerances above (the paths round
    differently: the fused forward applies GELU to the fp32 pre-activation, the unfused one to its bf16 copy; the
    fused backward rounds (dout @ w) * gelu' once, the unfused one rounds dout @ w first)."""
    idx, tgt = batch(6)
    for recompute in (False, True):
        runs = {}
        for fused in ("1", "0"):
            m = bf16_model(emu, 6, fused=fused == "1")
            m.recompute_gelu = recompute
            m.zero_grad()
            loss = m.forward(idx, tgt)
            logits = m.logits().copy()
            m.backward()
            runs[fused] = (loss, logits, {k: v.copy() for k, v in m.grads().items()}, m.grad_norm())
        (lf, xf, gf, nf), (lu, xu, gu, nu) = runs["1"], runs["0"]
        assert abs(lf - lu) <= 2e-3 * abs(lu), (recompute, lf, lu)
        assert normwise(xf, xu) <= 1e-2, recompute
        errs = {k: normwise(gf[k], gu[k]) for k in gu}
        assert max(errs.values()) <= 2e-2, (recompute, errs)
        assert abs(nf - nu) <= 2e-2 * nu
