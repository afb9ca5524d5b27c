"""The CUDA backend (csrc/cuda) without a GPU: compiled with g++ against the CUDA-on-CPU emulator (csrc/emu)
into the test-only module gpt2core_cuda_emu (tests/csrc/cuda/cuda_emu/CMakeLists.txt, built here into build/emu-py,
incrementally), and compared with the CPU backend.

- every op, forward and backward, on odd shapes (B=3, T=37 not a multiple of the 32-row attention tile,
  C=192=3*64, head sizes 64/16/10/128, padded vocab, ignored targets), under the emulator schedules fwd, high
  and ahead:<seed> (each in a subprocess: GPT2CORE_EMU_SCHED is read once per process) with the emulator's
  memory checker on (races, uninitialised shared memory, out-of-bounds device memory), with the launch trace
  (GPT2CORE_EMU_TRACE) showing that every __global__ kernel in csrc/cuda ran;
- a whole training step of a tiny model (forward, backward, clipping, AdamW) and five steps of training.

Tolerances (fp32): op outputs within 1e-5 of the largest reference value (normwise): both backends compute in
fp32 and differ only in summation order (tree vs sequential reductions, tiled online softmax vs two-pass
softmax), whose rounding error grows like n * 2^-24 ~ 1e-6 for the n <= 768 terms of these shapes.
"""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[3]
# GPT2CORE_EMU_BUILD (a test-tool knob): another build of the module to test, e.g. scripts/mutation_test.py's build
# of a mutant (build/emu-mut), whose tests then run on it
BUILD = Path(os.environ.get("GPT2CORE_EMU_BUILD") or ROOT / "build" / "emu-py")
CUDA_SRC = ROOT / "csrc" / "cuda"


def _cuda_headers_present():
    for base in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if base and (Path(base) / "include" / "cuda_bf16.h").exists():
            return True
    return False


