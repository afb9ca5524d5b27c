"""fp16 mixed precision, whole model, on the emulated CUDA backend (gpt2core_cuda_emu, see test_cuda_emu.py).

The fp16 model (ModelF16) keeps fp32 master weights, gradients, AdamW moments and statistics; the ops read an
fp16 copy of the weights (rounded to nearest even) and read and write fp16 activations. References: the float64
CPU model (forward, backward) and the fp32 CPU model (a whole training step), on the same weights. The backward
runs with a loss scale (grad_scale = 1024: the loss gradient, and so every fp16 activation gradient, is 1024x
larger, keeping small ones out of fp16's subnormal range) and the optimizer step unscales (its grad_scale
divides by 1024), as a training loop with a constant loss scale does.

Tolerances: the bf16 model's (test_cuda_emu_bf16_model.py: 1e-2 normwise on logits, 2e-2 per gradient tensor,
2e-3 relative on losses, for bf16's unit roundoff 2^-8 accumulated along the ~15-activation chains of forward
and backward) scaled by the ratio of the unit roundoffs, 2^-11 / 2^-8 = 1/8: 1.25e-3 on logits, 2.5e-3 on
gradients and the norm, 2.5e-4 on losses. Measured: logits 3.7e-4, gradients 1.3e-3, loss 2.4e-6. An fp16
model that stored activations in bf16, kept a statistic in fp16 or lost the loss scale would be off by 8x or
by orders of magnitude.
"""
import numpy as np
import pytest

from test_cuda_emu import CFG, batch, emu, grad_errors, init_params, normwise  # noqa: F401  (emu: fixture)

LOGITS, GRADS, LOSS = 1.25e-3, 2.5e-3, 2.5e-4
SCALE = 1024.0  # the constant loss scale of these tests


def f16_model(emu, seed, **options):  # noqa: F811
    m = emu.ModelF16(**CFG, device="cuda", **options)
    init_params(m, seed)
    m.params_changed()
    return m


def reference(emu, seed, cls="ModelF64"):  # noqa: F811
    m = getattr(emu, cls)(**CFG, device="cpu")
    init_params(m, seed)
    return m


def test_f16_model_is_cuda_only_and_reports_its_memory(emu):  # noqa: F811
    with pytest.raises(ValueError, match="fp16 mixed precision needs device='cuda'"):
        emu.ModelF16(**CFG, device="cpu")
    m = emu.ModelF16(**CFG, device="cuda")
    assert m.dtype == "float16"
    assert m.params()["wte"].dtype == np.float32  # the master weights
    n, h = m.num_parameters, m.memory_bytes(3, 37)
    assert h["params"] == n * (2 + 4) and h["grads"] == 4 * n and h["optimizer"] == 8 * n  # fp16 copy + fp32 master
    assert h["activations"] == emu.ModelBF16(**CFG, device="cuda").memory_bytes(3, 37)["activations"]


def test_f16_forward_backward_match_float64(emu):  # noqa: F811
    idx, tgt = batch()
    ref, m = reference(emu, 0), f16_model(emu, 0)
    loss_r, loss_m = ref.forward(idx, tgt), m.forward(idx, tgt)
    assert abs(loss_m - loss_r) <= LOSS * abs(loss_r), (loss_m, loss_r)
    assert normwise(m.logits(), ref.logits()) <= LOGITS
    errs = grad_errors(ref, m, idx, tgt, SCALE)
    assert max(errs.values()) <= GRADS, errs
    assert not np.any(m.grads()["wte"][CFG["vocab_size"]:])  # padded vocab rows: exactly zero gradient
    assert abs(m.grad_norm() / SCALE - ref.grad_norm()) <= GRADS * ref.grad_norm()


