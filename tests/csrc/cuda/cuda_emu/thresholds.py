"""The threshold table of the CUDA kernels (csrc/cuda): per kernel family, the sizes at which a kernel or its launcher
changes code path, and the shapes the emulator tests run on either side of each.

A code path that only real sizes take is invisible to tests on small shapes: a column reduction whose row-threads
loop once at the test sizes (N <= 111 rows) but hundreds of times at d12's N = 65,536 passes every test with
`s = partial[...]` in place of `s += partial[...]`. So every change of path is listed here with the quantity that
decides it (chunk count against block rows, vectors per row against block threads, a grid `min` / `max`, a
grid-stride loop, a vector path against its scalar one and the ragged tail, a tile multiple against a partial tile,
one block against several), computed from the launcher's own constants, read from the source (`const_int`): when a
constant changes, the quantity follows, and test_cuda_emu_thresholds.py::test_every_threshold_is_crossed fails if
the listed shapes no longer fall on both sides.

Each Threshold: `quantity(case)` is what the code compares (e.g. the chunk count R), `at` the largest value on the
first path (path changes between at and at + 1), `cases` shapes for the op runner `op` in threshold_ops.py (one
entry per shape, at least one with quantity <= at and one with quantity > at). `slow` cases are the real d12 training
shapes (N = B * T = 64 * 1024 = 65,536 rows, C = 768): CI runs them (pytest -m slow, its own step in .ci/run).

Thresholds no emulator test can cross in principle are in UNREACHABLE, with the reason.
"""
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

CUDA = Path(__file__).resolve().parents[4] / "csrc" / "cuda"


def const_int(file, pattern):
    """The integer a regex with one group finds in csrc/cuda/<file> (exactly once): a launcher's constant."""
    found = re.findall(pattern, (CUDA / file).read_text())
    if len(found) != 1:
        raise LookupError(f"csrc/cuda/{file}: {pattern!r} found {len(found)} times (the threshold table is stale)")
    return int(found[0])


def launcher_int(file, function, pattern):
    """The integer `pattern` (one group) finds in the body of host function `function` of csrc/cuda/<file>."""
    text = (CUDA / file).read_text()
    m = re.search(r"\nvoid " + function + r"\(.*?\n}\n", text, re.S)
    if not m:
        raise LookupError(f"csrc/cuda/{file}: launcher {function} not found (the threshold table is stale)")
    found = re.findall(pattern, m.group(0))
    if len(found) != 1:
        raise LookupError(f"csrc/cuda/{file}: {pattern!r} found {len(found)} times in {function} (the threshold "
                          "table is stale)")
    return int(found[0])


def kconst(file, name):
    """`constexpr int <name> = <int>;` of csrc/cuda/<file>."""
    return const_int(file, r"constexpr int " + name + r"\s*=\s*(\d+)\s*;")


