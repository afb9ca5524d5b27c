"""Peak throughput of the GPUs people train on, for utilisation (MFU) in scripts/bench.py and gpt2core.doctor."""
from __future__ import annotations

# dense, no sparsity: (16-bit tensor cores, tf32, fp32). The first column is the bf16 and the fp16 peak (equal on
# sm_80+); T4 and V100 have fp16 tensor cores only (no bf16, no tf32: their tf32 column is the fp32 peak).
GPU_PEAK_TFLOPS = {
    "H100 SXM": (989.0, 494.5, 67.0), "H100 PCIe": (756.0, 378.0, 51.0), "H200": (989.0, 494.5, 67.0),
    "A100": (312.0, 156.0, 19.5), "A10G": (125.0, 62.5, 31.2), "L4": (121.0, 60.0, 30.3),
    "RTX 4090": (165.2, 82.6, 82.6), "RTX 3090": (71.0, 35.6, 35.6), "T4": (65.0, 8.1, 8.1),
    "V100": (125.0, 15.7, 15.7),
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
    half, tf32, fp32 = GPU_PEAK_TFLOPS[key]
    return {"bf16": half, "fp16": half, "tf32": tf32, "fp32": fp32}[precision], key