def test_f16_training_step_matches_the_fp32_cpu_step(emu):  # noqa: F811
    """One whole step, forward_backward (loss scaled by 1024) then the optimizer step (norm, clip to half the
    norm, AdamW with the scale divided back out), against the fp32 CPU model's step on the same weights: moments
    within the gradients' tolerance (m is linear in the gradient; v quadratic: twice its relative error), the
    fp32 master weights as in test_cuda_emu.test_training_step_matches_cpu (Adam's first step moves a weight by
    ~lr sign(g): weights with a clear gradient, |g| > 10 GRADS max|g|, agree within 1e-5 of the update; every
    weight within 2 lr), and the fp16 copy is the master rounded to nearest even (seen through the logits of the
    next forward, which equal those of a fresh model loaded with the new master weights)."""
    idx, tgt = batch(2)
    cpu, m = reference(emu, 1, "Model"), f16_model(emu, 1)
    before = {k: v.copy() for k, v in cpu.params().items()}
    cpu.forward_backward(idx, tgt)
    m.forward_backward(idx, tgt, grad_scale=SCALE)
    loss_c, loss_m = cpu.take_loss(), m.take_loss() / SCALE  # the device-side sum of grad_scale * mean loss
    assert abs(loss_m - loss_c) <= LOSS * abs(loss_c)
    grads = {k: v.copy() for k, v in cpu.grads().items()}
    norm_c, norm_m = cpu.grad_norm(), m.grad_norm() / SCALE
    assert abs(norm_m - norm_c) <= GRADS * norm_c
    lr = 1e-3
    cpu.adamw_update(lr=lr, step=1, grad_scale=0.5 / norm_c)
    m.adamw_update(lr=lr, step=1, grad_scale=0.5 / norm_m / SCALE)
    for what, tol in (("adam_m", GRADS), ("adam_v", 2 * GRADS)):
        c, g = getattr(cpu, what)(), getattr(m, what)()
        errs = {k: normwise(g[k], c[k]) for k in c}
        assert max(errs.values()) <= tol, (what, errs)
    c, g = cpu.params(), m.params()
    for k in c:
        clear = np.abs(grads[k]) > 10 * GRADS * np.max(np.abs(grads[k])) if np.any(grads[k]) else np.ones(c[k].shape, bool)
        upd_c, upd_g = (c[k] - before[k])[clear].astype(np.float64), (g[k] - before[k])[clear].astype(np.float64)
        if upd_c.size:
            assert np.max(np.abs(upd_g - upd_c)) <= 1e-5 * max(np.max(np.abs(upd_c)), 1e-30) + 1e-5 * np.max(np.abs(c[k])), k
        assert np.max(np.abs(g[k] - c[k])) <= 2 * lr + 1e-6, k
    fresh = emu.ModelF16(**CFG, device="cuda")
    for k, v in fresh.params().items():
        v[...] = g[k]
    fresh.params_changed()
    assert fresh.forward(idx, tgt) == m.forward(idx, tgt) and np.array_equal(fresh.logits(), m.logits())


def test_f16_five_steps_lower_the_loss_like_float64(emu):  # noqa: F811
    idx, tgt = batch(1)
    losses = {}
    for name, m, scale in (("f64", reference(emu, 3), 1.0), ("f16", f16_model(emu, 3), SCALE)):
        run = []
        for step in range(1, 6):
            m.zero_grad()
            m.forward_backward(idx, tgt, grad_scale=scale)
            run.append(m.take_loss() / scale)
            norm = m.grad_norm() / scale
            m.adamw_update(lr=1e-3, step=step, grad_scale=min(1.0, 1.0 / (norm + 1e-6)) / scale)
        losses[name] = np.array(run)
    lf, lh = losses["f64"], losses["f16"]
    assert np.all(np.diff(lh) < 0) and lh[-1] < lh[0] - 0.1, lh
    np.testing.assert_allclose(lh, lf, rtol=LOSS)


