"""bf16 attention of the emulated CUDA backend (csrc/cuda/attention_tc.cuh's tensor-core forward and backward,
and attention_naive.cuh, with floatX = __nv_bfloat16) through gpt2core_cuda_emu.OpsBF16.attention(qkv, dout, dqkv, NH) -> (out, dqkv),
against a float64 numpy reference of causal attention over the bf16-ROUNDED inputs (the bf16 contract).

Shapes: B=3; T=37 (not a multiple of the 32-row tile), T=9 and T=70; C=192 with head sizes 64 and 16, head size
10 (C=20; not a multiple of the 8-element bf16 pack: scalar loads), head size 128 (C=256); head sizes 64 and 16
again with misaligned buffers (misalign=True: the scalar fallback of the 16-byte pack loads). Both rungs: flash
(default) and naive (the backend's attention option, given when it is made), each under the emulator
schedules fwd, rev and random:7 (GPT2CORE_EMU_SCHED is read once per process, so each run is a subprocess that
runs this file as a script), which must also agree bit for bit (no atomics in the attention kernels).

The third variant, cudnn (attention='cudnn'), is the backend's path through the attention seam
(cuDNN's fused SDPA on GPUs; its CPU implementation, csrc/emu/seams_cpu.cpp, here): the backend's glue (strides,
stats, the self-check against the flash kernel at construction, adding the seam's output into dqkv).

Tolerance, per element: |got - ref| <= 2^-8 |ref| + 1e-5 max|ref| (for dqkv in the cudnn variant
2^-8 (|ref| + |grad|) + 5e-5 max|ref|: the seam's output grad is rounded to bf16 before it is added into dqkv
and rounded again, and the seam's fp32 sums run in another order).
- 2^-8 |ref|: every output is rounded once to bf16 (8 significant bits, round to nearest even: relative error
  at most 2^-8; the contract's "2^-9" is the same bound relative to the top of the binade). That covers out,
  and dqkv, which accumulates in bf16: the kernel reads the bf16 dqkv, adds the fp32 gradient and rounds the sum
  once, so the reference is dqkv_in + grad rounded once.
- 1e-5 max|ref|: the fp32 arithmetic before that rounding (summation order, online softmax: ~n 2^-24 for the
  n <= 768 terms here, as in test_cuda_emu.py's fp32 tolerance).
- flash out: the tensor-core forward rounds P to bf16 for the P V product (as FlashAttention-2; the row sums
  stay fp32): at most 2^-8 relative per term (2^-9 but at the bottom of a binade), so 2^-8 (P |v|) absolute,
  covered by adding P |v| to |ref| in the 2^-8 term.
- flash dqkv: the tensor-core backward rounds P (for dv = P^T dout) and dS (for dq = scale dS K, dk =
  scale dS^T Q) to bf16 the same way: |P|^T |dout|, scale |dS| |K|, scale |dS|^T |Q| are added to |ref|.
- Intermediate bf16 values: the flash backward computes D = dout . out from the STORED (bf16) out, so the
  flash reference does too (D from the out the backend returned: the backward is checked given its forward); the naive backward computes D = sum_j P dP from its fp32
  probabilities, so its reference uses the exact out. Everything else (P, lse, dS, D) stays fp32 in both.
"""
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from test_cuda_emu import BUILD, emu  # noqa: F401  (emu: the fixture that builds and imports gpt2core_cuda_emu)

HERE = Path(__file__).resolve()
REL = 2.0**-8   # one rounding to bf16
ABS = 1e-5      # fp32 arithmetic, relative to the tensor's largest reference value
ABS_SEAM = 5e-5  # the seam's CPU backward sums in another order (scores scaled after the dot product, sequential
                 # sums over up to 70 keys x 64 dims): n 2^-24 with n ~ 768 is 4.6e-5
