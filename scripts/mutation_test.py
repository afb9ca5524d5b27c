"""Mutation test of the GPU-free verification: how many single bugs injected into the CUDA kernels
(csrc/cuda) the emulated op tests catch, and how.

Each mutation in MUTATIONS replaces one exact snippet of one file. The script copies csrc/cuda into a
scratch folder (<build-dir>/src/cuda), applies one mutation at a time, builds the test module against
it (tests/csrc/cuda/cuda_emu/CMakeLists.txt with GPT2CORE_EMU_CUDA_DIR; only backend_cuda.cu recompiles between
mutants) and runs tests/csrc/cuda/cuda_emu/compare_ops.py (every op against the CPU backend) under each emulator
schedule, and tests/csrc/cuda/cuda_emu/threshold_ops.py (the pseudo-schedule "thresholds": the shapes of the threshold
table, tests/csrc/cuda/cuda_emu/thresholds.py, on both sides of every code-path change, against float64 / the CPU
backend). A mutation of a file of csrc/model (file "../model/<name>": the clip rule and loss scaler the kernels
share with the CPU backend) is applied to the file in place (csrc/model is included from everywhere, by paths a
scratch copy cannot shadow) and restored after its run, even on an error or Ctrl-C (check `git status` after a
killed run); it is compiled into both backends, so only the checks against written-out semantics can kill it.
A mutant is
  killed by report   a launch failed with an emulator report (race, bounds, uninitialised shared memory,
                     barrier or warp rule); "line" when the report names the mutated line (file:line),
  killed by mismatch an op differs from the CPU backend (normwise error > 1e-5, or not finite),
  killed by error    any other failure (a crash, an exception),
  survived           every schedule passed.
Schedules are deterministic (seeded), so a verdict is reproducible; --repeat N reruns each mutant to
show it.

    python scripts/mutation_test.py                        # every mutation, schedules thresholds,fwd,low,high,ahead:1
    python scripts/mutation_test.py --only-threshold --schedules thresholds,fwd --stop-early   # the threshold mutants
    python scripts/mutation_test.py --thresholds           # per kernel family: the thresholds its tests cross
    python scripts/mutation_test.py --together --only A B  # threshold mutants of disjoint kernels in one build
    python scripts/mutation_test.py --only block_sum_first_barrier gelu_tail_guard
    GPT2CORE_EMU_RACECHECK=0 python scripts/mutation_test.py --schedules fwd,rev,random:7   # checker off

--together (threshold mutants only, for a loaded machine where each build takes minutes): the chosen mutations are
applied at once, built once, and every threshold shape runs (a shape that raises counts as failed); a mutant is
killed when a shape of its own threshold fails. Sound when the mutants change kernels that no shape of another mutant's threshold runs (choose them so:
e.g. one per kernel family); a combined build that fails to compile or crashes gives no verdicts.
Mutants with `tests` (issue 39: the inference, sampling and modern-op code of csrc/cuda, csrc/cpu, csrc/model and
the Python package's stop-string handling) are judged by those pytest nodes instead, each the input that exposes the
bug: C++ mutants are built into the emulator's test module as above (csrc/cpu and csrc/model mutated in place and
restored), and the tests run on it, with gpt2core._C replaced by that module (it compiles the same bindings.cpp and
CPU backend) so that the tests of the CPU kernels run the mutant too; "py:<file>" mutants change a copy of the
installed package (<build-dir>/py) and need no build. Killed "by tests" when a node fails; a node id pytest cannot
find is a harness error, never a kill.

    python scripts/mutation_test.py --judged-by-tests       # the inference / sampling / modern-op mutants

Prints one line per mutant and the score; --json writes the table. Mutants in code the emulator never compiles
(nvcc-only: inline PTX, architecture gates, library calls; tests/csrc/cuda/test_one_code_path.py lists them) are in
the list with the reason no emulator test can reach them: they are checked to apply, never run. A full run takes ~20 s per mutant to
build plus ~8 s per schedule on one core (the first build of <build-dir> takes a few minutes).
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CUDA = ROOT / "csrc" / "cuda"
EMU_TESTS = ROOT / "tests" / "csrc" / "cuda" / "cuda_emu"
# what an emulator report says (csrc/emu: racecheck.cpp and the scheduler's rule checks)
REPORT = re.compile(r"shared-memory race|device-memory race|out-of-bounds|uninitialised shared memory|"
                    r"__syncthreads \(|divergent __syncthreads|_sync \(|__syncwarp \(|deadlock")


BASELINE_SCHEDULES = ["fwd", "rev", "random:7"]


@dataclass
class Mutation:
    name: str
    file: str   # in csrc/cuda ("../model/x.h": csrc/model/x.h)
    old: str    # exact snippet, must occur once
    new: str
    why: str
    threshold: str = ""    # the threshold table entry (thresholds.py) whose far side the mutant breaks
    unreachable: str = ""  # nvcc-only code: why no emulator test can reach it (never run)
    tests: tuple = ()      # pytest node ids whose failure kills it (the exposing inputs): judged by pytest, not the op runs


MUTATIONS = [
    Mutation("block_sum_first_barrier", "common.cuh",
             "  v = warp_sum(v);\n  __syncthreads();  // scratch may still be read by a previous call\n",
             "  v = warp_sum(v);\n",
             "block_sum's scratch write races with the reads of the previous block_max / block_sum"),
    Mutation("block_sum_second_barrier", "common.cuh",
             "  if (lane == 0) scratch[warp] = v;\n  __syncthreads();\n  v = lane < nwarps ? scratch[lane] : T(0);",
             "  if (lane == 0) scratch[warp] = v;\n  v = lane < nwarps ? scratch[lane] : T(0);",
             "block_sum reads the per-warp sums before every warp wrote its own"),
    # (block_max's first barrier is not in the list: every caller uses block_max first, so no earlier reads of
    # scratch exist and removing that barrier is an equivalent mutant; the full run of the first list showed it)
    Mutation("block_max_second_barrier", "common.cuh",
             "  if (lane == 0) scratch[warp] = v;\n  __syncthreads();\n  v = lane < nwarps ? scratch[lane] : -INFINITY;",
             "  if (lane == 0) scratch[warp] = v;\n  v = lane < nwarps ? scratch[lane] : -INFINITY;",
             "block_max reads the per-warp maxima before every warp wrote its own"),
    Mutation("block_sum_lane_le_nwarps", "common.cuh",
             "  v = lane < nwarps ? scratch[lane] : T(0);",
             "  v = lane <= nwarps ? scratch[lane] : T(0);",
             "block_sum reads one scratch slot no warp wrote"),
    Mutation("warp_sum_shuffle_mask", "common.cuh",
             "for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);",
             "for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0x7fffffffu, v, o);",
             "warp_sum's mask leaves out lane 31"),
    Mutation("dkdv_stats_after_barrier", "attention.cuh",
             "  extra();\n  __syncthreads();\n}",
             "  __syncthreads();\n  extra();\n}",
             "the dk/dv kernel's row statistics are stored after the barrier its readers pass"),
    Mutation("refill_first_barrier", "attention.cuh",
             "                                    int r0, int T, int hs, bool vec, Extra&& extra) {\n  __syncthreads();\n",
             "                                    int r0, int T, int hs, bool vec, Extra&& extra) {\n",
             "attention tiles are overwritten while other warps still read the previous ones"),
    Mutation("group_sum_xor_offset", "attention.cuh",
             "  v += __shfl_xor_sync(kFullMask, v, 2);\n  return v;",
             "  v += __shfl_xor_sync(kFullMask, v, 4);\n  return v;",
             "attention's 4-lane group sum combines the wrong lanes"),
    Mutation("column_sum_barrier", "reduce.cuh",
             "  sh[threadIdx.y][threadIdx.x] = s;\n  __syncthreads();\n",
             "  sh[threadIdx.y][threadIdx.x] = s;\n",
             "the column partial sum reads other rows' shared slots before they are written"),
    Mutation("column_reduce_bound", "reduce.cuh",
             "for (int r = threadIdx.y; r < R; r += kReduceRows) s += partial[size_t(r) * C + c];",
             "for (int r = threadIdx.y; r <= R; r += kReduceRows) s += partial[size_t(r) * C + c];",
             "the column reduction adds one partial row too many"),
    Mutation("layernorm_backward_chunk_end", "layernorm.cuh",
             "const int r0 = blockIdx.x * rows_per_chunk, r1 = min(N, r0 + rows_per_chunk);",
             "const int r0 = blockIdx.x * rows_per_chunk, r1 = r0 + rows_per_chunk;",
             "layernorm backward's last chunk of rows reads past row N"),
    Mutation("gelu_tail_guard", "gelu.cuh",
             "    for (size_t k = iv; k < N; k++) out[k] = store_t<floatX>(gelu(load_f(inp[k])));",
             "    for (size_t k = iv; k <= N; k++) out[k] = store_t<floatX>(gelu(load_f(inp[k])));",
             "gelu's vector tail writes one element past the end"),
    Mutation("classifier_plain_rmw", "classifier.cuh",
             "      atomicAdd(valid, 1);",
             "      *valid += 1;",
             "the count of non-ignored rows as a plain read-modify-write from many blocks"),
    Mutation("naive_attention_syncwarp", "attention_naive.cuh",
             "  __syncwarp();  // the row of dS is read across lanes below\n",
             "",
             "lanes read other lanes' dS values without __syncwarp"),
    Mutation("residual_index", "residual.cuh",
             "    if (i < N) out[i] = store_t<floatX>(load_f(a[i]) + load_f(b[i]));",
             "    if (i < N) out[i] = store_t<floatX>(load_f(a[i]) + load_f(b[i + 1]));",
             "residual reads b one element ahead (the last one past the end)"),
    Mutation("norm_partial_index", "global_norm.cuh",
             "  if (threadIdx.x == 0) partial[blockIdx.x] = s;",
             "  if (threadIdx.x == 0) partial[blockIdx.x / 2] = s;",
             "two blocks store their partial sum of squares in one slot"),
    # ---------------------------------------------------------------- threshold mutants (issue 30): each is wrong only on
    # the far side of a code-path threshold of tests/csrc/cuda/cuda_emu/thresholds.py, which the op shapes of
    # compare_ops.py (N <= 111 rows, C <= 768, V = 97) mostly never reach
    Mutation("column_reduce_keep_last", "reduce.cuh",
             "for (int r = threadIdx.y; r < R; r += kReduceRows) s += partial[size_t(r) * C + c];",
             "for (int r = threadIdx.y; r < R; r += kReduceRows) s = partial[size_t(r) * C + c];",
             "pass 2's row-thread keeps only its last chunk (wrong once R > kReduceRows: the reviewer's survivor)",
             threshold="reduce.chunks_vs_reduce_rows"),
    Mutation("column_reduce_one_pass", "reduce.cuh",
             "for (int r = threadIdx.y; r < R; r += kReduceRows) s += partial[size_t(r) * C + c];",
             "for (int r = threadIdx.y; r < R && r < kReduceRows; r += kReduceRows) s += partial[size_t(r) * C + c];",
             "pass 2's row-threads take one chunk each (chunks past kReduceRows are dropped)",
             threshold="reduce.pass2_row_loop"),
    Mutation("column_partial_one_row_pass", "reduce.cuh",
             "for (int n = r0 + threadIdx.y; n < r1; n += kColRows) {",
             "for (int n = r0 + threadIdx.y; n < r1 && n < r0 + kColRows; n += kColRows) {",
             "pass 1's row-threads take one row each (rows of a chunk past kColRows are dropped)",
             threshold="reduce.chunk_row_threads"),
    Mutation("layernorm_bwd_one_column_pass", "layernorm.cuh",
             "    for (int c = threadIdx.x; c < C; c += blockDim.x) {\n      float sw = sums[c], sb = sums[C + c];",
             "    for (int c = threadIdx.x; c < C && c < int(blockDim.x); c += blockDim.x) {\n"
             "      float sw = sums[c], sb = sums[C + c];",
             "layernorm backward's dw / db sums skip the columns past the block's threads (C > 512)",
             threshold="layernorm.bwd_columns_per_thread"),
    Mutation("layernorm_fwd_cache_bound", "layernorm.cuh",
             "  if (vec && C <= 32 * kCache * K)",
             "  if (vec && C <= 32 * kCache * K + K)",
             "the register-cached forward takes a row one vector wider than its cache",
             threshold="layernorm.fwd_register_cache"),
    Mutation("layernorm_bwd_no_smem_opt_in", "layernorm.cuh",
             "  if (smem > 48 * 1024)\n",
             "  if (smem > 64 * 1024)\n",
             "layernorm backward launches with over 48 KiB of dynamic shared memory without the opt-in (C > 6144)",
             threshold="layernorm.bwd_smem_opt_in"),
    Mutation("classifier_lse_one_vector_pass", "classifier.cuh",
             "  for (int i = threadIdx.x; i < VV; i += blockDim.x) {\n    const P p = P::load(row + K * i);\n"
             "    float v[K];",
             "  for (int i = threadIdx.x; i < VV && i < int(blockDim.x); i += blockDim.x) {\n"
             "    const P p = P::load(row + K * i);\n    float v[K];",
             "the logsumexp drops the vectors past one per thread (V > 4 x 512 fp32)",
             threshold="classifier.fwd_vectors_per_thread"),
    Mutation("classifier_dlogits_one_vector_pass", "classifier.cuh",
             "  for (int i = threadIdx.x; i < VV; i += blockDim.x) {\n    P v = P::load(row + K * i);",
             "  for (int i = threadIdx.x; i < VV && i < int(blockDim.x); i += blockDim.x) {\n    P v = P::load(row + K * i);",
             "dlogits leaves the vectors past one per thread unwritten (V > 4 x 512 fp32)",
             threshold="classifier.fwd_vectors_per_thread"),
    Mutation("classifier_count_one_pass", "classifier.cuh",
             "  for (int i = threadIdx.x; i < N; i += blockDim.x) c += targets[i] >= 0;",
             "  for (int i = threadIdx.x; i < N && i < int(blockDim.x); i += blockDim.x) c += targets[i] >= 0;",
             "the valid-target count stops after one target per thread (N > 1024 rows: every real batch)",
             threshold="classifier.count_rows"),
    Mutation("loss_accumulate_one_pass", "classifier.cuh",
             "  for (int i = threadIdx.x; i < N; i += blockDim.x) s += double(losses[i]);",
             "  for (int i = threadIdx.x; i < N && i < int(blockDim.x); i += blockDim.x) s += double(losses[i]);",
             "the loss sum stops after one row per thread (N > 1024 rows)",
             threshold="classifier.count_rows"),
    Mutation("encoder_wte_one_bucket_pass", "encoder.cuh",
             "  for (int u = blockIdx.x; u < U; u += gridDim.x) {",
             "  for (int u = blockIdx.x; u < U && u < int(gridDim.x); u += gridDim.x) {",
             "the wte gradient skips the token buckets past one per block (more than 2048 distinct tokens)",
             threshold="encoder.wte_bucket_stride"),
    Mutation("adamw_one_grid_pass", "adamw.cuh",
             "i < units; i += size_t(gridDim.x) * blockDim.x) {",
             "i < units && i < size_t(gridDim.x) * blockDim.x; i += size_t(gridDim.x) * blockDim.x) {",
             "AdamW leaves the values past one grid of units unupdated (segments over 2M values: d12's wte)",
             threshold="adamw.grid_stride"),
    Mutation("sum_squares_one_grid_pass", "global_norm.cuh",
             "i < n; i += size_t(gridDim.x) * blockDim.x) {",
             "i < n && i < size_t(gridDim.x) * blockDim.x; i += size_t(gridDim.x) * blockDim.x) {",
             "the gradient norm drops the values past one grid (n > 65536: every real model)",
             threshold="global_norm.grid_stride"),
    # ---------------------------------------------------------------- the shared optimizer policy (one code path)
    Mutation("loss_scaler_nan_is_clean", "../model/optimizer.h",
             "  const bool finite = std::isfinite(sumsq);",
             "  const bool finite = !std::isinf(sumsq);",
             "the loss scaler's overflow check counts a NaN sum of squares as clean (the reviewer's device-branch "
             "survivor, now in the one code path)"),
    Mutation("clip_nan_norm_applies", "../model/optimizer.h",
             "  if (!std::isfinite(norm)) return false;",
             "  if (std::isinf(norm)) return false;",
             "a NaN gradient norm passes the clip rule: AdamW writes NaN updates"),
    # ---------------------------------------------------------------- nvcc-only code (never compiled by the emulator)
    Mutation("mma_bf16_operands_swapped", "mma.cuh",
             ': "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));\n  } else {',
             ': "r"(a[0]), "r"(a[2]), "r"(a[1]), "r"(a[3]), "r"(b[0]), "r"(b[1]));\n  } else {',
             "the bf16 mma's A fragment registers out of order",
             unreachable="inline PTX: the emulator implements mma.sync itself (mma_emu.h, checked against a float64 "
                         "product in tests/csrc/emu/mma.cu); only a GPU run (test_cuda_gpu.py) reaches the asm"),
    Mutation("ldmatrix_trans_dropped", "mma.cuh",
             "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16",
             "ldmatrix.sync.aligned.m8n8.x4.shared.b16",
             "ldmatrix_x4_trans loads untransposed",
             unreachable="inline PTX (GPU only: test_cuda_gpu.py); the emulator's ldmatrix .trans is checked in "
                         "tests/csrc/emu/mma.cu"),
    Mutation("sm75_head_size_gate", "attention_tc.cuh",
             "  return HS <= 64;",
             "  return HS <= 128;",
             "sm_75 compiles the tensor-core kernels for head sizes it cannot run",
             unreachable="__CUDA_ARCH__ < 800 branch: the emulator is sm_90 and never compiles it (an sm_75 GPU "
                         "would run test_cuda_gpu.py)"),
    Mutation("k8_split_halves_swapped", "mma.cuh",
             "  mma_m16n8k8_f16(d, lo, b[0]);\n  mma_m16n8k8_f16(d, hi, b[1]);",
             "  mma_m16n8k8_f16(d, lo, b[1]);\n  mma_m16n8k8_f16(d, hi, b[0]);",
             "the sm_75 m16n8k16 split pairs each half of A with the wrong half of B",
             unreachable="only called below sm_80 (__CUDA_ARCH__ < 800 branch of mma_m16n8k16), which the emulator "
                         "never compiles; tests/csrc/emu/mma.cu checks the k8 layout itself"),
    Mutation("mma_k8_operands_swapped", "mma.cuh",
             ': "r"(a[0]), "r"(a[1]), "r"(b));',
             ': "r"(a[1]), "r"(a[0]), "r"(b));',
             "the fp16 m16n8k8 mma's A fragment registers swapped",
             unreachable="inline PTX (GPU only: test_cuda_gpu.py); the emulator's m16n8k8 is checked in "
                         "tests/csrc/emu/mma.cu"),
    Mutation("sm70_tc_gate_open", "attention_tc.cuh",
             "#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 750\n  return false;",
             "#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 750\n  return true;",
             "below sm_75 the tensor-core kernels compile their bodies (ldmatrix traps there)",
             unreachable="__CUDA_ARCH__ < 750 branch: compiled only for sm_70 by nvcc, never by the emulator"),
    Mutation("launch_grid_block_swapped", "portable.h",
             "  kernel<<<(grid), (block), (smem), (stream)>>>(__VA_ARGS__)",
             "  kernel<<<(block), (grid), (smem), (stream)>>>(__VA_ARGS__)",
             "LAUNCH under nvcc passes the block as the grid",
             unreachable="the nvcc definition of LAUNCH (the emulator defines its own, checked by every emulator "
                         "test); a GPU run (test_cuda_gpu.py) would fail every kernel"),
    Mutation("host_device_host_only", "../model/host_device.h",
             "#define GPT2CORE_HOST_DEVICE __host__ __device__",
             "#define GPT2CORE_HOST_DEVICE __host__",
             "the clip rule and loss scaler compile for the host only",
             unreachable="nvcc-only macro: CI's nvcc build of the CUDA backend fails (a kernel calls a host "
                         "function), no emulator test is needed or able to see it"),
    Mutation("matmul_error_detail_dropped", "matmul.cuh",
             "  detail = gpt2core::seams::last_matmul_error();\n#endif\n  throw",
             "#endif\n  throw",
             "a failed cuBLASLt call's message loses the library's detail",
             unreachable="library error text (GPU only); test_cublaslt_descriptors.py checks the seam's messages"),
    Mutation("matmul_workspace_not_released", "backend_cuda.cu",
             "    seams::release_matmul_stream(stream_);\n",
             "",
             "the backend's cuBLASLt workspace outlives its stream",
             unreachable="library workspace (GPU only): a leak that test_cuda_gpu.py's repeated model creation "
                         "would show in device memory"),
    Mutation("attention_error_detail_dropped", "backend_cuda.cu",
             "    detail = seams::last_attention_error();\n",
             "",
             "a failed cuDNN call's message loses the library's detail",
             unreachable="library error text (GPU only); test_cudnn_graph.py checks the seam's messages"),
]


# ---------------------------------------------------------------- inference, sampling and the modern ops (issue 39)
# Judged by the pytest nodes named beside each (the exposing input): C++ mutants of csrc/cuda (a scratch copy), csrc/cpu
# and csrc/model (in place, restored) are built into the emulator's test module, which the tests then use for
# gpt2core._C too (the same bindings.cpp: run_tests); "py:<file>" mutants change a copy of the installed package.
PY = "tests/python/test_inference_edges.py::"
EDGES = "tests/csrc/cuda/test_cuda_emu_infer_edges.py::"
THRESH = "tests/csrc/cuda/test_cuda_emu_thresholds.py::test_threshold_case"
V3 = "x86-64-v3"
INFERENCE_MUTATIONS = [
    # ---- CPU decode GEMVs (cpu/ops_infer.h), each variant forced
    Mutation("gemv_tail_row_dropped", "../cpu/ops_infer.h",
             "  for (int o = o0; o < o1; o++)\n    for (int n0 = 0; n0 < N; n0 += 3) {",
             "  for (int o = o0; o + 1 < o1; o++)\n    for (int n0 = 0; n0 < N; n0 += 3) {",
             "the AVX2 GEMV leaves the last output row of each thread's range unwritten",
             tests=(PY + f"test_every_variant_every_weight_type_decodes_the_full_forward[{V3}-fp32-C56]",)),
    Mutation("gemv_row1_tail_chunk_dropped", "../cpu/ops_infer.h",
             "  for (; i < C; i += 8) {\n    const __m256 w = ld.load8(o, i);",
             "  for (; i + 8 < C; i += 8) {\n    const __m256 w = ld.load8(o, i);",
             "the AVX2 GEMV skips the last 8 inputs of a row whose length is no multiple of 32 (C = 56)",
             tests=(PY + f"test_every_variant_every_weight_type_decodes_the_full_forward[{V3}-bf16-C56]",)),
    Mutation("q8_load_scale_of_next_block", "../cpu/ops_infer.h",
             "_mm256_broadcast_ss(scales + row * nb + i / kQ8Block);",
             "_mm256_broadcast_ss(scales + row * nb + (i + 8) / kQ8Block);",
             "the widening int8 GEMV takes the last 8 weights of each block with the next block's scale",
             tests=(PY + f"test_every_variant_every_weight_type_decodes_the_full_forward[{V3}-int8-C56]",)),
    Mutation("plain_gemv_fp16_as_bf16", "../cpu/ops_infer.h",
             "for (int i = 0; i < C; i++) s += weight_as<T>(wr, i, bf16) * x[i];",
             "for (int i = 0; i < C; i++) s += weight_as<T>(wr, i, true) * x[i];",
             "the portable GEMV decodes fp16 weights as bf16 (a wrong fp16 decode where C % 8 != 0 or on baseline)",
             tests=(PY + "test_every_variant_every_weight_type_decodes_the_full_forward[baseline-fp16-C56]",)),
    Mutation("plain_q8_blocks_floor", "../cpu/ops_infer.h",
             "                               int OC, int o0, int o1) {\n  const int nb = (C + kQ8Block - 1) / kQ8Block;",
             "                               int OC, int o0, int o1) {\n  const int nb = C / kQ8Block;",
             "the portable int8 GEMV counts whole blocks only: rows whose length is no multiple of 32 read the scales "
             "of the row before",
             tests=(PY + "test_every_variant_every_weight_type_decodes_the_full_forward[baseline-int8-C56]",)),
    Mutation("q8i_row1_odd_block_dropped", "../cpu/ops_infer.h",
             "  if (b < nb) block(b, 0);\n",
             "",
             "the integer-dot GEMV drops the last block of an odd block count (C = 96: 3 blocks)",
             tests=(PY + f"test_int8_integer_dot_every_variant_with_mass_at_the_edges[{V3}-96-33]",)),
    Mutation("avx2_attention_max_not_subtracted", "../cpu/ops_infer.h",
             "  float sum = 0;\n  for (int t2 = 0; t2 < n; t2++) { p[t2] = fast_exp(p[t2] - maxv); sum += p[t2]; }",
             "  float sum = 0;\n  for (int t2 = 0; t2 < n; t2++) { p[t2] = fast_exp(p[t2]); sum += p[t2]; }",
             "the AVX2 decode attention's softmax without its maximum subtracted (scores of +200 overflow)",
             tests=(EDGES + f"test_cpu_decode_attention_huge_maximum_at_every_key[{V3}-hs64-n12-Tq1]",)),
    Mutation("plain_attention_sum_skips_new_key", "../cpu/ops_infer.h",
             "          T sum = 0;\n          for (int t2 = 0; t2 < n; t2++) {",
             "          T sum = 0;\n          for (int t2 = 0; t2 + 1 < n; t2++) {",
             "the portable attention leaves the newest key's probability unnormalised (the last key, an edge)",
             tests=(EDGES + "test_cpu_decode_attention_huge_maximum_at_every_key[baseline-hs48-n9-Tq1]",)),
    Mutation("rope_at_row_offset_dropped", "../cpu/ops_infer.h",
             "rope_table_row(cs.data(), sn.data(), long(pos[b]) + t, hs, base, +1);",
             "rope_table_row(cs.data(), sn.data(), long(pos[b]), hs, base, +1);",
             "CPU rotary at per-sequence positions rotates every prefill row by the sequence's first position",
             tests=(PY + "test_decode_to_the_last_cache_position_and_generate_past_block_size[bf16]",)),
    # ---- the variant dispatch (cpu/backend_cpu.cpp)
    Mutation("isas_lists_variants_cpu_lacks", "../cpu/backend_cpu.cpp",
             "    if (v.runs_here()) names.emplace_back(v.name);",
             "    names.emplace_back(v.name);",
             "cpu_isas() offers variants this CPU cannot run (x86-64-v4 without AVX-512): forcing one fails",
             tests=(PY + "test_every_variant_every_weight_type_decodes_the_full_forward",)),
    # ---- the host sampler (model/sampling.h: the CPU backend's, and the CUDA backend's host fallback)
    Mutation("sampler_top_p_strict", "../model/sampling.h",
             "      if (c >= want) { m = j + 1; break; }",
             "      if (c > want) { m = j + 1; break; }",
             "the nucleus takes one token more when its cumulative sum lands exactly on top_p",
             tests=(EDGES + "test_flat_logits_top_p_exactly_on_the_cumulative_boundary[8-0.5-4]",)),
    Mutation("sampler_ties_to_higher_id", "../model/sampling.h",
             "    return za > zb || (za == zb && a < b);",
             "    return za > zb || (za == zb && a > b);",
             "tied logits ordered towards the higher id (the top_k cut keeps the wrong tokens)",
             tests=(EDGES + "test_ties_at_the_top_k_cut_keep_the_lower_ids",)),
    Mutation("sampler_greedy_tie_last", "../model/sampling.h",
             "      if (v > bv) { bv = v; best = i; }",
             "      if (v >= bv) { bv = v; best = i; }",
             "greedy decoding picks the last of tied maxima instead of the lowest id",
             tests=(EDGES + "test_ties_at_the_top_k_cut_keep_the_lower_ids",)),
    Mutation("sampler_nucleus_not_renormalised", "../model/sampling.h",
             "    total = 0;\n    for (size_t j = 0; j < m; j++) total += p[j];",
             "",
             "the draw inside the nucleus uses the mass of every kept token (the nucleus's last token over-drawn)",
             tests=(EDGES + "test_flat_logits_top_p_exactly_on_the_cumulative_boundary[8-0.5-4]",)),
    # ---- KV bookkeeping (model/gpt2_infer.h)
    Mutation("kv_full_check_off_by_one", "../model/gpt2_infer.h",
             "    if (pos[i] >= kv_T_)",
             "    if (pos[i] > kv_T_)",
             "decode at a full cache writes one position past it instead of refusing",
             tests=(PY + "test_decode_to_the_last_cache_position_and_generate_past_block_size[int8]",)),
    # ---- CUDA decode attention and sampler (infer.cuh)
    Mutation("decode_block_max_skips_last_warp", "infer.cuh",
             "  for (int w = 1; w < kDecodeWarps; w++) mx = fmaxf(mx, wmax[w]);",
             "  for (int w = 1; w < kDecodeWarps - 1; w++) mx = fmaxf(mx, wmax[w]);",
             "the decode softmax's maximum leaves out the last warp's keys: exp overflows when the maximum is there",
             tests=(EDGES + "test_cuda_decode_attention_huge_maximum_at_every_key[hs64-n12-Tq1]",)),
    Mutation("split_combine_max_skips_last_share", "infer.cuh",
             "  for (int s = 0; s < splits; s++) M = fmaxf(M, part_ml[2 * (p0 + s)]);",
             "  for (int s = 0; s + 1 < splits; s++) M = fmaxf(M, part_ml[2 * (p0 + s)]);",
             "the split-key combine's maximum leaves out the last share: overflow when the maximum is there",
             tests=(EDGES + "test_cuda_decode_attention_huge_maximum_at_every_key[hs32-n9-Tq1]",)),
    Mutation("split_share_past_n", "infer.cuh",
             "const int k0 = min(n, s * chunk), nk = min(n, k0 + chunk) - k0;",
             "const int k0 = min(n, s * chunk), nk = k0 + chunk - k0;",
             "each split share takes a whole chunk: the last ones read keys past the sequence (a read past the cache)",
             tests=(EDGES + "test_cuda_decode_attention_huge_maximum_at_every_key[hs32-n9-Tq1]",)),
    Mutation("sample_chunk_past_v", "infer.cuh",
             "const int i0 = min(V, tid * per), i1 = min(V, i0 + per);",
             "const int i0 = min(V, tid * per), i1 = i0 + per;",
             "the unsorted inverse CDF's idle threads read the padding columns past V",
             tests=(EDGES + "test_all_the_mass_in_the_first_or_last_id[97]",)),
    Mutation("sample_kernel_top_p_strict", "infer.cuh",
             "        if (c >= want) {\n          mm = j + 1;",
             "        if (c > want) {\n          mm = j + 1;",
             "the device nucleus takes one token more when its cumulative sum lands exactly on top_p",
             tests=(EDGES + "test_flat_logits_top_p_exactly_on_the_cumulative_boundary[8-0.5-4]",)),
    Mutation("sample_key_ties_to_higher_id", "infer.cuh",
             "return (uint64_t(o) << 32) | uint64_t(0xffffffffu - uint32_t(i));",
             "return (uint64_t(o) << 32) | uint64_t(uint32_t(i));",
             "the device sampler orders tied logits towards the higher id",
             tests=(EDGES + "test_ties_at_the_top_k_cut_keep_the_lower_ids",)),
    Mutation("sample_kept_total_over_all_v", "infer.cuh",
             "      if (sample_key(zi, i) >= thr_m) local += exp_nonpositive((double(zi) - zmax) * inv_t);",
             "      local += exp_nonpositive((double(zi) - zmax) * inv_t);",
             "top_k above the sorted candidates with top_p: the nucleus is measured against all V tokens",
             tests=(EDGES + "test_top_k_above_the_device_candidates_with_top_p",)),
    # ---- rotary (rope.cuh), ReLU^2 (relu2.cuh), Muon (muon.cuh)
    Mutation("rope_at_row_offset_dropped_cuda", "rope.cuh",
             "const int p = (pos ? pos[bt / T] : pos0) + int(bt % T);",
             "const int p = pos ? pos[bt / T] : pos0 + int(bt % T);",
             "CUDA rotary at per-sequence positions rotates every prefill row by the sequence's first position",
             tests=(EDGES + "test_decode_to_the_last_position_of_the_context[fp32-modern]",)),
    Mutation("rope_table_one_past", "rope.cuh",
             "  if (idx >= maxT * h) return;",
             "  if (idx > maxT * h) return;",
             "the rotary table kernel writes one row entry past the table",
             tests=(THRESH + "[rope.grid_tail[0]]",)),
    Mutation("rope_table_one_row_short", "backend_cuda.cu",
             "rope_table(most + Tn, C / NH, base)",
             "rope_table(most + Tn - 1, C / NH, base)",
             "the CUDA rotary launcher sizes its table one row short: decode one past the table's rows reads past it",
             tests=(THRESH + "[rope.table_rows[1]]",)),
    Mutation("relu2_forward_tail_short", "relu2.cuh",
             "    for (size_t k = iv; k < N; k++) out[k] = store_t<floatX>(relu2(load_f(inp[k])));",
             "    for (size_t k = iv; k + 1 < N; k++) out[k] = store_t<floatX>(relu2(load_f(inp[k])));",
             "ReLU^2's vector tail skips the last value (N % 4 != 0)",
             tests=(THRESH + "[relu2.vector_tail[1]]",)),
    Mutation("muon_normalize_no_eps", "muon.cuh",
             "  const float inv = 1.0f / (float(sqrt(sumsq[blockIdx.y * sumsq_stride])) + float(kMuonNormEps));",
             "  const float inv = 1.0f / float(sqrt(sumsq[blockIdx.y * sumsq_stride]));",
             "Newton-Schulz's normalisation without its epsilon: a matrix with a zero gradient gets an infinite update",
             tests=(EDGES + "test_muon_step_with_a_zero_gradient_matrix",)),
    Mutation("muon_batch_one_norm", "muon.cuh",
             "  muon_normalize(X, x, ss, n, batch, sx, 1, stream);",
             "  muon_normalize(X, x, ss, n, batch, sx, 0, stream);",
             "a batched Newton-Schulz normalises every matrix by the first one's norm",
             tests=("tests/csrc/cuda/test_cuda_emu_muon.py::test_emulated_cuda_newton_schulz_batched_is_each_matrix_alone",)),
    # ---- the Python stop-string handling (inference.py, serve.py)
    Mutation("stop_window_in_characters", "py:model/engine.py",
             '    longest = max(len(s.encode("utf-8")) for s in stops)',
             "    longest = max(len(s) for s in stops)",
             "generate's stop-string window counts characters: a stop of 4-byte characters in single-byte tokens is "
             "never seen whole",
             tests=(PY + "test_generate_stops_at_a_stop_string_of_four_byte_characters",)),
    Mutation("truncate_last_stop_found", "py:model/engine.py",
             "            cut = min(cut, i)",
             "            cut = i",
             "the text is cut at the last listed stop string found, not the earliest occurrence",
             tests=(PY + "test_several_stop_strings_the_earliest_occurrence_wins",)),
    Mutation("generate_decodes_a_full_window", "py:model/engine.py",
             '("decode", [b for b in live if ctx_len[b] < block])',
             '("decode", [b for b in live if ctx_len[b] <= block])',
             "generate decodes once more into a full cache instead of re-prefilling the window past block_size",
             tests=(PY + "test_decode_to_the_last_cache_position_and_generate_past_block_size[bf16]",)),
    Mutation("text_stream_first_listed_stop", "py:inference/scheduler.py",
             "        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)",
             "        cut = next((i for i in (text.find(s) for s in self.stop) if i >= 0), -1)",
             "the server cuts at the first listed stop string found, not the one that starts first",
             tests=(PY + "test_server_stops_at_multibyte_stop_strings_and_the_earliest_wins",)),
    Mutation("text_stream_holds_too_little", "py:inference/scheduler.py",
             "                for k in range(min(len(s) - 1, len(text)), hold, -1):",
             "                for k in range(min(len(s) - 2, len(text)), hold, -1):",
             "the server releases a stop string's first character before the stop is complete (and then misses it)",
             tests=(PY + "test_server_stops_at_multibyte_stop_strings_and_the_earliest_wins",)),
]
MUTATIONS += INFERENCE_MUTATIONS


def mutated_line(text, m):
    """1-based line of the mutation in the mutated file (the first changed line, or the one after a deletion)."""
    start = text.index(m.old)
    common = len(os.path.commonprefix([m.old, m.new]))
    return text[:start + common].count("\n") + 1


def sync_tree(src, dst):
    """Makes dst a copy of src, rewriting only files that differ (so the build stays incremental)."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file():
            target = dst / f.name
            data = f.read_bytes()
            if not target.exists() or target.read_bytes() != data:
                target.write_bytes(data)


