"""The cuBLASLt translation of the matmul seam (csrc/cuda/seams_cublaslt.cu), run for real without a GPU.

Under the emulator the seam's CPU implementation (csrc/emu/seams_cpu.cpp) replaces cuBLASLt, so the code that turns
a matmul into cuBLASLt descriptors never runs in CI. cuBLASLt's descriptor calls need neither a handle nor a driver
(only cublasLtCreate, the heuristic and cublasLtMatmul do), so here the real describe_matmul, linked against
NVIDIA's libcublasLt, builds the call for every precision (fp32, TF32, bf16, fp16, and bf16 / fp16 inputs into an
fp32 D: the weight-gradient path), every epilogue (bias, GELU with and without bias and aux, GELU backward, bias
gradient), both transposes, accumulation and batching,
with pointers of every alignment; tests/csrc/cuda/cublaslt/describe.cpp reads every attribute back through cuBLASLt's
Get*Attribute calls. `interpret` below evaluates what was read back -- and nothing else -- with cuBLASLt's
documented column-major semantics (cublasLt.h):
    D = epilogue(alpha * op(A) op(B) + beta * C), op by TRANSA / TRANSB, each matrix (rows, cols, ld, batch count,
    batch stride) in column order at its pointer; BIAS adds the bias vector (length D rows) to every column;
    GELU applies gelu (tanh form, see csrc/cuda/matmul.cuh) and the AUX variants store its input in the aux matrix
    (ld AUX_LD, batch stride AUX_BATCH_STRIDE, D's type when AUX_DATA_TYPE is unset); DGELU multiplies by gelu' of
    the aux matrix; BGRADB stores, at the bias pointer in BIAS_DATA_TYPE, the sums over k of op(B) per column of D
    (overwriting); TF32 compute rounds A and B to 10 mantissa bits.
and that must equal the seam's CPU implementation run on the same buffers.

Needs g++, cublasLt.h and libcublasLt (skipped without them) and the emulated module (for the CPU seam).
"""
import ctypes
import hashlib
import itertools
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from test_cuda_emu import emu  # noqa: F401  (fixture)
from test_emu import ROOT, _seam_cuda_include as _cuda_include

CUDA_R_32F, CUDA_R_16F, CUDA_R_16BF = 0, 2, 14     # library_types.h
CUDA_R_8F_E4M3, CUDA_R_8F_E5M2 = 28, 29
COMPUTE_32F, COMPUTE_32F_FAST_TF32 = 68, 77      # cublas_api.h
OP_N, OP_T = 0, 1
ORDER_COL = 0
# cublasLtEpilogue_t values -> what they do (cublasLt.h)
EPILOGUES = {1: set(), 4: {"bias"}, 32: {"gelu"}, 36: {"bias", "gelu"}, 160: {"gelu", "aux"},
             164: {"bias", "gelu", "aux"}, 192: {"dgelu"}, 512: {"bgradb"}}
F32, BF16, F16, E4M3, E5M2 = 0, 1, 2, 3, 4        # seams::DType
NONE, GELU, GELU_BACKWARD = 0, 1, 2              # seams::Epilogue
SOURCES = [ROOT / "csrc" / "cuda" / "seams_cublaslt.cu", ROOT / "tests" / "csrc" / "cuda" / "cublaslt" / "describe.cpp"]
HEADERS = [ROOT / "csrc" / "cuda" / h for h in ("seams_cublaslt_call.h", "seams_cublaslt.h", "seams_check.h")] + [
    ROOT / "csrc" / "cuda" / "seams.h"]


class SeamParams(ctypes.Structure):
    _fields_ = [(f, ctypes.c_uint64) for f in ("d", "a", "b", "bias", "pre_gelu")] + [
        (f, ctypes.c_int32) for f in ("d_type", "a_type", "b_type", "lda", "ldb", "ldd", "trans_a", "trans_b", "m",
                                      "n", "k", "accumulate", "epilogue", "batch", "tf32")] + [
        ("alpha", ctypes.c_float)] + [(f, ctypes.c_int64) for f in ("stride_a", "stride_b", "stride_d")] + [
        ("bias_grad", ctypes.c_uint64), ("a_scale", ctypes.c_uint64), ("b_scale", ctypes.c_uint64)]


