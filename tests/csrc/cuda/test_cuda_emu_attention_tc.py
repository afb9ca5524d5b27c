"""The tensor-core flash attention (csrc/cuda/attention_tc.cuh) for both 16-bit storage types, fp16 (__half) and
bf16, called directly (gpt2core_cuda_emu.attention_tc: forward, then the backward into a given dqkv), against
float64 numpy over the ROUNDED inputs (test_cuda_emu_bf16_attention.reference), under the emulator's run-ahead
schedules low, high and ahead:7 (GPT2CORE_EMU_SCHED is read once per process: each run is a subprocess that runs
this file as a script), which must also agree bit for bit (no atomics: the backward's dQ is one block's sum over
the key tiles in a fixed order, from the dS tiles the dkdv kernel stored).

Shapes: B=2; T=37 and T=70 (not multiples of the 64-row tile; T=70: two tiles, so dS tiles off the diagonal),
T=128 (exactly two tiles) and T=130 (three) with hs=64, hs=128 (C=256), hs=16 and hs=10 (zero-padded to 64; hs=10: scalar loads), and
misaligned buffers (the scalar fallback of the 16-byte loads); the backward accumulating into dqkv (dqkv_in +
gradient) and, in the "write" cases, storing the gradient (InputGrad::Write: dqkv starts poisoned, so every element
must be written). Every output buffer and the backward's scratch (D and the dS tiles) is poisoned (NaN bits) before
the kernels run.

Tolerance, per element, with u the storage type's unit roundoff (bf16 2^-8, fp16 2^-11: 8 and 11 significant
bits, round to nearest even, relative error <= u; see test_cuda_emu_bf16_attention.py for the terms):
    |got - ref| <= u (|ref| + extra) + 1e-5 max|ref|
- u |ref|: out and dqkv (dqkv_in + gradient, added in fp32) are each rounded once to the storage type;
- u extra: P is rounded to the storage type for P V (forward: extra = P |v|) and for dV = P^T dout, dS for
  dQ = scale dS K and dK = scale dS^T Q (backward: extra = the products with |P| and |dS|);
- 1e-5 max|ref|: the fp32 arithmetic before the rounding (~n 2^-24 for n <= 1024 terms), which also covers fp16's
  subnormal P below 2^-14 (absolute error <= 2^-25 per term).
lse is checked at fp32: |got - ref| <= 1e-5 (1 + |ref|).
The same outputs must also pass the GPU test's bound (attention_bound.py: derived from the precision for any
accumulation order, without the 1e-5 headroom): out_gpu_bound and dqkv_gpu_bound in the ratios.
"""
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import attention_bound
from test_cuda_emu import BUILD, emu  # noqa: F401  (emu: the fixture that builds and imports gpt2core_cuda_emu)
from test_cuda_emu_bf16_attention import check_under_schedules, reference, round_bf16

HERE = Path(__file__).resolve()
UNIT = {"f16": 2.0**-11, "bf16": 2.0**-8}
ABS = 1e-5
B = 2
CASES = [  # (name, C, NH, T, misalign, accumulate)
    ("hs=64 T=37", 192, 3, 37, False, True),
    ("hs=64 T=70", 128, 2, 70, False, True),
    ("hs=64 T=128", 64, 1, 128, False, True),
    ("hs=64 T=130", 64, 1, 130, False, True),
    ("hs=128 T=33", 256, 2, 33, False, True),
    ("hs=16 T=37", 64, 4, 37, False, True),
    ("hs=10 T=9", 20, 2, 9, False, True),
    ("misaligned hs=64 T=70", 128, 2, 70, True, True),
    ("write hs=64 T=70", 128, 2, 70, False, False),
    ("write hs=128 T=33", 256, 2, 33, False, False),
]
TILE_CASES = [
    # the forward's tiles (128 queries for hs = 64, 64 for hs = 128; 64-key tiles, two K / V buffers): one row, one
    # key tile exactly and one past it, one query tile exactly and one past it, several query and key tiles (warps
    # that skip the tiles above their rows)
    ("hs=64 T=1", 64, 1, 1, False, True),
    ("hs=64 T=64", 64, 1, 64, False, True),
    ("hs=64 T=65", 64, 1, 65, False, True),
    ("hs=64 T=129", 64, 1, 129, False, True),
    ("hs=64 T=257", 64, 1, 257, False, True),
    ("hs=128 T=1", 128, 1, 1, False, True),
    ("hs=128 T=64", 128, 1, 64, False, True),
    ("hs=128 T=65", 128, 1, 65, False, True),
    ("hs=128 T=192", 128, 1, 192, False, True),
    ("misaligned hs=128 T=129", 128, 1, 129, True, True),
]


