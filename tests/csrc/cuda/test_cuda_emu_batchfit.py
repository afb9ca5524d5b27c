"""On the emulated CUDA device (issue 29): `gpt2core-train --batch-size auto` picks the largest micro-batch that fits
the device's free memory and keeps the total batch; an explicit -B that does not fit is refused before the first step
with one line naming the B that would (exit 2).

The emulator's test knob GPT2CORE_EMU_TOTAL_MEM (an environment variable read by csrc/emu, never a user option) sets
the bytes of memory per device: cudaMemGetInfo reports it and cudaMalloc refuses beyond it. Each case runs in a subprocess whose gpt2core package uses the emulated module (the same
bindings.cpp as gpt2core._C, with csrc/cuda compiled against the emulator) as its core, so the training entry point
runs unchanged, through cli.entry (exit codes, one-line errors)."""
import json
import os
import subprocess
import sys

import pytest

from gpt2core.data import shakespeare

from test_cuda_emu import BUILD, emu  # noqa: F401  (fixture)

# gpt2core with the emulated core: the module stands in for gpt2core._C; the emulator needs no driver
_ENTRY = """
import sys
sys.path.insert(0, sys.argv[1])
import gpt2core_cuda_emu
sys.modules["gpt2core._C"] = gpt2core_cuda_emu
import gpt2core._libs
gpt2core._libs.driver_problem = lambda: ""
import gpt2core._cuda
gpt2core._cuda.load = lambda: []  # the emulated plugin stays: never the real _C_cuda
from gpt2core import train
sys.exit(train.console(sys.argv[2:]))
"""
M = 2**20
TINY = ["--preset", "tiny", "--precision", "fp32", "-T", "32", "--steps", "1", "--val-every", "0", "--sample-tokens",
        "0", "--threads", "1"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("shakespeare")
    shakespeare.prepare(d)
    return d


def train(tmp_path, data, total_mem, *args):
    env = dict(os.environ, GPT2CORE_EMU_TOTAL_MEM=str(total_mem))
    r = subprocess.run([sys.executable, "-c", _ENTRY, str(BUILD), "--device", "cuda", "--data-dir", str(data),
                        "--output-dir", str(tmp_path / "run"), *TINY, *args], env=env, capture_output=True,
                       text=True, timeout=900)
    return r


def batch_line(out):
    return next(line for line in out.splitlines() if line.startswith("batch: "))


_FOOTPRINTS = {}  # B -> bytes, measured once per session


def footprint(tmp_path, data, B):
    """Device bytes one run at micro-batch B holds, measured through the same entry point (plenty of memory): the
    emulator's allocations after the run's probe and first step."""
    if B not in _FOOTPRINTS:
        _FOOTPRINTS[B] = _footprint(tmp_path, data, B)
    return _FOOTPRINTS[B]


def _footprint(tmp_path, data, B):
    probe = """
import sys, json
sys.path.insert(0, sys.argv[1])
import gpt2core_cuda_emu as E
sys.modules["gpt2core._C"] = E
import gpt2core._libs
gpt2core._libs.driver_problem = lambda: ""
import gpt2core._cuda
gpt2core._cuda.load = lambda: []  # the emulated plugin stays: never the real _C_cuda
from gpt2core import batchfit, train
from gpt2core.config import TrainConfig
t = train.Trainer(train.parse_args(sys.argv[2:]))
free, total = E.cuda_mem_info(0)
t.run()
free2, _ = E.cuda_mem_info(0)
print(json.dumps({"used": total - min(free, free2), "B": t.cfg.batch_size}))
"""
    r = subprocess.run([sys.executable, "-c", probe, str(BUILD), "--device", "cuda", "--data-dir", str(data),
                        "--output-dir", str(tmp_path / f"fp{B}"), *TINY, "-B", str(B)], capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])["used"]


def test_auto_picks_the_largest_B_that_fits_and_keeps_the_total_batch(emu, tmp_path, data):  # noqa: F811
    """The device's memory is set between what B=4 and B=8 hold (measured here through the same entry point, so
    the bound does not come from the code under test): auto must choose 4 of the 16 sequences per step (a divisor:
    4 micro-steps keep 512 tokens per step), and the run must finish."""
    used4, used8 = footprint(tmp_path, data, 4), footprint(tmp_path, data, 8)
    assert used4 < used8
    # the budget is 95% of the memory free before the model; set it midway between the two footprints
    total = int((used4 + used8) / 2 / (1 - 0.05))
    r = train(tmp_path, data, total, "-B", "auto", "--total-batch-tokens", str(16 * 32))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "batch: B=4 T=32 world=1 grad_accum=4 -> 512 tokens/step" in r.stdout, batch_line(r.stdout)
    assert "--batch-size auto: B=4" in r.stdout
    # with all the memory it wants, the same command takes the whole step in one micro-batch
    r = train(tmp_path, data, 80 << 30, "-B", "auto", "--total-batch-tokens", str(16 * 32), "--overwrite")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "batch: B=16 T=32 world=1 grad_accum=1 -> 512 tokens/step" in r.stdout, batch_line(r.stdout)


def test_an_explicit_B_that_does_not_fit_is_refused_naming_the_one_that_does(emu, tmp_path, data):  # noqa: F811
    used2, used4 = footprint(tmp_path, data, 2), footprint(tmp_path, data, 4)
    total = int((used2 + used4) / 2 / (1 - 0.05))
    r = train(tmp_path, data, total, "-B", "8")
    assert r.returncode == 2, r.stdout[-3000:] + r.stderr[-3000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith("gpt2core-train: error: -B 8 -T 32 needs ") and "-B 2 fits" in lines[0], lines[0]
    assert "4 micro-steps per optimizer step for the same 256 tokens" in lines[0], lines[0]
    assert "step     0" not in r.stdout  # refused before the first step
    # the B it names runs, with the accumulation that keeps the 256 tokens
    r = train(tmp_path, data, total, "-B", "2", "--total-batch-tokens", "256", "--overwrite")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "batch: B=2 T=32 world=1 grad_accum=4 -> 256 tokens/step" in r.stdout, batch_line(r.stdout)


def test_nothing_fits_is_one_line(emu, tmp_path, data):  # noqa: F811
    r = train(tmp_path, data, 4 * M)  # less than the weights, gradients and AdamW state of the tiny preset
    assert r.returncode in (1, 2), r.stdout[-3000:] + r.stderr[-3000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr and "out of memory" in lines[0], r.stderr