B = 3
CASES = [  # (name, C, NH, T, misalign)
    ("hs=64", 192, 3, 37, False),
    ("hs=64 T=9", 192, 3, 9, False),
    ("hs=64 T=70", 192, 3, 70, False),
    ("hs=16", 192, 12, 37, False),
    ("hs=10", 20, 2, 9, False),
    ("hs=128", 256, 2, 33, False),
    ("misaligned hs=64", 192, 3, 37, True),
    ("misaligned hs=16", 192, 12, 9, True),
]

try:
    from bf16 import round_bf16  # tests/bf16.py, the shared helper
except ImportError:
    def round_bf16(x):
        """float32 -> nearest bf16 (ties to even), returned as float32; NaN stays NaN."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        u = x.view(np.uint32).astype(np.uint64)
        r = (((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32)
        return np.where(np.isnan(x), x, r).astype(np.float32)


def reference(qkv, dout, dqkv, NH, flash, stored_out=None):
    """float64 causal attention: (out, dqkv + grad, P |v|, grad_abs), inputs already bf16-rounded. grad_abs: the
    gradient's products with |P| and |dS| (the bound on the tensor-core backward's rounding of P and dS). stored_out: the out the
    backend stored (flash: its backward takes D from it), else out rounded to bf16."""
    qkv, dout, dqkv = (np.asarray(a, np.float64) for a in (qkv, dout, dqkv))
    Bq, T, C3 = qkv.shape
    C = C3 // 3
    hs = C // NH
    scale = 1.0 / np.sqrt(hs)
    heads = lambda a: a.reshape(Bq, T, NH, hs).transpose(0, 2, 1, 3)  # noqa: E731  (B, NH, T, hs)
    q, k, v = (heads(qkv[:, :, i * C:(i + 1) * C]) for i in range(3))
    s = scale * q @ k.transpose(0, 1, 3, 2)
    s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
    P = np.exp(s - s.max(-1, keepdims=True))
    P /= P.sum(-1, keepdims=True)
    o = P @ v
    out = o.transpose(0, 2, 1, 3).reshape(Bq, T, C)
    do = heads(dout)
    stored = round_bf16(out.astype(np.float32)) if stored_out is None else stored_out
    o_used = heads(np.asarray(stored, np.float64)) if flash else o
    D = (do * o_used).sum(-1, keepdims=True)
    dS = P * (do @ v.transpose(0, 1, 3, 2) - D)
    to_rows = lambda gs: np.concatenate([g.transpose(0, 2, 1, 3).reshape(Bq, T, C) for g in gs], axis=-1)  # noqa: E731
    grad = to_rows((scale * dS @ k, scale * dS.transpose(0, 1, 3, 2) @ q, P.transpose(0, 1, 3, 2) @ do))
    aS = np.abs(dS)
    grad_abs = to_rows((scale * aS @ np.abs(k), scale * aS.transpose(0, 1, 3, 2) @ np.abs(q),
                        P.transpose(0, 1, 3, 2) @ np.abs(do)))
    # P |v|: the bound on the tensor-core forward's extra rounding (P is rounded to bf16 for the P V product)
    pv_abs = (P @ np.abs(v)).transpose(0, 2, 1, 3).reshape(Bq, T, C)
    return out, dqkv + grad, pv_abs, grad_abs


def error_ratio(got, ref, term=None, abs_=ABS):
    """max over elements of |got - ref| / (REL (|ref| + |term|) + ABS max|ref|): <= 1 passes. term: a value
    rounded to bf16 before it was added into ref (its rounding error scales with |term|, not |ref|)."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    if not np.all(np.isfinite(got)):
        return float("inf")
    extra = 0.0 if term is None else np.abs(np.asarray(term, np.float64))
    return float(np.max(np.abs(got - ref) / (REL * (np.abs(ref) + extra) + abs_ * np.max(np.abs(ref)))))


