"""Benchmark training steps: ms/step, tokens/s, achieved GFLOP/s and utilisation (MFU).

    python scripts/bench.py --preset d12 -B 4 -T 64 --threads 2            # CPU backend
    python scripts/bench.py --preset d12 -B 64 -T 1024 --device cuda       # GPU (CUDA backend)

FLOPs per token are 6*N + 6*L*C*T (forward + backward, N = parameters less wpe). The CPU peak is
cores x clock x FP32 FLOPs per cycle per core (AVX-512: 2 FMA units x 16 lanes x 2 = 64; AVX2: 32);
pass --peak-gflops to override. GPU peaks are the dense bf16 / tf32 tensor-core figures.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

GPU_PEAK_TFLOPS = {  # dense, no sparsity: (bf16, tf32, fp32)
    "H100 SXM": (989.0, 494.5, 67.0), "H100 PCIe": (756.0, 378.0, 51.0), "H200": (989.0, 494.5, 67.0),
    "A100": (312.0, 156.0, 19.5), "A10G": (125.0, 62.5, 31.2), "L4": (121.0, 60.0, 30.3),
    "RTX 4090": (165.2, 82.6, 82.6), "RTX 3090": (71.0, 35.6, 35.6), "T4": (65.0, 8.1, 8.1),
}


def gpu_peak_tflops(name: str, precision: str) -> tuple[float, str] | None:
    """Dense peak of the GPU called `name` (as the driver reports it) for this precision, with the table's key."""
    key = None
    if "H100" in name:
        key = "H100 PCIe" if "PCIe" in name else "H100 SXM"
    else:
        key = next((k for k in GPU_PEAK_TFLOPS if k in name), None)
    if key is None:
        return None
    bf16, tf32, fp32 = GPU_PEAK_TFLOPS[key]
    return {"bf16": bf16, "tf32": tf32, "fp32": fp32}[precision], key


def cpu_peak_gflops(threads: int) -> tuple[float, str]:
    flags, mhz = "", 0.0
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags") and not flags:
                    flags = line
                elif line.startswith("cpu MHz") and not mhz:
                    mhz = float(line.split(":")[1])
    except OSError:
        pass
    per_cycle = 64 if "avx512f" in flags else 32 if "fma" in flags else 8
    ghz = mhz / 1000 if mhz else 2.0
    return threads * ghz * per_cycle, f"{threads} cores x {ghz:.2f} GHz x {per_cycle} FLOP/cycle"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="d12")
    ap.add_argument("-B", "--batch-size", type=int, default=4)
    ap.add_argument("-T", "--seq-len", type=int, default=64)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=5, help="timed steps")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--peak-gflops", type=float, default=None, help="override the peak used for utilisation")
    ap.add_argument("--breakdown", action="store_true", help="also time forward / backward / optimizer")
    ap.add_argument("--precision", choices=["fp32", "tf32", "bf16"], default=None,
                    help="fp32, tf32 or bf16 mixed precision (CUDA); default bf16 on sm_80+, else fp32")
    ap.add_argument("--attention", choices=["auto", "flash", "cudnn", "naive"], default=None, help="CUDA attention kernel")
    ap.add_argument("--recompute-gelu", action="store_true")
    args = ap.parse_args(argv)

    from gpt2core import GPT2, _C, build_info
    from gpt2core.config import get_preset

    if args.threads:
        _C.set_num_threads(args.threads)
    threads = _C.get_num_threads()
    cfg = get_preset(args.preset)
    model = GPT2(cfg, device=args.device, seed=0, precision=args.precision, attention=args.attention)
    model.recompute_gelu = args.recompute_gelu
    B, T = args.batch_size, args.seq_len
    rng = np.random.default_rng(0)
    x = rng.integers(0, cfg.vocab_size, size=(B, T), dtype=np.int32)
    y = rng.integers(0, cfg.vocab_size, size=(B, T), dtype=np.int32)

    parts = {"fwd": [], "bwd": [], "opt": []}
    times = []
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        model.zero_grad()
        model.forward(x, y)
        t1 = time.perf_counter()
        model.backward()
        t2 = time.perf_counter()
        model.step(lr=1e-4)
        t3 = time.perf_counter()
        if i >= args.warmup:
            times.append(t3 - t0)
            parts["fwd"].append(t1 - t0); parts["bwd"].append(t2 - t1); parts["opt"].append(t3 - t2)
    dt = float(np.median(times))
    tps = B * T / dt
    flops = cfg.flops_per_token(T)
    gflops = tps * flops / 1e9
    info = build_info()
    print(f"gpt2core {info['version']} | {args.device} | BLAS {info['blas']} | threads {threads}")
    print(f"preset {args.preset} ({model.num_parameters:,} params) | precision {model.precision} | B={B} T={T} | "
          f"{flops / 1e9:.3f} GFLOP/token")
    print(f"ms/step {dt * 1e3:.1f} (median of {args.steps}) | tokens/s {tps:,.0f} | GFLOP/s {gflops:.1f}")
    if args.breakdown:
        print(" | ".join(f"{k} {np.median(v) * 1e3:.1f} ms" for k, v in parts.items()))
    if args.device == "cpu":
        peak, how = (args.peak_gflops, "given") if args.peak_gflops else cpu_peak_gflops(threads)
        print(f"CPU fp32 FMA peak {peak:.1f} GFLOP/s ({how}) | utilisation {100 * gflops / peak:.1f}%")
    else:
        peak, how = args.peak_gflops, "given"
        index = int(args.device.partition(":")[2] or 0)
        name = _C.cuda_device_name(index)
        if not peak and (found := gpu_peak_tflops(name, model.precision)):
            peak, how = found[0] * 1e3, f"{found[1]} dense {model.precision}"
        if peak:
            print(f"GPU {name} | MFU {100 * gflops / peak:.1f}% of {peak / 1e3:.1f} TFLOP/s ({how})")
        else:
            print("GPU peak table (dense TFLOP/s bf16/tf32/fp32): " +
                  ", ".join(f"{k} {v[0]:.0f}/{v[1]:.0f}/{v[2]:.0f}" for k, v in GPU_PEAK_TFLOPS.items()))
    return {"ms_per_step": dt * 1e3, "tok_per_s": tps, "gflops": gflops}


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
