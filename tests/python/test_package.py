"""Package-level behaviour: build_info, device selection, presets."""
import subprocess
import sys

import numpy as np
import pytest

import gpt2core
from gpt2core import GPT2, PRESETS
from gpt2core.model import DeviceError


def test_build_info_reports_what_was_compiled():
    info = gpt2core.build_info()
    for key in ("version", "backends", "blas", "cuda", "cuda_archs", "cudnn", "cudnn_sdpa", "nccl"):
        assert key in info
    assert not info["cudnn_sdpa"] or (info["cuda"] and info["cudnn"])  # the attention seam over cuDNN's SDPA
    assert "cpu" in info["backends"]
    assert "openblas" in info["blas"].lower() or "blas" in info["blas"].lower()
    assert info["version"] == gpt2core.__version__
    assert all(a.isdigit() for a in info["cuda_archs"])
    # archs are those the CUDA code was compiled for: none in a build without it
    assert bool(info["cuda_archs"]) == info["cuda"]


def test_extension_modules_export_only_their_module_init():
    """_C and _C_cuda (where built) are linked with hidden visibility and a version script: their dynamic symbol
    tables define PyInit_<name> and nothing else (before, 34 gpt2:: symbols were exported by both modules, so one
    module's could bind to the other's at load time). Read with nm."""
    import glob
    import os
    import shutil

    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm not found")
    here = os.path.dirname(gpt2core.__file__)
    mods = sorted(glob.glob(os.path.join(here, "_C.*.so")) + glob.glob(os.path.join(here, "_C_cuda.*.so")))
    assert mods, here
    for path in mods:
        name = os.path.basename(path).split(".")[0]
        out = subprocess.run([nm, "-D", "--defined-only", path], capture_output=True, text=True, check=True).stdout
        # exported: global symbols (upper-case types, or u: unique global); lower case are local to the module
        defined = {f[-1] for f in (line.split() for line in out.splitlines()) if len(f) >= 2 and
                   (f[-2].isupper() or f[-2] == "u")}
        assert defined == {f"PyInit_{name}"}, (path, sorted(defined)[:20])
    info = gpt2core.build_info()  # the run-time counts of a refused bias-gradient epilogue (0 until CUDA runs)
    assert info["bgradb_refused_shapes"] >= 0 and info["bgradb_fallbacks"] >= 0


def test_cuda_without_gpu_is_a_clear_python_error():
    if "cuda" in gpt2core.build_info()["backends"]:
        pytest.skip("CUDA backend compiled; covered by the CUDA tests")
    with pytest.raises(DeviceError, match="cuda"):
        GPT2("tiny", device="cuda")
    with pytest.raises(ValueError, match="device"):
        GPT2("tiny", device="tpu")


def test_d12_has_gpt2_small_parameter_count():
    assert PRESETS["d12"].num_parameters() == 124_475_904
    # ~0.80 GFLOP per token at T=1024 (6N + 6LCT, see GPT2Config.flops_per_token)
    assert abs(PRESETS["d12"].flops_per_token() / 1e9 - 0.80) < 0.01


def test_presets_build_and_agree_with_core_count():
    for name in ("tiny", "s2"):
        m = GPT2(name)
        assert m.num_parameters == PRESETS[name].num_parameters()
        assert m.params["wte"].shape == (PRESETS[name].padded_vocab_size, PRESETS[name].n_embd)


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown preset"):
        GPT2("d13")


def test_generate_is_seeded_and_in_vocab():
    m = GPT2("tiny", seed=3)
    a = m.generate(np.array([[1, 2, 3]]), 5, seed=7)
    b = m.generate(np.array([[1, 2, 3]]), 5, seed=7)
    np.testing.assert_array_equal(a, b)
    assert a.shape == (1, 8) and a.max() < 50257