@pytest.fixture(scope="session")
def emu():
    """Builds (incrementally) and imports gpt2core_cuda_emu."""
    if shutil.which("cmake") is None:
        pytest.skip("cmake not found")
    if not _cuda_headers_present():
        pytest.skip("NVIDIA's CUDA headers (cuda_bf16.h) not found: the emulated backend compiles against them")
    if not (BUILD / "CMakeCache.txt").exists():
        subprocess.run(["cmake", "-S", str(ROOT / "tests" / "csrc" / "cuda" / "cuda_emu"), "-B", str(BUILD),
                        "-DCMAKE_BUILD_TYPE=Release", f"-DPython_EXECUTABLE={sys.executable}"],
                       check=True, capture_output=True, text=True)
    r = subprocess.run(["cmake", "--build", str(BUILD), "-j2"], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.fail("building gpt2core_cuda_emu failed:\n" + r.stdout[-6000:] + r.stderr[-6000:])
    sys.path.insert(0, str(BUILD))
    import gpt2core_cuda_emu
    return gpt2core_cuda_emu


def kernel_names():
    """Names of all __global__ kernels defined in csrc/cuda."""
    names = set()
    for f in list(CUDA_SRC.glob("*.cuh")) + list(CUDA_SRC.glob("*.cu")):
        if f.name == "seams_cublaslt.cu":
            continue  # GPU-only library calls, no kernels
        text = f.read_text()
        names |= set(re.findall(r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?(\w+)\s*\(", text))
    return names


def test_kernel_names_found():
    names = kernel_names()
    assert {"encoder_forward_kernel", "layernorm_forward_kernel", "attention_forward_kernel",
            "attention_backward_dq_kernel", "adamw_kernel", "crossentropy_forward_kernel"} <= names


def test_memory_checker_is_on(emu):
    """The kernels were compiled with the emulator's instrumentation (a build that loses it, e.g. to LTO,
    would still pass every op test, with races and overruns unchecked)."""
    assert emu.memory_checker_enabled()


# Schedules for the op tests (each ~10 s): with the memory checker on, a race within a barrier interval is
# reported whatever the order, so one lock-step schedule (fwd) is enough of those; run-ahead schedules (high:
# warps from the last first, ahead: random warp order per barrier interval) add the orders where one warp is
# furthest ahead of the others, which expose what the checker does not see (device-memory ordering between
# threads of a block) as numeric mismatches. rev and random lock-step schedules add nothing the mutation test
# (scripts/mutation_test.py) found.
@pytest.mark.parametrize("sched", ["fwd", "high", "ahead:7"])
def test_ops_match_cpu_and_every_kernel_runs(emu, sched, tmp_path):
    trace = tmp_path / "trace.txt"
    env = dict(os.environ, GPT2CORE_EMU_SCHED=sched, GPT2CORE_EMU_TRACE=str(trace))
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "csrc" / "cuda" / "cuda_emu" / "compare_ops.py"), str(BUILD)],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    errors = json.loads(r.stdout.strip().splitlines()[-1])
    expected_ops = {"encoder_forward", "encoder_backward", "layernorm_forward", "layernorm_backward",
                    "matmul_forward", "matmul_backward", "attention(hs=64)", "attention(hs=16)",
                    "attention(hs=10)", "attention(hs=128)", "gelu_forward", "gelu_backward", "residual_forward",
                    "crossentropy_forward", "crossentropy_backward_inplace", "sum_squares", "adamw",
                    "unaligned encoder_forward", "unaligned gelu_forward", "unaligned gelu_backward",
                    "unaligned residual_forward", "unaligned adamw", "unaligned layernorm_forward",
                    "unaligned layernorm_backward", "unaligned crossentropy_forward",
                    "unaligned crossentropy_backward_inplace", "naive attention(hs=64)", "naive attention(hs=10)",
                    "cudnn attention(hs=64)", "cudnn attention(hs=10)", "matmul_gelu_forward",
                    "gelu_matmul_backward", "unfused matmul_gelu_forward", "unfused gelu_matmul_backward",
                    "crossentropy_counted", "clipped_adamw", "layernorm_backward write", "matmul_backward write",
                    "matmul_backward bgrad refused", "auto attention write", "naive attention write", "cudnn attention write", "crossentropy_fused",
                    "unaligned crossentropy_fused", "loss_scale_update",
                    "attention_kv_forward", "attention_kv_forward split", "encoder_forward_at", "gather_rows", "sample_tokens",
                    "fp8_quantize"}
    modern = {"rmsnorm_forward", "residual_rmsnorm_forward", "rmsnorm_backward", "rmsnorm_backward write",
              "rope_forward", "rope_backward", "qk_norm_forward", "qk_norm_backward", "relu2_forward", "relu2_backward",
              "softcap_forward", "crossentropy_softcap", "crossentropy_softcap_fused"}
    expected_ops |= modern | {"unaligned " + k for k in modern} | {
        "matmul_relu2_forward", "relu2_matmul_backward", "encoder_forward no wpe", "encoder_backward no wpe",
        "layernorm_forward no bias", "residual_layernorm_forward no bias", "layernorm_backward no bias"}
    assert expected_ops <= set(errors)
    bad = {k: v for k, v in errors.items() if not v <= 1e-5}
    assert not bad, f"ops differing from the CPU backend (normwise error > 1e-5) under {sched}: {bad}"
    launched = set(re.sub(r"[()]|<.*", "", line.strip()) for line in trace.read_text().splitlines() if line.strip())
    missing = kernel_names() - launched
    assert not missing, f"__global__ kernels in csrc/cuda never launched: {sorted(missing)}"


# ----------------------------------------------------------------------------- whole model
CFG = dict(max_seq_len=40, vocab_size=97, padded_vocab_size=128, n_layer=2, n_head=3, n_embd=192)
B, T = 3, 37


def init_params(model, seed=0):
    """GPT-2-like random init (numpy views; under the emulation device memory is host memory)."""
    rng = np.random.default_rng(seed)
    for name, v in model.params().items():
        if name.endswith("w") and v.ndim == 2 or name in ("wte", "wpe"):
            v[...] = rng.standard_normal(v.shape) * 0.02
        elif name in ("ln1w", "ln2w", "lnfw"):
            v[...] = 1.0 + rng.standard_normal(v.shape) * 0.1
        else:
            v[...] = rng.standard_normal(v.shape) * 0.02
    v = model.params()["wte"]
    v[CFG["vocab_size"]:] = 0.0


def batch(seed=0):
    rng = np.random.default_rng(100 + seed)
    idx = rng.integers(0, CFG["vocab_size"], (B, T)).astype(np.int32)
    tgt = rng.integers(0, CFG["vocab_size"], (B, T)).astype(np.int32)
    tgt[0, 2] = -1
    tgt[2, -1] = -1
    return idx, tgt


def normwise(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def grad_errors(ref, m, idx, tgt, scale=1.0):
    """A zeroed forward and backward of each model (m's loss gradient scaled by `scale`); normwise error of every
    gradient of m, divided by `scale`, against ref's."""
    ref.zero_grad()
    ref.forward(idx, tgt)
    ref.backward()
    m.zero_grad()
    m.forward(idx, tgt)
    m.backward(grad_scale=scale)
    gr, gm = ref.grads(), m.grads()
    return {k: normwise(gm[k] / scale, gr[k]) for k in gr}


def train_step(m, idx, tgt, step, clip=1.0, lr=1e-3):
    m.zero_grad()
    loss = m.forward(idx, tgt)
    m.backward()
    norm = m.grad_norm()
    scale = min(1.0, clip / (norm + 1e-6))
    m.adamw_update(lr=lr, step=step, grad_scale=scale)
    return loss, norm


def test_model_reports_cuda(emu):
    info = emu.build_info()
    assert info["cuda"] and "cuda" in info["backends"]
    m = emu.Model(**CFG, device="cuda")
    assert m.device == "cuda"
    assert emu.cuda_status() == ""
    with pytest.raises(ValueError, match="float32"):
        emu.ModelF64(**CFG, device="cuda")
    assert emu.Model(**CFG, device="cuda:0").device == "cuda"
    with pytest.raises(RuntimeError, match="does not exist"):  # the emulator has one device
        emu.Model(**CFG, device="cuda:1")
    with pytest.raises(ValueError, match="cuda:<index>"):
        emu.Model(**CFG, device="cuda:x")


def test_training_step_matches_cpu(emu):
    """Forward (logits, loss), backward (every gradient), grad norm, clipping and AdamW (every updated weight
    and moment) of a tiny 2-layer model: fp32 within 1e-5 normwise per tensor (summation-order rounding, see
    the module docstring)."""
    idx, tgt = batch()
    models = {}
    for dev in ("cpu", "cuda"):
        m = emu.Model(**CFG, device=dev)
        init_params(m)
        models[dev] = m
    cpu, gpu = models["cpu"], models["cuda"]
    loss_c, loss_g = cpu.forward(idx, tgt), gpu.forward(idx, tgt)
    assert abs(loss_g - loss_c) <= 1e-5 * abs(loss_c)
    assert normwise(gpu.logits(), cpu.logits()) <= 1e-5
    assert normwise(gpu.token_losses(), cpu.token_losses()) <= 1e-5
    errs = grad_errors(cpu, gpu, idx, tgt)
    assert max(errs.values()) <= 1e-5, errs
    gc = cpu.grads()
    nc, ng = cpu.grad_norm(), gpu.grad_norm()
    assert abs(ng - nc) <= 1e-5 * nc
    scale = 0.5 / nc  # clip to half the norm: exercises grad_scale
    before = {k: v.copy() for k, v in cpu.params().items()}
    grads = {k: v.copy() for k, v in gc.items()}
    lr = 1e-3
    for m in (cpu, gpu):
        m.adamw_update(lr=lr, step=1, grad_scale=scale)
    for what in ("adam_m", "adam_v"):  # linear / quadratic in the gradient: same 1e-5 as the gradients
        c, g = getattr(cpu, what)(), getattr(gpu, what)()
        errs = {k: normwise(g[k], c[k]) for k in c}
        assert max(errs.values()) <= 1e-5, (what, errs)
    # Updated weights. Adam's first step moves each weight by lr * g / (|g| + eps) ~ lr * sign(g): not
    # continuous at g = 0, so a weight whose gradient is within rounding (1e-5 * max|g|) of zero may move by
    # up to 2 lr differently. Weights with a clear gradient (|g| > 1e-3 max|g|) match within 1e-5 of the
    # update's and the tensor's largest magnitude; every weight within 2 lr.
    c, g = cpu.params(), gpu.params()
    for k in c:
        clear = np.abs(grads[k]) > 1e-3 * np.max(np.abs(grads[k])) if np.any(grads[k]) else np.ones_like(grads[k], bool)
        upd_c = (c[k] - before[k])[clear].astype(np.float64)
        upd_g = (g[k] - before[k])[clear].astype(np.float64)
        if upd_c.size:
            assert np.max(np.abs(upd_g - upd_c)) <= 1e-5 * max(np.max(np.abs(upd_c)), 1e-30) + 1e-5 * np.max(np.abs(c[k])), k
        assert np.max(np.abs(g[k] - c[k])) <= 2 * lr + 1e-6, k


def test_five_steps_lower_the_loss_like_cpu(emu):
    losses = {}
    for dev in ("cpu", "cuda"):
        m = emu.Model(**CFG, device=dev)
        init_params(m, seed=3)
        idx, tgt = batch(1)
        losses[dev] = [train_step(m, idx, tgt, step)[0] for step in range(1, 6)]
    lc, lg = np.array(losses["cpu"]), np.array(losses["cuda"])
    assert lg[-1] < lg[0] - 0.1, lg  # it learns (the same batch every step)
    assert np.all(np.diff(lg) < 0), lg
    np.testing.assert_allclose(lg, lc, rtol=1e-4)  # loose: AdamW's m/sqrt(v) amplifies rounding over steps


def test_fused_and_unfused_training_steps_agree(emu):
    """fused=True (the default: residual + layernorm in one kernel, GELU in the matmul epilogues of
    the MLP) against fused=False (the separate kernels), with stored and with recomputed GELU
    activations: one training step -- loss, logits, every gradient, grad norm, updated weights -- within 1e-5
    normwise per tensor (both do the same fp32 arithmetic up to summation order; see the module docstring).
    Updated weights as in test_training_step_matches_cpu (Adam's first step is discontinuous at g = 0)."""
    idx, tgt = batch(6)
    lr = 1e-3
    for recompute in (False, True):
        runs = {}
        for fused in ("1", "0"):
            m = emu.Model(**CFG, device="cuda", fused=fused == "1")
            m.recompute_gelu = recompute
            init_params(m, seed=6)
            before = {k: v.copy() for k, v in m.params().items()}
            m.zero_grad()
            loss = m.forward(idx, tgt)
            logits = m.logits().copy()
            m.backward()
            grads = {k: v.copy() for k, v in m.grads().items()}
            norm = m.grad_norm()
            m.adamw_update(lr=lr, step=1, grad_scale=min(1.0, 1.0 / norm))
            runs[fused] = (loss, logits, grads, norm, {k: v.copy() for k, v in m.params().items()})
        (lf, xf, gf, nf, pf), (lu, xu, gu, nu, pu) = runs["1"], runs["0"]
        assert abs(lf - lu) <= 1e-5 * abs(lu), (recompute, lf, lu)
        assert normwise(xf, xu) <= 1e-5, recompute
        errs = {k: normwise(gf[k], gu[k]) for k in gu}
        assert max(errs.values()) <= 1e-5, (recompute, errs)
        assert abs(nf - nu) <= 1e-5 * nu
        for k in pu:
            g = gu[k]
            clear = np.abs(g) > 1e-3 * np.max(np.abs(g)) if np.any(g) else np.ones_like(g, bool)
            upd_f = (pf[k] - before[k])[clear].astype(np.float64)
            upd_u = (pu[k] - before[k])[clear].astype(np.float64)
            if upd_u.size:
                tol = 1e-5 * np.max(np.abs(upd_u)) + 1e-5 * np.max(np.abs(pu[k]))
                assert np.max(np.abs(upd_f - upd_u)) <= tol, k
            assert np.max(np.abs(pf[k] - pu[k])) <= 2 * lr + 1e-6, k


def test_a_device_without_concurrent_managed_access_is_refused(emu, monkeypatch):
    """Parameters and gradients live in managed memory that numpy views read while kernels may run: a platform
    without concurrent managed access (Windows, WSL; the emulator pretends so) must be refused up front with the
    reason, not crash at the first host read during a kernel."""
    monkeypatch.setenv("GPT2CORE_EMU_NO_CONCURRENT_MANAGED_ACCESS", "1")
    with pytest.raises(RuntimeError, match="concurrent managed memory access"):
        emu.Model(**CFG, device="cuda")


def test_a_refused_gelu_epilogue_falls_back_to_the_separate_kernels(emu, monkeypatch, capfd):
    """cuBLASLt may refuse a fused epilogue at run time (no kernel for the combination). The emulator's matmul seam
    refuses both GELU epilogues under GPT2CORE_EMU_REFUSE_GELU_EPILOGUE; the fused backend then says so once per
    direction and runs matmul + GELU kernels: loss and gradients as the unfused backend's (1e-5 normwise, as in
    test_fused_and_unfused_training_steps_agree), over two steps."""
    idx, tgt = batch(7)
    runs = {}
    for fused, refuse in (("1", "1"), ("0", None)):
        if refuse:
            monkeypatch.setenv("GPT2CORE_EMU_REFUSE_GELU_EPILOGUE", refuse)
        else:
            monkeypatch.delenv("GPT2CORE_EMU_REFUSE_GELU_EPILOGUE", raising=False)
        m = emu.Model(**CFG, device="cuda", fused=fused == "1")
        init_params(m, seed=7)
        losses = []
        for _ in range(2):
            m.zero_grad()
            losses.append(m.forward(idx, tgt))
            m.backward()
        runs[fused] = (losses, {k: v.copy() for k, v in m.grads().items()})
    (lf, gf), (lu, gu) = runs["1"], runs["0"]
    np.testing.assert_allclose(lf, lu, rtol=1e-5)
    errs = {k: normwise(gf[k], gu[k]) for k in gu}
    assert max(errs.values()) <= 1e-5, errs
    err = capfd.readouterr().err
    for direction in ("forward", "backward"):
        assert err.count(f"refused the fused GELU {direction} epilogue") == 1, err


# ----------------------------------------------------------------------------- the real build, no GPU
def test_real_cuda_build_without_gpu_is_a_clear_device_error():
    """gpt2core._C compiled with the CUDA backend (pip install . with nvcc) on a machine without a usable GPU:
    device='cuda' raises DeviceError saying why (cudaGetDeviceCount's error or no device)."""
    from gpt2core import GPT2, GPT2Config, _C
    from gpt2core.model import DeviceError

    if "cuda" not in _C.build_info()["backends"]:
        pytest.skip("this gpt2core._C has no CUDA backend")
    assert _C.build_info()["cuda"] is True
    if _C.cuda_status() == "":
        pytest.skip("a CUDA device is available here")
    cfg = GPT2Config(block_size=8, vocab_size=10, padded_vocab_size=16, n_layer=1, n_head=2, n_embd=8)
    with pytest.raises(DeviceError, match="cuda"):
        GPT2(cfg, device="cuda")
    with pytest.raises(RuntimeError, match="CUDA"):  # the backend constructor says the same at the _C level
        _C.Model(max_seq_len=8, vocab_size=10, padded_vocab_size=16, n_layer=1, n_head=2, n_embd=8, device="cuda")


@pytest.fixture(scope="session")
def nvcc_check_cache(tmp_path_factory):
    """scripts/check_cuda_compile.py --cache-dir for this session: the no-spill check below and the launch-bounds
    check (test_launch_bounds.py) run the same nvcc compile of csrc/cuda (same files, archs and flags), so the second
    reads what the first compiled instead of compiling again (the key hashes every input: a changed file compiles)."""
    return tmp_path_factory.mktemp("nvcc-check")


@pytest.mark.slow
def test_cuda_kernels_compile_without_spills(nvcc_check_cache):
    """The real nvcc build of csrc/cuda for sm_75 (T4), sm_80 and sm_90, and of tests/csrc/cuda/cuda_compile (the bf16 instantiations):
    warnings are errors, no register spills, shared memory within limits (scripts/check_cuda_compile.py reads
    ptxas -v). The backend instantiates its float, bf16 and fp16 kernels, so the fp16 model's kernels are checked
    for sm_75; sm_70 (V100) too where this nvcc still targets it (CUDA 13 dropped Volta: CUDA 12 toolkits).
    Needs only the CUDA toolkit."""
    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None)
    if nvcc is None:
        pytest.skip("nvcc not found")
    files = [str(f) for f in sorted(CUDA_SRC.glob("*.cu")) + sorted((ROOT / "tests" / "csrc" / "cuda" / "cuda_compile").glob("*.cu"))]
    listed = subprocess.run([nvcc, "--list-gpu-arch"], capture_output=True, text=True).stdout.split()
    archs = ("70," if "compute_70" in listed else "") + "75,80,90"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "check_cuda_compile.py"), "--archs", archs, "-q",
                        "--nvcc", nvcc, "-I", str(ROOT / "csrc"), "--cache-dir", str(nvcc_check_cache), *files],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]


