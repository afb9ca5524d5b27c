"""The modern architecture (issue 26: rotary positions, RMSNorm, QK-norm, ReLU^2, no biases, an untied head, soft-capped
logits) on the emulated CUDA backend against the CPU backend, whole model: every field on, and each alone; fp32 (fused
and unfused kernels; flash, cuDNN-seam and materialised attention), bf16 and fp16; CUDA graphs replaying it bit for bit.
The ops one by one are in test_cuda_emu_modern.py (float64) and compare_ops.py (against the CPU backend).

Tolerances are those of the GPT-2 model on the same backends, for the same reasons (the new ops are row-wise or
elementwise fp32 arithmetic with one rounding per stored value, like the ones they replace):
- fp32 (test_cuda_emu.py): 1e-5 normwise per tensor, the summation-order rounding of fp32 reductions;
- bf16 (test_cuda_emu_bf16_model.py): against the float64 model, 2e-3 relative on the loss, and normwise 2e-2 on the
  logits and 3e-2 per gradient tensor: twice GPT-2's 1e-2 and 1.5x its 2e-2, because this model's logits are ~3x
  more sensitive to the 2^-8 roundings of its stored activations. Measured on the same batch (fp16 / GPT-2 in
  brackets): logits 9.5e-3 (1.4e-3 / 2.8e-3), gradients 1.3e-2 (2.3e-3 / 7.5e-3). Field by field in fp16 the logits
  error is GPT-2's 4.1e-4 except with rmsnorm (8.7e-4: no gain, no centring, so less cancellation), untied
  (7.1e-4: an lm_head unrelated to wte) and softcap (5.4e-4: one more rounding of the logits); the errors scale with
  the unit roundoff (bf16 / fp16 = 7, the ratio 2^-8 / 2^-11 = 8), as rounding does and a kernel bug would not;
- fp16 (test_cuda_emu_f16_model.py): the bf16 bounds scaled by 2^-11 / 2^-8 = 1/8, backward with a loss scale of 1024.
"""
import numpy as np
import pytest

from test_cuda_emu import CFG, batch, emu, grad_errors, init_params, normwise, train_step  # noqa: F401  (emu: fixture)

MODERN = dict(position="rope", norm="rmsnorm", qk_norm=True, activation="relu2", bias=False, tie_embeddings=False,
              logit_softcap=15.0)
SINGLE = {"rope": dict(position="rope", rope_base=500.0), "rmsnorm": dict(norm="rmsnorm"), "qk_norm": dict(qk_norm=True),
          "relu2": dict(activation="relu2"), "no_bias": dict(bias=False), "untied": dict(tie_embeddings=False),
          "softcap": dict(logit_softcap=3.0)}
ARCHS = {"modern": MODERN, **SINGLE}


def model(emu, cls, device, arch, seed=0, **options):  # noqa: F811
    m = getattr(emu, cls)(**CFG, device=device, **arch, **options)
    init_params(m, seed)
    if cls in ("ModelBF16", "ModelF16"):
        m.params_changed()
    return m


def test_modern_model_has_the_config_tensors_on_cuda(emu):  # noqa: F811
    m = model(emu, "Model", "cuda", MODERN)
    names = set(m.params())
    assert "wpe" not in names and "lm_head" in names and not any(n.endswith("b") for n in names), names
    assert names == set(model(emu, "Model", "cpu", MODERN).params())


@pytest.mark.parametrize("arch", list(ARCHS))
def test_fp32_forward_backward_matches_cpu(emu, arch):  # noqa: F811
    idx, tgt = batch(11)
    cpu, gpu = model(emu, "Model", "cpu", ARCHS[arch]), model(emu, "Model", "cuda", ARCHS[arch])
    lc, lg = cpu.forward(idx, tgt), gpu.forward(idx, tgt)
    assert abs(lg - lc) <= 1e-5 * abs(lc), (lg, lc)
    assert normwise(gpu.logits(), cpu.logits()) <= 1e-5  # capped logits where the soft-cap is on
    assert normwise(gpu.token_losses(), cpu.token_losses()) <= 1e-5
    errs = grad_errors(cpu, gpu, idx, tgt)
    assert max(errs.values()) <= 1e-5, errs
    assert abs(gpu.grad_norm() - cpu.grad_norm()) <= 1e-5 * cpu.grad_norm()