def run_cases(module_dir, mode):
    """Script mode: every case through OpsBF16 of the module in module_dir with attention=mode; prints one JSON object
    {"errors": {case: {"out": ratio, "dqkv": ratio}}, "digest": sha256 of all outputs}."""
    sys.path.insert(0, str(module_dir))
    import gpt2core_cuda_emu as E

    flash = mode != "naive"  # the cudnn seam also takes D from the stored bf16 out
    # cudnn: the seam writes the gradient rounded to bf16, which the backend then adds to dqkv (a second
    # rounding): the first rounding's error scales with |grad|
    rng = np.random.default_rng(2024)
    errors, digest = {}, hashlib.sha256()
    for name, C, NH, T, misalign in CASES:
        qkv = round_bf16(rng.standard_normal((B, T, 3 * C)))
        dout = round_bf16(rng.standard_normal((B, T, C)))
        dqkv = round_bf16(rng.standard_normal((B, T, 3 * C)))
        out, dq = E.OpsBF16("cuda", misalign=misalign, attention=mode).attention(qkv, dout, dqkv, NH)
        ref_out, ref_dq, pv_abs, grad_abs = reference(qkv, dout, dqkv, NH, flash, out if mode == "flash" else None)
        assert out.shape == ref_out.shape and dq.shape == ref_dq.shape, name
        assert np.array_equal(round_bf16(out), out) and np.array_equal(round_bf16(dq), dq), name  # bf16 values
        errors[name] = {"out": error_ratio(out, ref_out, pv_abs if mode == "flash" else None), "dqkv": error_ratio(dq, ref_dq, *((ref_dq - dqkv, ABS_SEAM) if mode == "cudnn" else (grad_abs,) if mode == "flash" else ()))}
        digest.update(np.ascontiguousarray(out, np.float32).tobytes())
        digest.update(np.ascontiguousarray(dq, np.float32).tobytes())
    print(json.dumps({"errors": errors, "digest": digest.hexdigest()}))


def test_round_bf16_helper():
    x = np.array([1.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, 1.0 + 2**-7 + 2**-9, -2.5, 3.4e38, np.inf, np.nan], np.float32)
    want = np.array([1.0, 1.0, 1.0 + 2**-6, 1.0 + 2**-7, -2.5, np.inf, np.inf, np.nan], np.float32)
    np.testing.assert_array_equal(round_bf16(x), want)  # ties to even, overflow to inf, NaN kept


def check_under_schedules(script, arg, cases, schedules, what):
    """Runs `script BUILD arg` (script mode: prints {"errors": {case: {output: ratio}}, "digest": ...}) once per
    emulator schedule; every ratio must be <= 1 and the digests of all schedules equal (bit-reproducible)."""
    digests = {}
    for sched in schedules:
        env = dict(os.environ, GPT2CORE_EMU_SCHED=sched)
        r = subprocess.run([sys.executable, str(script), str(BUILD), arg], env=env, capture_output=True, text=True,
                           timeout=900)
        assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
        res = json.loads(r.stdout.strip().splitlines()[-1])
        assert {name for name, *_ in cases} == set(res["errors"])
        bad = {k: v for k, v in res["errors"].items() if not max(v.values()) <= 1.0}
        assert not bad, f"{what} outside the tolerance under {sched}: {bad}"
        digests[sched] = res["digest"]
    assert len(set(digests.values())) == 1, f"{what} differs between schedules: {digests}"


@pytest.mark.parametrize("variant", ["flash", "naive", "cudnn"])  # cudnn: the seam's CPU implementation here
def test_bf16_attention_matches_float64_reference(emu, variant):  # noqa: F811
    if not hasattr(emu, "OpsBF16"):
        pytest.skip("gpt2core_cuda_emu has no OpsBF16 yet (bf16 test bindings)")
    check_under_schedules(HERE, variant, CASES, ("fwd", "rev", "random:7"), f"bf16 {variant} attention")


if __name__ == "__main__":
    run_cases(sys.argv[1], sys.argv[2])
