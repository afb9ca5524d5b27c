"""Bad inputs at the _C boundary and in the GPT2 wrapper: a Python exception whose message names the
argument, never a crash, and the model unchanged afterwards."""
import math

import numpy as np
import pytest

from gpt2core import GPT2, GPT2Config, _C
from gpt2core.config import get_preset
from gpt2core.model import DeviceError

from conftest import make_problem

PB = make_problem("padded")  # V=97, Vp=128, block size 11, B=3, T=7
I32 = np.int32


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """~200 tiny forwards that test validation, not threading: one thread keeps them fast on a loaded
    machine (OpenMP barriers stall when other processes hold the cores). Restored afterwards."""
    n = _C.get_num_threads()
    _C.set_num_threads(1)
    yield
    _C.set_num_threads(n)


def _bad_idx():
    V, Vp, maxT = PB.V, PB.Vp, PB.maxT
    ok = PB.idx
    big_t = np.zeros((2, maxT + 1), I32)
    return {
        "list": ok.tolist(),
        "none": None,
        "int64": ok.astype(np.int64),
        "float32": ok.astype(np.float32),
        "uint16": ok.astype(np.uint16),
        "big-endian": ok.astype(">i4"),
        "1-D": ok[0].copy(),
        "3-D": ok[None].copy(),
        "strided": np.zeros((3, 14), I32)[:, ::2],
        "fortran": np.asfortranarray(ok),
        "empty": np.zeros((2, 0), I32),
        "id == vocab_size": np.where(ok == ok[1, 2], V, ok).astype(I32),
        "padded id": np.full((1, 3), Vp - 1, I32),
        "huge id": np.full((1, 3), 2**31 - 1, I32),
        "-1": np.where(ok == ok[0, 0], -1, ok).astype(I32),
        "-100": np.where(ok == ok[0, 0], -100, ok).astype(I32),
        "negative": np.full((2, 2), -7, I32),
        "T > block size": big_t,
    }


def _bad_targets():
    ok = PB.targets
    return {
        "list": ok.tolist(),
        "int64": ok.astype(np.int64),
        "float64": ok.astype(np.float64),
        "1-D": ok.reshape(-1).copy(),
        "3-D": ok[None].copy(),
        "transposed": ok.T.copy(),
        "short": ok[:, :-1].copy(),
        "fewer rows": ok[:2].copy(),
        "strided": np.zeros((3, 14), I32)[:, ::2],
        "-2": np.where(ok == ok[2, 3], -2, ok).astype(I32),
        "id == vocab_size": np.full_like(ok, PB.V),
        "padded id": np.full_like(ok, PB.Vp - 1),
        "int min": np.full_like(ok, np.iinfo(np.int32).min),
    }


@pytest.fixture(scope="module", params=[_C.Model, _C.ModelF64], ids=["f32", "f64"])
def core(request):
    m = PB.model(request.param)
    loss = m.forward(PB.idx, PB.targets)
    return m, loss


@pytest.mark.parametrize("case", list(_bad_idx()))
def test_core_rejects_bad_idx(core, case):
    m, loss = core
    with pytest.raises(ValueError, match=r"\bidx\b"):
        m.forward(_bad_idx()[case], None)
    with pytest.raises(ValueError, match=r"\bidx\b"):
        m.forward(_bad_idx()[case], PB.targets)
    assert m.forward(PB.idx, PB.targets) == loss  # nothing changed


@pytest.mark.parametrize("case", list(_bad_targets()))
def test_core_rejects_bad_targets(core, case):
    m, loss = core
    with pytest.raises(ValueError, match=r"\btargets\b"):
        m.forward(PB.idx, _bad_targets()[case])
    assert m.forward(PB.idx, PB.targets) == loss


def test_messages_say_what_is_wrong(core):
    m, _ = core
    with pytest.raises(ValueError, match=r"idx must be int32.*int64"):
        m.forward(PB.idx.astype(np.int64))
    with pytest.raises(ValueError, match=r"idx contains id 97 .*0\.\.96"):
        m.forward(np.full((1, 2), 97, I32))
    with pytest.raises(ValueError, match=r"targets contains id -2 .*0\.\.96.*-1 or -100"):
        m.forward(PB.idx, np.full_like(PB.idx, -2))
    with pytest.raises(ValueError, match=r"T=12.*max_seq_len=11"):
        m.forward(np.zeros((1, 12), I32))
    with pytest.raises(ValueError, match=r"targets must have the same shape as idx \(3, 7\), got \(3, 6\)"):
        m.forward(PB.idx, PB.targets[:, :6].copy())
    with pytest.raises(ValueError, match="C-contiguous"):
        m.forward(np.asfortranarray(PB.idx))