class Layout(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int32), ("order", ctypes.c_int32), ("batch_count", ctypes.c_int32),
                ("rows", ctypes.c_uint64), ("cols", ctypes.c_uint64), ("ld", ctypes.c_int64),
                ("batch_stride", ctypes.c_int64)]


class Described(ctypes.Structure):
    _fields_ = [(f, ctypes.c_int32) for f in ("compute_type", "scale_type", "transa", "transb", "bias_type",
                                              "aux_type")] + [
        ("epilogue", ctypes.c_uint32), ("bias", ctypes.c_uint64), ("aux", ctypes.c_uint64),
        ("aux_ld", ctypes.c_int64), ("aux_batch_stride", ctypes.c_int64)] + [
        (f, Layout) for f in ("a", "b", "c", "d")] + [("max_workspace", ctypes.c_uint64)] + [
        (f, ctypes.c_uint32) for f in ("align_a", "align_b", "align_c", "align_d")] + [
        (f, ctypes.c_uint64) for f in ("A", "B", "C", "D")] + [("alpha", ctypes.c_float), ("beta", ctypes.c_float)] + [
        ("a_scale", ctypes.c_uint64), ("b_scale", ctypes.c_uint64), ("fast_accum", ctypes.c_int32)]


def _cublaslt():
    inc = _cuda_include()
    if shutil.which("g++") is None or inc is None or not (inc / "cublasLt.h").exists():
        pytest.skip("needs g++ and cublasLt.h")
    libdirs = [d for d in (inc.parent / "lib64", inc.parent / "lib") if list(d.glob("libcublasLt.so*"))]
    if not libdirs:
        pytest.skip("libcublasLt not found")
    return inc, libdirs[0]


@pytest.fixture(scope="module")
def describe():
    inc, lib = _cublaslt()
    # one build per toolkit (GPT2CORE_SEAM_CUDA_HOME may name a CUDA 12 tree: .ci/cuda_pypi.sh runs these tests against both majors)
    out = ROOT / "build" / f"cublaslt-{hashlib.sha1(str(inc).encode()).hexdigest()[:10]}" / "libdescribe.so"
    out.parent.mkdir(parents=True, exist_ok=True)
    if not out.exists() or any(p.stat().st_mtime > out.stat().st_mtime for p in SOURCES + HEADERS):
        cmd = ["g++", "-std=c++17", "-O1", "-fPIC", "-shared", "-Wall", "-Wextra", "-Werror", f"-I{ROOT / 'csrc'}",
               f"-isystem{inc}", "-x", "c++", str(SOURCES[0]), "-x", "none", str(SOURCES[1]), f"-L{lib}",
               "-lcublasLt", "-lcudart", f"-Wl,-rpath,{lib}", "-o", str(out)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-4000:]
    so = ctypes.CDLL(str(out))
    so.gpt2_describe_matmul.argtypes = [ctypes.POINTER(SeamParams), ctypes.POINTER(Described), ctypes.c_char_p,
                                        ctypes.c_int]

    def run(params):
        d, err = Described(), ctypes.create_string_buffer(1024)
        assert so.gpt2_describe_matmul(ctypes.byref(params), ctypes.byref(d), err, 1024) == 0, err.value.decode()
        return d
    return run


# ------------------------------------------------------------------------------------------ memory and types
def bf16_bits(x):
    """float32 -> bf16 bits, round to nearest even (no NaNs here)."""
    b = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)


def tf32(x):
    """fp32 -> TF32 (10 mantissa bits), round to nearest."""
    b = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((b + 0x1000) & 0xFFFFE000).astype(np.uint32).view(np.float32).astype(np.float64)


