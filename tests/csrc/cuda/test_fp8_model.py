"""precision fp8 in the model (GPT2Model::set_fp8, csrc/model/gpt2.h): the four Linear layers of every block (and
the head with head=True) through the Backend's FP8 ops, on the emulated CUDA backend (a bf16 model) and on the CPU
reference (an fp32 model).

- A few training steps (two micro-steps each, AdamW) in FP8 stay within a stated tolerance of the same steps in the
  model's own precision, and differ from them (FP8 is engaged).
- The weights' e4m3 copy is made once per optimizer step, not per micro-step (the op profile counts its casts), from
  the weights as they are after the update (their amax and scale, against numpy).
- Shapes FP8 cannot take are refused with a ValueError naming them.

Tolerance: e4m3 keeps 3 fraction bits (a relative rounding error up to 2^-4 per value) and e5m2 2 bits (2^-3), so
each Linear's output carries errors of a few percent per value that average over the k terms of its sums. Measured
here (3 steps, bf16 emulated and fp32 CPU, with and without the head): the loss of each step within 0.09% of the
non-FP8 step's, each gradient tensor of the first step within 14% (relative Frobenius norm; ln1w's the largest).
Asserted: 0.5% and 25%.
"""
import numpy as np
import pytest

from fp8 import ref_scale
from test_cuda_emu import emu  # noqa: F401  (fixture)

CFG8 = dict(max_seq_len=16, vocab_size=97, padded_vocab_size=128, n_layer=2, n_head=3, n_embd=48)
B8, T8 = 2, 16  # B * T = 32, a multiple of 16


def make(emu, cls, device, fp8=False, head=False):  # noqa: F811
    m = getattr(emu, cls)(**CFG8, device=device)
    rng = np.random.default_rng(0)
    for name, v in m.params().items():
        if name in ("ln1w", "ln2w", "lnfw"):
            v[...] = 1.0 + rng.standard_normal(v.shape) * 0.1
        else:
            v[...] = rng.standard_normal(v.shape) * 0.05
    m.params()["wte"][CFG8["vocab_size"]:] = 0.0
    m.params_changed()
    if fp8:
        m.set_fp8(True, head=head)
    return m


def batches(n):
    rng = np.random.default_rng(42)
    return [(rng.integers(0, CFG8["vocab_size"], (B8, T8)).astype(np.int32),
             rng.integers(0, CFG8["vocab_size"], (B8, T8)).astype(np.int32)) for _ in range(n)]


def train(m, steps=3, micro=2):
    """(losses per step, the gradients of the first step)"""
    data = batches(steps * micro)
    losses, first_grads = [], None
    for step in range(1, steps + 1):
        m.zero_grad()
        for k in range(micro):
            idx, tgt = data[(step - 1) * micro + k]
            m.forward_backward(idx, tgt, 1.0 / micro)
        losses.append(m.take_loss())
        if first_grads is None:
            first_grads = {k: v.astype(np.float64).copy() for k, v in m.grads().items()}
        m.optimizer_step(lr=3e-3, step=step, grad_clip=1.0)
    return np.array(losses), first_grads


MODELS = [("ModelBF16", "cuda"), ("Model", "cpu")]


@pytest.mark.parametrize("cls,device", MODELS)
@pytest.mark.parametrize("head", [False, True])
def test_fp8_steps_within_tolerance_of_the_models_precision(emu, cls, device, head):  # noqa: F811
    base_losses, base_grads = train(make(emu, cls, device))
    m = make(emu, cls, device, fp8=True, head=head)
    assert m.fp8 and m.fp8_head == head
    losses, grads = train(m)
    assert np.all(np.isfinite(losses))
    rel = np.abs(losses - base_losses) / base_losses
    assert rel.max() <= 0.005, f"losses {losses} vs {base_losses}: {rel}"
    assert not np.array_equal(losses, base_losses)  # the FP8 path ran
    for name, g in grads.items():
        want = base_grads[name]
        if not np.any(want):
            continue
        err = np.linalg.norm(g - want) / np.linalg.norm(want)
        assert err <= 0.25, f"{name}: relative error {err:.3f}"