def test_edge_values_are_accepted(core):
    m, _ = core
    # the last real id, T == block size, a read-only array, targets all -1 but one
    idx = np.full((1, PB.maxT), PB.V - 1, I32)
    idx.flags.writeable = False
    tgt = np.full((1, PB.maxT), -1, I32)
    tgt[0, 4] = PB.V - 1
    assert math.isfinite(m.forward(idx, tgt))


@pytest.mark.parametrize("cls", [_C.Model, _C.ModelF64], ids=["f32", "f64"])
def test_minus_100_is_ignored_like_minus_1(cls):
    """Hugging Face labels mark ignored positions with -100: the same loss, per-token losses and
    gradients as -1 (which make_problem puts at two positions), and the caller's array is left as it was."""
    pb = make_problem("padded", seed=1)
    hf = np.where(pb.targets == -1, -100, pb.targets).astype(I32)
    hf_before = hf.copy()
    a, b, c = pb.model(cls), pb.model(cls), pb.model(cls)
    loss = a.forward(pb.idx, pb.targets)
    assert b.forward(pb.idx, hf) == loss and math.isfinite(loss)
    np.testing.assert_array_equal(b.token_losses(), a.token_losses())
    a.backward(1.0)
    b.backward(1.0)
    c.forward_backward(pb.idx, hf, 1.0)
    np.testing.assert_array_equal(b.flat_grads(), a.flat_grads())
    np.testing.assert_array_equal(c.flat_grads(), a.flat_grads())
    np.testing.assert_array_equal(hf, hf_before)


def test_a_rejected_call_between_forward_and_backward_keeps_the_step(padded):
    """Validation happens before any state changes: backward still uses the last good forward."""
    pb = padded
    a, b = pb.model(), pb.model()
    for m in (a, b):
        m.forward(pb.idx, pb.targets)
    with pytest.raises(ValueError):
        b.forward(pb.idx, pb.targets[:, :3].copy())
    with pytest.raises(ValueError):
        b.forward(np.full((2, 2), 1000, I32), None)
    a.backward(1.0)
    b.backward(1.0)
    np.testing.assert_array_equal(a.flat_grads(), b.flat_grads())


def test_core_state_errors():
    m = PB.model()
    with pytest.raises(RuntimeError, match="logits"):
        m.logits()
    with pytest.raises(RuntimeError, match="token_losses"):
        m.token_losses()
    with pytest.raises(ValueError, match="step"):
        m.adamw_update(lr=1e-3, step=0)
    for bad in (-1e-3, math.nan):
        with pytest.raises(ValueError, match="lr"):
            m.adamw_update(lr=bad, step=1)
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="grad_scale"):
            m.adamw_update(lr=1e-3, step=1, grad_scale=bad)
    np.testing.assert_array_equal(m.params()["wte"], PB.params["wte"])  # none of them touched weights


# ----------------------------------------------------------------------------- config

GOOD = dict(max_seq_len=8, vocab_size=10, padded_vocab_size=16, n_layer=1, n_head=2, n_embd=8)


@pytest.mark.parametrize("field,value,words", [
    ("max_seq_len", 0, "max_seq_len"),
    ("max_seq_len", -3, "max_seq_len"),
    ("vocab_size", 0, "vocab_size"),
    ("padded_vocab_size", 9, "padded_vocab_size"),
    ("n_layer", 0, "n_layer"),
    ("n_head", 0, "n_head"),
    ("n_embd", -8, "n_embd"),
    ("n_head", 3, "divisible"),
])
@pytest.mark.parametrize("cls", [_C.Model, _C.ModelF64])
def test_core_rejects_bad_config(cls, field, value, words):
    with pytest.raises(ValueError, match=words):
        cls(**{**GOOD, field: value})


def test_core_rejects_unknown_device():
    with pytest.raises(ValueError, match="device"):
        _C.Model(**GOOD, device="tpu")
    if "cuda" not in _C.build_info()["backends"]:
        with pytest.raises(ValueError, match="cuda"):
            _C.Model(**GOOD, device="cuda")


@pytest.mark.parametrize("field,value", [
    ("block_size", 0), ("vocab_size", -1), ("padded_vocab_size", 0), ("n_layer", 0), ("n_head", -2),
    ("n_embd", 0), ("n_layer", 2.0), ("n_embd", "64"), ("block_size", None),
])
def test_config_rejects_bad_values(field, value):
    with pytest.raises(ValueError, match=field):
        GPT2Config(**{field: value})


def test_config_rejects_inconsistent_values():
    with pytest.raises(ValueError, match="padded_vocab_size"):
        GPT2Config(vocab_size=100, padded_vocab_size=99)
    with pytest.raises(ValueError, match="divisible"):
        GPT2Config(n_embd=48, n_head=5)
    with pytest.raises(ValueError, match="nope"):
        get_preset("nope")


