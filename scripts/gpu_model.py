#!/usr/bin/env python3
"""A roofline model of one GPT-2 training step of the CUDA backend on named GPUs. MODELLED, NOT MEASURED.

Where the launches come from: the CUDA backend compiled against the CUDA-on-CPU emulator (tests/csrc/cuda/cuda_emu, the
test-only module gpt2core_cuda_emu) runs one bf16 training step (fp16 for GPUs without bf16: T4, V100) of a SMALL
model with GPT2CORE_EMU_LAUNCH_LOG
set: one JSON line per kernel launch (name, grid, block, integer arguments), cuBLASLt / cuDNN seam call (GEMM
m, n, k, epilogue; attention B, T, NH, HS) and memset. Emulating d12 at B=64, T=1024 would take hours on a CPU,
so the step is emulated twice, with 1 and 2 layers, and scaled analytically:
  - sizes: every integer in the log (kernel arguments, GEMM m / n / k, memset bytes) is matched BY VALUE to a
    named size of the small config (B, T, B*T, C, 3C, 4C, NH, hs, V, Vp, number of parameters...; the small
    config is chosen so that these are distinct, which is checked) and re-evaluated at the target config;
  - counts: launch counts are affine in n_layer (count(L) = count(1) + (L - 1) (count(2) - count(1)));
  - grids: each kernel's grid at the target comes from the launcher's rule (KERNELS below), which is checked
    against the logged grid at the small config, so the table cannot silently drift from the source.
Registers and static shared memory per kernel come from ptxas (scripts/check_cuda_compile.py, -Xptxas -v).

Per launch: FLOPs, the minimum HBM bytes (each input read once, each output written once), occupancy (blocks
per SM from threads, registers, shared memory) and a roofline time
    t = max(flops / (peak x eff), bytes / (bandwidth x eff_mem)) / (fill x hide) + launch gap,
with fill = min(1, blocks / SMs) and hide = min(1, occupancy / needed occupancy). Every constant is in
ASSUMPTIONS and GPUS and is printed with the table. Calibrate with `bench.py --profile` on a GPU: the model is
to be checked, not trusted.

    python scripts/gpu_model.py                          # emulate, then H100 and A100 at d12 B=64 T=1024
    python scripts/gpu_model.py --gpu H100 L4 --attention cudnn flash --top 20
    python scripts/gpu_model.py --gpu T4 V100 --attention flash       # fp16 (no bf16 below sm_80)
    python scripts/gpu_model.py --log step.jsonl --small-config ...   # an existing log (see --help)
    python scripts/gpu_model.py --reproduce-llmc     # llm.c's own step on H100 / A100 beside its measured rate

Efficiencies are per GPU (GPU_EFF: each a (low, high) pair with its source), so every figure is a RANGE: the step
modelled with the low set and with the high set. Before the model predicts gpt2core it must reproduce llm.c's
measured rates for llm.c's own step shape (d12, B=64, T=1024, bf16, cuDNN attention; --reproduce-llmc).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# GPT2CORE_EMU_BUILD (the tests' knob): another build of the emulated module to run, e.g. one engineer's own
EMU_BUILD = Path(os.environ.get("GPT2CORE_EMU_BUILD") or ROOT / "build" / "emu-py")


# ------------------------------------------------------------------------------------------- GPUs
@dataclass(frozen=True)
class GPU:
    name: str
    sm: int                 # compute capability (ptxas report of this arch, or the nearest compiled)
    tensor_tflops: float    # dense bf16 (fp16 on sm_70 / sm_75) tensor-core peak with fp32 accumulate
    fp32_tflops: float      # CUDA-core fp32 FMA peak (2 FLOPs per FMA)
    hbm_gbs: float          # DRAM bandwidth
    sms: int
    regs_per_sm: int = 65536
    smem_per_sm: int = 228 * 1024  # bytes usable by blocks (1 KiB per block reserved on sm_80+)
    threads_per_sm: int = 2048
    blocks_per_sm: int = 32
    bf16: bool = True       # False: fp16 tensor cores only, the model runs in fp16 (gpt2core.model.pick_precision)

    @property
    def precision(self) -> str:
        return "bf16" if self.bf16 else "fp16"


# Published datasheet figures (dense, no sparsity; boost clocks).
GPUS = {
    "H100": GPU("H100 SXM5 80GB", 90, 989.0, 67.0, 3350.0, 132),
    "A100": GPU("A100 SXM4 80GB", 80, 312.0, 19.5, 2039.0, 108, smem_per_sm=164 * 1024),
    "L4": GPU("L4", 89, 121.0, 30.3, 300.0, 58, smem_per_sm=100 * 1024, threads_per_sm=1536, blocks_per_sm=24),
    "T4": GPU("T4", 75, 65.0, 8.1, 320.0, 40, smem_per_sm=64 * 1024, threads_per_sm=1024, blocks_per_sm=16,
              bf16=False),
    "V100": GPU("V100 SXM2 32GB", 70, 125.0, 15.7, 900.0, 80, smem_per_sm=96 * 1024, bf16=False),
    "RTX4090": GPU("RTX 4090", 89, 165.2, 82.6, 1008.0, 128, smem_per_sm=100 * 1024, threads_per_sm=1536,
                   blocks_per_sm=24),
}

# Efficiencies (fractions of the peaks above) and other constants of the model: guesses from public results
# (cuBLAS large-GEMM utilisation, FlashAttention-2 / cuDNN SDPA papers and release notes), to be calibrated.
ASSUMPTIONS = {
    "gemm_eff": 0.70,           # cuBLASLt bf16 GEMMs of GPT-2 sizes (k, n >= 768) reach ~70% of tensor peak
    "gemm_eff_small": 0.40,     # GEMMs with fewer than 4 waves of 128x128 tiles
    "bgrad_extra": 0.05,        # a GEMM with the bias-gradient epilogue (BGRADB: sums of op(A) over k) takes this
                                # fraction longer (unmeasured; the sums come from tiles already loaded)
    "cudnn_fwd_eff": 0.55,      # cuDNN fused SDPA, causal, hs=64, of tensor peak
    "cudnn_bwd_eff": 0.40,
    "mma_fwd_eff": 0.45,        # our mma.sync flash kernel, sm_80/sm_89 (FlashAttention-2 reaches ~50-70% on A100)
    "mma_bwd_eff": 0.35,
    "mma_sm90_scale": 0.60,     # on sm_90 mma.sync (no wgmma / TMA) reaches ~60% of what wgmma kernels do
    "fp32_useful": 0.50,        # CUDA-core kernels: useful FMAs / issued instructions (SASS counts of the flash
                                # kernel: 50-57%); applied to the fp32 peak
    "mem_eff": 0.85,            # achievable fraction of HBM bandwidth for streaming kernels
    "occ_mem": 0.50,            # occupancy needed to hide DRAM latency (memory-bound kernels)
    "occ_compute": 0.25,        # occupancy needed to hide ALU latency (compute-bound kernels)
    "launch_gap_us": 1.0,       # per kernel / library call, CUDA-graph replay (back-to-back launches)
    "regs_unknown": 32,         # registers of a kernel ptxas did not report
    "grad_accum": 8,            # micro-steps per optimizer step (524,288 tokens at B=64, T=1024)
}


# Per-GPU efficiencies, (low, high) fractions of that GPU's peaks, each with where it comes from. H100 reaches a
# smaller share of its peak than A100 (one set for every GPU made the H100 figures 1.3-1.4x too optimistic).
# The keys replace ASSUMPTIONS' for that GPU; GPUs not listed keep ASSUMPTIONS (a point, marked as a guess).
LLMC_SRC = "llm.c (github.com/karpathy/llm.c) GPT-2 124M runs, as quoted in issue 29 and DESIGN.md"
GPU_EFF = {
    "H100": {
        "gemm_eff": (0.60, 0.80, "cuBLAS best-case bf16 GEMM ~80% of the 989 TFLOP/s peak (issue 29 audit); "
                                 "GPT-2's k=768 GEMMs lower (low end: guess)"),
        "cudnn_fwd_eff": (0.25, 0.29, "cuDNN's published H100 SDPA, causal, hs=64, T=1024: forward ~288 TFLOP/s "
                                      "(issue 29 audit); low end: guess"),
        "cudnn_bwd_eff": (0.30, 0.35, "the same source: backward ~348 TFLOP/s; low end: guess"),
        "mem_eff": (0.80, 0.90, "STREAM-like copies reach 80-90% of the 3.35 TB/s HBM3 (guess from public "
                                "bandwidth tests)"),
        "mma_fwd_eff": (0.12, 0.23, "FlashAttention-2 (mma.sync, the structure of attention_tc.cuh) forward, causal, "
                                    "hs=64, T=1k on an H100: ~229 TFLOP/s (FA3 paper, arXiv 2407.08608) = the high "
                                    "end; low end: half of it (guess; the previous kernel measured 53)"),
        "mma_bwd_eff": (0.10, 0.17, "FlashAttention-2's backward on H100, hs=64: ~150-170 TFLOP/s (the same paper's "
                                    "figures, approximately) = the high end; low end: guess (the previous kernels "
                                    "measured 60)"),
        "mma_sm90_scale": (1.0, 1.0, "the H100 mma_*_eff above are already sm_90 figures"),
    },
    "A100": {
        "gemm_eff": (0.70, 0.87, "cuBLAS best-case bf16 GEMM ~87% of the 312 TFLOP/s peak (issue 29 audit); "
                                 "low end: guess"),
        "cudnn_fwd_eff": (0.45, 0.60, "FlashAttention-2-class causal forward at hs=64 on A100, ~50-70% of peak "
                                      "(FlashAttention-2 paper); guess within it"),
        "cudnn_bwd_eff": (0.35, 0.45, "the same source, backward; guess within it"),
        "mem_eff": (0.85, 0.92, "guess from public A100 bandwidth tests (1.7-1.9 of 2.04 TB/s)"),
    },
}
# llm.c's measured training rates for its own step (d12, B=64, T=1024, bf16, cuDNN attention), per GPU
LLMC_MEASURED = {"H100": (468e3, "468K tokens/s per H100 at 38% MFU"), "A100": (218e3, "~218K tokens/s per A100")}


def efficiency_sets(gpu_key: str, A: dict) -> tuple[dict, dict]:
    """The (low, high) assumption sets for a GPU: ASSUMPTIONS with its GPU_EFF pairs applied (what --assume
    changed stays as given)."""
    lo, hi = dict(A), dict(A)
    for k, (a, b, _src) in GPU_EFF.get(gpu_key, {}).items():
        if A[k] == ASSUMPTIONS[k]:  # not overridden on the command line
            lo[k], hi[k] = a, b
    return lo, hi


# ------------------------------------------------------------------------------------------- sizes
@dataclass(frozen=True)
class Config:
    B: int
    T: int
    C: int
    NH: int
    L: int
    V: int
    Vp: int
    maxT: int

    @property
    def params(self) -> int:
        C, L = self.C, self.L
        return self.Vp * C + self.maxT * C + L * (12 * C * C + 13 * C) + 2 * C

    def sizes(self) -> dict[str, int]:
        """The named sizes a logged integer may be (per layer: n_layer never appears in a launch)."""
        B, T, C, NH, V, Vp = self.B, self.T, self.C, self.NH, self.V, self.Vp
        BT = B * T
        return {"B": B, "T": T, "BT": BT, "C": C, "3C": 3 * C, "4C": 4 * C, "NH": NH, "hs": C // NH, "V": V,
                "Vp": Vp, "maxT": self.maxT, "BNH": B * NH, "BTNH": BT * NH, "TC": T * C, "BTC": BT * C,
                "BT3C": BT * 3 * C, "BT4C": BT * 4 * C, "BTVp": BT * Vp, "P": self.params, "VpC": Vp * C}


TARGET = Config(B=64, T=1024, C=768, NH=12, L=12, V=50257, Vp=50304, maxT=1024)
# The emulated config: small, every named size distinct (checked), hs = 64 as in GPT-2.
SMALL = Config(B=3, T=40, C=128, NH=2, L=1, V=293, Vp=320, maxT=56)


def symbol_table(cfg: Config) -> dict[int, str]:
    table: dict[int, str] = {}
    for name, v in cfg.sizes().items():
        if v in table:
            raise ValueError(f"small config ambiguous: {name} and {table[v]} are both {v}")
        table[v] = name
    return table


def symbolic(v: int, table: dict[int, str]):
    """A logged integer as a size name, or the integer itself (a constant such as a chunk count)."""
    return table.get(v, v)


def evaluate(x, cfg: Config) -> int:
    return cfg.sizes()[x] if isinstance(x, str) else x


# ------------------------------------------------------------------------------------------- kernels
def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def causal_pairs(T: int, tile: int | None = None) -> int:
    """(query, key) pairs with key <= query; with tile: pairs a tiled kernel computes (whole diagonal tiles)."""
    if tile is None:
        return T * (T + 1) // 2
    n = ceil_div(T, tile)
    return tile * tile * n * (n + 1) // 2


def column_chunks(N: int, C: int) -> int:  # csrc/cuda/reduce.cuh
    return min(ceil_div(N, 32), ceil_div(1024, ceil_div(C, 256)))


# name -> (argument names of the logged integers, cost(a, cfg, es) -> dict). a: the arguments evaluated at cfg,
# es: bytes per floatX. Keys: flops (CUDA-core fp32), tc_flops (tensor-core), bytes (minimum HBM traffic),
# blocks (the launcher's grid rule). FLOPs of memory-bound kernels are rough (they never bind).
def _ln_fwd(a, cfg, es):
    N, C = a["N"], a["C"]
    return dict(flops=8 * N * C, bytes=N * C * es * 3 + 8 * N, blocks=ceil_div(N, 8))  # (residual: +1 read)


def _col_partial(a, cfg, es):  # 16-byte loads: 32 lanes x (16 / es) columns per block
    N, C = a["N"], a["C"]
    return dict(flops=N * C, bytes=N * C * es + 4 * column_chunks(N, C) * C,
                blocks=ceil_div(C, 32 * (16 // es)) * column_chunks(N, C))


def _attn_fwd(a, cfg, es):
    T, NH, hs, B = a["T"], a["NH"], a["hs"], cfg.B
    return dict(flops=4 * B * NH * hs * causal_pairs(T, 32), bytes=B * T * NH * hs * es * 4 + 4 * B * NH * T,
                blocks=ceil_div(T, 32) * NH * B)


def _attn_dkdv(a, cfg, es):  # S, dP recomputed; dV, dK: 4 matmuls
    T, NH, hs, B = a["T"], a["NH"], a["hs"], cfg.B
    return dict(flops=8 * B * NH * hs * causal_pairs(T, 32), bytes=B * T * NH * hs * es * 8 + 8 * B * NH * T,
                blocks=ceil_div(T, 32) * NH * B)


def _attn_dq(a, cfg, es):  # S, dP recomputed again; dQ: 3 matmuls
    T, NH, hs, B = a["T"], a["NH"], a["hs"], cfg.B
    return dict(flops=6 * B * NH * hs * causal_pairs(T, 32), bytes=B * T * NH * hs * es * 6 + 8 * B * NH * T,
                blocks=ceil_div(T, 32) * NH * B)


def tc_fwd_rows(hs: int) -> int:  # attention_tc.cuh TcFwd: 4 warps of 32 query rows (hs <= 64) or of 16
    return 128 if hs <= 64 else 64


def tc_fwd_pairs(T: int, hs: int) -> int:
    """(query, key) pairs the FlashAttention-2-structured forward multiplies: each warp (32 or 16 rows) takes the
    64-key tiles up to the one holding its last row, within the tiles its block loads (up to min(T, the block's last
    row)); tiles wholly after a warp's rows are skipped."""
    rows = tc_fwd_rows(hs)
    wr = rows // 4
    total = 0
    for q0 in range(0, T, rows):
        nkt = (min(T, q0 + rows) - 1) // 64 + 1
        for w in range(4):
            total += wr * 64 * min(nkt, (q0 + w * wr + wr - 1) // 64 + 1)
    return total


def tc_dkdv_pairs(T: int) -> int:
    """Pairs the dkdv kernel multiplies: each 64-key tile against the 32-row query slabs from its first key to T."""
    return sum(64 * 32 * ceil_div(T - k0, 32) for k0 in range(0, T, 64))


def _attn_tc_fwd(a, cfg, es):  # attention_tc.cuh: 128 (64) queries x 64-key tiles, 4 warps; Q K^T, P V on tensor cores
    T, NH, hs, B = a["T"], a["NH"], a["hs"], cfg.B
    pairs = tc_fwd_pairs(T, hs)
    return dict(tc_flops=4 * B * NH * hs * pairs, flops=6 * B * NH * pairs,
                bytes=B * T * NH * hs * es * 4 + 4 * B * NH * T, blocks=ceil_div(T, tc_fwd_rows(hs)) * NH * B)


def _attn_tc_dkdv(a, cfg, es):  # attention_tc.cuh: 64-key tiles, 32-query slabs; S^T, dP^T, dV, dK: 4 products on
    T, NH, hs, B = a["T"], a["NH"], a["hs"], cfg.B  # tensor cores, + the dS^T tiles written (es per tiled pair)
    pairs = tc_dkdv_pairs(T)
    return dict(tc_flops=8 * B * NH * hs * pairs, flops=8 * B * NH * pairs,
                bytes=B * T * NH * hs * es * 8 + 8 * B * NH * T + B * NH * causal_pairs(T, 64) * es,
                blocks=ceil_div(T, 64) * NH * B)


def _attn_tc_dq(a, cfg, es):  # attention_tc.cuh: 64-query tiles; dQ = dS K: 1 product, dS^T tiles read back, K read,
    T, NH, hs, B = a["T"], a["NH"], a["hs"], cfg.B  # dq added into dqkv
    return dict(tc_flops=2 * B * NH * hs * causal_pairs(T, 64), flops=B * T * NH * hs,
                bytes=B * NH * causal_pairs(T, 64) * es + B * T * NH * hs * es * 3, blocks=ceil_div(T, 64) * NH * B)


KERNELS = {
    "encoder_forward_kernel": (["BT", "T", "C"], lambda a, c, es: dict(
        flops=a["BT"] * a["C"], bytes=3 * a["BT"] * a["C"] * es, blocks=ceil_div(a["BT"] * a["C"] // (16 // es), 256))),
    "encoder_backward_wpe_kernel": (["B", "T", "C"], lambda a, c, es: dict(
        flops=a["B"] * a["T"] * a["C"], bytes=a["B"] * a["T"] * a["C"] * es + 8 * a["T"] * a["C"],
        blocks=ceil_div(a["T"] * a["C"], 256))),
    "encoder_backward_wte_kernel": (["BT", "C"], lambda a, c, es: dict(
        flops=a["BT"] * a["C"], bytes=a["BT"] * a["C"] * (es + 8), blocks=min(a["BT"], 2048) * ceil_div(a["C"], 64))),
    "layernorm_forward_kernel": (["N", "C"], _ln_fwd),
    # dinp and pass 1 of dw, db in one kernel: dout and inp read once from DRAM (the column pass meets L1 / L2),
    # dinp read and written (accumulating: the log does not record the flag), an (R, C) row of partial sums per
    # block for each of dw, db
    "layernorm_backward_kernel": (["N", "C", None], lambda a, c, es: dict(
        flops=16 * a["N"] * a["C"], bytes=4 * a["N"] * a["C"] * es + 8 * a["N"] +
        8 * column_chunks(a["N"], a["C"]) * a["C"], blocks=column_chunks(a["N"], a["C"]))),
    "column_partial_sum_kernel": (["N", "C", None], _col_partial),
    "column_reduce_kernel": (["R", "C"], lambda a, c, es: dict(  # R at the target; R = 1: a GEMM epilogue's sums
        flops=a["R"] * a["C"], bytes=4 * (1 if a["R"] == 1 else column_chunks(c.B * c.T, a["C"])) * a["C"] + 8 * a["C"],
        blocks=ceil_div(a["C"], 32))),
    "gelu_forward_kernel": (["N"], lambda a, c, es: dict(
        flops=15 * a["N"], bytes=2 * a["N"] * es, blocks=ceil_div(a["N"] // (16 // es), 256))),
    "gelu_backward_kernel": (["N"], lambda a, c, es: dict(
        flops=25 * a["N"], bytes=4 * a["N"] * es, blocks=ceil_div(a["N"] // (16 // es), 256))),
    "residual_forward_kernel": (["N"], lambda a, c, es: dict(
        flops=a["N"], bytes=3 * a["N"] * es, blocks=ceil_div(a["N"] // (16 // es), 256))),
    "attention_forward_kernel": (["T", "NH", "hs"], _attn_fwd),
    "attention_backward_dot_kernel": (["B", "T", "NH", "hs"], lambda a, c, es: dict(
        flops=2 * a["B"] * a["T"] * a["NH"] * a["hs"], bytes=2 * a["B"] * a["T"] * a["NH"] * a["hs"] * es,
        blocks=ceil_div(a["B"] * a["T"] * a["NH"] * 8, 256))),  # 8 lanes per row
    "attention_backward_dkdv_kernel": (["T", "NH", "hs"], _attn_dkdv),
    "attention_backward_dq_kernel": (["T", "NH", "hs"], _attn_dq),
    "attention_tc_forward_kernel": (["T", "NH", "hs"], _attn_tc_fwd),
    "attention_tc_backward_dkdv_kernel": (["T", "NH", "hs"], _attn_tc_dkdv),
    "attention_tc_backward_dq_kernel": (["T", "NH", "hs"], _attn_tc_dq),
    "crossentropy_forward_kernel": (["V", "Vp"], lambda a, c, es: dict(
        flops=4 * c.B * c.T * a["Vp"], bytes=c.B * c.T * a["Vp"] * es, blocks=c.B * c.T)),
    "crossentropy_backward_kernel": (["V", "Vp"], lambda a, c, es: dict(
        flops=4 * c.B * c.T * a["Vp"], bytes=2 * c.B * c.T * a["Vp"] * es, blocks=c.B * c.T)),
    # the training step's fused pass: the row's second read (dlogits) meets L2 (classifier.cuh), so one read + one
    # write of the logits reach DRAM
    "crossentropy_count_kernel": (["N"], lambda a, c, es: dict(flops=a["N"], bytes=4 * a["N"], blocks=1)),
    "crossentropy_forward_backward_kernel": (["V", "Vp"], lambda a, c, es: dict(
        flops=8 * c.B * c.T * a["Vp"], bytes=2 * c.B * c.T * a["Vp"] * es, blocks=c.B * c.T)),
    "loss_accumulate_kernel": (["N"], lambda a, c, es: dict(flops=a["N"], bytes=4 * a["N"], blocks=1)),
    "sum_squares_partial_kernel": (["n"], lambda a, c, es: dict(flops=2 * a["n"], bytes=4 * a["n"], blocks=256)),
    "sum_squares_final_kernel": ([None], lambda a, c, es: dict(flops=256, bytes=2048, blocks=1)),
    "loss_scale_update_kernel": ([None], lambda a, c, es: dict(flops=4, bytes=64, blocks=1)),  # fp16 loss scaling
    # AdamW: the launches of one step together update every parameter once (grad, m, v, master read; m, v,
    # master, bf16 copy written): P / (launches) each
    "adamw_kernel": ([None], lambda a, c, es: dict(flops=12 * c.params, bytes=(28 + es) * c.params, blocks=None)),
}


def base_name(kernel: str) -> str:
    return re.sub(r"<.*", "", kernel).split("::")[-1].strip()


# ------------------------------------------------------------------------------------------- the log
def read_log(path: Path, table: dict[int, str]) -> tuple[Counter, dict]:
    """Launch records after the {"mark": "step"} line, counted by hashable keys with sizes made symbolic; and
    each kernel key's logged grid."""
    keys: Counter = Counter()
    grids: dict = {}
    started = False
    for line in path.read_text().splitlines():
        r = json.loads(line)
        if "mark" in r:
            started = r["mark"] == "step"
            continue
        if not started:
            continue
        if "kernel" in r:
            name = base_name(r["kernel"])
            spec = KERNELS.get(name)
            if spec is None:
                raise KeyError(f"kernel {name} is not in gpu_model.KERNELS: add its cost")
            names, _ = spec
            ints = r["args"]
            args = tuple((n, symbolic(v, table)) for n, v in zip(names, ints) if n is not None)
            key = ("kernel", name, args, tuple(r["block"]), r.get("smem", 0))  # smem: dynamic shared bytes
            keys[key] += 1
            grids[key] = tuple(r["grid"])
        elif "seam" in r:
            fields = tuple(sorted((k, symbolic(v, table) if k in SIZE_FIELDS else v)
                                  for k, v in r.items() if k != "seam"))
            keys[("seam", r["seam"], fields)] += 1
        elif "memset" in r:
            n = r["memset"]
            sym = next((f"{k}*{table[n // k]}" for k in (4, 2, 1) if n % k == 0 and n // k in table), n)
            keys[("memset", sym)] += 1
    return keys, grids


SIZE_FIELDS = {"m", "n", "k", "batch", "B", "T", "NH", "HS"}  # the seam records' sizes (the rest are flags)


def scale_counts(one: Counter, two: Counter, L: int) -> Counter:
    """count(L) = count(1) + (L - 1)(count(2) - count(1)) for each launch."""
    out: Counter = Counter()
    for key in set(one) | set(two):
        n = one[key] + (L - 1) * (two[key] - one[key])
        if n < 0:
            raise ValueError(f"launch count not affine in n_layer: {key}")
        if n:
            out[key] += n
    return out


def check_grids(grids: dict, cfg: Config, es: int) -> None:
    """The grid rule of KERNELS at the emulated config must reproduce the logged grid."""
    for key, grid in grids.items():
        _, name, args, _block, _smem = key
        c = KERNELS[name][1]({n: evaluate(v, cfg) for n, v in args}, cfg, es)
        if c["blocks"] is not None and c["blocks"] != grid[0] * grid[1] * grid[2]:
            raise ValueError(f"gpu_model.KERNELS['{name}'] predicts {c['blocks']} blocks at the emulated config, "
                             f"the log says grid {grid}: the table is out of date")


# ------------------------------------------------------------------------------------------- ptxas
RE_PTXAS = re.compile(r"sm_(\d+) kernel (?:void )?(?:[\w:]+::)?(\w+)(<[^(]*>)?\(.*\): (\d+) registers, .*?(\d+) bytes smem")


def read_ptxas(path: Path | None) -> dict[tuple[int, str, str], list[tuple[str, int, int]]]:
    """(arch, kernel, 'bf16' | 'f16' | 'f32') -> [(template arguments, registers, static smem)] of its variants."""
    out: dict = {}
    if path is None or not path.exists():
        return out
    for line in path.read_text().splitlines():
        m = RE_PTXAS.search(line)
        if not m:
            continue
        arch, name, tmpl, regs, smem = int(m[1]), m[2], m[3] or "", int(m[4]), int(m[5])
        of = "bf16" if "bfloat16" in tmpl else "f16" if "__half" in tmpl else "f32"
        for dt in ("bf16", "f16", "f32"):
            if not tmpl or of == dt:
                out.setdefault((arch, name, dt), []).append((tmpl, regs, smem))
    return out


def kernel_resources(ptxas: dict, arch: int, name: str, dt: str, hs: int | None, A: dict) -> tuple[int, int]:
    """Registers and static smem of the variant that runs: the head-size template (64 or 128) when the kernel has
    one, else the largest over the variants (conservative)."""
    variants = ptxas.get((arch, name, dt), [])
    if hs is not None:
        HS = 64 if hs <= 64 else 128
        variants = [v for v in variants if v[0].startswith(f"<{HS},")] or variants
    if not variants:
        return A["regs_unknown"], 0
    return max(v[1] for v in variants), max(v[2] for v in variants)


def occupancy(gpu: GPU, threads: int, regs: int, smem: int) -> tuple[float, int]:
    """(resident threads / max threads per SM, blocks per SM), CUDA occupancy calculator rules: registers
    allocated per warp in units of 256, shared memory with 1 KiB reserved per block."""
    warps = ceil_div(threads, 32)
    regs_warp = ceil_div(max(regs, 1) * 32, 256) * 256
    by_regs = gpu.regs_per_sm // (regs_warp * warps)
    by_smem = gpu.smem_per_sm // (smem + 1024) if smem else gpu.blocks_per_sm
    by_threads = gpu.threads_per_sm // (warps * 32)
    blocks = max(0, min(gpu.blocks_per_sm, by_regs, by_smem, by_threads))
    return blocks * warps * 32 / gpu.threads_per_sm, blocks


# ------------------------------------------------------------------------------------------- the model
@dataclass
class Row:
    name: str
    count: int
    flops: float       # useful FLOPs (tensor + CUDA core) of all launches
    bytes: float
    occ: float | None
    seconds: float     # all launches
    bound: str


def gemm_cost(f: dict, cfg: Config, gpu: GPU, A: dict) -> tuple[float, float, float]:
    m, n, k, batch = (evaluate(f[x], cfg) for x in ("m", "n", "k", "batch"))
    sz = lambda t: 2 if t in ("bf16", "f16") else 4  # noqa: E731
    flops = 2.0 * m * n * k * batch
    nbytes = batch * (m * k * sz(f["a"]) + k * n * sz(f["b"]) + m * n * sz(f["d"]) * (1 + f["accumulate"]))
    nbytes += batch * m * n * sz(f["d"]) * (f["epilogue"] in (1, 2))  # pre-GELU written / read
    nbytes += m * sz(f["d"]) * f.get("bias_grad", 0)  # BGRADB: the row sums of op(A), from tiles already loaded
    tiles = batch * ceil_div(m, 128) * ceil_div(n, 128)
    eff = A["gemm_eff"] if tiles >= 4 * gpu.sms else A["gemm_eff_small"]
    peak = gpu.tensor_tflops if f["a"] in ("bf16", "f16") else gpu.tensor_tflops / 2  # fp32: TF32 at half rate
    t = max(flops / (peak * 1e12 * eff), nbytes / (gpu.hbm_gbs * 1e9 * A["mem_eff"]))
    return flops, nbytes, t * (1 + A["bgrad_extra"] * f.get("bias_grad", 0))


def model(counts: Counter, cfg: Config, gpu: GPU, ptxas: dict, es: int, A: dict = ASSUMPTIONS) -> list[Row]:
    rows: dict[str, Row] = {}
    gap = A["launch_gap_us"] * 1e-6
    n_adamw = sum(n for key, n in counts.items() if key[0] == "kernel" and key[1] == "adamw_kernel")
    arch = gpu.sm if any(k[0] == gpu.sm for k in ptxas) else (90 if gpu.sm >= 90 else 80)
    for key, n in counts.items():
        occ = None
        if key[0] == "seam" and key[1] == "matmul":
            f = dict(key[2])
            flops, nbytes, t = gemm_cost(f, cfg, gpu, A)
            label = f"cuBLASLt gemm {f['m']}x{f['n']}x{f['k']}" + (f" x{f['batch']}" if f["batch"] != 1 else "") + \
                ("" if not f["epilogue"] else " +gelu" if f["epilogue"] == 1 else " +dgelu") + \
                (" +bgrad" if f.get("bias_grad") else "") + (" +=" if f["accumulate"] else "")
            bound = "tensor" if flops / (gpu.tensor_tflops * 1e12) > nbytes / (gpu.hbm_gbs * 1e9) else "memory"
        elif key[0] == "seam":
            f = dict(key[2])
            B, T, NH, HS = (evaluate(f[x], cfg) for x in ("B", "T", "NH", "HS"))
            fwd = key[1] == "attention_forward"
            flops = (4 if fwd else 10) * B * NH * HS * causal_pairs(T)
            nbytes = B * T * NH * HS * es * (4 if fwd else 10)  # q k v (o) read / written; backward: + dq dk dv
            eff = A["cudnn_fwd_eff"] if fwd else A["cudnn_bwd_eff"]
            t = max(flops / (gpu.tensor_tflops * 1e12 * eff), nbytes / (gpu.hbm_gbs * 1e9 * A["mem_eff"]))
            label, bound = f"cuDNN {key[1]}", "tensor"
        elif key[0] == "memset":
            sym = key[1]
            if isinstance(sym, str):
                k, s = sym.split("*")
                nbytes = int(k) * cfg.sizes()[s]
            else:
                nbytes = sym
            flops, t, label, bound = 0, nbytes / (gpu.hbm_gbs * 1e9 * A["mem_eff"]), f"memset {sym}", "memory"
        else:
            _, name, args, block, dyn_smem = key
            a = {k: evaluate(v, cfg) for k, v in args}
            c = KERNELS[name][1](a, cfg, es)
            if name == "layernorm_forward_kernel" and n > 1:
                # one plain layernorm per step (ln1 of layer 0: read inp, write out, 2 N C) and n - 1 fused
                # residual + layernorm (read a and b, write residual and out: 4 N C); the log cannot tell them apart
                N, C = a["N"], a["C"]
                c = dict(c, bytes=N * C * es * (4 * (n - 1) + 2) / n + 8 * N)
            if name == "adamw_kernel":
                c = {k: (v / n_adamw if isinstance(v, (int, float)) else v) for k, v in c.items()}
                c["blocks"] = min(ceil_div(c["bytes"] / (28 + es) / 4, 256), 2048)
            threads = block[0] * block[1] * block[2]
            dt = ("bf16" if gpu.bf16 else "f16") if es == 2 else "f32"
            regs, smem = kernel_resources(ptxas, arch, name, dt, a.get("hs"), A)
            occ, _bps = occupancy(gpu, threads, regs, smem + dyn_smem)
            fill = min(1.0, c["blocks"] / gpu.sms)
            tc = c.get("tc_flops", 0)
            t_tc = 0.0
            if tc:
                eff = A["mma_bwd_eff"] if "backward" in name else A["mma_fwd_eff"]
                if gpu.sm >= 90:
                    eff *= A["mma_sm90_scale"]
                t_tc = tc / (gpu.tensor_tflops * 1e12 * eff)
            t_fp = c["flops"] / (gpu.fp32_tflops * 1e12 * A["fp32_useful"])
            t_mem = c["bytes"] / (gpu.hbm_gbs * 1e9 * A["mem_eff"])
            bound = max((t_tc, "tensor"), (t_fp, "fp32"), (t_mem, "memory"))[1]
            hide = min(1.0, occ / (A["occ_mem"] if bound == "memory" else A["occ_compute"])) if occ else 1e-9
            t = max(t_tc, t_fp, t_mem) / (fill * hide)
            flops, nbytes, label = c["flops"] + tc, c["bytes"], name
            if name.startswith("attention"):
                label += f" (T={a.get('T')}, hs={a.get('hs')})"
        r = rows.setdefault(label, Row(label, 0, 0.0, 0.0, occ, 0.0, bound))
        r.count += n
        r.flops += n * flops
        r.bytes += n * nbytes
        r.seconds += n * (t + gap)
    return sorted(rows.values(), key=lambda r: -r.seconds)


def step_flops(cfg: Config) -> float:
    """Training FLOPs of one micro-step, the MFU convention (llm.c / PaLM): 6 N + 6 L C T per token, with N the
    non-embedding-free parameter count including the tied lm_head."""
    return (6 * cfg.params + 6 * cfg.L * cfg.C * cfg.T) * cfg.B * cfg.T


# ------------------------------------------------------------------------------------------- emulation
def emulate(small: Config, layers: int, attention: str, log: Path, precision: str = "bf16") -> None:
    """Runs one bf16 (or fp16) training step of `small` with `layers` layers on the emulated CUDA backend, logging
    it."""
    cls = {"bf16": "ModelBF16", "fp16": "ModelF16"}[precision]
    code = f"""
import sys, numpy as np
sys.path.insert(0, {str(EMU_BUILD)!r})
import gpt2core_cuda_emu as E
m = E.{cls}(max_seq_len={small.maxT}, vocab_size={small.V}, padded_vocab_size={small.Vp}, n_layer={layers},
                n_head={small.NH}, n_embd={small.C}, device="cuda", attention={attention!r})
rng = np.random.default_rng(0)
for v in m.params().values():
    v[...] = rng.standard_normal(v.shape).astype(np.float32) * 0.02
m.params_changed()
idx = rng.integers(0, {small.V}, ({small.B}, {small.T})).astype(np.int32)
m.forward_backward(idx, idx, 1.0)  # warm-up: first-call allocations stay out of the log
open({str(log)!r}, "a").write('{{"mark": "step"}}\\n')
m.zero_grad()
m.forward_backward(idx, idx, 1.0)
m.take_loss()
m.optimizer_step(lr=1e-4, step=1)
"""
    env = dict(os.environ, GPT2CORE_EMU_LAUNCH_LOG=str(log))
    if not (EMU_BUILD / "CMakeCache.txt").exists():
        subprocess.run(["cmake", "-S", str(ROOT / "tests" / "csrc" / "cuda" / "cuda_emu"), "-B", str(EMU_BUILD),
                        "-DCMAKE_BUILD_TYPE=Release", f"-DPython_EXECUTABLE={sys.executable}"], check=True)
    subprocess.run(["cmake", "--build", str(EMU_BUILD), "-j2"], check=True, stdout=subprocess.DEVNULL)
    subprocess.run([sys.executable, "-c", code], env=env, check=True)


def launch_counts(attention: str, logdir: Path, target: Config, reuse: bool = False, precision: str = "bf16") -> Counter:
    logs = []
    for layers in (1, 2):
        table = symbol_table(replace(SMALL, L=layers))
        log = logdir / f"step_{attention}_L{layers}{'' if precision == 'bf16' else '_' + precision}.jsonl"
        if not (reuse and log.exists()):
            log.unlink(missing_ok=True)
            emulate(SMALL, layers, attention, log, precision)
        logs.append(read_log(log, table))
        check_grids(logs[-1][1], replace(SMALL, L=layers), 2)
    return scale_counts(logs[0][0], logs[1][0], target.L)


# ------------------------------------------------------------------------------------------- report
def bgradb_refused_ms(counts: Counter, cfg: Config, gpu: GPU, A: dict, es: int = 2) -> float:
    """What-if: milliseconds per micro-step added if cuBLASLt refuses every bias-gradient epilogue (BGRADB): each
    such dW GEMM loses its epilogue's sums (bgrad_extra, the m outputs) and the column-sum kernels read dout
    (k x m in the storage type) and reduce the partial rows instead (reduce.cuh, as matmul_backward_weights does)."""
    extra = 0.0
    for key, n in counts.items():
        if key[0] != "seam" or key[1] != "matmul" or not dict(key[2]).get("bias_grad"):
            continue
        f = dict(key[2])
        m, k = evaluate(f["m"], cfg), evaluate(f["k"], cfg)
        with_epi = gemm_cost(f, cfg, gpu, A)[2]
        without = gemm_cost(dict(f, bias_grad=0), cfg, gpu, A)[2]
        part = _col_partial({"N": k, "C": m}, cfg, es)
        t_sums = part["bytes"] / (gpu.hbm_gbs * 1e9 * A["mem_eff"]) + (4 * column_chunks(k, m) * m + 8 * m) / (
            gpu.hbm_gbs * 1e9 * A["mem_eff"]) + 2 * A["launch_gap_us"] * 1e-6
        extra += n * (without - with_epi + t_sums)
    return extra * 1e3


def report(counts: Counter, cfg: Config, gpu: GPU, ptxas: dict, title: str, top: int, A: dict = ASSUMPTIONS,
           quiet: bool = False) -> dict:
    if quiet:
        import contextlib
        import io

        with contextlib.redirect_stdout(io.StringIO()):
            return report(counts, cfg, gpu, ptxas, title, top, A)
    rows = model(counts, cfg, gpu, ptxas, 2, A)
    once = ("adamw", "sum_squares", "memset 4*P")  # per optimizer step: zero_grad, norm, AdamW
    micro = sum(r.seconds for r in rows if not r.name.startswith(once))
    opt = sum(r.seconds for r in rows) - micro
    step = A["grad_accum"] * micro + opt
    tokens = A["grad_accum"] * cfg.B * cfg.T
    tps = tokens / step
    mfu = A["grad_accum"] * step_flops(cfg) / step / (gpu.tensor_tflops * 1e12)
    print(f"\n== MODELLED (not measured): {gpu.name}, {title}: d{cfg.L} C={cfg.C} B={cfg.B} T={cfg.T} "
          f"{gpu.precision} ==")
    print(f"{'kernel / library call':58s} {'n':>5s} {'ms':>8s} {'%':>5s} {'GFLOP':>9s} {'GB':>7s} {'occ':>5s} bound")
    for r in rows[:top]:
        occ = f"{r.occ:.2f}" if r.occ is not None else "  -"
        print(f"{r.name[:58]:58s} {r.count:5d} {r.seconds * 1e3:8.3f} {100 * r.seconds / (micro + opt):5.1f} "
              f"{r.flops / 1e9:9.1f} {r.bytes / 1e9:7.2f} {occ:>5s} {r.bound}")
    print(f"micro-step (forward + backward) {micro * 1e3:.2f} ms; optimizer {opt * 1e3:.2f} ms; "
          f"step of {A['grad_accum']} micro-steps {step * 1e3:.1f} ms")
    print(f"MODELLED: {tps / 1e3:.0f}K tokens/s, MFU {100 * mfu:.1f}% "
          f"({step_flops(cfg) / cfg.B / cfg.T / 1e9:.3f} GFLOP/token, peak {gpu.tensor_tflops:.0f} TFLOP/s)")
    refused = bgradb_refused_ms(counts, cfg, gpu, A)
    print(f"what-if BGRADB refused (every dW GEMM's bias-gradient epilogue): +{refused:.3f} ms per micro-step "
          f"(column-sum kernels re-read dout), {tps / 1e3 * step / (step + A['grad_accum'] * refused / 1e3):.0f}K "
          f"tokens/s")
    return {"gpu": gpu.name, "variant": title, "micro_ms": micro * 1e3, "step_ms": step * 1e3, "tokens_per_s": tps,
            "mfu": mfu, "kernels": {r.name: r.seconds * 1e3 for r in rows}}


def print_assumptions(A: dict) -> None:
    print("Assumptions (all figures below are MODELLED from these, not measured on a GPU):")
    for k, v in A.items():
        print(f"  {k} = {v}" + (f"   (WHAT-IF via --assume; default {ASSUMPTIONS[k]})" if v != ASSUMPTIONS[k] else ""))
    print("  launches: emulated bf16 (fp16 for GPUs without bf16) step of " + f"{SMALL} with 1 and 2 layers, sizes "
          "re-evaluated at the target, "
          "counts affine in n_layer, grids from the launchers' rules (checked at the emulated config)")
    print("  GPUs (dense tensor / fp32 TFLOP/s, HBM GB/s, SMs): " +
          "; ".join(f"{g.name} {g.tensor_tflops:g}/{g.fp32_tflops:g}, {g.hbm_gbs:g}, {g.sms}" for g in GPUS.values()))


# ----------------------------------------------------------------------------------------------- decode (inference)
DECODE_ASSUMPTIONS = {
    "dram_latency_ns": 600.0,  # a dependent global load's round trip on H100 / A100 (guess from microbenchmarks)
    "fixed_latencies": 4,      # dependent round trips every decode-attention block pays (pos / slot, q, partials)
}


def _infer_const(name: str) -> int:
    """`constexpr int <name> = <int>;` of csrc/cuda/infer.cuh (the launcher's own constants)."""
    m = re.search(r"constexpr int " + name + r"\s*=\s*(\d+)\s*;", (ROOT / "csrc" / "cuda" / "infer.cuh").read_text())
    return int(m.group(1))


def decode_splits(B: int, Tq: int, NH: int, maxT: int, sms: int) -> int:
    """infer.cuh's decode_splits (the same rule, its constants read from the header)."""
    blocks = NH * Tq * B
    if maxT < _infer_const("kSplitMinKeys") or blocks >= _infer_const("kSplitBlocksPerSm") * sms:
        return 1
    want = ceil_div(_infer_const("kSplitBlocksPerSm") * sms, blocks)
    return max(1, min(want, maxT // _infer_const("kSplitMinChunk"), _infer_const("kDecodeMaxSplits")))


def decode_model(gpu: GPU, L: int, C: int, NH: int, V: int, params: int, ctx: int, B: int, es: int,
                 A: dict = ASSUMPTIONS, split: bool = True) -> dict:
    """One KV-cache decode step (csrc/cuda/infer.cuh + the model's GEMVs), MODELLED, NOT MEASURED.

    Bytes: every weight once (params * es; the tied head is wte) and, per layer, each sequence's K and V cache up to
    ctx (2 * B * ctx * C * es). The GEMVs (cuBLASLt, N = B rows) stream the weights at mem_eff of HBM. The decode
    attention runs NH * B * splits blocks of 4 warps (splits = decode_splits(B, 1, NH, maxT = ctx, SMs); 1 without
    split: attention_kv_kernel). A warp has `rows` key rows (hs * es bytes each) in flight at a time (1 in
    attention_kv_kernel, whose shuffle sum follows each key; kSplitKeysPerWarp in attention_kv_split_kernel), so by
    Little's law the kernel streams min(mem_eff * HBM, blocks * 4 * rows * hs * es / dram_latency); and no block
    finishes before its chain of dependent round trips (fixed_latencies + 2 passes x its keys per warp / rows). With a
    split, the combine kernel adds a launch and two round trips per layer."""
    hs = C // NH
    splits = decode_splits(B, 1, NH, ctx, gpu.sms) if split else 1
    rows = _infer_const("kSplitKeysPerWarp") if splits > 1 else 1
    warps = _infer_const("kDecodeBlock") // 32
    lat = DECODE_ASSUMPTIONS["dram_latency_ns"] * 1e-9
    mem = A["mem_eff"] * gpu.hbm_gbs * 1e9
    w_bytes = params * es
    kv_layer = 2 * B * ctx * C * es
    blocks = NH * B * splits
    resident = min(blocks, gpu.sms * 2048 // (32 * warps))  # threads per SM / block threads
    att_bw = min(mem, resident * warps * rows * hs * es / lat)
    keys_per_warp = ceil_div(ceil_div(ctx, splits), warps)
    chain = (DECODE_ASSUMPTIONS["fixed_latencies"] + 2 * ceil_div(keys_per_warp, rows)) * lat * ceil_div(blocks, resident)
    combine = (2 * lat + A["launch_gap_us"] * 1e-6) if splits > 1 else 0.0
    t_w = w_bytes / mem
    t_att_layer = max(kv_layer / att_bw, chain) + combine
    t_att = L * t_att_layer
    launches = L * 10 + 6  # kernels / library calls per step (layer: ln, qkv, kv_write, attention, proj, ...)
    t = t_w + t_att + launches * A["launch_gap_us"] * 1e-6
    return dict(gpu=gpu.name, B=B, ctx=ctx, splits=splits, weight_mb=w_bytes / 1e6, kv_mb=L * kv_layer / 1e6,
                attention_gbs=kv_layer / t_att_layer / 1e9, attention_frac=kv_layer / t_att_layer / (gpu.hbm_gbs * 1e9),
                t_weights_ms=t_w * 1e3, t_attention_ms=t_att * 1e3, step_ms=t * 1e3, tokens_per_s=B / t,
                effective_gbs=(w_bytes + L * kv_layer) / t / 1e9)


def decode_report(gpus: list[str]) -> list[dict]:
    print("== KV-cache decode step of d12 (124M), MODELLED, NOT MEASURED (no GPU): csrc/cuda/infer.cuh ==")
    print(f"assumptions: mem_eff {ASSUMPTIONS['mem_eff']}, dram_latency_ns {DECODE_ASSUMPTIONS['dram_latency_ns']}, "
          f"fixed_latencies {DECODE_ASSUMPTIONS['fixed_latencies']}, launch_gap_us {ASSUMPTIONS['launch_gap_us']} "
          "(CUDA-graph replay)")
    out = []
    params = 124_475_904  # d12 with Vp = 50,304 (wte tied to the head)
    for g in gpus:
        gpu = GPUS[g]
        for es, dt in ((4, "fp32"), (2, "bf16")):
            for B, ctx in ((1, 128), (1, 1024), (8, 1024), (64, 1024)):
                one = decode_model(gpu, 12, 768, 12, 50257, params, ctx, B, es, split=False)
                r = decode_model(gpu, 12, 768, 12, 50257, params, ctx, B, es)
                r["dtype"] = dt
                r["one_block_step_ms"] = one["step_ms"]
                out.append(r)
                print(f"{gpu.name:16s} {dt} B={B:<3d} ctx={ctx:<5d} weights {r['weight_mb']:6.0f} MB + KV "
                      f"{r['kv_mb']:7.1f} MB | decode attention x{r['splits']:<2d} {r['attention_gbs']:7.1f} GB/s "
                      f"({100 * r['attention_frac']:5.1f}% of HBM) | step {r['step_ms']:6.3f} ms (weights "
                      f"{r['t_weights_ms']:.3f}, attention {r['t_attention_ms']:.3f}; one block per head "
                      f"{one['step_ms']:.3f}) | {r['tokens_per_s']:8.0f} tokens/s, {r['effective_gbs']:6.0f} GB/s "
                      "overall")
    print("x<splits>: blocks per (head, sequence) of the split-key decode attention (decode_splits; x1: one block, "
          "attention_kv_kernel). Short caches and full grids keep one block.")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu", nargs="+", default=["H100", "A100"], choices=sorted(GPUS))
    ap.add_argument("--attention", nargs="+", default=["cudnn", "flash"], choices=["cudnn", "flash"],
                    help="cudnn: the attention seam (cuDNN SDPA); flash: gpt2core's own kernels")
    ap.add_argument("-B", type=int, default=TARGET.B)
    ap.add_argument("-T", type=int, default=TARGET.T)
    ap.add_argument("--layers", type=int, default=TARGET.L)
    ap.add_argument("--ptxas", type=Path, default=None,
                    help="a saved `check_cuda_compile.py --archs 80,90` report (default: run it, cached in build/model)")
    ap.add_argument("--logdir", type=Path, default=ROOT / "build" / "model")
    ap.add_argument("--reuse", action="store_true", help="reuse launch logs already in --logdir")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    ap.add_argument("--reproduce-llmc", action="store_true",
                    help="llm.c's own step (d12, B=64, T=1024, bf16, cuDNN attention) on H100 and A100: the modelled "
                         "range beside llm.c's measured tokens/s and its source")
    ap.add_argument("--assume", nargs="+", default=[], metavar="NAME=VALUE",
                    help="replace assumptions, e.g. gemm_eff_small=0.55 (what-if lines: label them as such)")
    ap.add_argument("--decode", action="store_true",
                    help="the KV-cache decode step of d12 instead (analytic, no emulation): bytes of weights and KV "
                         "cache per step over the modelled time, and the decode attention kernel's bandwidth")
    args = ap.parse_args(argv)
    if args.decode:
        r = decode_report(args.gpu)
        if args.json:
            args.json.write_text(json.dumps(r, indent=1))
        return 0
    if args.reproduce_llmc:
        args.gpu, args.attention, args.B, args.T, args.layers = ["H100", "A100"], ["cudnn"], 64, 1024, 12
    A = dict(ASSUMPTIONS)
    for kv in args.assume:
        name, _, value = kv.partition("=")
        if name not in A or not value:
            ap.error(f"--assume {kv}: expected NAME=VALUE with NAME one of {', '.join(A)}")
        A[name] = float(value) if isinstance(A[name], float) else int(value)
    target = Config(B=args.B, T=args.T, C=TARGET.C, NH=TARGET.NH, L=args.layers, V=TARGET.V, Vp=TARGET.Vp,
                    maxT=max(TARGET.maxT, args.T))
    args.logdir.mkdir(parents=True, exist_ok=True)
    ptx = args.ptxas
    if ptx is None:
        ptx = args.logdir / "ptxas.txt"
        if not (args.reuse and ptx.exists()):
            r = subprocess.run([sys.executable, str(ROOT / "scripts" / "check_cuda_compile.py"), "--device-only",
                                "--archs", "80,90"], capture_output=True, text=True)
            ptx.write_text(r.stdout)
            if r.returncode == 2:
                print("nvcc not found: registers assumed", ASSUMPTIONS["regs_unknown"], file=sys.stderr)
    ptxas = read_ptxas(ptx)
    print_assumptions(A)
    results = []
    for att in args.attention:
        for precision in ("bf16", "fp16"):
            gpus = [(g, GPUS[g]) for g in args.gpu if GPUS[g].precision == precision]
            if gpus and att == "cudnn" and precision == "fp16":  # cuDNN's fused SDPA needs sm_80+
                for _, gpu in gpus:
                    print(f"\n== {gpu.name}: no cuDNN fused attention on sm_{gpu.sm} (needs sm_80+): skipped ==")
                continue
            if not gpus:
                continue
            counts = launch_counts(att, args.logdir, target, args.reuse, precision)
            for key, gpu in gpus:
                title = "cuDNN attention" if att == "cudnn" else "gpt2core flash attention"
                lo, hi = efficiency_sets(key, A)
                r = report(counts, target, gpu, ptxas, title + (" (high-efficiency end)" if key in GPU_EFF else ""),
                           args.top, hi)
                r_lo = report(counts, target, gpu, ptxas, title, args.top, lo, quiet=True)
                r["tokens_per_s_range"] = [r_lo["tokens_per_s"], r["tokens_per_s"]]
                r["mfu_range"] = [r_lo["mfu"], r["mfu"]]
                r["gpu_key"] = key
                if key in GPU_EFF:
                    print(f"MODELLED RANGE ({gpu.name}, {title}): {r_lo['tokens_per_s'] / 1e3:.0f}K .. "
                          f"{r['tokens_per_s'] / 1e3:.0f}K tokens/s, MFU {100 * r_lo['mfu']:.1f} .. "
                          f"{100 * r['mfu']:.1f}%; efficiencies (low, high) and sources:")
                    for k, (a, b, src) in GPU_EFF[key].items():
                        print(f"  {k} {a:.2f} .. {b:.2f}: {src}")
                else:
                    print(f"(no per-GPU efficiencies for {gpu.name}: one point from ASSUMPTIONS, a guess)")
                results.append(r)
    if args.reproduce_llmc:
        print(f"\n== llm.c's own step, MODELLED vs MEASURED (d12, B=64, T=1024, bf16, cuDNN attention) ==")
        for r in results:
            measured, what = LLMC_MEASURED[r["gpu_key"]]
            lo_tps, hi_tps = r["tokens_per_s_range"]
            inside = lo_tps <= measured <= hi_tps
            print(f"{r['gpu_key']}: modelled {lo_tps / 1e3:.0f}K .. {hi_tps / 1e3:.0f}K tokens/s | measured "
                  f"{what} ({LLMC_SRC}) | {'within' if inside else 'OUTSIDE'} the modelled range "
                  f"(measured / modelled high end = {measured / hi_tps:.2f})")
        print("(gpt2core's kernel sequence at llm.c's shape stands in for llm.c's own kernels.) The model predicts "
              "gpt2core only as far as it reproduces these; calibrate with "
              "`python -m gpt2core.doctor --calibrate` on a GPU")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