def test_gradients_and_norm_are_bitwise_deterministic_across_schedules(emu):
    """No float atomics in any result path (encoder backward, bias and LayerNorm parameter gradients, global
    norm, attention backward): the emulator's thread schedules (in-order, reversed, random) give bit-identical
    gradients, gradient norm and updated weights."""
    idx, tgt = batch(2)
    results = []
    try:
        for sched in ("fwd", "rev", "random:11"):
            emu.set_schedule(sched)
            m = emu.Model(**CFG, device="cuda")
            init_params(m, seed=5)
            loss, norm = train_step(m, idx, tgt, step=1)
            results.append((loss, norm, {k: v.copy() for k, v in m.grads().items()},
                            {k: v.copy() for k, v in m.params().items()}))
    finally:
        emu.set_schedule("fwd")
    loss0, norm0, g0, p0 = results[0]
    for loss, norm, g, p in results[1:]:
        assert loss == loss0 and norm == norm0
        for k in g0:
            assert np.array_equal(g[k], g0[k]), k
            assert np.array_equal(p[k], p0[k]), k


def test_out_of_memory_names_the_size(emu):
    with pytest.raises(RuntimeError, match=r"CUDA out of memory: asked for .* MiB.*smaller micro-batch"):
        emu.Model(max_seq_len=1024, vocab_size=97, padded_vocab_size=128, n_layer=48, n_head=3, n_embd=12288,
                  device="cuda")
