"""The real CUDA backend of gpt2core._C on a GPU, against the CPU backend. Skipped unless this _C has the CUDA
backend and a usable GPU (gpt2core._C.cuda_status() == ""); the same checks run without a GPU on the emulated
build in tests/csrc/cuda/test_cuda_emu.py.

Tolerances: fp32 (default) within 1e-5 normwise per tensor, as under emulation (summation order only; cuBLASLt
in CUBLAS_COMPUTE_32F). With tf32=True the matmuls round their inputs to TF32 (10-bit mantissa,
~5e-4 relative per product), so 2e-3.
"""
import numpy as np
import pytest

from gpt2core import _C

pytestmark = pytest.mark.skipif(
    "cuda" not in _C.build_info()["backends"] or _C.cuda_status() != "",
    reason="needs gpt2core._C with the CUDA backend and a usable GPU")

CFG = dict(max_seq_len=64, vocab_size=97, padded_vocab_size=128, n_layer=2, n_head=3, n_embd=192)
B, T = 3, 61
TOL = 1e-5
TOL_TF32 = 2e-3


def init_params(model, seed=0):
    rng = np.random.default_rng(seed)
    for name, v in model.params().items():
        if name in ("ln1w", "ln2w", "lnfw"):
            v[...] = 1.0 + rng.standard_normal(v.shape) * 0.1
        else:
            v[...] = rng.standard_normal(v.shape) * 0.02
    model.params()["wte"][CFG["vocab_size"]:] = 0.0


def batch(seed=0):
    rng = np.random.default_rng(100 + seed)
    idx = rng.integers(0, CFG["vocab_size"], (B, T)).astype(np.int32)
    tgt = rng.integers(0, CFG["vocab_size"], (B, T)).astype(np.int32)
    tgt[0, 2] = -1
    return idx, tgt