def read(ptr, type_, rows, cols, ld, batch_stride, batch):
    """Column-major (rows, cols) matrix number `batch` at address ptr, as float64."""
    size = {CUDA_R_32F: 4, CUDA_R_8F_E4M3: 1, CUDA_R_8F_E5M2: 1}.get(type_, 2)
    n = (rows - 1) + (cols - 1) * ld + 1
    raw = np.ctypeslib.as_array(({4: ctypes.c_float, 2: ctypes.c_uint16, 1: ctypes.c_uint8}[size] * n).from_address(
        ptr + batch * batch_stride * size))
    if size == 1:  # FP8: decoded by ml_dtypes, independently of the C++ conversion
        import ml_dtypes
        fp8 = ml_dtypes.float8_e4m3fn if type_ == CUDA_R_8F_E4M3 else ml_dtypes.float8_e5m2
        return raw.view(fp8).astype(np.float64)[np.arange(rows)[:, None] + np.arange(cols)[None, :] * ld]
    widen = {CUDA_R_32F: lambda r: r, CUDA_R_16F: lambda r: r.view(np.float16),
             CUDA_R_16BF: lambda r: (r.astype(np.uint32) << 16).view(np.float32)}[type_]
    vals = widen(raw).astype(np.float64)
    return vals[np.arange(rows)[:, None] + np.arange(cols)[None, :] * ld]


def matrix(layout, ptr, batch):
    return read(ptr, layout.type, layout.rows, layout.cols, layout.ld, layout.batch_stride, batch)


def gelu(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def gelu_grad(x):
    t = np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3))
    return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * np.sqrt(2 / np.pi) * (1 + 3 * 0.044715 * x * x)


def interpret(ds):
    """What the described cublasLtMatmul computes, per batch: (D, aux or None, magnitude for tolerances, bias
    gradient or None)."""
    assert all(lay.order == ORDER_COL for lay in (ds.a, ds.b, ds.c, ds.d))
    assert ds.scale_type == CUDA_R_32F  # alpha, beta and the epilogue in fp32
    epi = EPILOGUES[ds.epilogue]
    batches = {lay.batch_count for lay in (ds.a, ds.b, ds.c, ds.d)}
    assert len(batches) == 1, batches
    out = []
    for bi in range(batches.pop()):
        a, b, c = matrix(ds.a, ds.A, bi), matrix(ds.b, ds.B, bi), matrix(ds.c, ds.C, bi)
        if ds.compute_type == COMPUTE_32F_FAST_TF32:
            a, b = tf32(a), tf32(b)
        else:
            assert ds.compute_type == COMPUTE_32F
        if ds.a_scale or ds.b_scale:  # FP8: the dequantisation factors (one float each, device memory)
            assert ds.compute_type == COMPUTE_32F and ds.fast_accum == 0
            a = a * (ctypes.c_float.from_address(ds.a_scale).value if ds.a_scale else 1.0)
            b = b * (ctypes.c_float.from_address(ds.b_scale).value if ds.b_scale else 1.0)
        opa, opb = (a if ds.transa == OP_N else a.T), (b if ds.transb == OP_N else b.T)
        assert opa.shape[1] == opb.shape[0] and (opa.shape[0], opb.shape[1]) == (ds.d.rows, ds.d.cols)
        assert c.shape == (ds.d.rows, ds.d.cols)
        v = ds.alpha * (opa @ opb) + ds.beta * c
        mag = abs(ds.alpha) * (np.abs(opa) @ np.abs(opb)) + abs(ds.beta * c)
        if "bias" in epi:
            assert ds.bias_type == ds.d.type
            bias = read(ds.bias, ds.bias_type, ds.d.rows, 1, ds.d.rows, 0, 0)
            v, mag = v + bias, mag + np.abs(bias)
        bgrad = opb.sum(0) if "bgradb" in epi else None  # per column of D, over k
        aux_type = ds.d.type if ds.aux_type == -1 else ds.aux_type
        aux = None
        if "gelu" in epi:
            if "aux" in epi:
                aux = v
            v = gelu(v)
        if "dgelu" in epi:
            v = v * gelu_grad(read(ds.aux, aux_type, ds.d.rows, ds.d.cols, ds.aux_ld, ds.aux_batch_stride, bi))
        out.append((v, aux, mag, bgrad))
    return out


# ------------------------------------------------------------------------------------------ the cases
def buffer(rng, n, dtype, offset, keep):
    """n random values of seams dtype at `offset` bytes into a fresh buffer (kept alive in `keep`): the address."""
    size = 4 if dtype == F32 else 2
    raw = np.zeros(n * size + offset + 256, np.uint8)
    base = (-raw.ctypes.data) % 256  # 256-aligned start, then the offset under test
    view = raw[base + offset: base + offset + n * size]
    vals = rng.uniform(-1, 1, n).astype(np.float32)
    view[:] = {F32: vals, BF16: bf16_bits(vals), F16: vals.astype(np.float16)}[dtype].view(np.uint8)
    keep.append(raw)
    return view.ctypes.data