def test_core_accepts_equivalent_float32_dtypes_in_optimizer_and_collectives():
    # arrays that went through pickle (multiprocessing queues) carry an equal but distinct dtype object
    import pickle

    from gpt2core import _C
    m = GPT2("tiny", seed=1)
    x = np.random.default_rng(0).integers(0, 50257, (2, 8)).astype(np.int32)
    m.forward(x, x)
    m.backward()
    n = 64
    mom = pickle.loads(pickle.dumps(np.zeros(n, np.float32)))
    var = pickle.loads(pickle.dumps(np.zeros(n, np.float32)))
    before = m._m.flat_params()[:n].copy()
    m._m.adamw_update_range(0, n, mom, var, lr=1e-2, step=1)
    assert not np.array_equal(before, m._m.flat_params()[:n])
    assert np.abs(mom).sum() > 0
    with pytest.raises((TypeError, ValueError), match="m must"):
        m._m.adamw_update_range(0, n, np.zeros(n, np.float64), var, lr=1e-2, step=1)


def test_negative_ids_are_named():
    m = GPT2("tiny")
    with pytest.raises(ValueError, match=r"idx contains id -5"):
        m.forward(np.array([[1, -5, 2]]))


def test_recompute_gelu_gives_identical_gradients_and_saves_memory():
    from gpt2core import GPT2Config
    cfg = GPT2Config(block_size=16, vocab_size=97, padded_vocab_size=128, n_layer=3, n_head=2, n_embd=32)
    rng = np.random.default_rng(0)
    x = rng.integers(0, 97, (3, 11), dtype=np.int32)
    y = rng.integers(0, 97, (3, 11), dtype=np.int32)
    runs = {}
    for recompute in (False, True):
        m = GPT2(cfg, seed=5)
        m.recompute_gelu = recompute
        mem = m.memory_report(3, 11)
        losses = []
        for _ in range(2):  # two steps: the second backward uses weights changed by the first
            m.zero_grad()
            losses.append(m.forward(x, y))
            m.backward()
            m.step(lr=1e-2)
        runs[recompute] = (losses, {k: g.copy() for k, g in m.grads.items()}, mem)
    assert runs[True][0] == runs[False][0]  # same ops in the same order: bit-identical
    for k in runs[False][1]:
        np.testing.assert_array_equal(runs[True][1][k], runs[False][1][k])
    saved = runs[False][2]["activations"] - runs[True][2]["activations"]
    assert saved == (cfg.n_layer - 1) * 3 * 11 * 4 * cfg.n_embd * 4  # (L-1)*B*T*4C float32 values
    assert runs[False][2]["params"] == 4 * m.num_parameters


def test_train_reports_memory_at_start(tmp_path, capsys):
    from gpt2core import train
    from gpt2core.data import shakespeare
    d = shakespeare.prepare(tmp_path / "data")[0].parent
    train.main(["--preset", "tiny", "--data-dir", str(d), "-B", "2", "-T", "16", "--steps", "1",
                "--val-every", "0", "--sample-tokens", "2", "--recompute-gelu", "--output-dir", str(tmp_path / "o")])
    out = capsys.readouterr().out
    assert "memory: params" in out and "activations" in out and "GELU recomputed" in out


def test_speed_ladder_switches_are_validated_on_cpu():
    with pytest.raises(ValueError, match="tf32"):
        GPT2("tiny", precision="tf32")
    with pytest.raises(ValueError, match="flash"):
        GPT2("tiny", attention="flash")
    with pytest.raises(ValueError, match="precision"):
        GPT2("tiny", precision="bf8")
    GPT2("tiny", attention="naive")  # the CPU backend's own (materialised) attention


def test_subpackages_are_attributes_of_the_package():
    """`import gpt2core` then gpt2core.tokenizer / .data, imported on first use (a fresh interpreter: here pytest
    has imported them already), and .checkpoint, an old path of gpt2core.formats.checkpoint (gpt2core.MOVED)."""
    code = ("import sys, gpt2core\n"
            "assert not {'gpt2core.tokenizer', 'gpt2core.data'} & set(sys.modules)\n"
            "assert {'tokenizer', 'checkpoint', 'data'} <= set(dir(gpt2core))\n"
            "assert gpt2core.tokenizer.decode(gpt2core.tokenizer.encode('Hello world')) == 'Hello world'\n"
            "assert gpt2core.checkpoint is sys.modules['gpt2core.formats.checkpoint']\n"  # an old path: the new module
            "assert callable(gpt2core.data.find_shards)\n"
            "try:\n    gpt2core.tokenizr\nexcept AttributeError as e:\n    assert 'tokenizr' in str(e)\n"
            "else:\n    raise SystemExit('no AttributeError')\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
