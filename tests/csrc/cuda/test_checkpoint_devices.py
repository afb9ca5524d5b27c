"""Checkpoints do not depend on the device: one written by the CPU backend continues training on the
(emulated) CUDA backend exactly as on the CPU, and one written by the CUDA backend continues on the CPU.

The CUDA side is the real csrc/cuda backend compiled against csrc/emu (module gpt2core_cuda_emu, built
by tests/csrc/cuda/test_cuda_emu.py's fixture); the checkpoint code is the package's own, unchanged."""
import numpy as np
import pytest

from gpt2core import GPT2, GPT2Config
from gpt2core.checkpoint import load_checkpoint, save_checkpoint

from test_cuda_emu import emu  # noqa: F401  (session fixture: builds and imports gpt2core_cuda_emu)

CFG = GPT2Config(block_size=16, vocab_size=97, padded_vocab_size=128, n_layer=2, n_head=3, n_embd=48)
B, T = 3, 11
# fp32 on both backends; only the summation order differs (test_cuda_emu: ops agree to ~1e-6 relative),
# and after a few AdamW steps that difference stays far below this
RTOL = 2e-5


def emulated_cuda_gpt2(emu_module, config, precision="fp32"):
    """A GPT2 whose core model is the emulated CUDA backend (same Python wrapper as device='cuda')."""
    core = {"fp32": emu_module.Model, "bf16": emu_module.ModelBF16, "fp16": emu_module.ModelF16}[precision](
        max_seq_len=config.block_size, vocab_size=config.vocab_size, padded_vocab_size=config.padded_vocab_size,
        n_layer=config.n_layer, n_head=config.n_head, n_embd=config.n_embd, device="cuda")
    return GPT2.__new__(GPT2)._adopt(core, config, "cuda", precision)


def emulated_copy(emu_module, ref, precision):
    """An emulated CUDA GPT2 of `precision` holding ref's weights."""
    m = emulated_cuda_gpt2(emu_module, ref.config, precision)
    for k, p in m.params.items():
        p[...] = ref.params[k]
    m.params_changed()
    return m


def batches(n, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, CFG.vocab_size, (B, T), dtype=np.int32),
             rng.integers(0, CFG.vocab_size, (B, T), dtype=np.int32)) for _ in range(n)]


def train(model, data):
    losses = []
    for x, y in data:
        model.zero_grad()
        losses.append(model.forward(x, y))
        model.backward()
        model.step(lr=3e-3)
    return np.array(losses)


def flat(model):
    return np.concatenate([np.asarray(p).ravel() for p in model.params.values()])


@pytest.mark.parametrize("first", ["cpu", "cuda"])
def test_checkpoint_moves_between_backends(emu, tmp_path, first):  # noqa: F811
    data = batches(6)
    make = {"cpu": lambda: GPT2(CFG, seed=3),
            "cuda": lambda: emulated_cuda_gpt2(emu, CFG)}
    second = "cuda" if first == "cpu" else "cpu"

    a = make[first]()
    if first == "cuda":
        ref = GPT2(CFG, seed=3)
        for k, p in a.params.items():
            p[...] = ref.params[k]
    train(a, data[:3])
    ck = save_checkpoint(tmp_path / "ck", 3, a)

    # continue on the same backend, and on the other one from the checkpoint
    cont_same = train(a, data[3:])
    b = make[second]()
    load_checkpoint(ck).restore(b)
    assert b.step_count == 3
    cont_other = train(b, data[3:])

    np.testing.assert_allclose(cont_other, cont_same, rtol=RTOL)
    # atol: parameters near zero whose gradient is zero up to rounding take Adam steps of either sign
    # (update ~ lr * g / |g|); seen 5e-6 here. A lost or misplaced moment would move weights by ~lr = 3e-3.
    np.testing.assert_allclose(flat(b), flat(a), rtol=RTOL, atol=1e-5)
    assert np.all(b.params["wte"][CFG.vocab_size:] == 0)  # padded rows stay zero on both backends