def cases():
    # (a_type, b_type, d_type, tf32): fp32, TF32, bf16, fp16, and the weight-gradient paths (bf16 / fp16 inputs into
    # an fp32 D)
    precisions = [(F32, F32, F32, 0), (F32, F32, F32, 1), (BF16, BF16, BF16, 0), (BF16, BF16, F32, 0),
                  (F16, F16, F16, 0), (F16, F16, F32, 0)]
    # (epilogue, bias, pre_gelu, accumulate, bias_grad): every combination the seam accepts (bias_grad: batch 1)
    epilogues = [(NONE, 0, 0, 0, 0), (NONE, 1, 0, 0, 0), (NONE, 0, 0, 1, 0), (NONE, 1, 0, 1, 0), (GELU, 0, 0, 0, 0),
                 (GELU, 1, 0, 0, 0), (GELU, 0, 1, 0, 0), (GELU, 1, 1, 0, 0), (GELU_BACKWARD, 0, 1, 0, 0),
                 (NONE, 0, 0, 0, 1), (NONE, 0, 0, 1, 1)]
    for i, (prec, epi, ta, tb, batch) in enumerate(itertools.product(precisions, epilogues, (0, 1), (0, 1), (1, 3))):
        if not (epi[4] and batch > 1):
            yield i, prec, epi, ta, tb, batch


