"""scripts/gpu_model.py (the roofline model of a training step, MODELLED figures) on a synthetic launch log:
the arithmetic against values computed by hand here, the scaling rules (sizes matched by value and re-evaluated
at the target, launch counts affine in n_layer), the grid check against the launchers' rules, and occupancy."""
import importlib.util
import json
import math
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("gpu_model", ROOT / "scripts" / "gpu_model.py")
gm = importlib.util.module_from_spec(spec)
sys.modules["gpu_model"] = gm  # dataclasses look their module up
spec.loader.exec_module(gm)

SMALL = gm.Config(B=3, T=40, C=128, NH=2, L=1, V=293, Vp=320, maxT=56)
TARGET = gm.Config(B=4, T=256, C=768, NH=12, L=5, V=50257, Vp=50304, maxT=1024)
A = dict(gm.ASSUMPTIONS, launch_gap_us=2.0)
GPU = gm.GPU("test", 90, tensor_tflops=100.0, fp32_tflops=10.0, hbm_gbs=1000.0, sms=10)


def write_log(path, layers):
    """Warm-up noise, the step mark, then per layer one layernorm and one GEMM, and one memset of the grads."""
    BT, C = SMALL.B * SMALL.T, SMALL.C
    lines = [{"kernel": "residual_forward_kernel", "grid": [1, 1, 1], "block": [256, 1, 1], "args": [7]},
             {"mark": "step"}]
    for _ in range(layers):
        lines.append({"kernel": "layernorm_forward_kernel<floatX, kResidual, kCache>", "grid": [BT // 8, 1, 1],
                      "block": [256, 1, 1], "smem": 0, "args": [BT, C]})
        lines.append({"seam": "matmul", "m": BT, "n": 3 * C, "k": C, "batch": 1, "a": "bf16", "b": "bf16",
                      "d": "bf16", "accumulate": 0, "epilogue": 0, "bias": 1})
    lines.append({"memset": 4 * gm.replace(SMALL, L=layers).params})
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))


def counts(tmp_path):
    logs = []
    for layers in (1, 2):
        write_log(tmp_path / f"L{layers}.jsonl", layers)
        logs.append(gm.read_log(tmp_path / f"L{layers}.jsonl", gm.symbol_table(gm.replace(SMALL, L=layers))))
        gm.check_grids(logs[-1][1], SMALL, 2)
    return gm.scale_counts(logs[0][0], logs[1][0], TARGET.L)


def test_sizes_are_matched_by_value_and_counts_scale_with_layers(tmp_path):
    c = counts(tmp_path)
    ln = ("kernel", "layernorm_forward_kernel", (("N", "BT"), ("C", "C")), (256, 1, 1), 0)
    assert c[ln] == 5 and c[("memset", "4*P")] == 1 and sum(c.values()) == 11  # warm-up launch not counted
    gemm = [k for k in c if k[0] == "seam"]
    assert len(gemm) == 1 and dict(gemm[0][2])["m"] == "BT" and dict(gemm[0][2])["n"] == "3C"


def test_roofline_arithmetic_by_hand(tmp_path):
    rows = {r.name: r for r in gm.model(counts(tmp_path), TARGET, GPU, {(90, "layernorm_forward_kernel", "bf16"): [("<bf16, true, 8>", 64, 0)]},
                                        2, A)}
    BT, C = 4 * 256, 768
    # GEMM: 2 m n k FLOPs; bytes: A (m k), B (k n), D (m n) in bf16; 3 * 1024 / 128 * 6 = 144 tiles >= 4 * 10 SMs
    flops, nbytes = 2 * BT * 3 * C * C, 2 * (BT * C + C * 3 * C + BT * 3 * C)
    t = max(flops / (100e12 * 0.70), nbytes / (1000e9 * 0.85)) + 2e-6
    g = rows["cuBLASLt gemm BTx3CxC"]
    assert g.count == 5 and g.flops == 5 * flops and g.bytes == 5 * nbytes and math.isclose(g.seconds, 5 * t)
    # layernorm: of the 5 launches one is plain (2 N C: read inp, write out) and 4 fused residual + layernorm
    # (4 N C: read a and b, write residual and out), bf16, + 8 N bytes of statistics each; memory-bound; 64 registers
    # x 256 threads: 65536 / (64 * 32 * 8) = 4 blocks per SM = 1024 threads = occupancy 0.5 (= occ_mem: fully
    # hidden); BT / 8 = 128 blocks fill 10 SMs
    ln = rows["layernorm_forward_kernel"]
    assert ln.occ == 0.5 and ln.bound == "memory"
    assert math.isclose(ln.bytes, (4 * 4 + 2) * BT * C * 2 + 5 * 8 * BT)
    assert math.isclose(ln.seconds, ln.bytes / (1000e9 * 0.85) + 5 * 2e-6)
    # memset of the fp32 gradients: 4 P bytes at the target's P
    P = 50304 * 768 + 1024 * 768 + 5 * (12 * 768 * 768 + 13 * 768) + 2 * 768
    assert math.isclose(rows["memset 4*P"].seconds, 4 * P / (1000e9 * 0.85) + 2e-6)