@pytest.mark.parametrize("options", [dict(fused=False), dict(attention="naive"), dict(attention="cudnn"), dict(tf32=True)],
                         ids=["unfused", "naive", "cudnn", "tf32"])
def test_fp32_other_kernels_match_cpu(emu, options):  # noqa: F811
    """The unfused rung (separate residual + RMSNorm kernels) and the other attention paths: rotary and QK-norm are
    applied to qkv before any of them. tf32: the option reaches every matmul's seam params; the emulated seam computes
    fp32 either way (TF32's own 1e-3 rounding is checked on a GPU by test_cuda_gpu.py), so this checks the path."""
    idx, tgt = batch(12)
    cpu, gpu = model(emu, "Model", "cpu", MODERN), model(emu, "Model", "cuda", MODERN, **options)
    lc, lg = cpu.forward(idx, tgt), gpu.forward(idx, tgt)
    assert abs(lg - lc) <= 1e-5 * abs(lc), (lg, lc)
    errs = grad_errors(cpu, gpu, idx, tgt)
    assert max(errs.values()) <= 1e-5, errs


def test_fp32_five_steps_like_cpu(emu):  # noqa: F811
    losses = {}
    for dev in ("cpu", "cuda"):
        m = model(emu, "Model", dev, MODERN, seed=3)
        idx, tgt = batch(1)
        losses[dev] = np.array([train_step(m, idx, tgt, step)[0] for step in range(1, 6)])
    assert np.all(np.diff(losses["cuda"]) < 0) and losses["cuda"][-1] < losses["cuda"][0] - 0.1, losses["cuda"]
    np.testing.assert_allclose(losses["cuda"], losses["cpu"], rtol=1e-4)  # as test_cuda_emu's GPT-2 five steps


@pytest.mark.parametrize("cls,logits_tol,grads_tol,loss_tol,scale", [("ModelBF16", 2e-2, 3e-2, 2e-3, 1.0),
                                                                     ("ModelF16", 2.5e-3, 3.75e-3, 2.5e-4, 1024.0)])
def test_16bit_forward_backward_match_float64(emu, cls, logits_tol, grads_tol, loss_tol, scale):  # noqa: F811
    idx, tgt = batch(13)
    ref, m = model(emu, "ModelF64", "cpu", MODERN), model(emu, cls, "cuda", MODERN)
    lr_, lm = ref.forward(idx, tgt), m.forward(idx, tgt)
    assert abs(lm - lr_) <= loss_tol * abs(lr_), (lm, lr_)
    assert normwise(m.logits(), ref.logits()) <= logits_tol
    errs = grad_errors(ref, m, idx, tgt, scale)
    assert max(errs.values()) <= grads_tol, errs


@pytest.mark.parametrize("cls", ["Model", "ModelBF16"])
def test_graph_replays_the_modern_step_bitwise(emu, cls):  # noqa: F811
    """CUDA graphs: two optimizer steps of two micro-steps, captured and replayed, against the direct run, bit for
    bit (the rotary table is computed before the capture, by the direct first micro-step)."""
    graphed, direct = model(emu, cls, "cuda", MODERN), model(emu, cls, "cuda", MODERN)
    graphed.cuda_graphs = True
    rng = np.random.default_rng(4)
    for step in range(2):
        for m in (graphed, direct):
            m.zero_grad()
        for _ in range(2):
            x = rng.integers(0, CFG["vocab_size"], (3, 37)).astype(np.int32)
            y = rng.integers(0, CFG["vocab_size"], (3, 37)).astype(np.int32)
            for m in (graphed, direct):
                m.forward_backward(x, y, 0.5)
        lg, ld = graphed.take_loss(), direct.take_loss()
        assert lg == ld and np.isfinite(lg), (lg, ld)
        for k in direct.grads():
            assert np.array_equal(graphed.grads()[k], direct.grads()[k]), k
        norms = [m.optimizer_step(lr=1e-2, step=step + 1, grad_clip=0.05) for m in (graphed, direct)]
        assert norms[0] == norms[1]
        for k in direct.params():
            assert np.array_equal(graphed.params()[k], direct.params()[k]), k
    assert graphed.graph_captures == 2 and graphed.graph_replays > 0