def test_cublaslt_descriptors_describe_the_seams_matmul(emu, describe):  # noqa: F811
    checked = 0
    for i, (a_t, b_t, d_t, use_tf32), (epi, has_bias, has_aux, acc, has_bgrad), ta, tb, batch in cases():
        rng = np.random.default_rng(i)
        m, n, k = rng.integers(3, 24, 3)
        lda = (m if ta else k) + int(rng.integers(0, 3))
        ldb = (k if tb else n) + int(rng.integers(0, 3))
        ldd = n + int(rng.integers(0, 3))
        sa, sb, sd = (k if ta else m) * lda + 5, (n if tb else k) * ldb + 3, m * ldd + 7
        keep = []
        # byte offsets from a 256-aligned address: every alignment from the element size to 256
        off = [int(rng.choice([0, 4, 8, 16, 64] if t == F32 else [0, 2, 4, 8, 16, 64]))
               for t in (a_t, b_t, d_t, d_t, d_t, d_t)]
        p = SeamParams(a=buffer(rng, batch * sa, a_t, off[0], keep), b=buffer(rng, batch * sb, b_t, off[1], keep),
                       d=buffer(rng, batch * sd, d_t, off[2], keep),
                       bias=buffer(rng, n, d_t, off[3], keep) if has_bias else 0,
                       pre_gelu=buffer(rng, batch * sd, d_t, off[4], keep) if has_aux else 0,
                       bias_grad=buffer(rng, m, d_t, off[5], keep) if has_bgrad else 0,
                       d_type=d_t, a_type=a_t, b_type=b_t, lda=lda, ldb=ldb, ldd=ldd, trans_a=ta, trans_b=tb, m=m,
                       n=n, k=k, accumulate=acc, epilogue=epi, batch=batch, tf32=use_tf32,
                       alpha=float(rng.choice([1.0, 0.5, -1.25])),
                       stride_a=sa if batch > 1 else 0, stride_b=sb if batch > 1 else 0,
                       stride_d=sd if batch > 1 else 0)
        ds = describe(p)
        what = f"case {i}: {(a_t, b_t, d_t, use_tf32)} epilogue {(epi, has_bias, has_aux, acc, has_bgrad)} " \
               f"ta={ta} tb={tb} batch={batch}"
        # what cublasLtMatmul would receive, beyond the math: cuBLASLt's A is our B and its B our A (D^T = B^T A^T)
        assert (ds.A, ds.B, ds.C, ds.D) == (p.b, p.a, p.d, p.d), what
        assert ds.aux_type == -1, what  # left at its default (D's type): explicit types are for narrow precisions
        assert ds.max_workspace == 32 << 20, what
        es = {F32: 4, BF16: 2, F16: 2}

        def align(ptr, ld, t, stride):  # what the pointer, ld and batch stride guarantee, at most 256
            bits = ptr | (ld * es[t]) | (stride * es[t] if batch > 1 else 0) | 256
            return bits & -bits
        assert (ds.align_a, ds.align_b, ds.align_c, ds.align_d) == (
            align(p.b, ldb, b_t, sb), align(p.a, lda, a_t, sa), align(p.d, ldd, d_t, sd),
            align(p.d, ldd, d_t, sd)), what
        want_compute = COMPUTE_32F_FAST_TF32 if use_tf32 and a_t == b_t == d_t == F32 else COMPUTE_32F
        assert ds.compute_type == want_compute, what
        if has_bgrad:  # the gradient's output is cuBLASLt's bias pointer, in D's type
            assert (ds.epilogue, ds.bias, ds.bias_type) == (512, p.bias_grad, ds.d.type), what

        expected = interpret(ds)  # before the seam writes D (and aux)
        assert emu.seam_matmul(d=p.d, a=p.a, b=p.b, bias=p.bias, pre_gelu=p.pre_gelu, d_type=d_t, a_type=a_t,
                               b_type=b_t, lda=lda, ldb=ldb, ldd=ldd, trans_a=bool(ta), trans_b=bool(tb), m=m, n=n,
                               k=k, alpha=p.alpha, accumulate=bool(acc), epilogue=epi, batch=batch,
                               stride_a=p.stride_a, stride_b=p.stride_b, stride_d=p.stride_d,
                               bias_grad=p.bias_grad) == 0, what
        # fp32 sums of <= 23 products: ~1e-6 of the magnitude; TF32 inputs (2^-11 relative each) against the seam's
        # fp32 ones: 1e-3; a bf16 / fp16 D: one rounding (2^-8 / 2^-11 relative), possibly to the other neighbour
        rel = 1e-3 if want_compute == COMPUTE_32F_FAST_TF32 else 4e-6
        for bi, (v, aux, mag, bgrad) in enumerate(expected):
            if bgrad is not None:  # sums of k products (fp32, or TF32-rounded inputs); a 16-bit output: one rounding
                got = read(ds.bias, ds.bias_type, ds.d.cols, 1, ds.d.cols, 0, 0)[:, 0]
                bmag = np.abs(matrix(ds.b, ds.B, bi)).sum(0 if ds.transb == OP_N else 1)
                tol = rel * bmag * 1.2 + {F32: 0.0, BF16: 2.0 ** -8, F16: 2.0 ** -11}[d_t] * np.abs(bgrad)
                assert np.all(np.abs(got - bgrad) <= tol), f"{what}: bias gradient {got} vs {bgrad}"
            for got_ptr, want in ((ds.D, v), (ds.aux, aux)):
                if want is None:
                    continue
                got = read(got_ptr, ds.d.type, ds.d.rows, ds.d.cols, ds.d.ld if got_ptr == ds.D else ds.aux_ld,
                           ds.d.batch_stride if got_ptr == ds.D else ds.aux_batch_stride, bi)
                tol = rel * (mag + 1e-30) * 1.2 + {F32: 0.0, BF16: 2.0 ** -8, F16: 2.0 ** -11}[d_t] * np.abs(want)
                bad = np.abs(got - want) > tol
                assert not bad.any(), f"{what} batch {bi} {'D' if got_ptr == ds.D else 'aux'}: " \
                                      f"{np.argwhere(bad)[:3].tolist()} {got[bad][:3]} vs {want[bad][:3]}"
        checked += 1
    assert checked == 6 * 9 * 2 * 2 * 2 + 6 * 2 * 2 * 2