def test_bias_gradient_epilogue_costs_its_output_and_the_assumed_extra():
    """A weight-gradient GEMM with BGRADB: m more fp32 values written and bgrad_extra more time than without."""
    f = dict(m=768, n=3072, k=65536, batch=1, a="bf16", b="bf16", d="f32", accumulate=1, epilogue=0, bias=0)
    plain = gm.gemm_cost(f, TARGET, GPU, A)
    fused = gm.gemm_cost(dict(f, bias_grad=1), TARGET, GPU, A)
    assert fused[0] == plain[0] and fused[1] == plain[1] + 768 * 4
    t = max(plain[0] / (100e12 * 0.70), fused[1] / (1000e9 * 0.85))
    assert math.isclose(fused[2], t * (1 + A["bgrad_extra"])) and A["bgrad_extra"] > 0


def test_occupancy_rules():
    h100 = gm.GPUS["H100"]
    assert gm.occupancy(h100, 128, 255, 0) == (0.125, 2)            # 255 regs -> 256 x 32 per warp, 2 blocks
    assert gm.occupancy(h100, 128, 32, 48 * 1024) == (0.25, 4)      # 228 KiB / 49 KiB -> 4 blocks
    assert gm.occupancy(h100, 1024, 16, 0) == (1.0, 2)
    assert gm.causal_pairs(4) == 10 and gm.causal_pairs(40, 32) == 32 * 32 * 3


def test_ptxas_report_is_read_per_variant(tmp_path):
    rep = tmp_path / "ptxas.txt"
    rep.write_text(
        "x.cu sm_90 kernel void gpt2::cuda::attention_tc_forward_kernel<64, __nv_bfloat16>(int): 128 registers, "
        "0/0 bytes spill stores/loads, 0 bytes smem\n"
        "x.cu sm_90 kernel void gpt2::cuda::attention_tc_forward_kernel<128, __nv_bfloat16>(int): 170 registers, "
        "0/0 bytes spill stores/loads, 0 bytes smem\n"
        "x.cu sm_90 kernel void gpt2::cuda::attention_tc_forward_kernel<64, __half>(int): 120 registers, "
        "0/0 bytes spill stores/loads, 0 bytes smem\n"
        "x.cu sm_80 kernel void gpt2::cuda::column_partial_sum_kernel<float>(int): 20 registers, 0/0 bytes spill "
        "stores/loads, 1056 bytes smem\n")
    p = gm.read_ptxas(rep)
    assert gm.kernel_resources(p, 90, "attention_tc_forward_kernel", "bf16", 64, A) == (128, 0)
    assert gm.kernel_resources(p, 90, "attention_tc_forward_kernel", "f16", 64, A) == (120, 0)  # __half: fp16
    assert gm.kernel_resources(p, 90, "attention_tc_forward_kernel", "bf16", 100, A) == (170, 0)
    assert gm.kernel_resources(p, 80, "column_partial_sum_kernel", "f32", None, A) == (20, 1056)
    assert gm.kernel_resources(p, 80, "column_partial_sum_kernel", "bf16", None, A) == (A["regs_unknown"], 0)


def test_flash_tiles_count_the_pairs_the_kernels_multiply():
    """attention_tc.cuh's tiles, by hand: the forward's 128-query blocks (hs = 64; 64 for hs = 128) of four warps
    over 64-key tiles (a warp stops at the tile holding its last row), the dkdv kernel's 64-key tiles against
    32-query slabs; and the grids."""
    # T = 1: one block, each of its 4 warps (32 rows) multiplies one 64-key tile
    assert gm.tc_fwd_pairs(1, 64) == 4 * 32 * 64 and gm.tc_fwd_pairs(1, 128) == 4 * 16 * 64
    # T = 128, hs = 64: warps 0, 1 (rows 0-63) take key tile 0, warps 2, 3 take tiles 0 and 1
    assert gm.tc_fwd_pairs(128, 64) == 2 * 32 * 64 + 2 * 32 * 128
    # a multiple of 128: the 64 x 64 tile-granular causal count
    assert gm.tc_fwd_pairs(1024, 64) == gm.tc_fwd_pairs(1024, 128) == gm.causal_pairs(1024, 64)
    # T = 100: key tile 0 sees 4 slabs of 32 queries (0-127), key tile 1 two (64-127)
    assert gm.tc_dkdv_pairs(100) == 64 * 32 * 4 + 64 * 32 * 2
    a = {"T": 1024, "NH": 12, "hs": 64}
    assert gm._attn_tc_fwd(a, gm.TARGET, 2)["blocks"] == 8 * 12 * gm.TARGET.B
    assert gm._attn_tc_fwd(dict(a, hs=128), gm.TARGET, 2)["blocks"] == 16 * 12 * gm.TARGET.B
    assert gm._attn_tc_dkdv(a, gm.TARGET, 2)["blocks"] == 16 * 12 * gm.TARGET.B


