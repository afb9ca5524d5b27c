"""The cuDNN frontend graph of the attention seam (csrc/cuda/seams_cudnn.cu), assembled for real without a GPU.

Under the emulator the seam's CPU implementation replaces cuDNN. Assembling the frontend graph needs no handle
(validate() and everything after it need a device), and Graph::print() describes it: every tensor's uid, dims,
strides and type, and the SDPA node's scale, causal band and stats flag. tests/csrc/cuda/cudnn/describe.cpp returns that
description with the variant pack (uid -> address) the seam would execute it with; `forward` and `backward` below
evaluate the description -- and nothing else -- as cuDNN documents SDPA:
    S = attn_scale * Q K^T, keys outside the diagonal band masked (TOP_LEFT alignment: key j allowed for query i
    when j - i <= right_bound and, with a left bound l, i - j < l); O = softmax(S) V; Stats = logsumexp of each row
    of S (fp32); backward from (Q, K, V, O, dO, Stats): P = exp(S - Stats), dV = P^T dO, dS = P (dO V^T - rowsum(dO O)),
    dQ = attn_scale dS K, dK = attn_scale dS^T Q,
each tensor read and written through its own dims and strides at its pack address. That must equal the seam's CPU
implementation on the same buffers, forward and backward, for several shapes and scales.

Needs g++, cuDNN (cudnn.h, libcudnn, libnvrtc) and the frontend headers (skipped without them), and the emulated
module (for the CPU seam).
"""
import ctypes
import hashlib
import importlib.metadata as md
import json
import os
import shutil
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest

from test_cublaslt_descriptors import bf16_bits
from test_cuda_emu import emu  # noqa: F401  (fixture)
from test_emu import ROOT, _seam_cuda_include as _cuda_include

SOURCES = [ROOT / "csrc" / "cuda" / "seams_cudnn.cu", ROOT / "tests" / "csrc" / "cuda" / "cudnn" / "describe.cpp"]
HEADERS = [ROOT / "csrc" / "cuda" / h for h in ("seams_cudnn_graph.h", "seams_cudnn.h", "seams_check.h")] + [
    ROOT / "csrc" / "cuda" / "seams.h"]
SIZES = {"BFLOAT16": 2, "HALF": 2, "FLOAT": 4}
SEAM_DTYPE = {"BFLOAT16": 1, "HALF": 2}  # gpt2core::seams::DType


def _frontend_include():
    try:
        for f in md.files("nvidia-cudnn-frontend") or []:
            if str(f).replace(os.sep, "/").endswith("include/cudnn_frontend.h"):
                return Path(f.locate()).resolve().parent
    except md.PackageNotFoundError:
        pass
    inc = _cuda_include()
    return inc if inc and (inc / "cudnn_frontend.h").exists() else None


@pytest.fixture(scope="module")
def describe():
    inc, fe = _cuda_include(), _frontend_include()
    if shutil.which("g++") is None or inc is None or fe is None or not (inc / "cudnn.h").exists():
        pytest.skip("needs g++, cudnn.h and the cuDNN frontend headers")
    libs = [d for d in (inc.parent / "lib64", inc.parent / "lib") if list(d.glob("libcudnn.so*"))]
    if not libs:
        pytest.skip("libcudnn not found")
    # one build per toolkit (GPT2CORE_SEAM_CUDA_HOME may name a CUDA 12 tree: .ci/cuda_pypi.sh runs these tests against both majors)
    out = ROOT / "build" / f"cudnn-{hashlib.sha1(str(inc).encode()).hexdigest()[:10]}" / "libdescribe.so"
    out.parent.mkdir(parents=True, exist_ok=True)
    if not out.exists() or any(p.stat().st_mtime > out.stat().st_mtime for p in SOURCES + HEADERS):
        # -O0: the frontend's headers are large (about a minute of g++ on one core), the code runs once
        cmd = ["g++", "-std=c++17", "-O0", "-fPIC", "-shared", "-Wall", "-Wextra", "-Werror",
               "-DGPT2CORE_HAS_CUDNN_SDPA=1", f"-I{ROOT / 'csrc'}", f"-isystem{inc}", f"-isystem{fe}", "-x", "c++",
               str(SOURCES[0]), "-x", "none", str(SOURCES[1]), f"-L{libs[0]}", "-lcudnn", "-lnvrtc", "-lcudart",
               f"-Wl,-rpath,{libs[0]}", "-o", str(out)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-4000:]
    so = ctypes.CDLL(str(out))

    def run(B, T, NH, HS, scale, backward, dtype, qkv, out_, stats, dout=0, dqkv=0):
        text, err = ctypes.create_string_buffer(1 << 16), ctypes.create_string_buffer(1024)
        uids, addrs, n = (ctypes.c_int64 * 16)(), (ctypes.c_uint64 * 16)(), ctypes.c_int()
        rc = so.gpt2_describe_attention(B, T, NH, HS, ctypes.c_float(scale), int(backward), SEAM_DTYPE[dtype],
                                        ctypes.c_uint64(qkv),
                                        ctypes.c_uint64(out_), ctypes.c_uint64(stats), ctypes.c_uint64(dout),
                                        ctypes.c_uint64(dqkv), text, len(text), uids, addrs, 16, ctypes.byref(n),
                                        err, len(err))
        assert rc == 0, err.value.decode()
        return json.loads(text.value), dict(zip(uids[:n.value], addrs[:n.value]))
    return run