def test_the_describer_runs_the_toolkits_own_cublaslt(describe):
    """The library these checks ran against is the toolkit's (GPT2CORE_SEAM_CUDA_HOME may name the CUDA 12 tree assembled from
    NVIDIA's cu12 wheels, .ci/cuda_pypi.sh): cuBLASLt's own version and CUDA runtime match that toolkit's cuda.h."""
    import re
    inc, _ = _cublaslt()
    want = int(re.search(r"#define CUDA_VERSION (\d+)", (inc / "cuda.h").read_text()).group(1))
    maps = [ln.split()[-1] for ln in open("/proc/self/maps") if "libcublasLt.so" in ln]
    lt = ctypes.CDLL(maps[0])
    lt.cublasLtGetCudartVersion.restype = lt.cublasLtGetVersion.restype = ctypes.c_size_t
    assert lt.cublasLtGetCudartVersion() // 1000 == want // 1000, (maps[0], lt.cublasLtGetCudartVersion(), want)
    assert lt.cublasLtGetVersion() // 10000 == want // 1000
    print(f"cuBLASLt {lt.cublasLtGetVersion()} (CUDA runtime {lt.cublasLtGetCudartVersion()}) from {maps[0]}")


# ------------------------------------------------------------------------------------------ FP8
def fp8_buffer(rng, n, dtype, offset, keep):
    """n random finite fp8 values of seams dtype E4M3 / E5M2 (many binades, subnormals included) at `offset` bytes
    into a fresh 256-aligned buffer (kept alive in `keep`): the address."""
    import ml_dtypes
    raw = np.zeros(n + offset + 256, np.uint8)
    base = (-raw.ctypes.data) % 256
    view = raw[base + offset: base + offset + n]
    vals = rng.uniform(-2, 2, n) * 2.0 ** rng.integers(-9, 7, n)
    view[:] = vals.astype(np.float32).astype(ml_dtypes.float8_e4m3fn if dtype == E4M3 else
                                             ml_dtypes.float8_e5m2).view(np.uint8)
    assert np.isfinite(view.view(ml_dtypes.float8_e5m2 if dtype == E5M2 else ml_dtypes.float8_e4m3fn)
                       .astype(np.float32)).all()
    keep.append(raw)
    return view.ctypes.data


def test_cublaslt_descriptors_describe_the_fp8_matmul(emu, describe):  # noqa: F811
    """FP8 inputs ("TN": trans_a false, trans_b true), every input pair cuBLASLt takes (e4m3 x e4m3, e5m2 x e4m3,
    e4m3 x e5m2), D in bf16 / fp32 / fp16, with and without bias and accumulation: the scale pointers reach
    cuBLASLt swapped like the operands, fast accumulation stays off, and what the descriptors say (interpreted with
    ml_dtypes' decoding) equals the emulator's seam on the same buffers."""
    keep, checked = [], 0
    for i, ((a_t, b_t), d_t, (has_bias, acc)) in enumerate(itertools.product(
            [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)], (BF16, F32, F16), [(0, 0), (1, 0), (0, 1), (1, 1)])):
        if has_bias and d_t == F32:
            continue  # NotSupported (cuBLASLt's FP8 kernels take a bf16 bias for an fp32 D): checked below
        rng = np.random.default_rng(1000 + i)
        m, n, k = int(rng.integers(1, 40)), 8 * int(rng.integers(1, 6)), 16 * int(rng.integers(1, 5))
        lda, ldb = k + 16 * int(rng.integers(0, 2)), k + 16 * int(rng.integers(0, 2))
        ldd = n + 8 * int(rng.integers(0, 2))
        scales = [np.array([v], np.float32) for v in (2.0 ** rng.integers(-5, 5), rng.choice([0.375, 3.0, 2.0 ** -7]))]
        keep += scales
        p = SeamParams(a=fp8_buffer(rng, m * lda, a_t, int(rng.choice([0, 16, 32])), keep),
                       b=fp8_buffer(rng, n * ldb, b_t, int(rng.choice([0, 16, 64])), keep),
                       d=buffer(rng, m * ldd, d_t, int(rng.choice([0, 16])), keep),
                       bias=buffer(rng, n, d_t, int(rng.choice([0, 2, 16])), keep) if has_bias else 0,
                       d_type=d_t, a_type=a_t, b_type=b_t, lda=lda, ldb=ldb, ldd=ldd, trans_a=0, trans_b=1, m=m,
                       n=n, k=k, accumulate=acc, epilogue=NONE, batch=1, tf32=0,
                       alpha=float(rng.choice([1.0, 0.5, -1.25])),
                       a_scale=scales[0].ctypes.data, b_scale=scales[1].ctypes.data)
        what = f"fp8 case {i}: a {a_t} b {b_t} d {d_t} bias {has_bias} accumulate {acc} (m, n, k) {(m, n, k)}"
        ds = describe(p)
        assert (ds.A, ds.B, ds.a_scale, ds.b_scale) == (p.b, p.a, p.b_scale, p.a_scale), what  # swapped together
        assert ds.fast_accum == 0 and ds.compute_type == COMPUTE_32F, what
        assert (ds.a.type, ds.b.type) == tuple({E4M3: CUDA_R_8F_E4M3, E5M2: CUDA_R_8F_E5M2}[t] for t in (b_t, a_t))
        assert (ds.transa, ds.transb) == (OP_T, OP_N), what  # cuBLASLt's "TN", the only FP8 layout on sm_89 / sm_90
        if has_bias:
            assert ds.bias_type == ds.d.type, what
        expected = interpret(ds)
        assert emu.seam_matmul(d=p.d, a=p.a, b=p.b, bias=p.bias, pre_gelu=0, d_type=d_t, a_type=a_t, b_type=b_t,
                               lda=lda, ldb=ldb, ldd=ldd, trans_a=False, trans_b=True, m=m, n=n, k=k, alpha=p.alpha,
                               accumulate=bool(acc), epilogue=NONE, batch=1, stride_a=0, stride_b=0, stride_d=0,
                               a_scale=p.a_scale, b_scale=p.b_scale) == 0, what
        v, _, mag, _ = expected[0]
        got = read(ds.D, ds.d.type, ds.d.rows, ds.d.cols, ds.d.ld, 0, 0)
        # products of fp8 values are exact in fp32; sums of <= 64 of them: ~4e-6 of the magnitude (fp32 order);
        # a non-power-of-two scale applied to the sum rather than to each input: a few fp32 roundings more;
        # a 16-bit D: one rounding
        tol = 8e-6 * mag + {F32: 0.0, BF16: 2.0 ** -8, F16: 2.0 ** -11}[d_t] * np.abs(v)
        bad = np.abs(got - v) > tol
        assert not bad.any(), f"{what}: {np.argwhere(bad)[:3].tolist()} {got[bad][:3]} vs {v[bad][:3]}"
        checked += 1
    assert checked == 3 * 3 * 4 - 3 * 2