def test_16bit_models_need_their_tensor_cores(emu, monkeypatch):  # noqa: F811
    """The backend itself refuses a 16-bit model on a GPU without tensor cores for its type (the emulated device
    reports the capability GPT2CORE_EMU_COMPUTE_CAPABILITY names): bf16 below sm_80 (a T4, where the bf16
    kernels' mma instructions trap), fp16 below sm_70; fp16 runs on a T4, with our flash attention."""
    monkeypatch.setenv("GPT2CORE_EMU_COMPUTE_CAPABILITY", "75")
    with pytest.raises(RuntimeError, match=r"bf16 mixed precision needs an sm_80\+ GPU; cuda:0 is sm_75: use fp16"):
        emu.ModelBF16(**CFG, device="cuda")
    idx, tgt = batch()
    ref, m = reference(emu, 0), f16_model(emu, 0)
    assert abs(m.forward(idx, tgt) - ref.forward(idx, tgt)) <= LOSS * abs(ref.forward(idx, tgt))
    monkeypatch.setenv("GPT2CORE_EMU_COMPUTE_CAPABILITY", "61")
    with pytest.raises(RuntimeError, match=r"fp16 mixed precision needs an sm_70\+ GPU .*sm_61: use fp32"):
        emu.ModelF16(**CFG, device="cuda")
    emu.Model(**CFG, device="cuda")  # fp32 runs anywhere


def test_f16_100_steps_with_dynamic_loss_scaling_track_fp32(emu):  # noqa: F811
    """100 steps of a tiny model (1 layer, C=32, V=61, B=1, T=16; 4 batches in turn, so it memorises them) in fp16
    with dynamic loss scaling against the fp32 CPU model without it. The scale starts at 2^24, above what these
    fp16 activation gradients tolerate (fp16's largest value is 65504): the first steps overflow naturally and are
    skipped while it halves, then it doubles every 10 clean steps and backs off again at the next overflow. The
    fp32 run takes the same LR per loop step and skips the same steps (so its AdamW step count is the same count
    of applied updates, GradScaler's convention), so the curves differ by fp16 rounding only.
    Tolerance: one step's loss agrees to 2.5e-4 relative (test above); over 100 steps the weights drift apart by
    the accumulated rounding and Adam's per-coordinate normalisation, so the curves agree within 0.5% of the
    initial loss ln(61) at every step (measured: 0.04%, 0.0017 nats, 0.26% of the loss at that step; 14 skipped
    steps, 5 at the start), and both fall below a quarter of it (measured 0.45)."""
    from gpt2core.schedule import lr_at
    cfg = dict(max_seq_len=16, vocab_size=61, padded_vocab_size=64, n_layer=1, n_head=2, n_embd=32)
    rng = np.random.default_rng(1)
    xs = [rng.integers(0, 61, (1, 16)).astype(np.int32) for _ in range(4)]
    data = [(x, np.roll(x, -1, axis=1)) for x in xs]
    f16, ref = emu.ModelF16(**cfg, device="cuda"), emu.Model(**cfg, device="cpu")
    for m in (f16, ref):
        init_params(m, 2)
        m.params()["wte"][61:] = 0.0
        m.params_changed()
    f16.set_loss_scaling(True, scale=2.0**24, interval=10)
    applied, losses, skipped = 0, [], []
    for s in range(100):
        lr = lr_at(s, 1e-2, 5, 100, 1e-3)
        for m in (f16, ref):
            m.zero_grad()
            m.forward_backward(*data[s % 4], 1.0)
        losses.append((f16.take_loss(), ref.take_loss()))
        if np.isfinite(f16.optimizer_step(lr=lr, step=applied + 1, grad_clip=1.0)):
            ref.optimizer_step(lr=lr, step=applied + 1, grad_clip=1.0)
            applied += 1
        else:
            skipped.append(s)
    l16, l32 = np.array(losses).T
    assert skipped[:3] == [0, 1, 2] and len(skipped) > 5 and any(s > 20 for s in skipped), skipped
    assert f16.loss_scaler["skipped"] == len(skipped) and f16.loss_scaler["scale"] < 2.0**24
    assert np.max(np.abs(l16 - l32)) <= 0.005 * np.log(61), np.max(np.abs(l16 - l32))
    assert l16[-4:].max() < np.log(61) / 4 and l32[-4:].max() < np.log(61) / 4