def cdiv(a, b):
    return -(-a // b)


# ----------------------------------------------------------------------------------------- launcher constants
K32, K16 = 4, 8  # kVec<float>, kVec<bf16>: values per 16-byte vector
COL_TILE, COL_ROWS = kconst("reduce.cuh", "kColTile"), kconst("reduce.cuh", "kColRows")
COL_BLOCKS, COL_MIN_ROWS = kconst("reduce.cuh", "kColBlocks"), kconst("reduce.cuh", "kColMinRows")
REDUCE_ROWS = kconst("reduce.cuh", "kReduceRows")
LN_CACHE = kconst("layernorm.cuh", "kLnCacheFloats")
LN_FWD_BLOCK = kconst("layernorm.cuh", "kLnForwardThreads")
LN_BWD_BLOCK = kconst("layernorm.cuh", "kLnBackwardThreads")
CE_BLOCK, CE_FUSED_BLOCK = kconst("classifier.cuh", "kClassifierBlock"), kconst("classifier.cuh", "kClassifierFusedBlock")
CE_COUNT_BLOCK = kconst("classifier.cuh", "kClassifierOneBlock")  # crossentropy_count_kernel's one block
CE_ACC_BLOCK = kconst("classifier.cuh", "kClassifierOneBlock")  # loss_accumulate_kernel's one block
ENC_WTE_GRID = const_int("encoder.cuh", r"dim3 grid\(std::min\(BT, (\d+)\)")
ENC_WTE_CBLOCK = kconst("encoder.cuh", "kEncoderWteThreads")
ENC_BLOCK = kconst("encoder.cuh", "kEncoderThreads")
ELT_BLOCK = kconst("gelu.cuh", "kGeluThreads")
ADAMW_GRID = const_int("adamw.cuh", r"std::min\(ceil_div\(most, kAdamWThreads\), (\d+)\)")
ADAMW_BLOCK = kconst("adamw.cuh", "kAdamWThreads")
NORM_BLOCKS, NORM_THREADS = kconst("global_norm.cuh", "kNormBlocks"), kconst("global_norm.cuh", "kNormThreads")
ATT_TILE = kconst("attention.cuh", "kAttTile")
ATT_DOT_LANES = kconst("attention.cuh", "kDotLanes")
DEC_BLOCK, SAMPLE_BLOCK = kconst("infer.cuh", "kDecodeBlock"), kconst("infer.cuh", "kSampleBlock")
SAMPLE_CAP = kconst("infer.cuh", "kSampleCap")
SPLIT_MIN_KEYS, SPLIT_GROUP = kconst("infer.cuh", "kSplitMinKeys"), DEC_BLOCK // 32 * kconst("infer.cuh", "kSplitKeysPerWarp")
INFER_ROW_BLOCK = kconst("infer.cuh", "kInferRowBlock")
ROPE_BLOCK, RELU2_BLOCK = kconst("rope.cuh", "kRopeBlock"), kconst("relu2.cuh", "kRelu2Block")
RMS_BLOCK = kconst("rmsnorm.cuh", "kRmsBlock")
ROPE_TABLE_ROWS = const_int("backend_cuda.cu", r"std::max\(rope_rows_, (\d+)\)")  # the first rotary table's rows

# d12 at the README's batch: B = 64, T = 1024 (N = B * T rows), C = 768
D12_N, D12_C = 65536, 768


def column_chunks(N, C):
    """reduce.cuh's column_chunks: the row chunks of pass 1 (= the partial rows pass 2 reduces)."""
    if N <= 0 or C <= 0:
        return 0
    return min(cdiv(N, COL_MIN_ROWS), cdiv(COL_BLOCKS, cdiv(C, COL_TILE * 8)))


def rope_threads(c):
    """rope.cuh's rope_apply: threads of the launch, K pairs per thread on the vector path (h % K == 0, aligned)."""
    h = c["C"] // c["NH"] // 2
    vec = h % K32 == 0 and not c.get("misalign", False)
    return c["B"] * c["T"] * 2 * c["NH"] * (h // K32 if vec else h)


def column_chunk_rows(N, C):
    return cdiv(N, column_chunks(N, C))


@dataclass
class Threshold:
    family: str                 # kernel family: csrc/cuda/<family>.cuh
    name: str                   # unique, <family>.<what>
    where: str                  # the kernel / launcher expression that branches
    op: str                     # runner in threshold_ops.py
    quantity: Callable          # case -> the compared value
    at: int                     # last value on the first path
    cases: list                 # dicts of the runner's arguments
    slow: list = field(default_factory=list)  # real-size cases (d12), run by CI's slow step

    def sides(self, cases=None):
        q = [self.quantity(c) for c in (self.cases if cases is None else cases)]
        return any(v <= self.at for v in q), any(v > self.at for v in q)


T = Threshold
TABLE = [
    # ------------------------------------------------------------------ reduce.cuh (bias and LayerNorm dw / db sums)
    T("reduce", "reduce.pass2_row_loop", "column_reduce_kernel: for (r = threadIdx.y; r < R; r += kReduceRows)",
      "column_reduce", lambda c: c["R"], REDUCE_ROWS,
      [dict(R=REDUCE_ROWS, C=37), dict(R=REDUCE_ROWS + 1, C=37), dict(R=2 * REDUCE_ROWS + 1, C=37),
       dict(R=1, C=37)]),
    T("reduce", "reduce.chunks_vs_reduce_rows", "column_sum_accumulate: R = column_chunks(N, C) against kReduceRows",
      "column_sum", lambda c: column_chunks(c["N"], c["C"]), REDUCE_ROWS,
      [dict(N=COL_MIN_ROWS * REDUCE_ROWS, C=5), dict(N=COL_MIN_ROWS * REDUCE_ROWS + 1, C=5),
       dict(N=COL_MIN_ROWS * (REDUCE_ROWS + 1), C=5)],
      slow=[dict(N=D12_N, C=D12_C)]),
    T("reduce", "reduce.chunks_grid_cap", "column_chunks: min(ceil(N / kColMinRows), ceil(kColBlocks / ceil(C / 256)))",
      "column_sum", lambda c: cdiv(c["N"], COL_MIN_ROWS) - cdiv(COL_BLOCKS, cdiv(c["C"], COL_TILE * 8)), 0,
      [dict(N=COL_MIN_ROWS * cdiv(COL_BLOCKS, 33), C=COL_TILE * 8 * 32 + 1),
       dict(N=COL_MIN_ROWS * cdiv(COL_BLOCKS, 33) + 1, C=COL_TILE * 8 * 32 + 1)]),
    T("reduce", "reduce.chunk_row_threads", "column_partial_sum_kernel: rows of a chunk against kColRows row-threads",
      "column_sum", lambda c: column_chunk_rows(c["N"], c["C"]), COL_ROWS,
      [dict(N=COL_ROWS - 1, C=9), dict(N=COL_ROWS, C=9), dict(N=COL_ROWS + 1, C=9)]),
    T("reduce", "reduce.last_chunk_partial", "column_partial_sum_kernel: r1 = min(N, r0 + rows_per_chunk)",
      "column_sum", lambda c: c["N"] % column_chunk_rows(c["N"], c["C"]), 0,
      [dict(N=2 * COL_MIN_ROWS, C=9), dict(N=2 * COL_MIN_ROWS + 1, C=9), dict(N=3 * COL_MIN_ROWS - 1, C=9)]),
    T("reduce", "reduce.vector_path", "column_sum_accumulate: K = kVec when C % K == 0 and aligned, else 1",
      "column_sum", lambda c: int(c["C"] % (K16 if c.get("bf16") else K32) != 0 or c.get("misalign", False)), 0,
      [dict(N=70, C=8 * K32), dict(N=70, C=8 * K32 + 2), dict(N=70, C=8 * K32, misalign=True),
       dict(N=70, C=8 * K16, bf16=True), dict(N=70, C=8 * K16 + 4, bf16=True)]),
    T("reduce", "reduce.vector_column_tail", "column_partial_sum_kernel<K=kVec>: c0 < C, a block of kColTile * K columns",
      "column_sum", lambda c: c["C"] - COL_TILE * K32, 0,
      [dict(N=40, C=COL_TILE * K32), dict(N=40, C=COL_TILE * K32 + K32)]),
    T("reduce", "reduce.scalar_column_tail", "column_partial_sum_kernel<K=1>: c0 < C, a block of kColTile columns",
      "column_sum", lambda c: c["C"] - COL_TILE, 0, [dict(N=40, C=COL_TILE - 1), dict(N=40, C=COL_TILE + 1)]),
    T("reduce", "reduce.pass2_column_tail", "column_reduce: grid ceil(C / 32), c < C",
      "column_reduce", lambda c: c["C"] - 32, 0, [dict(R=3, C=32), dict(R=3, C=33)]),
    # ------------------------------------------------------------------ layernorm.cuh
    T("layernorm", "layernorm.fwd_rows_per_block", "layernorm_forward: grid ceil(N / (block / 32)), row < N",
      "layernorm_forward", lambda c: c["N"] - LN_FWD_BLOCK // 32, 0,
      [dict(N=LN_FWD_BLOCK // 32, C=64), dict(N=LN_FWD_BLOCK // 32 + 1, C=64)],
      slow=[dict(N=D12_N, C=D12_C, residual=False)]),
    T("layernorm", "layernorm.fwd_register_cache", "launch_layernorm_forward: vec && C <= 32 * kCache * K",
      "layernorm_forward", lambda c: c["C"], 32 * LN_CACHE,
      [dict(N=5, C=32 * LN_CACHE), dict(N=5, C=32 * LN_CACHE + K32)]),
    T("layernorm", "layernorm.fwd_vector_path", "layernorm_forward: vec = C % kVec == 0 && aligned",
      "layernorm_forward", lambda c: c["C"] % K32, 0, [dict(N=5, C=96), dict(N=5, C=98), dict(N=5, C=97)]),
    T("layernorm", "layernorm.fwd_vectors_per_lane", "layernorm_forward_kernel: lane l takes vectors l, l + 32, ...",
      "layernorm_forward", lambda c: c["C"] - 32 * K32, 0, [dict(N=3, C=32 * K32), dict(N=3, C=32 * K32 + K32)]),
    T("layernorm", "layernorm.bwd_columns_per_thread", "layernorm_backward_kernel: for (c = threadIdx.x; c < C; c += blockDim.x)",
      "layernorm_backward", lambda c: c["C"], LN_BWD_BLOCK,
      [dict(N=20, C=LN_BWD_BLOCK), dict(N=20, C=LN_BWD_BLOCK + K32)]),
    T("layernorm", "layernorm.bwd_smem_opt_in", "layernorm_backward: 2 C floats > 48 KiB: cudaFuncSetAttribute",
      "layernorm_backward", lambda c: 2 * c["C"] * 4, 48 * 1024,
      [dict(N=3, C=6144), dict(N=3, C=6144 + K32)]),
    T("layernorm", "layernorm.bwd_row_groups", "layernorm_backward_kernel: a chunk's rows a group of (block / 32) at a time",
      "layernorm_backward", lambda c: c["N"] - LN_BWD_BLOCK // 32, 0,
      [dict(N=LN_BWD_BLOCK // 32, C=64), dict(N=LN_BWD_BLOCK // 32 + 1, C=64), dict(N=LN_BWD_BLOCK // 32 + 7, C=64)]),
    T("layernorm", "layernorm.bwd_chunks_vs_reduce_rows", "layernorm_backward: column_reduce over R = column_chunks(N, C)",
      "layernorm_backward", lambda c: column_chunks(c["N"], c["C"]), REDUCE_ROWS,
      [dict(N=COL_MIN_ROWS * REDUCE_ROWS, C=20), dict(N=COL_MIN_ROWS * REDUCE_ROWS + 1, C=20)],
      slow=[dict(N=D12_N, C=D12_C)]),
    T("layernorm", "layernorm.bwd_scalar_tail", "layernorm_backward_row: vec off, i = K * CV + lane < C",
      "layernorm_backward", lambda c: c["C"] % K32, 0, [dict(N=9, C=64), dict(N=9, C=67)]),
    # ------------------------------------------------------------------ classifier.cuh
    T("classifier", "classifier.fwd_vectors_per_thread", "row_logsumexp: V / K vectors against kClassifierBlock threads",
      "crossentropy", lambda c: c["V"] // K32, CE_BLOCK,
      [dict(N=3, V=K32 * CE_BLOCK, Vp=K32 * CE_BLOCK), dict(N=3, V=K32 * CE_BLOCK + K32, Vp=K32 * CE_BLOCK + 2 * K32)]),
    T("classifier", "classifier.fused_vectors_per_thread", "crossentropy_forward_backward: V / K against kClassifierFusedBlock",
      "crossentropy_fused", lambda c: c["V"] // K32, CE_FUSED_BLOCK,
      [dict(N=3, V=K32 * CE_FUSED_BLOCK, Vp=K32 * CE_FUSED_BLOCK),
       dict(N=3, V=K32 * CE_FUSED_BLOCK + K32 + 1, Vp=K32 * CE_FUSED_BLOCK + 4 * K32)]),
    T("classifier", "classifier.ragged_tail", "row_logsumexp / row_dlogits: the columns [K * (V / K), V) one at a time",
      "crossentropy", lambda c: c["V"] % K32, 0,
      [dict(N=4, V=96, Vp=128), dict(N=4, V=97, Vp=128), dict(N=4, V=99, Vp=128, target_tail=True)]),
    T("classifier", "classifier.zero_padding_vectors", "row_dlogits: Vec zero stores over [ceil(V / K), Vp / K)",
      "crossentropy", lambda c: c["Vp"] // K32 - cdiv(c["V"], K32), 0,
      [dict(N=4, V=96, Vp=96), dict(N=4, V=96, Vp=100), dict(N=4, V=93, Vp=128)]),
    T("classifier", "classifier.scalar_path", "crossentropy_*: vec = Vp % K == 0 && aligned, else one value at a time",
      "crossentropy", lambda c: c["Vp"] % K32, 0, [dict(N=4, V=97, Vp=100), dict(N=4, V=97, Vp=101)]),
    T("classifier", "classifier.count_rows", "crossentropy_count_kernel / loss_accumulate_kernel: N rows over one block",
      "loss_count", lambda c: c["N"], min(CE_COUNT_BLOCK, CE_ACC_BLOCK),
      [dict(N=min(CE_COUNT_BLOCK, CE_ACC_BLOCK)), dict(N=max(CE_COUNT_BLOCK, CE_ACC_BLOCK) + 3),
       dict(N=3 * max(CE_COUNT_BLOCK, CE_ACC_BLOCK) + 1)],
      slow=[dict(N=D12_N)]),
    T("classifier", "classifier.rows_per_launch", "crossentropy_*: one block per row, grid N (fused: with the count)",
      "crossentropy_fused", lambda c: c["N"], 1, [dict(N=1, V=13, Vp=16), dict(N=37, V=13, Vp=16)]),
    # ------------------------------------------------------------------ encoder.cuh
    T("encoder", "encoder.wte_bucket_stride", "encoder_backward: grid.x = min(BT, 2048), blocks stride over U buckets",
      "encoder_backward", lambda c: c["U"], ENC_WTE_GRID,
      [dict(B=1, T=ENC_WTE_GRID, C=8, U=ENC_WTE_GRID), dict(B=1, T=ENC_WTE_GRID + 40, C=8, U=ENC_WTE_GRID + 37)]),
    T("encoder", "encoder.wte_column_blocks", "encoder_backward_wte_kernel: grid.y = ceil(C / 64), c < C",
      "encoder_backward", lambda c: c["C"] - ENC_WTE_CBLOCK, 0,
      [dict(B=2, T=9, C=ENC_WTE_CBLOCK, U=7), dict(B=2, T=9, C=ENC_WTE_CBLOCK + 1, U=7)],
      slow=[dict(B=64, T=1024, C=D12_C, U=50257)]),
    T("encoder", "encoder.fwd_vector_path", "encoder_forward: vec = C % kVec == 0 && aligned",
      "encoder_forward", lambda c: c["C"] % K32, 0, [dict(B=2, T=9, C=16), dict(B=2, T=9, C=18)]),
    T("encoder", "encoder.fwd_grid_tail", "encoder_forward: grid ceil(B T C / K / 256), idx < n",
      "encoder_forward", lambda c: c["B"] * c["T"] * c["C"] // K32 - ENC_BLOCK, 0,
      [dict(B=1, T=ENC_BLOCK // 4, C=16), dict(B=1, T=ENC_BLOCK // 4 + 1, C=16)]),
    # ------------------------------------------------------------------ gelu.cuh / residual.cuh (elementwise)
    T("gelu", "gelu.vector_tail", "gelu_*_kernel: iv + K <= N, else the tail one value at a time",
      "gelu", lambda c: c["n"] % K32, 0, [dict(n=1024), dict(n=1025), dict(n=1027)]),
    T("gelu", "gelu.grid_blocks", "gelu_*: grid ceil(ceil(N / K) / 256)",
      "gelu", lambda c: cdiv(c["n"], K32) - ELT_BLOCK, 0, [dict(n=ELT_BLOCK * K32), dict(n=ELT_BLOCK * K32 + 1)]),
    T("gelu", "gelu.scalar_path", "gelu_*: vec = aligned, else one value per thread",
      "gelu", lambda c: int(c.get("misalign", False)), 0, [dict(n=1027), dict(n=1027, misalign=True)]),
    T("residual", "residual.vector_tail", "residual_forward_kernel: the tail past the last whole vector",
      "residual", lambda c: c["n"] % K32, 0, [dict(n=1024), dict(n=1026), dict(n=1026, misalign=True)]),
    # ------------------------------------------------------------------ adamw.cuh
    T("adamw", "adamw.grid_stride", "launch_adamw: grid.x = min(ceil(units / 256), 2048): blocks stride beyond",
      "adamw", lambda c: cdiv(c["n"], 4), ADAMW_GRID * ADAMW_BLOCK,
      [dict(n=4 * ADAMW_GRID * ADAMW_BLOCK), dict(n=4 * ADAMW_GRID * ADAMW_BLOCK + 4 * ADAMW_BLOCK + 3)]),
    T("adamw", "adamw.ragged_tail", "adamw_kernel: i4 + 4 > n, the last unit one value at a time",
      "adamw", lambda c: c["n"] % 4, 0, [dict(n=1024), dict(n=1027), dict(n=1027, misalign=True)]),
    # ------------------------------------------------------------------ global_norm.cuh
    T("global_norm", "global_norm.grid_stride", "sum_squares_partial_kernel: kNormBlocks x kNormThreads stride over n",
      "sum_squares", lambda c: c["n"], NORM_BLOCKS * NORM_THREADS,
      [dict(n=1000), dict(n=NORM_BLOCKS * NORM_THREADS), dict(n=NORM_BLOCKS * NORM_THREADS + 1),
       dict(n=3 * NORM_BLOCKS * NORM_THREADS + 17)]),
    # ------------------------------------------------------------------ attention.cuh (fp32 flash kernels)
    T("attention", "attention.query_tiles", "attention_*: grid ceil(T / kAttTile), the last tile partial",
      "attention", lambda c: c["T"] - ATT_TILE, 0,
      [dict(B=1, T=ATT_TILE, C=64, NH=1), dict(B=1, T=ATT_TILE + 1, C=64, NH=1),
       dict(B=1, T=2 * ATT_TILE, C=64, NH=1), dict(B=1, T=2 * ATT_TILE + 1, C=128, NH=2)],
      slow=[dict(B=1, T=1024, C=64, NH=1)]),
    T("attention", "attention.dot_rows", "attention_backward_dot: grid ceil(B NH T kDotLanes / 256)",
      "attention", lambda c: c["B"] * c["NH"] * c["T"] * ATT_DOT_LANES - 256, 0,
      [dict(B=1, T=256 // ATT_DOT_LANES, C=64, NH=1), dict(B=1, T=256 // ATT_DOT_LANES + 1, C=64, NH=1)]),
    # KV-cache inference (infer.cuh)
    T("infer", "infer.decode_keys", "attention_kv_kernel: for key = threadIdx.x; key < n; key += kDecodeBlock (the "
      "softmax pass; n = pos + 1 keys)", "attention_kv", lambda c: c["pos"] + 1, DEC_BLOCK,
      [dict(pos=DEC_BLOCK - 1, C=192, NH=3, splits=1), dict(pos=DEC_BLOCK + 4, C=192, NH=3, splits=1)]),
    T("infer", "infer.decode_head_lanes", "attention_kv_kernel: for d = lane; d < hs; d += 32 (a key's dot product)",
      "attention_kv", lambda c: c["C"] // c["NH"], 32, [dict(pos=9, C=48, NH=3), dict(pos=9, C=192, NH=3)]),
    T("infer", "infer.decode_split", "decode_splits: one block per (head, query, sequence) below kSplitMinKeys cache "
      "positions, attention_kv_split_kernel + attention_kv_combine_kernel from there (maxT = pos + 3 here)",
      "attention_kv", lambda c: c["pos"] + c.get("Tq", 1) + 2, SPLIT_MIN_KEYS - 1,
      [dict(pos=SPLIT_MIN_KEYS - 4, C=192, NH=3), dict(pos=SPLIT_MIN_KEYS - 3, C=192, NH=3)]),
    T("infer", "infer.split_key_groups", "attention_kv_split_kernel: warps take kSplitKeysPerWarp keys per turn, "
      "4 warps x 4 keys = 16 per block turn, the last group partial (keys per share = ceil(n / splits); a cache of 256 "
      "positions, 3 heads: 4 splits)",
      "attention_kv", lambda c: -(-(c["pos"] + 1) // 4), SPLIT_GROUP,
      [dict(pos=4 * SPLIT_GROUP - 1, C=192, NH=3, maxT=256), dict(pos=4 * SPLIT_GROUP + 3, C=192, NH=3, maxT=256),
       dict(pos=8 * SPLIT_GROUP + 6, C=192, NH=3, maxT=256)]),
    T("infer", "infer.sample_chunks", "sample_kernel, nothing cut: chunks of ceil(V / kSampleBlock) ids per thread",
      "sample", lambda c: c["V"], SAMPLE_BLOCK, [dict(V=SAMPLE_BLOCK, top_k=0, top_p=1.0),
                                                 dict(V=SAMPLE_BLOCK + 7, top_k=0, top_p=1.0)]),
    T("infer", "infer.sample_cap", "sample_kernel: top_k <= kSampleCap sorts the top_k keys; above, the kSampleCap "
      "largest for the nucleus", "sample", lambda c: c["top_k"], SAMPLE_CAP,
      [dict(V=SAMPLE_CAP + 300, top_k=SAMPLE_CAP, top_p=0.9), dict(V=SAMPLE_CAP + 300, top_k=SAMPLE_CAP + 1, top_p=0.5)]),
    # issue 39: the rest of infer.cuh's decisions, and the modern architecture's elementwise kernels
    T("infer", "infer.sample_top_k_host", "sample_kernel: top_k > kSampleCap with top_p off: the row is flagged and "
      "the backend samples it on the host (model/sampling.h)", "sample", lambda c: c["top_k"] * (c["top_p"] >= 1),
      SAMPLE_CAP, [dict(V=SAMPLE_CAP + 300, top_k=SAMPLE_CAP, top_p=1.0),
                   dict(V=SAMPLE_CAP + 300, top_k=SAMPLE_CAP + 1, top_p=1.0)]),
    T("infer", "infer.sample_nucleus_host", "sample_kernel: a nucleus (top_k 0) that reaches past the kSampleCap "
      "sorted candidates (nearly flat logits) is flagged and sampled on the host; a peaked one stays on the device",
      "sample", lambda c: int(c["scale"] < 1), 0,
      [dict(V=SAMPLE_CAP + 476, top_k=0, top_p=0.8, scale=6.0), dict(V=SAMPLE_CAP + 476, top_k=0, top_p=0.95,
                                                                      scale=0.1)]),
    T("infer", "infer.sample_idle_threads", "sample_kernel, nothing cut: V < kSampleBlock leaves threads past V with "
      "empty chunks (i0 = min(V, tid * per))", "sample", lambda c: SAMPLE_BLOCK - c["V"], 0,
      [dict(V=SAMPLE_BLOCK, top_k=0, top_p=1.0), dict(V=97, top_k=0, top_p=1.0)]),
    T("infer", "infer.split_empty_shares", "attention_kv_split_kernel: nk <= 0 for shares past n = pos + 1 keys "
      "(m = -inf, l = 0 partials)", "attention_kv", lambda c: c["splits"] - (c["pos"] + 1), 0,
      [dict(pos=5, C=192, NH=3, splits=4, maxT=9), dict(pos=4, C=192, NH=3, splits=5, maxT=9),
       dict(pos=1, C=192, NH=3, splits=4, maxT=9)]),
    T("infer", "infer.split_head_values_per_lane", "attention_kv_split_kernel: lane l takes dims l, l + 32, ... < hs "
      "(up to kDecodeMaxHs / 32)", "attention_kv", lambda c: c["C"] // c["NH"], 96,
      [dict(pos=20, C=96, NH=1, splits=3), dict(pos=20, C=128, NH=1, splits=3), dict(pos=20, C=40, NH=1, splits=2)]),
    T("infer", "infer.row_columns", "encoder_forward_at / kv_write / gather_rows: one row per block, columns "
      "c = threadIdx.x, c += kInferRowBlock", "infer_rows", lambda c: c["C"], INFER_ROW_BLOCK,
      [dict(C=INFER_ROW_BLOCK, NH=4), dict(C=INFER_ROW_BLOCK + 32, NH=3), dict(C=2 * INFER_ROW_BLOCK + 64, NH=6)]),
    T("rope", "rope.vector_path", "rope_apply: vec = h % kVec == 0 && aligned16(qkv), else one pair per thread",
      "rope", lambda c: int(c["C"] // c["NH"] // 2 % K32 != 0 or c.get("misalign", False)), 0,
      [dict(B=2, T=5, C=48, NH=3, pos0=3, maxT=8), dict(B=2, T=5, C=60, NH=3, pos0=3, maxT=8),
       dict(B=2, T=5, C=48, NH=3, pos0=3, maxT=8, misalign=True)]),
    T("rope", "rope.grid_tail", "rope_apply: grid ceil(n / kRopeBlock), idx < n (n = B T 2 NH pairs-or-vectors)",
      "rope", rope_threads, ROPE_BLOCK,
      [dict(B=2, T=8, C=64, NH=2, pos0=0, maxT=8), dict(B=1, T=17, C=64, NH=2, pos0=0, maxT=17),
       dict(B=3, T=7, C=40, NH=2, pos0=5, maxT=12)]),
    T("rope", "rope.positions_per_row", "rope_forward_at: row (b, t) at pos[b] + t, up to the table's last row",
      "rope_at", lambda c: c["T"], 1, [dict(pos=[0, 7, 3], T=1, maxT=8), dict(pos=[0, 5, 2], T=3, maxT=8)]),
    T("rope", "rope.table_rows", "CudaBackend::rope_forward_at: the table covers max(pos) + T rows (the first one "
      "1024, then doubled): positions up to its last row, and one past it (a longer table)", "rope_at",
      lambda c: max(c["pos"]) + c["T"], ROPE_TABLE_ROWS,
      [dict(pos=[ROPE_TABLE_ROWS - 3, 4], T=3, maxT=ROPE_TABLE_ROWS),
       dict(pos=[ROPE_TABLE_ROWS - 2, 0], T=3, maxT=ROPE_TABLE_ROWS + 1)]),
    T("rmsnorm", "rmsnorm.rows_per_block", "rmsnorm_*: one row per warp, grid ceil(N / (kRmsBlock / 32)), row < N",
      "rmsnorm", lambda c: c["N"] - RMS_BLOCK // 32, 0,
      [dict(N=RMS_BLOCK // 32, C=64), dict(N=RMS_BLOCK // 32 + 1, C=64)]),
    T("rmsnorm", "rmsnorm.vector_path", "rmsnorm_*: vec = C % kVec == 0 && aligned, else one value per access",
      "rmsnorm", lambda c: int(c["C"] % K32 != 0 or c.get("misalign", False)), 0,
      [dict(N=5, C=96), dict(N=5, C=98), dict(N=5, C=96, misalign=True)]),
    T("rmsnorm", "rmsnorm.vectors_per_lane", "rmsnorm_*_kernel: lane l takes vectors l, l + 32, ... < C / K",
      "rmsnorm", lambda c: c["C"] // K32 - 32, 0, [dict(N=3, C=32 * K32), dict(N=3, C=32 * K32 + K32)]),
    T("rmsnorm", "rmsnorm.scalar_tail", "rmsnorm_*_kernel: vec off, i = lane .. C in steps of 32 (C > 32 and a tail)",
      "rmsnorm", lambda c: c["C"] % 32, 0, [dict(N=4, C=64, misalign=True), dict(N=4, C=67)]),
    T("rmsnorm", "qknorm.head_vector_path", "qknorm_*: vec = HS % kVec == 0 (and 3C), groups of 2 NH heads per row",
      "qk_norm", lambda c: int(c["C"] // c["NH"] % K32 != 0), 0,
      [dict(B=2, T=3, C=48, NH=3), dict(B=2, T=3, C=30, NH=3), dict(B=3, T=5, C=256, NH=2)]),
    T("relu2", "relu2.vector_tail", "relu2_*_kernel: iv + K <= N, else the tail one value at a time",
      "relu2", lambda c: c["n"] % K32, 0, [dict(n=1024), dict(n=1025), dict(n=1027)]),
    T("relu2", "relu2.grid_blocks", "relu2_*: grid ceil(ceil(N / K) / kRelu2Block)",
      "relu2", lambda c: cdiv(c["n"], K32) - RELU2_BLOCK, 0,
      [dict(n=RELU2_BLOCK * K32), dict(n=RELU2_BLOCK * K32 + 1)]),
    T("relu2", "relu2.scalar_path", "relu2_*: vec = aligned, else one value per thread",
      "relu2", lambda c: int(c.get("misalign", False)), 0, [dict(n=1027), dict(n=1027, misalign=True)]),
]

# Code paths no emulator test can reach, and why.
UNREACHABLE = {
    "decode_splits' full-grid side (NH * Tq * B >= kSplitBlocksPerSm * 132 blocks: one block per (head, query, "
    "sequence) again)": "1,056 blocks of a 256-position cache: too slow to emulate for CI; the rule is a host "
    "function checked on both sides in test_cuda_emu_infer.py::test_split_choice, and the kernels on either side are "
    "the ones infer.decode_split runs",
    "grids over 2^31 - 1 blocks / 65,535 in y or z": "no launcher computes such a grid at d12 (the largest, the "
    "classifier's N = 65,536 blocks, is far below); an emulated launch of 2^31 blocks would take days",
    "index products above 2^31 (d12 logits: 65,536 x 50,304 = 3.3e9 values)": "13 GB of fp32 logits and 3.3e9 "
    "emulated threads: checked statically instead (test_index_width.py: every product of sizes is 64-bit)",
    "more blocks than one wave of the largest GPU (132 SMs of an H100)": "not a code path: the emulator runs blocks "
    "one after another whatever their number; the kernels' results do not depend on residency (no inter-block "
    "waits), which the block-order schedules check",
    "attention_tc.cuh / mma.cuh below sm_80 (tc_arch_runs, the k8 split of m16n8k16)": "arch-only branches "
    "(__CUDA_ARCH__ < 800) the emulator (sm_90) never compiles: the k8 split is checked against the k16 product "
    "in tests/csrc/emu/mma.cu; the arch gate against attention_tc_fits by test_cuda_gpu.py on a GPU",
    "matmul / cuDNN attention": "library calls behind csrc/cuda/seams.h: the emulator serves them from CPU "
    "implementations; their thresholds are the library's (the descriptors are checked by "
    "test_cublaslt_descriptors.py and test_cudnn_graph.py)",
}