def build(build_dir, scratch):
    if not (build_dir / "CMakeCache.txt").exists():
        cfg = ["cmake", "-S", str(ROOT / "tests" / "csrc" / "cuda" / "cuda_emu"), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release",
               f"-DPython_EXECUTABLE={sys.executable}", f"-DGPT2CORE_EMU_CUDA_DIR={scratch}",
               "-DCMAKE_INTERPROCEDURAL_OPTIMIZATION=OFF"]  # no LTO: each mutant relinks the whole module
        if shutil.which("ninja"):
            cfg += ["-G", "Ninja"]
        subprocess.run(cfg, check=True, capture_output=True, text=True)
    r = subprocess.run(["cmake", "--build", str(build_dir), "-j2"], capture_output=True, text=True)
    return r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


def run_ops(build_dir, sched, timeout, checker=True, first=None):
    """One run of the op comparison (compare_ops.py) under schedule sched, or (sched "thresholds") of the threshold
    shapes (threshold_ops.py, schedule fwd; the mutant's threshold first, stopping at the first failing shape)."""
    script = "threshold_ops.py" if sched == "thresholds" else "compare_ops.py"
    extra = ["--fail-fast"] + (["--first", first] if first else []) if sched == "thresholds" else []
    env = dict(os.environ, GPT2CORE_EMU_SCHED="fwd" if sched == "thresholds" else sched)
    if not checker:
        env["GPT2CORE_EMU_RACECHECK"] = "0"
    env.pop("GPT2CORE_EMU_TRACE", None)
    try:
        r = subprocess.run([sys.executable, str(EMU_TESTS / script), str(build_dir)] + extra,
                           env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "error", "timed out"
    out = r.stdout + r.stderr
    if r.returncode != 0:
        report = [line for line in out.splitlines() if REPORT.search(line)]
        return ("report", report[-1]) if report else ("error", out.strip().splitlines()[-1] if out.strip() else "")
    errors = json.loads(r.stdout.strip().splitlines()[-1])
    bad = {k: v for k, v in errors.items() if not v <= 1e-5}
    return ("mismatch", f"{len(bad)} ops differ, e.g. {sorted(bad)[:3]}") if bad else ("pass", "")


def run_schedules(m, line, build_dir, schedules, timeout, stop_early, checker=True):
    """{schedule: [kind, detail]} for the built mutant, and the verdict (the first killing kind, or survived)."""
    runs = {}
    for sched in schedules:
        kind, detail = run_ops(build_dir, sched, timeout, checker, m.threshold or None)
        if kind == "report" and re.search(re.escape(f"{Path(m.file).name}:{line}") + r"\b", detail):
            kind = "report (line)"
        runs[sched] = [kind, detail]
        if stop_early and kind != "pass":
            break
    kinds = [k for k, _ in runs.values() if k != "pass"]
    return runs, kinds[0] if kinds else "survived"


def source_file(m):
    """The file m changes in the working tree (before any scratch copy), and how it is named in reports."""
    if m.file.startswith("py:"):
        return ROOT / "python" / "gpt2core" / m.file[3:], "python/gpt2core/" + m.file[3:]
    return CUDA / m.file, m.file.replace("../", "")


def python_copy(build_dir):
    """A fresh copy of the installed gpt2core package (its compiled modules) under <build-dir>/py, with the working
    tree's Python sources over it: what a "py:" mutant changes (PYTHONPATH=<build-dir>/py runs the tests on it)."""
    r = subprocess.run([sys.executable, "-c", "import gpt2core, os; print(os.path.dirname(gpt2core.__file__))"],
                       cwd=str(build_dir.parent), capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit("py: mutants need gpt2core installed (pip install .): " + r.stderr.strip()[-300:])
    dst = build_dir / "py" / "gpt2core"
    if dst.exists():
        shutil.rmtree(dst)
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(r.stdout.strip(), dst, ignore=ignore)
    shutil.copytree(ROOT / "python" / "gpt2core", dst, ignore=ignore, dirs_exist_ok=True)
    return dst


# gpt2core with its core module replaced by the emulator's test module built from the mutant (the same bindings.cpp,
# plus the emulated CUDA backend), then pytest: the tests of gpt2core._C run on the mutant's CPU code
EMU_AS_CORE = ("import sys; b = sys.argv.pop(1); sys.path.insert(0, b); import gpt2core_cuda_emu as E; "
               "sys.modules['gpt2core._C'] = E; import pytest; sys.exit(pytest.main(sys.argv[1:]))")


def run_tests(m, build_dir, timeout):
    """m's exposing tests on the built mutant: ("tests", detail) when one fails (killed), ("error", ...) when the
    mutant crashes the process (killed), ("pass", detail) when all pass or skip, ("harness error", ...) when pytest
    cannot run them (a node id that does not exist, a collection error)."""
    args = ["-x", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "--rootdir", str(ROOT), *m.tests]
    env = dict(os.environ, GPT2CORE_EMU_BUILD=str(build_dir))
    if m.file.startswith("py:"):
        env["PYTHONPATH"] = str(build_dir / "py") + os.pathsep + env.get("PYTHONPATH", "")
        cmd = [sys.executable, "-m", "pytest", *args]
    else:
        cmd = [sys.executable, "-c", EMU_AS_CORE, str(build_dir), *args]
    try:
        r = subprocess.run(cmd, cwd=str(ROOT), env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "tests", "timed out"
    lines = (r.stdout + r.stderr).strip().splitlines()
    last = lines[-1] if lines else ""
    if r.returncode == 0:
        return "pass", last
    if r.returncode == 1:
        failed = [ln for ln in lines if ln.startswith(("FAILED", "ERROR"))]
        return "tests", (failed[0] if failed else last)[:300]
    if r.returncode < 0:  # the mutant crashed the test process (e.g. a write past a buffer: glibc's abort)
        return "error", f"the tests crashed (signal {-r.returncode}): {last[:200]}"
    return "harness error", f"pytest exit {r.returncode}: {last}"


def evaluate(m, build_dir, scratch, schedules, timeout, stop_early, baseline):
    """Applies m in scratch, builds, runs the schedules (or m's tests); returns a result dict."""
    sync_tree(CUDA, scratch)
    in_place = m.file.startswith("../")  # csrc/model, csrc/cpu: mutated in place, restored below
    _, where = source_file(m)
    path = python_copy(build_dir) / m.file[3:] if m.file.startswith("py:") else \
        (CUDA if in_place else scratch) / m.file
    text = path.read_text()
    if text.count(m.old) != 1:
        raise SystemExit(f"mutation {m.name}: snippet found {text.count(m.old)} times in {where}")
    line = mutated_line(text, m)
    result = {"name": m.name, "where": f"{where}:{line}", "why": m.why, "runs": {},
              "threshold": m.threshold, "tests": list(m.tests)}
    if m.unreachable:
        result.update(verdict="unreachable", detail=m.unreachable)
        return result
    path.write_text(text.replace(m.old, m.new))
    try:
        return run_mutant(m, line, result, build_dir, scratch, schedules, timeout, stop_early, baseline)
    finally:
        if in_place:
            path.write_text(text)


def run_mutant(m, line, result, build_dir, scratch, schedules, timeout, stop_early, baseline):
    if not m.file.startswith("py:"):
        ok, log = build(build_dir, scratch)
        if not ok:
            result.update(verdict="build error", detail=log.strip().splitlines()[-1] if log.strip() else "")
            return result
    if m.tests:
        kind, detail = run_tests(m, build_dir, timeout)
        result["runs"] = {"tests": [kind, detail]}
        result["verdict"] = {"pass": "survived"}.get(kind, kind)
        result["detail"] = detail
        return result
    result["runs"], result["verdict"] = run_schedules(m, line, build_dir, schedules, timeout, stop_early)
    result["detail"] = next((d for k, d in result["runs"].values() if k != "pass"), "")
    if baseline:  # the emulator before the memory checker and the run-ahead schedules
        result["baseline_runs"], result["baseline"] = run_schedules(m, line, build_dir, BASELINE_SCHEDULES, timeout,
                                                                    stop_early, checker=False)
    return result


def evaluate_together(ms, build_dir, scratch, timeout):
    """Applies every mutation of ms (threshold mutants of csrc/cuda) at once, builds, runs every threshold shape;
    returns one result per mutant: killed (mismatch) when a shape of its threshold fails."""
    sync_tree(CUDA, scratch)
    texts = {}
    lines = {}
    for m in ms:
        if not m.threshold or m.file.startswith("../"):
            raise SystemExit(f"--together takes threshold mutants of csrc/cuda only, not {m.name}")
        path = scratch / m.file
        text = texts.get(path, path.read_text())
        if text.count(m.old) != 1:
            raise SystemExit(f"mutation {m.name}: snippet found {text.count(m.old)} times in csrc/cuda/{m.file}")
        lines[m.name] = mutated_line(text, m)
        texts[path] = text.replace(m.old, m.new)
    for path, text in texts.items():
        path.write_text(text)
    ok, log = build(build_dir, scratch)
    base = [{"name": m.name, "where": f"{m.file}:{lines[m.name]}", "why": m.why, "threshold": m.threshold,
             "together": [x.name for x in ms]} for m in ms]
    if not ok:
        return [dict(r, verdict="build error", detail=log.strip().splitlines()[-1]) for r in base]
    env = dict(os.environ, GPT2CORE_EMU_SCHED="fwd")
    r = subprocess.run([sys.executable, str(EMU_TESTS / "threshold_ops.py"), str(build_dir), "--keep-going"], env=env,
                       capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        tail = (r.stdout + r.stderr).strip().splitlines()[-1:]
        return [dict(x, verdict="error", detail=f"combined run failed, no verdicts: {tail}") for x in base]
    errors = json.loads(r.stdout.strip().splitlines()[-1])
    out = []
    for x in base:
        bad = sorted(k for k, v in errors.items() if k.startswith(x["threshold"] + "[") and not v <= 1e-5)
        out.append(dict(x, verdict="mismatch" if bad else "survived", runs={"thresholds": ["mismatch" if bad else
                   "pass", ""]}, detail=f"{len(bad)} shapes of {x['threshold']} differ: {bad}" if bad else ""))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", nargs="+", metavar="NAME", help="mutations to run (default: all)")
    ap.add_argument("--schedules", default="thresholds,fwd,low,high,ahead:1",
                    help="comma-separated emulator schedules (thresholds: the threshold table's shapes)")
    ap.add_argument("--only-threshold", action="store_true",
                    help="only the threshold mutants and those of the shared optimizer policy (csrc/model)")
    ap.add_argument("--judged-by-tests", action="store_true",
                    help="only the mutants judged by their exposing tests (inference, sampling, modern ops: issue 39)")
    ap.add_argument("--thresholds", action="store_true",
                    help="print, per kernel family, the thresholds its tests cross, and exit")
    ap.add_argument("--build-dir", default=str(ROOT / "build" / "emu-mut"), help="build folder (reused)")
    ap.add_argument("--stop-early", action="store_true", help="stop a mutant at its first killing schedule")
    ap.add_argument("--repeat", type=int, default=1, help="run each mutant this many times (verdicts must agree)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per compare_ops run")
    ap.add_argument("--baseline", action="store_true",
                    help="also score each mutant as the emulator did before its memory checker: checker off "
                         "(GPT2CORE_EMU_RACECHECK=0), lock-step schedules " + ",".join(BASELINE_SCHEDULES))
    ap.add_argument("--together", action="store_true",
                    help="apply the chosen threshold mutants at once (one build); each is judged by its own threshold's shapes")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--list", action="store_true", help="list the mutations and exit")
    args = ap.parse_args(argv)
    if args.list:
        for m in MUTATIONS:
            print(f"{m.name:34s} {m.file:22s} {m.why}" + (f" [unreachable: {m.unreachable}]" if m.unreachable else ""))
        return 0
    if args.thresholds:
        threshold_report()
        return 0
    chosen = [m for m in MUTATIONS if (not args.only or m.name in args.only)
              and (not args.only_threshold or m.threshold or (m.file.startswith("../") and not m.tests))
              and (not args.judged_by_tests or m.tests)]
    unknown = set(args.only or []) - {m.name for m in MUTATIONS}
    if unknown:
        ap.error(f"unknown mutations: {sorted(unknown)}")
    build_dir = Path(args.build_dir).resolve()
    scratch = build_dir / "src" / "cuda"
    schedules = args.schedules.split(",")
    results = []
    if args.together:
        try:
            t0 = time.time()
            results = evaluate_together([m for m in chosen if not m.unreachable], build_dir, scratch, args.timeout)
        finally:
            sync_tree(CUDA, scratch)
        for r in results:
            r["deterministic"], r["seconds"] = True, round(time.time() - t0, 1)
            print(f"{r['name']:34s} {r['where']:24s} {r['verdict']:15s} (together) {r['detail'][:300]}", flush=True)
        chosen = []
    try:
        for m in chosen:
            t0 = time.time()
            runs = [evaluate(m, build_dir, scratch, schedules, args.timeout, args.stop_early, args.baseline)
                    for _ in range(args.repeat)]
            r = runs[0]
            r["deterministic"] = all(x["verdict"] == r["verdict"] for x in runs)
            r["seconds"] = round(time.time() - t0, 1)
            results.append(r)
            killers = ",".join(s for s, (k, _) in r["runs"].items() if k != "pass") or "-"
            base = f" (before: {r['baseline']})" if args.baseline else ""
            print(f"{r['name']:34s} {r['where']:24s} {r['verdict']:15s} by {killers:24s}{base} {r['detail'][:300]}",
                  flush=True)
    finally:
        sync_tree(CUDA, scratch)  # leave the scratch copy unmutated
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    threshold_report(results)
    unreachable = [r for r in results if r["verdict"] == "unreachable"]
    for r in unreachable:
        print(f"unreachable by any emulator test: {r['name']} ({r['where']}): {r['detail']}")
    results = [r for r in results if r["verdict"] != "unreachable"]
    killed = score("score", [r["verdict"] for r in results])
    if args.baseline:
        score("before (checker off, lock-step schedules)", [r["baseline"] for r in results])
    print(f"{sum(not r['deterministic'] for r in results)} verdicts changed between repeats")
    return 0 if killed == len(results) else 1


def threshold_report(results=None):
    """Per kernel family: its thresholds (tests/csrc/cuda/cuda_emu/thresholds.py), whether the tests' shapes cross
    each (one on each side), the real d12 shapes, and the verdicts of the mutants aimed at each."""
    sys.path.insert(0, str(EMU_TESTS))
    import thresholds
    verdicts = {}
    for r in results or []:
        if r.get("threshold"):
            verdicts.setdefault(r["threshold"], []).append(f"{r['name']}: {r['verdict']}")
    families = {}
    for th in thresholds.TABLE:
        families.setdefault(th.family, []).append(th)
    print(f"threshold table: {len(thresholds.TABLE)} thresholds, "
          f"{sum(len(t.cases) for t in thresholds.TABLE)} shapes, {sum(len(t.slow) for t in thresholds.TABLE)} d12 shapes")
    for fam, ths in families.items():
        crossed = [t for t in ths if all(t.sides())]
        print(f"  {fam}: {len(crossed)}/{len(ths)} thresholds crossed by its tests")
        for t in ths:
            below, above = t.sides()
            q = sorted({t.quantity(c) for c in t.cases})
            mark = "crossed" if below and above else "NOT crossed"
            d12 = " + d12 shape" if t.slow else ""
            mut = f"; mutants: {', '.join(verdicts[t.name])}" if t.name in verdicts else ""
            print(f"    {t.name:40s} {mark:11s} at {t.at} (tested at {q}){d12}{mut}")
    for what, why in thresholds.UNREACHABLE.items():
        print(f"  not reachable by an emulator test: {what}: {why}")


def score(title, verdicts):
    killed = [v for v in verdicts if v not in ("survived", "build error", "harness error")]
    print(f"{title}: {len(killed)}/{len(verdicts)} killed; {sum(v.startswith('report') for v in killed)} by an "
          f"emulator report ({killed.count('report (line)')} naming the mutated line), {killed.count('mismatch')} "
          f"by numeric mismatch, {killed.count('error')} by another error, {killed.count('tests')} by their tests")
    return len(killed)


if __name__ == "__main__":
    sys.exit(main())