def normwise(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


@pytest.mark.parametrize("tf32", [False, True])
def test_forward_backward_match_cpu(tf32):
    tol = TOL_TF32 if tf32 else TOL
    idx, tgt = batch()
    cpu, gpu = _C.Model(**CFG, device="cpu"), _C.Model(**CFG, device="cuda", tf32=tf32)
    for m in (cpu, gpu):
        init_params(m)
    lc, lg = cpu.forward(idx, tgt), gpu.forward(idx, tgt)
    assert abs(lg - lc) <= tol * abs(lc)
    assert normwise(gpu.logits(), cpu.logits()) <= tol
    for m in (cpu, gpu):
        m.zero_grad()
        m.forward(idx, tgt)
        m.backward()
    gc, gg = cpu.grads(), gpu.grads()
    errs = {k: normwise(gg[k], gc[k]) for k in gc}
    assert max(errs.values()) <= tol, errs
    assert abs(gpu.grad_norm() - cpu.grad_norm()) <= tol * cpu.grad_norm()


def test_training_lowers_loss_like_cpu_and_is_deterministic():
    runs = {}
    for dev in ("cpu", "cuda", "cuda"):
        m = _C.Model(**CFG, device=dev)
        init_params(m, seed=3)
        idx, tgt = batch(1)
        losses = []
        for step in range(1, 6):
            m.zero_grad()
            losses.append(m.forward(idx, tgt))
            m.backward()
            norm = m.grad_norm()
            m.adamw_update(lr=1e-3, step=step, grad_scale=min(1.0, 1.0 / (norm + 1e-6)))
        runs.setdefault(dev, []).append((np.array(losses), m.flat_params().copy()))
    (lc, _), = runs["cpu"]
    (lg, pg), (lg2, pg2) = runs["cuda"]
    assert lg[-1] < lg[0] - 0.1
    np.testing.assert_allclose(lg, lc, rtol=max(1e-4, TOL))
    assert np.array_equal(lg, lg2) and np.array_equal(pg, pg2), "two identical CUDA runs differ"


def test_tuned_matmuls_match_the_heuristic_and_repeat_bitwise():
    """matmul_tuning=True (cuBLASLt's candidates timed once per shape, the fastest kept): the same step as the
    heuristic's first within fp32 summation order, and bit-identical run to run within one process (the choice is
    cached, and timing rewrites nothing: a += GEMM is timed on scratch)."""
    idx, tgt = batch(2)
    runs = []
    for tuning in (False, True, True):
        m = _C.Model(**CFG, device="cuda", matmul_tuning=tuning)
        init_params(m, seed=5)
        for step in range(1, 4):
            m.zero_grad()
            m.forward(idx, tgt)
            m.backward()
            m.adamw_update(lr=1e-3, step=step, grad_scale=1.0)
        m.zero_grad()
        runs.append((m.forward(idx, tgt), m.flat_params().copy()))
    (l0, p0), (l1, p1), (l2, p2) = runs
    assert abs(l1 - l0) <= 1e-4 * abs(l0) and normwise(p1, p0) <= 1e-4
    assert l1 == l2 and np.array_equal(p1, p2)


def test_out_of_memory_is_a_clear_error():
    big = dict(CFG, max_seq_len=1024, n_layer=48, n_embd=192 * 64 // 3 * 3)  # ~1e12 bytes of parameters
    with pytest.raises(RuntimeError, match="out of memory"):
        _C.Model(**dict(big, n_head=3), device="cuda")


# ----------------------------------------------------------------------------- bf16 mixed precision
def bf16_tolerances():
    """Same reasoning as tests/csrc/cuda/test_cuda_emu_bf16_model.py: bf16 stores activations with 2^-9 relative
    rounding; ~15 stored activations in a chain per direction."""
    return dict(loss=2e-3, logits=1e-2, grads=2e-2)


# (model class, the compute capability its tensor cores need, tolerances, loss scale): fp16's as in
# tests/csrc/cuda/test_cuda_emu_f16_model.py (bf16's scaled by 2^-11 / 2^-8), with a constant loss scale
HALF_MODELS = [("ModelBF16", 80, bf16_tolerances(), 1.0),
               ("ModelF16", 70, dict(loss=2.5e-4, logits=1.25e-3, grads=2.5e-3), 1024.0)]


@pytest.mark.parametrize("cls,need,tol,scale", HALF_MODELS, ids=["bf16", "fp16"])
def test_16bit_matches_float64_and_learns(cls, need, tol, scale):
    if "cuda" in _C.build_info()["backends"] and _C.cuda_capability(0) < need:
        pytest.skip(f"{cls} needs sm_{need}+ tensor cores")
    idx, tgt = batch()
    ref, m = _C.ModelF64(**CFG, device="cpu"), getattr(_C, cls)(**CFG, device="cuda")
    for x in (ref, m):
        init_params(x)
    m.params_changed()
    lr_, lm = ref.forward(idx, tgt), m.forward(idx, tgt)
    assert abs(lm - lr_) <= tol["loss"] * abs(lr_)
    assert normwise(m.logits(), ref.logits()) <= tol["logits"]
    for x, s in ((ref, 1.0), (m, scale)):
        x.zero_grad()
        x.forward(idx, tgt)
        x.backward(grad_scale=s)
    errs = {k: normwise(m.grads()[k] / scale, ref.grads()[k]) for k in ref.grads()}
    assert max(errs.values()) <= tol["grads"], errs
    losses = []
    for step in range(1, 6):
        m.zero_grad()
        losses.append(m.forward(idx, tgt))
        m.backward(grad_scale=scale)
        norm = m.grad_norm() / scale
        m.adamw_update(lr=1e-3, step=step, grad_scale=min(1.0, 1.0 / (norm + 1e-6)) / scale)
    assert np.all(np.diff(losses) < 0) and losses[-1] < losses[0] - 0.1, losses


@pytest.mark.skipif("cuda" in _C.build_info()["backends"] and _C.cuda_capability(0) < 80,
                    reason="bf16 tensor cores need sm_80+")
@pytest.mark.parametrize("attention,fused", [("flash", "0"), ("naive", "1"), ("cudnn", "1")])
def test_bf16_speed_ladder_rungs_agree(attention, fused):
    """Every rung computes the same model: bf16 with flash attention and fused kernels (the reference here)
    against naive attention, unfused kernels, and cuDNN attention, within the bf16 tolerances."""
    if attention == "cudnn" and not _C.build_info().get("cudnn_sdpa"):
        pytest.skip("built without cuDNN SDPA")
    tol = bf16_tolerances()
    idx, tgt = batch()
    runs = []
    for att, fu in (("flash", "1"), (attention, fused)):
        m = _C.ModelBF16(**CFG, device="cuda", attention=att, fused=fu == "1")
        init_params(m)
        m.params_changed()
        m.zero_grad()
        loss = m.forward(idx, tgt)
        logits = m.logits().copy()
        m.backward()
        runs.append((loss, logits, {k: v.copy() for k, v in m.grads().items()}))
    (l0, x0, g0), (l1, x1, g1) = runs
    assert abs(l1 - l0) <= tol["loss"] * abs(l0)
    assert normwise(x1, x0) <= tol["logits"]
    errs = {k: normwise(g1[k], g0[k]) for k in g0}
    assert max(errs.values()) <= tol["grads"], errs


@pytest.mark.parametrize("attention", ["flash", "auto"])
@pytest.mark.parametrize("cls", ["Model", "ModelBF16"])
def test_cuda_graph_replay_matches_the_direct_run(cls, attention):
    """As tests/csrc/cuda/test_cuda_graphs.py under emulation, on the real stream-capture machinery: cuBLASLt, cuDNN and
    our kernels recorded into graphs (micro-step, optimizer step) and replayed with new tokens, learning rates
    and weights. Bit for bit with our
    (deterministic) kernels; with cuDNN's attention (auto, bf16), whose backward may accumulate dQ with atomics,
    within bf16 rounding (1e-2 normwise)."""
    graphed, direct = (getattr(_C, cls)(**CFG, device="cuda", attention=attention) for _ in range(2))
    for m in (graphed, direct):
        init_params(m)
        m.params_changed()
    graphed.cuda_graphs = True
    tol = 1e-2 if cls == "ModelBF16" and attention == "auto" else 0.0
    for step in range(3):
        for m in (graphed, direct):
            m.zero_grad()
        for k in range(3):
            x, y = batch(10 * step + k)
            for m in (graphed, direct):
                m.forward_backward(x, y, 1 / 3)
        lg, ld = graphed.take_loss(), direct.take_loss()
        assert abs(lg - ld) <= tol * ld
        for name, g in direct.grads().items():
            assert normwise(graphed.grads()[name], g) <= tol, name
        norms = [m.optimizer_step(lr=1e-3 / (step + 1), step=step + 1, grad_clip=0.05) for m in (graphed, direct)]
        assert abs(norms[0] - norms[1]) <= tol * norms[1]
        for name, p in direct.params().items():
            assert normwise(graphed.params()[name], p) <= tol, name
    assert graphed.graph_captures == 2 and graphed.graph_replays == 8 + 2


# ----------------------------------------------------------------------------- the modern architecture (issue 26)
MODERN = dict(position="rope", norm="rmsnorm", qk_norm=True, activation="relu2", bias=False, tie_embeddings=False,
              logit_softcap=15.0)


@pytest.mark.parametrize("tf32", [False, True])
def test_modern_forward_backward_match_cpu(tf32):
    """Rotary, RMSNorm, QK-norm, ReLU^2, no biases, an untied head and soft-capped logits on the GPU against the CPU
    backend, with the GPT-2 model's tolerances above (test_cuda_emu_modern_model.py runs the same under emulation)."""
    tol = TOL_TF32 if tf32 else TOL
    idx, tgt = batch(1)
    cpu, gpu = _C.Model(**CFG, device="cpu", **MODERN), _C.Model(**CFG, device="cuda", tf32=tf32, **MODERN)
    for m in (cpu, gpu):
        init_params(m)
    lc, lg = cpu.forward(idx, tgt), gpu.forward(idx, tgt)
    assert abs(lg - lc) <= tol * abs(lc)
    assert normwise(gpu.logits(), cpu.logits()) <= tol
    for m in (cpu, gpu):
        m.zero_grad()
        m.forward(idx, tgt)
        m.backward()
    errs = {k: normwise(gpu.grads()[k], cpu.grads()[k]) for k in cpu.grads()}
    assert max(errs.values()) <= tol, errs


# the modern model's 16-bit bounds (test_cuda_emu_modern_model.py: ~3x GPT-2's sensitivity, measured and explained)
MODERN_HALF = [("ModelBF16", 80, dict(loss=2e-3, logits=2e-2, grads=3e-2), 1.0),
               ("ModelF16", 70, dict(loss=2.5e-4, logits=2.5e-3, grads=3.75e-3), 1024.0)]


@pytest.mark.parametrize("cls,need,tol,scale", MODERN_HALF, ids=["bf16", "fp16"])
@pytest.mark.parametrize("attention", ["flash", "auto"])  # auto: cuDNN's SDPA where it is available
def test_modern_16bit_matches_float64(cls, need, tol, scale, attention):
    if _C.cuda_capability(0) < need:
        pytest.skip(f"{cls} needs sm_{need}+ tensor cores")
    idx, tgt = batch(2)
    ref, m = _C.ModelF64(**CFG, device="cpu", **MODERN), getattr(_C, cls)(**CFG, device="cuda", attention=attention,
                                                                          **MODERN)
    for x in (ref, m):
        init_params(x)
    m.params_changed()
    lr_, lm = ref.forward(idx, tgt), m.forward(idx, tgt)
    assert abs(lm - lr_) <= tol["loss"] * abs(lr_)
    assert normwise(m.logits(), ref.logits()) <= tol["logits"]
    for x, s in ((ref, 1.0), (m, scale)):
        x.zero_grad()
        x.forward(idx, tgt)
        x.backward(grad_scale=s)
    errs = {k: normwise(m.grads()[k] / scale, ref.grads()[k]) for k in ref.grads()}
    assert max(errs.values()) <= tol["grads"], errs


# ----------------------------------------------------------------------------- tensor-core attention, op by op
@pytest.fixture(scope="module")
def attention_tc_lib(tmp_path_factory):
    """csrc/cuda/attention_tc.cuh's forward + backward (the emulator tests' entry, cuda_emu/attention_tc_ops.cu) as
    a shared library nvcc builds for this GPU (cuda_gpu/attention_tc_gpu.cu), loaded with ctypes."""
    import ctypes
    import os
    import shutil
    import subprocess
    from pathlib import Path

    here = Path(__file__).resolve().parent
    nvcc = shutil.which("nvcc") or next((str(Path(b) / "bin" / "nvcc") for b in (os.environ.get("CUDA_HOME"),
                                         "/usr/local/cuda") if b and (Path(b) / "bin" / "nvcc").exists()), None)
    if nvcc is None:
        pytest.skip("nvcc not found: the tensor-core attention's op test compiles its entry for this GPU")
    cc = _C.cuda_capability(0)
    lib = tmp_path_factory.mktemp("attention_tc") / "attention_tc_gpu.so"
    r = subprocess.run([nvcc, "-O2", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", f"-arch=sm_{cc}",
                        "-I", str(here.parents[2] / "csrc"), "-I", str(here), str(here / "cuda_gpu" /
                        "attention_tc_gpu.cu"), "-o", str(lib)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    so = ctypes.CDLL(str(lib))
    so.gpt2core_test_attention_tc.restype = ctypes.c_int
    return so


def _attention_tc_gpu(so, f16, qkv_b, dout_b, dqkv_b, NH, misalign, accumulate):
    import ctypes
    Bq, T, C3 = qkv_b.shape
    C = C3 // 3
    out = np.zeros((Bq, T, C), np.uint16)
    lse = np.zeros((Bq, NH, T), np.float32)
    dq = np.ascontiguousarray(dqkv_b, np.uint16).copy()
    err = ctypes.create_string_buffer(512)
    ptr = lambda a: a.ctypes.data_as(ctypes.c_void_p)  # noqa: E731
    rc = so.gpt2core_test_attention_tc(int(f16), ptr(out), ptr(lse), ptr(dq), ptr(np.ascontiguousarray(qkv_b)),
                                       ptr(np.ascontiguousarray(dout_b)), Bq, T, C, NH, int(misalign),
                                       int(accumulate), err, 512)
    assert rc == 0, err.value.decode()
    return out, lse, dq


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_tensor_core_attention_within_the_precision_bound(attention_tc_lib, dtype):
    """The tensor-core attention's forward and backward on this GPU, every case of the emulator test
    (test_cuda_emu_attention_tc.CASES: odd T, hs 10..128, misaligned, accumulate and write), against float64 over
    the rounded inputs, within the bound DERIVED FROM THE PRECISION (attention_bound.py's docstring: the storage
    type's unit roundoff u for every rounding to 16 bits, plus gamma(n) = n u_a / (1 - n u_a), u_a = 2^-23, for the
    fp32 accumulation of n = T + hs + 4 terms in any order with truncating rounding, and 2^-22 per exp2
    approximation). It replaces the emulator bound's 1e-5 max|ref| headroom, which was measured for the emulator's
    order of accumulation and would be flaky with the GPU's unspecified one. Two runs must agree bit for bit (no
    atomics), and every output was poisoned before the kernels ran."""
    import attention_bound
    from test_cuda_emu_attention_tc import B as BB, CASES, from_bits, lse_reference, to_bits
    from test_cuda_emu_bf16_attention import reference

    cc = _C.cuda_capability(0)
    if cc < 75 or (dtype == "bf16" and cc < 80):
        pytest.skip(f"{dtype} tensor-core attention needs sm_{80 if dtype == 'bf16' else 75}+")
    rng = np.random.default_rng(14)
    worst = {}
    for name, C, NH, T, misalign, accumulate in CASES:
        if cc < 80 and C // NH != 64:
            continue  # below sm_80 the tensor-core kernels take HS = 64 only (attention_tc_fits)
        qkv_b, qkv = to_bits(rng.standard_normal((BB, T, 3 * C)), dtype)
        dout_b, dout = to_bits(rng.standard_normal((BB, T, C)), dtype)
        dqkv_b, dqkv = to_bits(rng.standard_normal((BB, T, 3 * C)) if accumulate else np.zeros((BB, T, 3 * C)), dtype)
        runs = [_attention_tc_gpu(attention_tc_lib, dtype == "f16", qkv_b, dout_b, dqkv_b, NH, misalign, accumulate)
                for _ in range(2)]
        assert all(np.array_equal(a, b) for a, b in zip(*runs)), f"{name}: two runs differ"
        out_b, lse, dq_b = runs[0]
        out, dq = from_bits(out_b, dtype), from_bits(dq_b, dtype)
        ref_out, ref_dq, _, _ = reference(qkv, dout, dqkv, NH, True, out)
        fwd, bwd, lse_bound = attention_bound.bounds(qkv, dout, dqkv, out, NH, dtype)
        ref_lse = lse_reference(qkv, NH)
        worst[name] = (attention_bound.ratio(out, ref_out, fwd, dtype), attention_bound.ratio(dq, ref_dq, bwd, dtype),
                       float(np.max(np.abs(lse - ref_lse) / lse_bound)) if np.all(np.isfinite(lse)) else np.inf)
    assert worst and all(max(v) <= 1.0 for v in worst.values()), worst


# Issue 37 on real kernels: what tests/csrc/cuda/test_cuda_emu_memplan.py proves bit for bit under the emulator
# (recompute levels, optimizer offload, ZeRO-2's sharded gradients), here on the GPU, at the same small modern-
# architecture shape and with the same steps (optimizer steps of two micro-steps, an ignored target, clipping active,
# fp16 with dynamic loss scaling). The memory each frees is scripts/memplan_gpu.py's (cudaMemGetInfo on a GPU counts
# in pages, not bytes).
def _small_model(precision, arch="modern", fused=True):
    from test_cuda_emu_memplan import CLASSES, MODERN, SMALL
    from test_cuda_emu import init_params as init_small
    if precision != "fp32" and _C.cuda_capability(0) < 80:
        pytest.skip("16-bit tensor cores need sm_80+ here")
    m = getattr(_C, CLASSES[precision])(**SMALL, device="cuda", attention="flash", fused=fused,
                                        **(MODERN if arch == "modern" else {}))
    init_small(m)
    m.params_changed()
    return m


def _equal_runs(a, b, what):
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert np.array_equal(np.asarray(x), np.asarray(y)), (what, i)


@pytest.mark.parametrize("arch", ["gpt2", "modern"])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_recompute_levels_are_bit_identical_on_the_gpu(precision, arch):
    """layer (also inside CUDA graphs) = none, fused or not; gelu = none with the separate kernels (fused=False). With
    the fused kernels (the default) GPT-2's gelu level is not none's bits: cuBLASLt's GELU epilogue computes GELU its
    own way (in 16-bit on the fp32 sum before rounding), and backward can only rebuild the activation with
    gpt2core's kernel from the stored pre-activation, so the gelu level's forward uses that kernel (csrc/model/
    gpt2.cpp): its first loss is unfused none's, and training stays within the precision's tolerance of none's.
    ReLU^2 has no epilogue: there gelu = none, fused too. Measured on an H200 (d12, bf16, 3 steps): loss 8.8395
    (gelu) against 8.8354 (none)."""
    from test_cuda_emu_memplan import run_steps
    scaled = precision == "fp16"
    runs = {}
    for level, graphs, fused in [("none", False, True), ("none", False, False), ("gelu", False, True),
                                 ("gelu", False, False), ("layer", False, True), ("layer", True, True),
                                 ("layer", False, False)]:
        m = _small_model(precision, arch, fused)
        runs[level, graphs, fused] = run_steps(m, level, scaled, graphs, steps=2)
        assert not graphs or m.graph_replays > 0
    for level, graphs, fused in runs:
        if (level, fused) != ("gelu", True) or arch == "modern":
            _equal_runs(runs["none", False, fused], runs[level, graphs, fused], (precision, arch, level, graphs, fused))
    gelu, none = runs["gelu", False, True], runs["none", False, True]
    assert gelu[0] == runs["none", False, False][0]
    tol = 1e-5 if precision == "fp32" else 3e-2
    assert abs(gelu[-3] - none[-3]) <= tol * abs(none[-3])  # the second step's loss
    assert normwise(gelu[-1], none[-1]) <= tol


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_optimizer_offload_is_bit_identical_on_the_gpu(precision):
    """AdamW on the host's cores (pinned memory, the kernel's own adamw_one compiled for the CPU) against the
    adamw kernel on the device: losses, gradients, weights and both moments bit for bit, also with the last
    micro-step's gradients copied to the host during its backward (prefetch_grads: a second stream); then back on
    the device, one more step as the model that never left."""
    from test_cuda_emu_memplan import run_steps
    runs = {}
    for offload in (False, True, "prefetch"):  # prefetch: the last micro-step's gradients copied during backward
        m = _small_model(precision)
        m.offload = bool(offload)
        assert m.offload == bool(offload)
        runs[offload] = run_steps(m, "none", precision == "fp16", steps=3, prefetch=offload == "prefetch")
        assert m.grad_prefetches == (3 if offload == "prefetch" else 0)
        runs[offload] += [m.adam_m()["qkvw"].copy(), m.adam_v()["fcw"].copy(), str(m.loss_scaler)]
        m.offload = False
        runs[offload] += run_steps(m, "none", precision == "fp16", steps=1)
    _equal_runs(runs[False], runs[True], precision)
    _equal_runs(runs[False], runs["prefetch"], (precision, "prefetch"))


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_zero2_grad_shard_is_bit_identical_on_the_gpu(precision):
    """A model that keeps flat [lo, hi) of its gradients (one-rank bucket hook): after one micro-step the full
    model's gradients of that range, after two the float32 sum of each micro-step's own (accumulate_master on the
    device)."""
    from test_cuda_emu_memplan import check_grad_shard
    full, sharded = _small_model(precision), _small_model(precision)
    if precision == "fp16":
        for m in (full, sharded):
            m.set_loss_scaling(True, scale=1024.0)
    n = full.num_parameters
    sharded.set_grad_shard(n // 3, n - 1000)
    check_grad_shard(full, sharded, n // 3, n - 1000)


# (batch, rows, cols): d12's Muon matrices by shape (qkvw's 36 of 768 x 768: three batches of at most 13,
# muon_ns_batch_cap; the MLP's 12 of 3072 x 768 and 768 x 3072), and odd sizes whose slots (cuda/muon.cuh) are not
# 256-byte multiples of their data
@pytest.mark.parametrize("shape", [(36, 768, 768), (4, 3072, 768), (4, 768, 3072), (5, 37, 53), (3, 53, 37)])
def test_batched_newton_schulz_is_each_matrix_alone_on_the_gpu(shape):
    """Backend::muon_orthogonalize_batch on the GPU: one strided-batched cuBLASLt call per product (batch_invariant:
    the batch-of-one's algorithm, or one call per matrix) gives each matrix bitwise what it gets alone and in a
    smaller batch (data-parallel ranks batch different shares), and agrees with the CPU's bf16 Newton-Schulz to
    within bf16's rounding amplified by the quintic (the emulated test's bound, test_cuda_emu_muon.py)."""
    x = np.random.default_rng(sum(shape)).standard_normal(shape).astype(np.float32)
    kw = dict(ns_dtype="bfloat16", device="cuda")
    batched = _C.newton_schulz(x, **kw)
    np.testing.assert_array_equal(batched, _C.newton_schulz(x, per_matrix=True, **kw))
    np.testing.assert_array_equal(batched[1:], _C.newton_schulz(x[1:], **kw))
    cpu = _C.newton_schulz(x, ns_dtype="bfloat16")
    for b in range(shape[0]):
        assert normwise(batched[b], cpu[b]) < 1e-1, b
