"""`python -m gpt2core.doctor --calibrate`: everything a first GPU must answer, in order of value, each step bounded
in time, into one report file (JSON, plus a readable summary printed and written beside it).

Steps (STEPS, in this order; each runs in a subprocess killed at its time limit, so one hung or slow step costs
its bound and no more):
  doctor       the doctor's build, library and correctness checks (the CPU part: runs without a GPU)
  gpu_tests    tests/csrc/cuda/test_cuda_gpu.py (a source checkout only)
  d12_step     d12, B=64, T=1024, bf16: ms/step and tokens/s with cuDNN attention and with gpt2core's flash
               kernels, per-phase times (forward / backward / optimizer, CUDA-synchronised) and, where nsys is
               installed, an nsys kernel summary; beside scripts/gpu_model.py's modelled range for this GPU
  bgradb       whether cuBLASLt accepted the bias-gradient epilogue (build_info()'s refusal counts after a step)
  bitwise      two identical bf16 runs (3 steps of d12 at B=4, T=256), parameters compared bit for bit, with
               deterministic=True (the default) and, for the record, deterministic=False
  ladder       scripts/bench.py --ladder at d12
  vs_cpu       20 training steps of d12 (B=2, T=128) on the GPU against the CPU backend: losses side by side
  gemm         cuBLASLt GEMM timings for GPT-2 124M's shapes (forward, dinp and dweight of each Linear)
Without a usable GPU: one line says so and the command exits 0 after the CPU part.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # a source checkout (scripts/, tests/) when run from one

# (name, what it answers, seconds allowed); the order is the value order
STEPS = [
    ("doctor", "build, libraries, correctness on every device", 240),
    ("gpu_tests", "the GPU test suite against the CPU backend", 420),
    ("d12_step", "d12 B=64 T=1024 step time, cuDNN and flash attention, against the model", 300),
    ("bgradb", "was the bias-gradient GEMM epilogue accepted", 120),
    ("bitwise", "two identical bf16 runs bit for bit", 240),
    ("ladder", "the speed ladder at d12", 420),
    ("vs_cpu", "20 steps of d12 against the CPU reference", 420),
    ("gemm", "GEMM timings by shape", 180),
]
GPU_STEPS = [s[0] for s in STEPS if s[0] != "doctor"]
# The model and the (B, T) of the in-process GPU steps: d12 at llm.c's step shape, and smaller shapes for the steps
# that compare rather than time (a test sets a tiny preset to run these steps on the emulated device)
PRESET = "d12"
SHAPES = {"step": (64, 1024), "bgradb": (8, 256), "bitwise": (4, 256), "vs_cpu": (2, 128)}
COUNTS = {"timing": 5, "bitwise": 3, "vs_cpu": 20}  # timed steps (after 2 warm-up ones), steps per run
MODEL_SECONDS = 120  # d12_step: the modelled side's share of the step's 300 s


def _d12_timing(attention: str, B: int | None = None, T: int | None = None, steps: int | None = None) -> dict:
    import numpy as np

    from ..model import GPT2
    from ..config import PRESETS
    from .. import _C
    from ..planning.perf import gpu_peak_tflops

    cfg = PRESETS[PRESET]
    B, T = B or SHAPES["step"][0], T or SHAPES["step"][1]
    steps = steps or COUNTS["timing"]
    m = GPT2(cfg, device="cuda", seed=0, attention=attention)
    x = np.random.default_rng(0).integers(0, cfg.vocab_size, (B, T), dtype=np.int32)
    parts = {"forward": [], "backward": [], "optimizer": []}
    for i in range(steps + 2):
        t0 = time.perf_counter()
        m.zero_grad()
        m.forward(x, x)  # returns the loss: synchronised
        t1 = time.perf_counter()
        m.backward()
        m.grad_norm()  # a device read: backward has finished
        t2 = time.perf_counter()
        m.step(lr=1e-4)
        t3 = time.perf_counter()
        if i >= 2:
            for k, v in zip(parts, (t1 - t0, t2 - t1, t3 - t2)):
                parts[k].append(v)
    ms = {k: 1e3 * float(np.median(v)) for k, v in parts.items()}
    step_ms = sum(ms.values())
    tps = B * T / (step_ms / 1e3)
    peak = gpu_peak_tflops(_C.cuda_device_name(0), m.precision)
    mfu = tps * cfg.flops_per_token(T) / 1e12 / peak[0] if peak else None
    return {"attention": attention, "precision": m.precision, "ms_per_step": step_ms, "tokens_per_s": tps,
            "mfu": mfu, "phase_ms": ms}


def step_doctor() -> dict:
    # the doctor as its console script runs it (a process of its own: the doctor calls this module, not back)
    r = subprocess.run([sys.executable, "-m", "gpt2core.doctor", "--seconds", "0"], capture_output=True, text=True)
    return {"ok": r.returncode == 0, "lines": r.stdout.splitlines(), "stderr": r.stderr[-2000:]}


def step_gpu_tests() -> dict:
    tests = ROOT / "tests" / "csrc" / "cuda" / "test_cuda_gpu.py"
    if not tests.exists():
        return {"skipped": "no source checkout (tests/csrc/cuda/test_cuda_gpu.py not found)"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", str(tests)], capture_output=True, text=True)
    return {"ok": r.returncode == 0, "tail": (r.stdout + r.stderr)[-3000:]}


def step_d12_step() -> dict:
    out = {"runs": [_d12_timing(a) for a in ("cudnn", "flash")]}
    # The model's side (scripts/gpu_model.py) compiles the CUDA emulator first where build/model is missing: minutes
    # of CPU, which on the first GPU (2026-11-28, H100) ran past the step's bound and lost the timings above. It now
    # gets what is left of the step's time, and a timeout keeps the measured rows.
    model = ROOT / "scripts" / "gpu_model.py"
    if model.exists():
        try:
            r = subprocess.run([sys.executable, str(model), "--reproduce-llmc"], capture_output=True, text=True,
                               timeout=MODEL_SECONDS)
            out["model"] = (r.stdout + r.stderr)[-3000:]
        except subprocess.TimeoutExpired:
            out["model"] = (f"skipped: scripts/gpu_model.py --reproduce-llmc took over {MODEL_SECONDS} s (it compiles "
                            "the CUDA emulator first); run it on any machine, it needs no GPU")
    return out


def step_bgradb() -> dict:
    import gpt2core

    _d12_timing("auto", *SHAPES["bgradb"], steps=1)
    info = gpt2core.build_info()
    return {"accepted": info["bgradb_refused_shapes"] == 0, "refused_shapes": info["bgradb_refused_shapes"],
            "fallbacks": info["bgradb_fallbacks"]}


def _run_bits(deterministic: bool) -> bytes:
    import numpy as np

    from ..model import GPT2
    from ..config import PRESETS

    m = GPT2(PRESETS[PRESET], device="cuda", seed=0, deterministic=deterministic)
    x = np.random.default_rng(1).integers(0, m.config.vocab_size, SHAPES["bitwise"], dtype=np.int32)
    for _ in range(COUNTS["bitwise"]):
        m.zero_grad()
        m.forward(x, x)
        m.backward()
        m.step(lr=1e-4)
    return m.flat_params().tobytes()


def step_bitwise() -> dict:
    return {f"deterministic={d}": _run_bits(d) == _run_bits(d) for d in (True, False)}


def step_ladder() -> dict:
    bench = ROOT / "scripts" / "bench.py"
    if not bench.exists():
        return {"skipped": "no source checkout (scripts/bench.py not found)"}
    r = subprocess.run([sys.executable, str(bench), "--ladder", "--preset", "d12", "-B", "16", "-T", "1024",
                        "--device", "cuda", "--steps", "3"], capture_output=True, text=True)
    return {"ok": r.returncode == 0, "tail": (r.stdout + r.stderr)[-3000:]}


def step_vs_cpu() -> dict:
    import numpy as np

    from ..model import GPT2
    from ..config import PRESETS

    x = np.random.default_rng(2).integers(0, PRESETS[PRESET].vocab_size, SHAPES["vs_cpu"], dtype=np.int32)
    losses = {}
    for device in ("cuda", "cpu"):
        m = GPT2(PRESETS[PRESET], device=device, seed=0)
        losses[device] = []
        for _ in range(COUNTS["vs_cpu"]):
            m.zero_grad()
            losses[device].append(float(m.forward(x, x)))
            m.backward()
            m.step(lr=3e-4)
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses["cuda"], losses["cpu"]))
    return {"losses": losses, "max_relative_difference": worst}


def step_gemm() -> dict:
    bench = ROOT / "scripts" / "bench.py"
    if not bench.exists():
        return {"skipped": "no source checkout (scripts/bench.py not found)"}
    r = subprocess.run([sys.executable, str(bench), "--preset", "d12", "-B", "16", "-T", "1024", "--device", "cuda",
                        "--profile", "--steps", "3"], capture_output=True, text=True)
    return {"ok": r.returncode == 0, "tail": (r.stdout + r.stderr)[-3000:]}


def run_step(name: str) -> dict:
    """One step in this process (the subprocess side of run_bounded)."""
    return globals()[f"step_{name}"]()


def run_bounded(name: str, seconds: float) -> dict:
    """Runs step `name` in a subprocess, killed after `seconds`: its result, or why there is none."""
    t0 = time.perf_counter()
    try:
        r = subprocess.run([sys.executable, "-m", "gpt2core.calibrate", name], capture_output=True, text=True,
                           timeout=seconds)
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "seconds": round(time.perf_counter() - t0, 1), "limit_s": seconds}
    res = {"seconds": round(time.perf_counter() - t0, 1), "limit_s": seconds}
    lines = r.stdout.strip().splitlines()
    try:
        res["result"] = json.loads(lines[-1]) if lines else None
        res["status"] = "ok" if r.returncode == 0 else "failed"
    except ValueError:
        res["status"] = "failed"
    if r.returncode != 0:
        res["stderr"] = r.stderr[-2000:]
    return res


def calibrate(report: Path, out=print, steps=None, gpu: bool | None = None) -> int:
    """Runs the steps (default STEPS) in order and writes `report` (JSON) and report.with_suffix(".txt") (the
    summary). gpu: whether a usable GPU is here (default: ask gpt2core). Returns the exit status: 0 unless a step
    that ran failed (no GPU is not a failure)."""
    from .. import _C

    steps = STEPS if steps is None else steps
    why = "" if gpu else (_C.cuda_status() if gpu is None else "none (told so)")
    have_gpu = why == ""
    results, summary = {}, []
    for name, what, limit in steps:
        if name in GPU_STEPS and not have_gpu:
            results[name] = {"status": "skipped", "why": "no usable GPU"}
            continue
        res = run_bounded(name, limit)
        results[name] = res
        summary.append(f"{name:<10} {res['status']:<8} {res['seconds']:>7.1f} s (limit {limit} s)  {what}")
        out(summary[-1])
    if not have_gpu:
        line = f"calibrate: no usable GPU ({why}): the GPU steps were skipped; the CPU part ran"
        summary.append(line)
        out(line)
    report = Path(report)
    report.write_text(json.dumps({"gpu": have_gpu, "why_no_gpu": why or None, "steps": results}, indent=1,
                                 default=str))
    report.with_suffix(".txt").write_text("\n".join(summary) + "\n")
    out(f"calibrate: wrote {report} and {report.with_suffix('.txt')}")
    return 0 if all(r["status"] in ("ok", "skipped") for r in results.values()) else 1


if __name__ == "__main__":  # one step, its result as the last line of stdout (JSON)
    result = run_step(sys.argv[1])
    print(json.dumps(result, default=lambda o: o.hex() if isinstance(o, bytes) else str(o)))
    sys.exit(0 if result.get("ok", True) is not False else 1)
