"""The CPU backend's fused loss (crossentropy_forward_backward and crossentropy_softcap_forward_backward: cap, max,
sum of exponentials and gradient one row at a time, ops::crossentropy_forward_backward_rows) against the separate ops
the model's forward() + backward() run (softcap_forward over the whole logits, crossentropy_forward, then
crossentropy_backward / crossentropy_softcap_backward): the same per-value arithmetic in the same order, so the same
bits, with an ignored target, a padded vocabulary and the last row; and the loss against float64 numpy."""
import numpy as np
import pytest

from gpt2core import GPT2, GPT2Config

CFG = GPT2Config(block_size=16, vocab_size=61, padded_vocab_size=64, n_layer=1, n_head=2, n_embd=32)


@pytest.mark.parametrize("cap", [None, 3.0])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_fused_loss_has_the_bits_of_the_separate_ops(cap, dtype):
    cfg = CFG.replace(logit_softcap=cap, tie_embeddings=cap is None)
    rng = np.random.default_rng(5)
    x = rng.integers(0, 61, (3, 9), dtype=np.int32)
    y = rng.integers(0, 61, (3, 9), dtype=np.int32)
    y[0, 2] = -1
    y[2, 8] = -1  # the last row ignored too
    a, b = GPT2(cfg, seed=1, dtype=dtype), GPT2(cfg, seed=1, dtype=dtype)
    # the head's padded rows (61..63) nonzero: their logits are then nonzero too, and only the loss's zeroing of the
    # padded columns keeps them out of the gradients (a fused pass that skipped it would show here)
    pad = rng.standard_normal((3, cfg.n_embd))
    for m in (a, b):
        m._m.params()["lm_head" if cap else "wte"][61:] = pad
    g = a.flat_grads()
    g[:] = np.nan  # poison: backward must write or add into zeroed gradients only
    a.zero_grad()
    b.zero_grad()
    loss, logits = a.forward(x, y, return_logits=True)
    logits = logits.astype(np.float64)[..., :61]  # capped when cap is set (what the loss is of)
    a.backward(0.5)
    b._m.forward_backward(x, y, 0.5)
    assert np.array_equal(a.flat_grads(), b.flat_grads())
    assert b._m.take_loss() == pytest.approx(0.5 * loss, rel=1e-12 if dtype == "float64" else 1e-6)
    # the loss against float64 numpy of the (capped) logits
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    valid = y >= 0
    want = np.mean((lse - np.take_along_axis(logits, np.maximum(y, 0)[..., None], -1)[..., 0])[valid])
    assert loss == pytest.approx(want, rel=1e-10 if dtype == "float64" else 1e-5)