def test_wrapper_rejects_bad_construction():
    cfg = GPT2Config(block_size=8, vocab_size=10, padded_vocab_size=16, n_layer=1, n_head=2, n_embd=8)
    with pytest.raises(ValueError, match="dtype"):
        GPT2(cfg, dtype="float16")
    with pytest.raises(ValueError, match="device"):
        GPT2(cfg, device="tpu")
    if "cuda" not in _C.build_info()["backends"]:
        with pytest.raises(DeviceError, match="cuda"):
            GPT2(cfg, device="cuda")
    with pytest.raises(ValueError, match="unknown preset"):
        GPT2("d13")


# ----------------------------------------------------------------------------- GPT2 wrapper

@pytest.fixture(scope="module")
def wrapped():
    cfg = GPT2Config(block_size=PB.maxT, vocab_size=PB.V, padded_vocab_size=PB.Vp, n_layer=PB.L,
                     n_head=PB.NH, n_embd=PB.C)
    model = GPT2(cfg, seed=3)
    return model, model.forward(PB.idx, PB.targets)


@pytest.mark.parametrize("case,exc", [
    ("float32", TypeError), ("3-D", ValueError), ("empty", ValueError), ("id == vocab_size", ValueError),
    ("padded id", ValueError), ("-1", ValueError), ("negative", ValueError), ("T > block size", ValueError),
    ("huge id", ValueError),
])
def test_wrapper_rejects_bad_idx(wrapped, case, exc):
    model, loss = wrapped
    with pytest.raises(exc, match=r"\bidx\b"):
        model.forward(_bad_idx()[case], PB.targets if case in ("float32", "id == vocab_size") else None)
    assert model.forward(PB.idx, PB.targets) == loss


def test_wrapper_accepts_hf_ignore_index(wrapped):
    model, loss = wrapped
    assert model.forward(PB.idx, np.where(PB.targets == -1, -100, PB.targets)) == loss


def test_wrapper_rejects_out_of_int32_ids(wrapped):
    model, _ = wrapped
    with pytest.raises(ValueError, match=r"\bidx\b"):
        model.forward(np.array([[1, 2**31 + 5]], dtype=np.int64))  # would wrap to a valid-looking id
    with pytest.raises(ValueError, match=r"\btargets\b"):
        model.forward(PB.idx, np.full(PB.idx.shape, 2**32 + 3, dtype=np.int64))


@pytest.mark.parametrize("case,exc", [
    ("float64", TypeError), ("3-D", ValueError), ("transposed", ValueError), ("short", ValueError),
    ("-2", ValueError), ("id == vocab_size", ValueError), ("padded id", ValueError),
])
def test_wrapper_rejects_bad_targets(wrapped, case, exc):
    model, loss = wrapped
    with pytest.raises(exc, match=r"\btargets\b"):
        model.forward(PB.idx, _bad_targets()[case])
    assert model.forward(PB.idx, PB.targets) == loss


def test_wrapper_generate_rejects_bad_arguments(wrapped):
    model, _ = wrapped
    with pytest.raises(ValueError, match="temperature"):
        model.generate(PB.idx[:1, :3], 2, temperature=0.0)
    with pytest.raises(TypeError, match=r"\bidx\b"):
        model.generate(np.ones((1, 3)), 2)
    with pytest.raises(ValueError, match=r"top_k must be an integer >= 0.*-1"):
        model.generate(PB.idx[:1, :3], 2, top_k=-1)


def test_generate_cli_rejects_negative_top_k(capsys):
    from gpt2core import generate
    with pytest.raises(SystemExit) as e:
        generate.main(["--model", "unused.bin", "--top-k", "-1"])
    assert e.value.code == 2      # argparse's usage error, before any model is read
    assert "argument --top-k: must be an integer >= 0, got '-1'" in capsys.readouterr().err


def test_constructor_errors_name_the_argument():
    with pytest.raises(TypeError, match=r"config must be a GPT2Config or a preset name.*dict"):
        GPT2({"n_layer": 2})
    with pytest.raises(TypeError, match=r"device must be a string .*None"):
        GPT2("tiny", device=None)


def test_rejected_step_does_not_advance_step_count():
    cfg = GPT2Config(block_size=8, vocab_size=10, padded_vocab_size=16, n_layer=1, n_head=2, n_embd=8)
    model = GPT2(cfg)
    model.forward(np.ones((1, 4), I32), np.ones((1, 4), I32))
    model.backward()
    with pytest.raises(ValueError, match="lr"):
        model.step(lr=-1.0)
    assert model.step_count == 0


@pytest.mark.parametrize("make", ["pickled", "metadata"])
def test_core_accepts_any_native_int32_dtype(make):
    import pickle
    if make == "pickled":  # e.g. batches sent through a multiprocessing queue
        idx = pickle.loads(pickle.dumps(PB.idx))
    else:
        idx = PB.idx.astype(np.dtype("i4", metadata={"source": "shard"}))
    assert idx.dtype == np.int32 and idx.flags.c_contiguous
    m = PB.model()
    assert m.forward(idx, PB.targets) == m.forward(PB.idx, PB.targets)