class Graph:
    """A printed frontend graph with its variant pack: tensors by the names the SDPA node gives them."""

    def __init__(self, desc, pack):
        self.j, self.pack = desc, pack
        (self.node,) = desc["nodes"]
        self.tensors = {t["uid"]: t for t in desc["tensors"]}
        self.io = desc["context"]["io_data_type"]

    def tensor(self, name):
        uid = {**self.node["inputs"], **self.node["outputs"]}[name]
        t = self.tensors[uid]
        return t, self.pack[uid], t["data_type"] or self.io

    def offsets(self, name, base):
        """The element offsets from `base` of every element of the 4-d tensor `name` (its dims and strides at
        its pack address)."""
        t, addr, dtype = self.tensor(name)
        start, rem = divmod(addr - base, SIZES[dtype])
        assert rem == 0, name
        return start + sum(np.arange(d).reshape([-1 if i == k else 1 for k in range(4)]) * s
                           for i, (d, s) in enumerate(zip(t["dim"], t["stride"])))

    def read(self, name):
        """The 4-d tensor `name` through its dims and strides at its pack address, as float64."""
        t, addr, dtype = self.tensor(name)
        dims, strides, size = t["dim"], t["stride"], SIZES[dtype]
        extent = sum((d - 1) * s for d, s in zip(dims, strides)) + 1
        raw = np.ctypeslib.as_array(((ctypes.c_uint16 if size == 2 else ctypes.c_float) * extent).from_address(addr))
        vals = {"BFLOAT16": lambda r: (r.astype(np.uint32) << 16).view(np.float32),
                "HALF": lambda r: r.view(np.float16), "FLOAT": lambda r: r}[dtype](raw)
        idx = sum(np.arange(d).reshape([-1 if i == k else 1 for k in range(4)]) * s
                  for i, (d, s) in enumerate(zip(dims, strides)))
        return vals[idx].astype(np.float64)

    def scale(self):
        return struct.unpack(">f", bytes.fromhex(self.node["attn_scale_value"]))[0]

    def scores_and_mask(self):
        q, k = self.read("Q"), self.read("K")
        s = self.scale() * np.einsum("bhid,bhjd->bhij", q, k)
        assert self.node["diagonal_alignment"] == "TOP_LEFT" and not self.node["padding_mask"]
        assert not self.node["alibi_mask"] and self.node["dropout_probability"] is None
        i, j = np.arange(s.shape[2])[:, None], np.arange(s.shape[3])[None, :]
        allowed = np.ones_like(i * j, bool)
        if self.node["right_bound"] is not None:
            allowed &= j - i <= self.node["right_bound"]
        if self.node["left_bound"] is not None:
            allowed &= i - j < self.node["left_bound"]
        return np.where(allowed, s, -np.inf), allowed


def forward(g):
    assert g.node["tag"] == "SDPA" and g.node["generate_stats"]
    s, _ = g.scores_and_mask()
    lse = np.log(np.exp(s - s.max(-1, keepdims=True)).sum(-1)) + s.max(-1)
    o = np.einsum("bhij,bhjd->bhid", np.exp(s - lse[..., None]), g.read("V"))
    return {"O": o, "Stats": lse[..., None]}