@pytest.mark.parametrize("cls,device", MODELS)
def test_fp8_weight_copy_once_per_optimizer_step(emu, cls, device):  # noqa: F811
    m = make(emu, cls, device, fp8=True, head=True)
    n_weights = 4 * CFG8["n_layer"] + 1
    m.profile = True
    train(m, steps=2, micro=3)
    calls = {name: n for name, _, n in m.op_profile}
    assert calls["forward.fp8_weights"] == 2 * n_weights  # once per step (before its first micro-step), not 3 times
    # the copy of the weights after the last update (the next forward's): [1 / s, amax] of each, as numpy says
    meta = m.fp8_weight_meta()
    p = m.params()
    ws = [p[k][l] for l in range(CFG8["n_layer"]) for k in ("qkvw", "attprojw", "fcw", "fcprojw")] + [p["wte"]]
    assert meta.shape == (n_weights, 2)
    for (inv, amax), w in zip(meta, ws):
        if cls == "ModelBF16":  # the ops' weights are the master's bf16 copy (stochastically rounded by AdamW)
            from bf16 import bf16_neighbours
            lo, hi = bf16_neighbours(np.abs(w).max())
            assert lo <= amax <= hi
        else:
            assert amax == np.float32(np.abs(w).max())
        assert inv == 1.0 / ref_scale(amax, "e4m3")


def test_fp8_refuses_shapes_it_cannot_take(emu):  # noqa: F811
    with pytest.raises(ValueError, match="n_embd must be a multiple of 16"):
        emu.Model(**{**CFG8, "n_embd": 24, "n_head": 3}, device="cpu").set_fp8(True)
    with pytest.raises(ValueError, match="padded_vocab_size must be a multiple of 16"):
        emu.Model(**{**CFG8, "padded_vocab_size": 100}, device="cpu").set_fp8(True, head=True)
    with pytest.raises(ValueError, match="needs precision fp8"):
        emu.Model(**CFG8, device="cpu").set_fp8(False, head=True)
    m = make(emu, "ModelBF16", "cuda", fp8=True)
    idx = np.zeros((1, 7), np.int32)
    with pytest.raises(ValueError, match="B \\* T must be a multiple of 16"):
        m.forward_backward(idx, idx, 1.0)
    with pytest.raises(ValueError, match="FP8 matmuls run in bf16 models"):
        m32 = make(emu, "Model", "cuda", fp8=True)
        m32.forward_backward(*batches(1)[0], 1.0)
    m.set_fp8(False)
    assert not m.fp8 and m.fp8_weight_meta().shape == (0, 2)


@pytest.mark.parametrize("head", [False, True])
def test_fp8_bytes_are_what_the_backend_allocates(emu, head):  # noqa: F811
    """memory_bytes' 'fp8' (GPT2Model::fp8_bytes: the weights' copy, metas and scratch) equals what the CPU backend
    counts as allocated by set_fp8 and the first FP8 step; no 'fp8' key without FP8."""
    m = make(emu, "Model", "cpu")
    train(m, steps=1)
    before = m.backend_bytes_in_use
    assert "fp8" not in m.memory_bytes(B8, T8)
    m.set_fp8(True, head=head)
    train(m, steps=1)
    want = m.memory_bytes(B8, T8)["fp8"]
    assert m.backend_bytes_in_use - before == want
    C, L, Vp, N = CFG8["n_embd"], CFG8["n_layer"], CFG8["padded_vocab_size"], B8 * T8
    n_w = 4 * L + head
    assert want == 2 * (12 * C * C * L + head * Vp * C) + 8 * (n_w + 2) + 2 * N * 4 * C + 2 * N * max(4 * C, head * Vp)