def test_stale_grid_rule_and_unknown_kernel_are_errors(tmp_path):
    log = tmp_path / "bad.jsonl"
    rec = {"kernel": "layernorm_forward_kernel", "grid": [99, 1, 1], "block": [256, 1, 1], "args": [120, 128]}
    log.write_text(json.dumps({"mark": "step"}) + "\n" + json.dumps(rec) + "\n")
    _, grids = gm.read_log(log, gm.symbol_table(SMALL))
    with pytest.raises(ValueError, match="out of date"):
        gm.check_grids(grids, SMALL, 2)
    log.write_text(json.dumps({"mark": "step"}) + "\n" + json.dumps(dict(rec, kernel="mystery_kernel")) + "\n")
    with pytest.raises(KeyError, match="mystery_kernel"):
        gm.read_log(log, gm.symbol_table(SMALL))


def test_ambiguous_small_config_is_refused():
    with pytest.raises(ValueError, match="ambiguous"):
        gm.symbol_table(gm.Config(B=2, T=40, C=128, NH=2, L=1, V=293, Vp=320, maxT=56))  # B == NH
    assert Counter(gm.symbol_table(gm.SMALL).values()).most_common(1)[0][1] == 1


def test_per_gpu_efficiencies_are_ranges_with_sources_and_llmc_is_the_yardstick():
    """H100 and A100 each have their own (low, high) efficiencies with a source beside each; the H100's best-case
    GEMM share is below the A100's (80% vs 87% of peak); a range's ends are ordered; an --assume override wins over
    both ends; llm.c's measured rates are recorded with their source."""
    for key in ("H100", "A100"):
        for name, (lo, hi, src) in gm.GPU_EFF[key].items():
            assert name in gm.ASSUMPTIONS and 0 < lo <= hi <= 1 and len(src) > 20, (key, name)
    assert gm.GPU_EFF["H100"]["gemm_eff"][1] == 0.80 and gm.GPU_EFF["A100"]["gemm_eff"][1] == 0.87
    lo, hi = gm.efficiency_sets("H100", dict(gm.ASSUMPTIONS))
    assert lo["gemm_eff"] < hi["gemm_eff"] and lo["launch_gap_us"] == hi["launch_gap_us"]
    lo, hi = gm.efficiency_sets("H100", dict(gm.ASSUMPTIONS, gemm_eff=0.5))
    assert lo["gemm_eff"] == hi["gemm_eff"] == 0.5
    assert gm.efficiency_sets("T4", dict(gm.ASSUMPTIONS)) == (gm.ASSUMPTIONS, gm.ASSUMPTIONS)
    assert gm.LLMC_MEASURED["H100"][0] == 468e3 and gm.LLMC_MEASURED["A100"][0] == 218e3


def test_refused_bgradb_what_if_adds_the_column_sums(tmp_path):
    """A dW GEMM with BGRADB, refused: the epilogue's extra goes, the column-sum kernels' reads of dout (k x m in
    bf16) and their partial rows come: more time than the epilogue costs. Without bias-gradient GEMMs: nothing."""
    f = (("m", "3C"), ("n", "C"), ("k", "BT"), ("batch", 1), ("a", "bf16"), ("b", "bf16"), ("d", "f32"),
         ("accumulate", 1), ("epilogue", 0), ("bias", 0), ("bias_grad", 1))
    c = Counter({("seam", "matmul", f): 5})
    extra = gm.bgradb_refused_ms(c, TARGET, GPU, A)
    BT, m = 4 * 256, 3 * 768
    assert extra * 1e-3 > 5 * BT * m * 2 / (1000e9 * 0.85)  # at least dout read once more per GEMM
    assert gm.bgradb_refused_ms(Counter({("seam", "matmul", f[:-1] + (("bias_grad", 0),)): 5}), TARGET, GPU, A) == 0
    rep = gm.report(c, TARGET, GPU, {}, "t", 5, A, quiet=True)
    assert rep["tokens_per_s"] > 0