def to_bits(x, dtype):
    """float array -> (uint16 bit patterns, the rounded values as float64) in dtype ('f16' or 'bf16')."""
    if dtype == "f16":
        with np.errstate(over="ignore"):  # beyond 65504 -> inf, as the hardware rounds
            h = np.asarray(x, np.float64).astype(np.float16)  # numpy rounds to nearest even
        return h.view(np.uint16), h.astype(np.float64)
    r = round_bf16(x)
    return (r.view(np.uint32) >> 16).astype(np.uint16), r.astype(np.float64)


def from_bits(u, dtype):
    u = np.asarray(u, np.uint16)
    if dtype == "f16":
        return u.view(np.float16).astype(np.float64)
    return (u.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def error_ratio(got, ref, unit, extra=0.0):
    """max of |got - ref| / (unit (|ref| + |extra|) + ABS max|ref|): <= 1 passes; inf when got has a NaN/inf."""
    if not np.all(np.isfinite(got)):
        return float("inf")
    return float(np.max(np.abs(got - ref) / (unit * (np.abs(ref) + np.abs(extra)) + ABS * np.max(np.abs(ref)))))


def lse_reference(qkv, NH):
    Bq, T, C3 = qkv.shape
    C = C3 // 3
    hs = C // NH
    q = qkv[:, :, :C].reshape(Bq, T, NH, hs).transpose(0, 2, 1, 3)
    k = qkv[:, :, C:2 * C].reshape(Bq, T, NH, hs).transpose(0, 2, 1, 3)
    s = np.where(np.tril(np.ones((T, T), bool)), q @ k.transpose(0, 1, 3, 2) / np.sqrt(hs), -np.inf)
    m = s.max(-1, keepdims=True)
    return (m + np.log(np.exp(s - m).sum(-1, keepdims=True)))[..., 0]


def run_cases(module_dir, arg):
    """Script mode: arg = dtype ('f16', 'bf16'), or dtype:tiles for TILE_CASES; prints {"errors": {case: {...ratios}},
    "digest": sha256 of the outputs}."""
    sys.path.insert(0, str(module_dir))
    import gpt2core_cuda_emu as E

    dtype, _, which = arg.partition(":")
    rng = np.random.default_rng(14)
    errors, digest = {}, hashlib.sha256()
    for name, C, NH, T, misalign, accumulate in (TILE_CASES if which == "tiles" else CASES):
        qkv_b, qkv = to_bits(rng.standard_normal((B, T, 3 * C)), dtype)
        dout_b, dout = to_bits(rng.standard_normal((B, T, C)), dtype)
        dqkv_b, dqkv = to_bits(rng.standard_normal((B, T, 3 * C)) if accumulate else np.zeros((B, T, 3 * C)), dtype)
        out_b, lse, dq_b = E.attention_tc(dtype == "f16", qkv_b, dout_b, dqkv_b, NH, misalign, accumulate)
        out, dq = from_bits(out_b, dtype), from_bits(dq_b, dtype)
        ref_out, ref_dq, pv_abs, grad_abs = reference(qkv, dout, dqkv, NH, True, out)
        ref_lse = lse_reference(qkv, NH)
        lse_err = np.max(np.abs(lse - ref_lse) / (1e-5 * (1 + np.abs(ref_lse)))) if np.all(np.isfinite(lse)) else np.inf
        fwd_bound, bwd_bound, lse_bound = attention_bound.bounds(qkv, dout, dqkv, out, NH, dtype)
        errors[name] = {"out": error_ratio(out, ref_out, UNIT[dtype], pv_abs),
                        "dqkv": error_ratio(dq, ref_dq, UNIT[dtype], grad_abs), "lse": float(lse_err),
                        # the GPU test's bound (attention_bound.py: from the precision, any accumulation order)
                        "out_gpu_bound": attention_bound.ratio(out, ref_out, fwd_bound, dtype),
                        "dqkv_gpu_bound": attention_bound.ratio(dq, ref_dq, bwd_bound, dtype),
                        "lse_gpu_bound": float(np.max(np.abs(lse - ref_lse) / lse_bound))
                        if np.all(np.isfinite(lse)) else float("inf")}
        for a in (out_b, lse, dq_b):
            digest.update(np.ascontiguousarray(a).tobytes())
    print(json.dumps({"errors": errors, "digest": digest.hexdigest()}))


def test_bits_helpers():
    x = np.array([1.0, 1.0 + 2**-11, 1.0 + 3 * 2**-11, 2.0**-24, 2.0**-25, 65520.0, -np.inf])
    b, r = to_bits(x, "f16")  # ties to even, the smallest subnormal, its half (tie to 0), overflow to inf
    np.testing.assert_array_equal(r, [1.0, 1.0, 1.0 + 2**-9, 2.0**-24, 0.0, np.inf, -np.inf])
    np.testing.assert_array_equal(from_bits(b, "f16"), r)
    b, r = to_bits(np.array([1.0 + 2**-8, -2.5]), "bf16")
    np.testing.assert_array_equal(from_bits(b, "bf16"), [1.0, -2.5])


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_attention_tc_matches_float64_reference(emu, dtype):  # noqa: F811
    if not hasattr(emu, "attention_tc"):
        pytest.skip("gpt2core_cuda_emu has no attention_tc binding")
    check_under_schedules(HERE, dtype, CASES, ("low", "high", "ahead:7"), f"{dtype} tensor-core attention")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_attention_tc_tile_edges(emu, dtype):  # noqa: F811
    """The forward's tile boundaries (T = 1, one key tile and one past it, one query tile and one past it, several of
    each) in a lock-step and a run-ahead schedule (about 25 s each)."""
    if not hasattr(emu, "attention_tc"):
        pytest.skip("gpt2core_cuda_emu has no attention_tc binding")
    check_under_schedules(HERE, f"{dtype}:tiles", TILE_CASES, ("fwd", "ahead:3"), f"{dtype} tensor-core attention")


def test_attention_tc_single_buffer_on_sm75(emu, monkeypatch):  # noqa: F811
    """On sm_75 (no cp.async; 64 KiB of shared memory) the forward keeps one K / V buffer: the same results, under
    a run-ahead schedule (hs = 128 runs too here, though the backend never picks it on sm_75)."""
    if not hasattr(emu, "attention_tc"):
        pytest.skip("gpt2core_cuda_emu has no attention_tc binding")
    monkeypatch.setenv("GPT2CORE_EMU_COMPUTE_CAPABILITY", "75")
    check_under_schedules(HERE, "f16", CASES, ("high",), "fp16 tensor-core attention on sm_75")


@pytest.mark.parametrize(("C", "T", "rows"), [(64, 256, 128), (128, 128, 64)])
def test_forward_never_reads_key_tiles_above_the_diagonal(emu, C, T, rows):  # noqa: F811
    """Keys and values after the first query tile are NaN: that tile's rows (128 for hs = 64, 64 for hs = 128) must
    come out exact, so no key tile above the diagonal was loaded into them (a masked NaN still poisons P V)."""
    if not hasattr(emu, "attention_tc"):
        pytest.skip("gpt2core_cuda_emu has no attention_tc binding")
    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, T, 3 * C))
    x[:, rows:, C:] = np.nan  # K and V of the later keys
    qkv_b, qkv = to_bits(x, "bf16")
    dout_b, _ = to_bits(rng.standard_normal((1, T, C)), "bf16")
    out_b, lse, _ = emu.attention_tc(False, qkv_b, dout_b, np.zeros_like(qkv_b), 1, False, False)
    out = from_bits(out_b, "bf16")[:, :rows]
    ref_out, _, pv_abs, _ = reference(qkv[:, :rows], np.zeros((1, rows, C)), np.zeros((1, rows, 3 * C)), 1, True,
                                      out)
    assert error_ratio(out, ref_out, UNIT["bf16"], pv_abs) <= 1.0
    ref_lse = lse_reference(qkv[:, :rows], 1)
    assert np.all(np.abs(lse[..., :rows] - ref_lse) <= 1e-5 * (1 + np.abs(ref_lse)))