def test_fp8_matmul_params_cublaslt_refuses_are_refused_by_the_seam(emu):  # noqa: F811
    """The FP8 rules of seams.h, as every implementation checks them (validate_matmul): what cuBLASLt's FP8 kernels
    cannot take is refused before any work, with InvalidValue (layout, types, sizes, alignment) or NotSupported
    (epilogues, batching, an fp32 D with a bias), and the same params with k = 16 and TN are accepted."""
    keep = []
    a = np.zeros(4096 + 256, np.uint8)
    keep.append(a)
    base = a.ctypes.data + (-a.ctypes.data) % 256
    ok = dict(d=base + 2048, a=base, b=base + 1024, bias=0, pre_gelu=0, d_type=BF16, a_type=E4M3, b_type=E4M3,
              lda=16, ldb=16, ldd=16, trans_a=False, trans_b=True, m=4, n=16, k=16, alpha=1.0, accumulate=False,
              epilogue=NONE, batch=1, stride_a=0, stride_b=0, stride_d=0)
    assert emu.seam_matmul(**ok) == 0
    invalid, not_supported = 1, 801  # cudaErrorInvalidValue, cudaErrorNotSupported
    for change in [dict(trans_b=False), dict(trans_a=True, lda=16), dict(k=8, lda=16, ldb=16), dict(lda=24),
                   dict(ldb=8), dict(a_type=E5M2, b_type=E5M2), dict(a_type=BF16), dict(b_type=F32),
                   dict(a=base + 8), dict(b=base + 1024 + 4), dict(d=base + 2048 + 2), dict(ldd=12),
                   dict(d_type=E4M3), dict(a_type=BF16, b_type=BF16, a_scale=base + 3072)]:
        assert emu.seam_matmul(**{**ok, **change}) == invalid, change
    for change in [dict(epilogue=GELU), dict(batch=2, stride_a=64, stride_b=256, stride_d=64),
                   dict(bias_grad=base + 3072), dict(d_type=F32, bias=base + 3072)]:
        assert emu.seam_matmul(**{**ok, **change}) == not_supported, change