def backward(g):
    assert g.node["tag"] == "SDPA_BWD"
    s, allowed = g.scores_and_mask()
    p = np.where(allowed, np.exp(s - g.read("Stats")), 0.0)
    do, v, q, k = g.read("dO"), g.read("V"), g.read("Q"), g.read("K")
    ds = p * (np.einsum("bhid,bhjd->bhij", do, v) - (do * g.read("O")).sum(-1, keepdims=True))
    return {"dQ": g.scale() * np.einsum("bhij,bhjd->bhid", ds, k),
            "dK": g.scale() * np.einsum("bhij,bhid->bhjd", ds, q),
            "dV": np.einsum("bhij,bhid->bhjd", p, do)}


def bits16(rng, n, dtype):
    """n random values in [-1, 1) as the 16-bit patterns of `dtype` (BFLOAT16 or HALF)."""
    x = rng.uniform(-1, 1, n).astype(np.float32)
    return bf16_bits(x) if dtype == "BFLOAT16" else x.astype(np.float16).view(np.uint16)


# rounding of one stored 16-bit output: 2^-8 relative for bf16 (8-bit significand), 2^-11 for fp16 (11 bits)
UNIT = {"BFLOAT16": 2.0 ** -8, "HALF": 2.0 ** -11}


@pytest.mark.parametrize("dtype", ["BFLOAT16", "HALF"])
@pytest.mark.parametrize("B,T,NH,HS,scale", [(1, 5, 1, 8, None), (2, 7, 3, 16, 0.3), (2, 33, 2, 64, None)])
def test_cudnn_attention_graph_describes_the_seams_attention(emu, describe, B, T, NH, HS, scale, dtype):  # noqa: F811
    scale = scale or 1 / np.sqrt(HS)
    rng = np.random.default_rng(T)
    C = NH * HS
    qkv, dout = bits16(rng, B * T * 3 * C, dtype), bits16(rng, B * T * C, dtype)
    out, dqkv = np.zeros(B * T * C, np.uint16), np.zeros(B * T * 3 * C, np.uint16)
    stats = np.zeros(B * NH * T, np.float32)
    addr = {n: a.ctypes.data for n, a in dict(qkv=qkv, out=out, stats=stats, dout=dout, dqkv=dqkv).items()}
    seam = dict(qkv=addr["qkv"], out=addr["out"], stats=addr["stats"], dout=addr["dout"], B=B, T=T, NH=NH, HS=HS,
                scale=float(scale), dtype=SEAM_DTYPE[dtype])

    g = Graph(*describe(B, T, NH, HS, scale, False, dtype, addr["qkv"], addr["out"], addr["stats"]))
    assert g.io == dtype and g.j["context"]["compute_data_type"] == "FLOAT"
    assert g.scale() == np.float32(scale)
    want = forward(g)
    assert emu.seam_attention(dqkv=0, **seam) == 0
    # O: one rounding (UNIT relative) of values below 1; Stats: fp32 sums over T keys (seam) vs float64
    u = UNIT[dtype]
    np.testing.assert_allclose(g.read("O"), want["O"], rtol=u, atol=u / 2)
    np.testing.assert_allclose(g.read("Stats"), want["Stats"], rtol=1e-5, atol=1e-5)

    g = Graph(*describe(B, T, NH, HS, scale, True, dtype, addr["qkv"], addr["out"], addr["stats"], addr["dout"],
                        addr["dqkv"]))
    want = backward(g)
    # The backend lets cuDNN write its backward straight into dqkv (no zero fill, no scratch copy): the dQ, dK, dV
    # views must cover every element of the (B, T, 3, NH, HS) buffer exactly once.
    covered = np.sort(np.concatenate([g.offsets(n, addr["dqkv"]).ravel() for n in ("dQ", "dK", "dV")]))
    np.testing.assert_array_equal(covered, np.arange(dqkv.size))
    dqkv[:] = 0x7FC0  # bf16 NaN: the seam overwrites, it must not read or keep the old contents
    assert emu.seam_attention(dqkv=addr["dqkv"], **seam) == 0
    for name in ("dQ", "dK", "dV"):  # 16-bit outputs: UNIT of the tensor's largest value
        got = g.read(name)
        assert np.max(np.abs(got - want[name])) <= u * np.max(np.abs(want[name])), name