_SMEM_RUN = """
import sys, numpy as np
sys.path.insert(0, sys.argv[1])
import gpt2core_cuda_emu as E
for C in (64, 128):
    x = np.zeros((1, 9, 3 * C), np.uint16) + 0x3c00
    E.attention_tc(True, x, x[:, :, :C].copy(), x.copy(), 1, False, True)
"""


@pytest.mark.parametrize("cc", ["90", "75"])
def test_kernel_resources_knows_the_dynamic_shared_memory(emu, tmp_path, cc):  # noqa: F811
    """scripts/kernel_resources.py's DYNAMIC_SMEM (which its occupancy figures add to ptxas's static shared memory)
    equals what the launchers request, read from the emulator's launch log, for hs = 64 and 128 with two buffers
    (sm_90) and one (sm_75)."""
    sys.path.insert(0, str(HERE.parents[3] / "scripts"))
    import kernel_resources as kr

    log = tmp_path / "launches.jsonl"
    env = dict(os.environ, GPT2CORE_EMU_COMPUTE_CAPABILITY=cc, GPT2CORE_EMU_LAUNCH_LOG=str(log))
    r = subprocess.run([sys.executable, "-c", _SMEM_RUN, str(BUILD)], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    seen = set()
    for line in log.read_text().splitlines():
        rec = json.loads(line)
        name = rec.get("kernel", "").strip("()").split("<")[0]
        if name not in kr.DYNAMIC_SMEM:
            continue
        hs = rec["args"][2]  # T, NH, hs
        stages = 2 if cc == "90" else 1
        assert rec["smem"] == kr.DYNAMIC_SMEM[name](hs, stages), (name, hs, rec)
        seen.add((name, hs))
    assert seen == {(k, hs) for k in kr.DYNAMIC_SMEM for hs in (64, 128)}


# One fp16 attention forward + backward through the backend (OpsF16, attention='flash'), hs = C / NH with C = 64 NH.
_KERNELS_RUN = """
import sys, numpy as np
sys.path.insert(0, sys.argv[1])
import gpt2core_cuda_emu as E
hs, NH, T = int(sys.argv[2]), 2, 9
r = np.random.default_rng(0)
E.OpsF16("cuda", attention="flash").attention(r.standard_normal((1, T, 3 * hs * NH)), r.standard_normal((1, T, hs * NH)),
                                              r.standard_normal((1, T, 3 * hs * NH)), NH)
"""


@pytest.mark.parametrize(("cc", "hs", "tensor_cores"), [("90", 128, True), ("75", 64, True), ("75", 128, False),
                                                       ("70", 64, False)])
def test_fp16_flash_runs_the_kernels_the_gpu_has(emu, tmp_path, cc, hs, tensor_cores):  # noqa: F811
    """attention_tc_fits, on the emulated device's capability (GPT2CORE_EMU_COMPUTE_CAPABILITY): the tensor-core
    kernels from sm_75 (ldmatrix, fp16 m16n8k8), where sm_7x runs hs = 64 only (hs = 128's dkdv kernel would spill
    there); the CUDA-core kernels otherwise. Read from the emulator's launch log."""
    log = tmp_path / "launches.jsonl"
    env = dict(os.environ, GPT2CORE_EMU_COMPUTE_CAPABILITY=cc, GPT2CORE_EMU_LAUNCH_LOG=str(log))
    r = subprocess.run([sys.executable, "-c", _KERNELS_RUN, str(BUILD), str(hs)], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    names = {json.loads(line).get("kernel", "").split("<")[0] for line in log.read_text().splitlines()}
    tc = {"attention_tc_forward_kernel", "attention_tc_backward_dkdv_kernel", "attention_tc_backward_dq_kernel"}
    cuda_cores = {"attention_forward_kernel", "attention_backward_dkdv_kernel", "attention_backward_dq_kernel"}
    assert (tc <= names, cuda_cores & names) == ((True, set()) if tensor_cores else (False, cuda_cores)), names


if __name__ == "__main__":
    run_cases(sys.argv[1], sys.argv[2])
