"""The memory plan and --recompute on the emulated CUDA device (issue 37).

- the plan against the emulator's allocation accounting (cudaMemGetInfo: every cudaMalloc the backend made, its
  scratch buffers included) after a training step, for every recompute level in fp32, bf16 and fp16 at the tiny
  shape of these tests, the s4 preset's layers and a d12-sized layer (C=768, 12 heads, T=256): within 2%. The plan
  is asked with library_workspace=0: the emulator's matmul seam allocates no cuBLASLt workspace;
- --recompute gelu / layer bit for bit the same as none: losses, gradients and weights over three optimizer steps
  of two micro-steps each with clipping active, fp32, bf16 and fp16 (with dynamic loss scaling), every
  architecture field on;
- a configuration the plan says does not fit under GPT2CORE_EMU_TOTAL_MEM is refused before anything is allocated,
  naming the change that fits, and that change trains.
"""
import os
import subprocess
import sys

import numpy as np
import pytest

from gpt2core import GPT2Config, memplan
from gpt2core.data import shakespeare

from test_cuda_emu import BUILD, CFG, emu, init_params  # noqa: F401  (emu: fixture)
from test_cuda_emu_batchfit import _ENTRY
from test_cuda_emu_modern_model import MODERN

CLASSES = {"fp32": "Model", "bf16": "ModelBF16", "fp16": "ModelF16"}


def config_of(cfg, arch=None):
    arch = arch or {}
    return GPT2Config(block_size=cfg["max_seq_len"], vocab_size=cfg["vocab_size"],
                      padded_vocab_size=cfg["padded_vocab_size"], n_layer=cfg["n_layer"], n_head=cfg["n_head"],
                      n_embd=cfg["n_embd"], **{k: v for k, v in arch.items() if k != "logit_softcap"},
                      logit_softcap=arch.get("logit_softcap"))


def batch(seed, B, T, V):
    rng = np.random.default_rng(seed)
    return rng.integers(0, V, (B, T)).astype(np.int32), rng.integers(0, V, (B, T)).astype(np.int32)


SHAPES = {"tiny": (CFG, 3, 37), "s4": (dict(max_seq_len=64, vocab_size=97, padded_vocab_size=128, n_layer=4,
                                             n_head=4, n_embd=256), 2, 64),
          "d12-layer": (dict(max_seq_len=256, vocab_size=97, padded_vocab_size=128, n_layer=1, n_head=12,
                             n_embd=768), 1, 256)}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_plan_matches_the_emulated_allocations(emu, shape):  # noqa: F811
    cfg, B, T = SHAPES[shape]
    for precision, cls in CLASSES.items():
        for level in memplan.RECOMPUTE:
            free0, _ = emu.cuda_mem_info(0)
            m = getattr(emu, cls)(**cfg, device="cuda", attention="flash")
            init_params(m) if shape == "tiny" else None
            m.recompute = level
            x, y = batch(1, B, T, cfg["vocab_size"])
            m.forward_backward(x, y, 1.0)
            m.optimizer_step(lr=1e-3, step=1)
            used = free0 - emu.cuda_mem_info(0)[0]
            o = memplan.Options(device="cuda", precision=precision, recompute=level, attention="flash",
                                library_workspace=0)
            planned = memplan.total(memplan.memory(config_of(cfg), B, T, o))
            assert abs(planned - used) <= 0.02 * used, (shape, precision, level, planned, used)
            del m


def run_steps(m, level, scaled):
    m.recompute = level
    if scaled:
        m.set_loss_scaling(True, scale=1024.0)
    out = []
    for step in range(1, 4):
        m.zero_grad()
        for micro in range(2):
            x, y = batch(10 * step + micro, 2, 24, CFG["vocab_size"])
            y[0, 3] = -1
            m.forward_backward(x, y, 0.5)
        out.append(m.take_loss())
        out.append(m.flat_grads().copy())
        norm = m.optimizer_step(lr=1e-2, step=step, grad_clip=0.05)
        assert norm > 0.05  # clipping is active
        out.append(m.flat_params().copy())
    return out


@pytest.mark.parametrize("precision", list(CLASSES))
def test_recompute_is_bit_identical_on_the_emulated_device(emu, precision):  # noqa: F811
    cfg = dict(CFG, n_layer=2, n_embd=64, n_head=2)
    runs = {}
    for level in memplan.RECOMPUTE:
        m = getattr(emu, CLASSES[precision])(**cfg, device="cuda", **MODERN)
        init_params(m)
        m.params_changed()
        runs[level] = run_steps(m, level, precision == "fp16")
    for level in ("gelu", "layer"):
        for a, b in zip(runs["none"], runs[level]):
            assert np.array_equal(np.asarray(a), np.asarray(b)), (precision, level)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("shakespeare")
    shakespeare.prepare(d)
    return d


def test_a_run_the_plan_refuses_is_refused_first_and_its_proposal_trains(emu, tmp_path, data):  # noqa: F811
    """s4 at T=256, fp32: the device's memory is set between what the plan says -B 1 needs with layer recompute
    and without it. The run is refused before anything is allocated, naming --recompute (gelu or layer); the
    named change trains."""
    o = memplan.Options(device="cuda", precision="fp32", library_workspace=0)
    need = {r: memplan.total(memplan.memory("s4", 1, 256, memplan.Options(**{**o.__dict__, "recompute": r})))
            for r in memplan.RECOMPUTE}
    assert need["layer"] < need["gelu"] < need["none"]
    total = int((need["layer"] + need["gelu"]) / 2 / (1 - memplan.SAFETY))
    args = [sys.executable, "-c", _ENTRY, str(BUILD), "--device", "cuda", "--data-dir", str(data), "--preset", "s4",
            "--precision", "fp32", "-T", "256", "-B", "1", "--steps", "1", "--val-every", "0", "--sample-tokens",
            "0", "--threads", "1", "--attention", "flash"]
    env = dict(os.environ, GPT2CORE_EMU_TOTAL_MEM=str(total))
    r = subprocess.run(args + ["--output-dir", str(tmp_path / "a")], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    line = r.stderr.strip().splitlines()
    assert len(line) == 1 and "smallest change that fits: --recompute layer" in line[0], r.stderr
    assert "step " not in r.stdout
    r = subprocess.run(args + ["--output-dir", str(tmp_path / "b"), "--recompute", "layer"], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