# loss tolerance of the 16-bit run's checkpoint continued in fp32 on the CPU: the two runs' activations differ by
# one rounding per op, ~1e-3 relative on the loss here in bf16 (2^-8); fp16's 2^-11 is 8x finer
CPU_RTOL = {"bf16": 2e-3, "fp16": 2.5e-4}


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_16bit_checkpoint_resumes_bit_exactly(emu, tmp_path, precision):  # noqa: F811
    """bf16 / fp16 mixed precision: the checkpoint holds the fp32 master weights and moments; restoring them and
    the step rebuilds the 16-bit weight copy with the same rounding (bf16: stochastic, seeded by the step; fp16:
    to nearest even), so 3 steps + save + load into a fresh model + 3 steps gives exactly the losses and weights
    of 6 uninterrupted steps."""
    data = batches(6, seed=1)
    ref = GPT2(CFG, seed=4)

    def fresh():
        return emulated_copy(emu, ref, precision)

    a = fresh()
    full = train(a, data)
    b = fresh()
    part = train(b, data[:3])
    ck = save_checkpoint(tmp_path / "ck", 3, b)
    c = emulated_cuda_gpt2(emu, CFG, precision)
    load_checkpoint(ck).restore(c)
    assert c.step_count == 3 and c._m.param_round_seed == 3
    part = np.concatenate([part, train(c, data[3:])])
    assert np.array_equal(part, full)
    assert np.array_equal(flat(c), flat(a))
    # and the 16-bit run's checkpoint continues in fp32 on the CPU
    d = GPT2(CFG, seed=0)
    load_checkpoint(ck).restore(d)
    np.testing.assert_allclose(train(d, data[3:]), full[3:], rtol=CPU_RTOL[precision])


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_loss_scaled_checkpoint_resumes_bit_exactly_with_its_scaler(emu, tmp_path, precision):  # noqa: F811
    """Dynamic loss scaling (interval 2) on the emulated CUDA backend in bf16 and fp16, overflows forced (an inf in one
    gradient before backward) at steps 2 and 5: 3 steps + save + load into a fresh loss-scaled model + 3 steps gives
    exactly the losses, weights and scaler (scale, clean, skipped) of 6 uninterrupted steps; the skipped step left
    step_count and the rounding seed at the last applied update. The checkpoint continues in fp32 on the CPU without
    loss scaling: the saved scaler is ignored there (the 16-bit tolerances above)."""
    data = batches(6, seed=2)
    overflow = [False, True, False, False, True, False]
    ref = GPT2(CFG, seed=5)

    def fresh():
        m = emulated_copy(emu, ref, precision)
        m._m.set_loss_scaling(True, scale=2.0**16, interval=2)
        return m

    def train_scaled(model, steps):
        losses = []
        for (x, y), inf in steps:
            model.zero_grad()
            if inf:
                model.flat_grads()[3] = np.inf
            losses.append(model.forward(x, y))
            model.backward()
            assert np.isfinite(model.step(lr=3e-3)) != inf
        return np.array(losses)

    a = fresh()
    full = train_scaled(a, zip(data, overflow))
    assert a.loss_scaler_state() == {"scale": 2.0**15, "clean": 1, "skipped": 2} and a.step_count == 4
    b = fresh()
    part = train_scaled(b, zip(data[:3], overflow[:3]))
    ck = save_checkpoint(tmp_path / "ck", 3, b)
    c = fresh()
    load_checkpoint(ck).restore(c)
    assert c.loss_scaler_state() == {"scale": 2.0**15, "clean": 1, "skipped": 1}
    assert c.step_count == 2 and c._m.param_round_seed == 2
    part = np.concatenate([part, train_scaled(c, zip(data[3:], overflow[3:]))])
    assert np.array_equal(part, full)
    assert np.array_equal(flat(c), flat(a)) and c.loss_scaler_state() == a.loss_scaler_state()
    d = GPT2(CFG, seed=0)
    load_checkpoint(ck).restore(d)
    assert not d.loss_scaling and d.step_count == 2
    np.testing.assert_allclose(train(d, [data[3], data[5]]), full[[3, 5]], rtol=CPU_RTOL[precision])
