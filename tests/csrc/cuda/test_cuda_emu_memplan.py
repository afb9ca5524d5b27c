"""The memory plan and --recompute on the emulated CUDA device (issue 37).

- the plan against the emulator's allocation accounting (cudaMemGetInfo: every cudaMalloc the backend made, its
  scratch buffers included) after the training runs below, every level and precision tested: within 2%. The plan
  is asked with library_workspace=0: the emulator's matmul seam allocates no cuBLASLt workspace. Larger shapes
  (a d12-wide layer with the tensor-core attention's scratch: ~20 s of emulation a step) are
  scripts/memplan_check.py's: within 0.001% when measured (issue 37's note);
- --recompute gelu / layer bit for bit the same as none: losses, gradients and weights over optimizer steps of two
  micro-steps each with clipping active, fp32 (also inside CUDA graphs), bf16 and fp16 (with dynamic loss
  scaling), every architecture field on;
- a configuration the plan says does not fit under GPT2CORE_EMU_TOTAL_MEM is refused before anything is allocated,
  naming the change that fits, and that change trains.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from gpt2core import GPT2Config, memplan
from gpt2core.data import shakespeare

from test_cuda_emu import BUILD, CFG, emu, init_params  # noqa: F401  (emu: fixture)
from test_cuda_emu_batchfit import _ENTRY

# gpt2core-train over the emulated core, also in a build without a CUDA backend of its own (GPT2CORE_CUDA=OFF): the
# device check finds the emulated one
ENTRY = _ENTRY.replace("from gpt2core import train", "import gpt2core._plugins\n"
                       "gpt2core._plugins.find = lambda: 'emulated'\nfrom gpt2core import train")
assert ENTRY != _ENTRY
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


SMALL = dict(CFG, n_layer=2, n_embd=64, n_head=2, max_seq_len=16)  # every op of the step, at a shape the emulator
#                                                                   runs in under a second per micro-step
B, T = 2, 16


def run_steps(m, level, scaled, graphs=False, steps=2, prefetch=False):
    """Optimizer steps of two micro-steps each (an ignored target, clipping active): the losses, gradients and
    weights after each. prefetch: the offloaded model copies the second micro-step's gradients to the host during
    its backward (prefetch_grads)."""
    m.recompute = level
    m.cuda_graphs = graphs
    if scaled:
        m.set_loss_scaling(True, scale=1024.0)
    out = []
    for step in range(1, steps + 1):
        m.zero_grad()
        for micro in range(2):
            x, y = batch(10 * step + micro, B, T, CFG["vocab_size"])
            y[0, 3] = -1
            if prefetch and micro == 1:
                m.prefetch_grads()
            m.forward_backward(x, y, 0.5)
        out.append(m.take_loss())
        out.append(m.flat_grads().copy())
        norm = m.optimizer_step(lr=1e-2, step=step, grad_clip=0.05)
        assert norm > 0.05  # clipping is active
        out.append(m.flat_params().copy())
    return out


@pytest.mark.parametrize("precision", list(CLASSES))
def test_recompute_is_bit_identical_and_the_plan_matches_the_allocations(emu, precision):  # noqa: F811
    """Each level's run against none's, bit for bit; and the device memory each run holds (the emulator's
    accounting: every cudaMalloc, scratch included) against the plan, within 2%. In fp32 the layer run is inside
    captured CUDA graphs (the first micro-step runs directly, the second is captured, the others replay it), and
    gelu runs too (in 16-bit it is the old path, tested on the CPU bit for bit; the emulator's time is short). In
    16-bit one optimizer step (its two micro-steps, the clipped update, the rounded weights) for the same reason:
    fp32's second step shows that the next forward reads the updated weights alike."""
    levels = [("none", False), ("gelu", False), ("layer", True)] if precision == "fp32" else [("none", False),
                                                                                           ("layer", False)]
    runs = {}
    for level, graphs in levels:
        free0, _ = emu.cuda_mem_info(0)
        m = getattr(emu, CLASSES[precision])(**SMALL, device="cuda", attention="flash", **MODERN)
        init_params(m)
        m.params_changed()
        runs[level, graphs] = run_steps(m, level, precision == "fp16", graphs, 2 if precision == "fp32" else 1)
        assert not graphs or m.graph_replays > 0
        used = free0 - emu.cuda_mem_info(0)[0]
        o = memplan.Options(device="cuda", precision=precision, recompute=level, attention="flash",
                            library_workspace=0)
        planned = memplan.total(memplan.memory(config_of(SMALL, MODERN), B, T, o))
        assert abs(planned - used) <= 0.02 * used, (precision, level, planned, used)
        del m
    for key, run in runs.items():
        for a, b in zip(runs["none", False], run):
            assert np.array_equal(np.asarray(a), np.asarray(b)), (precision, key)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("shakespeare")
    shakespeare.prepare(d)
    return d


def test_a_run_the_plan_refuses_is_refused_first_and_its_proposal_trains(emu, tmp_path, data):  # noqa: F811
    """The tiny preset at B=1, T=64, fp32: the device's memory is set between what the plan says layer recompute
    and GELU recompute need. The run is refused before anything is allocated, naming --recompute layer (the
    cheapest change that fits); with it, the same command trains."""
    need = {r: memplan.total(memplan.memory("tiny", 1, 64, memplan.Options(
        device="cuda", precision="fp32", recompute=r, library_workspace=0))) for r in memplan.RECOMPUTE}
    assert need["layer"] < need["gelu"] < need["none"]
    total = int((need["layer"] + need["gelu"]) / 2 / (1 - memplan.SAFETY))
    args = [sys.executable, "-c", ENTRY, str(BUILD), "--device", "cuda", "--data-dir", str(data), "--preset",
            "tiny", "--precision", "fp32", "-T", "64", "-B", "1", "--steps", "1", "--val-every", "0",
            "--sample-tokens", "0", "--threads", "1", "--attention", "flash"]
    env = dict(os.environ, GPT2CORE_EMU_TOTAL_MEM=str(total))
    r = subprocess.run(args + ["--output-dir", str(tmp_path / "a")], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    line = r.stderr.strip().splitlines()
    assert len(line) == 1 and "smallest change that fits: --recompute layer" in line[0], r.stderr
    assert "would run out of memory" in line[0] and "step " not in r.stdout
    r = subprocess.run(args + ["--output-dir", str(tmp_path / "b"), "--recompute", "layer"], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "each block recomputed in backward" in r.stdout


@pytest.mark.parametrize("precision", list(CLASSES))
def test_zero2_sharded_gradients_bit_for_bit_and_the_memory_it_frees(emu, precision):  # noqa: F811
    """ZeRO-2 on the emulated device (tests/python/test_zero2.py has the CPU side and the ranks): a model that keeps
    only flat [lo, hi) of its gradients, with the one-rank bucket hook, holds the full model's gradients of that range
    bit for bit after one micro-step, and the float32 sum of each micro-step's own gradients after two (the bucket
    accumulation is a device op: the CUDA backend's accumulate_master); fp16 with loss scaling (the shard carries
    the scale, as a full buffer does). The device memory it frees is the full buffer less the shard and the buckets
    (memplan.grad_bucket_values), by the emulator's accounting."""
    config = config_of(SMALL, MODERN)
    scaled = precision == "fp16"

    def make():
        m = getattr(emu, CLASSES[precision])(**SMALL, device="cuda", attention="flash", **MODERN)
        init_params(m)
        m.params_changed()
        if scaled:
            m.set_loss_scaling(True, scale=1024.0)
        return m

    full = make()
    n = full.num_parameters
    lo, hi = n // 3, n - 1000
    free0 = emu.cuda_mem_info(0)[0]
    sharded = make()
    held_full = free0 - emu.cuda_mem_info(0)[0]
    sharded.set_grad_shard(lo, hi)
    held_sharded = free0 - emu.cuda_mem_info(0)[0]
    assert sharded.grad_bucket_values == memplan.grad_bucket_values(config)
    assert held_full - held_sharded == 4 * (n - (hi - lo) - memplan.grad_bucket_values(config))
    check_grad_shard(full, sharded, lo, hi)


def check_grad_shard(full, sharded, lo, hi):
    """sharded (set_grad_shard(lo, hi)) with the one-rank bucket hook holds full's gradients of [lo, hi) after one
    micro-step, and the float32 sum of each micro-step's own after two."""
    from test_zero2 import own_part_hook
    own_part_hook(sharded, lo, hi)
    micro = [batch(s, B, T, CFG["vocab_size"]) for s in (1, 2)]
    own = []
    for x, y in micro:  # each micro-step's own gradients
        full.zero_grad()
        full.forward_backward(x, y, 0.5)
        own.append(full.flat_grads()[lo:hi].copy())
    sharded.zero_grad()
    sharded.forward_backward(*micro[0], 0.5)
    assert np.array_equal(sharded.grad_shard(), own[0])
    sharded.forward_backward(*micro[1], 0.5)
    assert np.array_equal(sharded.grad_shard(), own[0] + own[1])
    assert sharded.take_loss() > 0


@pytest.mark.parametrize("precision", list(CLASSES))
def test_optimizer_offload_is_bit_identical_and_frees_the_optimizer_state(emu, precision):  # noqa: F811
    """--offload optimizer on the emulated device: the fp32 master weights and the AdamW moments in pinned host
    memory, AdamW on the host (CudaBackend::adamw_host) with the kernel's own per-value arithmetic. Against the
    update on the device: losses, gradients, weights and moments bit for bit over optimizer steps of two micro-steps
    each with clipping active (fp16 with dynamic loss scaling); the device memory it frees is the master copy (16-bit
    models) and the moments, by the emulator's accounting, as the plan says; off moves them back and training goes
    on, the same bits as a model never offloaded."""
    scaled = precision == "fp16"
    runs, held, scalers = {}, {}, {}
    for offload in (False, True, "prefetch"):
        free0 = emu.cuda_mem_info(0)[0]
        m = getattr(emu, CLASSES[precision])(**SMALL, device="cuda", attention="flash", **MODERN)
        init_params(m)
        m.params_changed()
        m.offload = bool(offload)
        assert m.offload == bool(offload)
        runs[offload] = run_steps(m, "none", scaled, steps=3, prefetch=offload == "prefetch")
        assert m.grad_prefetches == (3 if offload == "prefetch" else 0)
        runs[offload] += [m.adam_m()["qkvw"].copy(), m.adam_v()["fcw"].copy()]
        scalers[offload] = m.loss_scaler  # the scaler stepped on the device after the host's update, as always
        held[offload] = free0 - emu.cuda_mem_info(0)[0]
        if offload is True:  # back on the device: one more step, as the model that never left
            m.offload = False
            runs["back"] = run_steps(m, "none", scaled, steps=1)
        elif offload is False:
            runs["stay"] = run_steps(m, "none", scaled, steps=1)
        del m
    for other in (True, "prefetch"):
        for a, b in zip(runs[False], runs[other]):
            assert np.array_equal(np.asarray(a), np.asarray(b)), (precision, other)
    assert scalers[True] == scalers[False] == scalers["prefetch"] and scalers[True]["clean"] == (3 if scaled else 0)
    for a, b in zip(runs["stay"], runs["back"]):
        assert np.array_equal(np.asarray(a), np.asarray(b)), precision
    n = config_of(SMALL, MODERN).num_parameters()
    master = 4 * n if precision != "fp32" else 0
    assert held[False] - held[True] == held[False] - held["prefetch"] == master + 8 * n
    plan = {o: memplan.memory(config_of(SMALL, MODERN), B, T, memplan.Options(
        device="cuda", precision=precision, offload=o, attention="flash", library_workspace=0))
        for o in ("none", "optimizer")}
    assert memplan.total(plan["none"]) - memplan.total(plan["optimizer"]) == master + 8 * n
    assert plan["optimizer"]["host"] == 16 * n + (4 if precision == "fp32" else 2) * n


def test_offload_refusals(emu):  # noqa: F811
    """Offloaded: the device-only update calls refuse, naming the offload; a ZeRO-2 shard combines with it in
    either order (tests/csrc/cuda/test_cuda_emu_zero_offload.py trains it)."""
    m = emu.ModelBF16(**SMALL, device="cuda", attention="flash", **MODERN)
    m.offload = True
    with pytest.raises(RuntimeError, match="offloaded to the host"):
        m.adamw_update(lr=1e-3, step=1)
    m.set_grad_shard(0, 10)
    assert m.offload and m.grad_sharded
    m.offload = False
    m.offload = True
    assert m.offload and m.grad_shard_range == (0, 10)


def test_train_with_offload_is_the_same_run_and_resumes_bit_exactly(emu, tmp_path, data):  # noqa: F811
    """gpt2core-train --offload optimizer over the emulated core (bf16, tiny preset, gradient accumulation 2,
    clipping at the default 1.0): the same losses and final weights as without offload; a run stopped after the
    checkpoint of step 2 and resumed (--resume auto) with offload ends with the same bits too (the restored master
    weights and moments go to host memory)."""
    base = [sys.executable, "-c", ENTRY, str(BUILD), "--device", "cuda", "--data-dir", str(data), "--preset", "tiny",
            "--precision", "bf16", "-T", "32", "-B", "2", "--total-batch-tokens", "128", "--val-every", "0",
            "--sample-tokens", "0", "--threads", "1", "--attention", "flash", "--checkpoint-every", "2"]

    def train(name, *extra):
        r = subprocess.run(base + ["--output-dir", str(tmp_path / name), *extra], capture_output=True, text=True,
                           timeout=900)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        return tmp_path / name, r.stdout

    plain, _ = train("plain", "--steps", "3")
    off, log = train("off", "--steps", "3", "--offload", "optimizer")
    loss = lambda d: [json.loads(x)["loss"] for x in open(d / "metrics.jsonl") if '"loss"' in x]  # noqa: E731
    assert len(loss(plain)) == 3 and loss(off) == loss(plain)
    assert (off / "model.bin").read_bytes() == (plain / "model.bin").read_bytes()
    half, _ = train("half", "--steps", "2", "--offload", "optimizer")
    _, log = train("half", "--steps", "3", "--offload", "optimizer", "--resume", "auto")
    assert "resumed from" in log
    assert (half / "model.bin").read_bytes() == (plain / "model.bin").read_bytes()
    assert loss(half) == loss(plain)
