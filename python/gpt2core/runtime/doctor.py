"""Self-check, the first command on a new machine, GPU box or Colab runtime:

    python -m gpt2core.doctor            (console script: gpt2core-doctor)

Prints what was compiled, every library found (path and version), the GPU (name, compute capability, driver,
memory) or why there is none, the precision and attention a model would pick, then checks correctness on
every available device (a few AdamW steps of a tiny model: the CPU against float64, a GPU against the CPU)
and, on a GPU, measures speed for --seconds (tokens/s and MFU on GPT-2 124M). Exit status 0 when every check
passes, 1 otherwise.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import numpy as np

from .. import cli

# loss tolerance of a device against the CPU after a few steps, by precision: fp32 summation order ~1e-5;
# tf32 matmuls keep 10 mantissa bits (~1e-3); bf16 activations 8 bits (~1e-2); fp16 activations 11 bits, 8x finer
# than bf16
LOSS_RTOL = {"fp32": 1e-4, "tf32": 5e-3, "bf16": 3e-2, "fp16": 4e-3}


def _mapped(fragment: str) -> str | None:
    """The path of a loaded shared library whose file name contains `fragment` (from /proc/self/maps)."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1]
                if path.startswith("/") and fragment in os.path.basename(path):
                    return path
    except OSError:
        pass
    return None


def gpu_facts(index: int = 0) -> dict:
    """Driver version and memory from nvidia-smi (absent on machines without an NVIDIA driver)."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return {}
    q = subprocess.run([smi, f"--id={index}", "--query-gpu=name,driver_version,memory.total",
                        "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
    parts = [p.strip() for p in q.stdout.strip().split(",")]
    return dict(zip(("name", "driver", "memory"), parts)) if q.returncode == 0 and len(parts) == 3 else {}


def report_build(out) -> dict:
    import gpt2core
    from .. import _C
    info = gpt2core.build_info()
    out(f"gpt2core {info['version']} ({os.path.dirname(gpt2core.__file__)})")
    archs = ",".join(info["cuda_archs"]) if info["cuda"] else "-"
    out(f"  compiled: backends {', '.join(info['backends'])} | CUDA archs {archs} | "
        f"cuDNN {'yes' if info['cudnn'] else 'no'} (SDPA attention {'yes' if info['cudnn_sdpa'] else 'no'}) | "
        f"NCCL {'yes' if info['nccl'] else 'no'} | Gloo {'yes' if info['gloo'] else 'no'}")
    out(f"  CPU code: {info['cpu_isa']} (variants this CPU runs: {', '.join(_C.cpu_isas())}) | "
        f"OpenMP threads {_C.get_num_threads()}")
    return info


def report_libraries(out, info) -> str | None:
    """Every shared library the package loaded or needs: path and version; a CUDA backend that cannot be loaded
    says why (the CPU still works, so that is not a failed check)."""
    from .. import _cuda, _libs, _plugins
    _build_config = _plugins.config()  # the CUDA backend's: this build's own or the installed plugin's
    out("libraries:")
    blas = _mapped("libscipy_openblas.so" if info["blas"].startswith("scipy-openblas") else "blas")
    out(f"  BLAS     {info['blas']}: {blas or 'linked statically'}")
    out(f"  OpenMP   {_mapped('libgomp') or _mapped('libomp') or 'not found in the process'}")
    if info["gloo"]:
        out(f"  Gloo     {_mapped('libgloo') or 'linked statically'}")
    if info.get("cuda_plugin"):
        out(f"  CUDA plugin {info['cuda_plugin']}")
    for p in _plugins.ignored():
        out(f"  CUDA plugin {p} ignored: this build has its own CUDA module")
    if not _build_config.CUDA_LIBRARIES:
        if info.get("cuda_error"):  # plugins that cannot be used: a failed check
            out(f"  CUDA     not loaded: {info['cuda_error']}")
            return "not loaded"
        out(f"  CUDA     none: {_plugins.why_none()}")
        return None
    try:
        found = _cuda.load()
    except ImportError as e:
        out(f"  CUDA     not loaded: {e}")
        # a machine with an NVIDIA driver whose CUDA backend cannot load has failed a check (exit status 1)
        return "not loaded" if _libs.driver() else None
    except OSError as e:  # never a traceback from the doctor
        out(f"  CUDA     not loaded: {e.filename or ''} {e.strerror or e}")
        return "not loaded" if _libs.driver() else None
    out(f"  (versions as the loaded libraries report them; this build: CUDA {_build_config.CUDA_VERSION}"
        + (f", cuDNN {_build_config.CUDNN_VERSION}" if getattr(_build_config, "CUDNN_VERSION", "") else "")
        + (f", NCCL {_build_config.NCCL_VERSION}" if getattr(_build_config, "NCCL_VERSION", "") else "") + ")")
    for f in found:
        out("  " + _libs.describe(f))
        for path, why in f.skipped:
            out(f"           skipped {path}: {why}")
    return None


def report_gpu(out) -> list[str]:
    """The CUDA device a model uses by default (["cuda"]) after printing it, or [] after printing why none."""
    from .. import _C
    from .. import _libs
    why = _libs.driver_problem() or _C.cuda_status()
    if why:
        out(f"GPU: none usable ({why})")
        return []
    from ..model import pick_precision
    cap = _C.cuda_capability(0)
    facts = gpu_facts(0)
    out(f"GPU cuda:0: {_C.cuda_device_name(0)} | sm_{cap} | driver {facts.get('driver', '?')} | "
        f"memory {facts.get('memory', '?')} | a model picks precision {pick_precision(None, cap)}, attention auto "
        f"(cuDNN SDPA where it checks out, else gpt2core's flash kernels)")
    return ["cuda"]


def _gpu_present() -> bool:
    """An NVIDIA driver is installed (libcuda.so.1 loads) or nvidia-smi lists a GPU."""
    from .. import _libs
    if _libs.driver():
        return True
    return bool(gpu_facts(0))


def _driver_or_status() -> str:
    from .. import _C, _libs
    return _libs.driver_problem() or _C.cuda_status()


def _train(device: str, dtype: str = "float32", steps: int = 4) -> tuple[list[float], str]:
    from ..model import GPT2
    from ..config import GPT2Config
    cfg = GPT2Config(block_size=32, vocab_size=97, padded_vocab_size=128, n_layer=2, n_head=2, n_embd=32)
    rng = np.random.default_rng(0)
    x = rng.integers(0, cfg.vocab_size, (4, 32), dtype=np.int32)
    y = np.roll(x, -1, axis=1)  # learnable: predict the next token of a fixed batch
    m = GPT2(cfg, device=device, seed=0, dtype=dtype)
    losses = []
    for _ in range(steps):
        m.zero_grad()
        losses.append(float(m.forward(x, y)))
        m.backward()
        m.step(lr=1e-2)
    return losses, m.precision


def check_correctness(out, devices: list[str]) -> bool:
    """CPU (fp32) against float64, then each GPU against the CPU: the loss of 4 AdamW steps of a tiny model."""
    ok = True
    ref, _ = _train("cpu", "float64")
    cpu, _ = _train("cpu")
    runs = [("cpu", cpu, "fp32", ref, "float64")] + [(d, *_train(d), cpu, "cpu fp32") for d in devices]
    for device, losses, precision, want, against in runs:
        err = max(abs(a - b) / abs(b) for a, b in zip(losses, want))
        good = err <= LOSS_RTOL[precision] and losses[-1] < losses[0]
        ok &= good
        out(f"check {device} ({precision}): 4 training steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
            f"max relative difference to {against} {err:.1e} (tolerance {LOSS_RTOL[precision]:.0e}): "
            f"{'OK' if good else 'FAIL'}")
    return ok


def speed_probe(out, device: str, seconds: float, preset: str = "d12", B: int = 8, T: int = 1024) -> int:
    """GPT-2 124M (d12), B=8 T=1024, as many steps as fit in `seconds` after two warm-up steps. Returns the timed
    steps."""
    from ..model import GPT2
    from ..config import PRESETS
    from .. import _C
    from ..planning.perf import gpu_peak_tflops
    cfg = PRESETS[preset]
    m = GPT2(cfg, device=device, seed=0)
    x = np.random.default_rng(0).integers(0, cfg.vocab_size, (B, T), dtype=np.int32)
    warmup, steps, t0 = 2, 0, None
    while t0 is None or time.perf_counter() - t0 < seconds:
        m.zero_grad()
        m.forward(x, x)  # returns the loss: each step ends synchronised with the GPU
        m.backward()
        m.step(lr=1e-4)
        steps += 1
        if t0 is None and steps == warmup:  # the clock starts once, after the warm-up (it restarted every 2 steps:
            steps, t0 = 0, time.perf_counter()  # a probe that never ended, found on an H200)
    dt = (time.perf_counter() - t0) / max(steps, 1)
    tps = B * T / dt
    tflops = tps * cfg.flops_per_token(T) / 1e12
    if device.startswith("cuda"):
        name = _C.cuda_device_name(int(device.partition(":")[2] or 0))
        peak = gpu_peak_tflops(name, m.precision)
        mfu = f"MFU {100 * tflops / peak[0]:.1f}% of {peak[0]:.0f} TFLOP/s ({peak[1]} {m.precision})" if peak \
            else "MFU ?"
    else:
        mfu = "MFU: CPU"
    out(f"speed {device}: {preset} B={B} T={T} {m.precision}: {dt * 1e3:.1f} ms/step, {tps:,.0f} tokens/s, "
        f"{tflops:.1f} TFLOP/s, {mfu}")
    return steps


def main(argv=None) -> int:
    ap = cli.ArgumentParser(prog="gpt2core-doctor", description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=cli.Float(0, 3600), default=20.0,
                    help="length of the GPU speed probe in seconds, 0..3600 (0: skip it; default 20)")
    ap.add_argument("--calibrate", action="store_true",
                    help="the GPU lease driver with its defaults (python -m gpt2core.calibrate: every step in value "
                         "order, each time-bounded, into one report); without a GPU: the doctor's step, then exit 0")
    ap.add_argument("--report", default="calibrate.json", help="--calibrate: the report file (JSON; a .txt "
                                                               "summary beside it, the step folders and the page "
                                                               "in a folder of its name)")
    args = ap.parse_args(argv)

    def out(line: str) -> None:
        print(line, flush=True)

    if args.calibrate:
        from .calibrate import calibrate
        return calibrate(args.report, out)
    return run_checks(out, args.seconds)


def run_checks(out, seconds: float = 20.0) -> bool | int:
    from .. import _plugins
    """The doctor's checks, printed through `out`; the exit status (0: every check passed)."""
    out(f"python {sys.version.split()[0]} | numpy {np.__version__} | {sys.platform}")
    info = report_build(out)
    cuda_failed = report_libraries(out, info)
    devices = report_gpu(out) if "cuda" in info["backends"] else []
    if "cuda" in info["backends"] and not devices and _gpu_present():
        # a GPU box whose CUDA backend cannot run has failed, even though the CPU checks below pass
        cuda_failed = _driver_or_status() or cuda_failed or "no usable GPU"
        out(f"FAIL: an NVIDIA GPU is present but the CUDA backend cannot run: {cuda_failed}")
    if "cuda" not in info["backends"]:
        out(f"GPU: this build has no CUDA backend and no CUDA plugin is installed ({_plugins.install_hint()})")
    ok = check_correctness(out, devices) and not cuda_failed
    for d in devices if seconds > 0 else []:
        speed_probe(out, d, seconds)
    info_now = gpt2core_build_info()
    if info_now.get("bgradb_refused_shapes"):
        out(f"note: the matmul library refused the bias-gradient epilogue (BGRADB) for "
            f"{info_now['bgradb_refused_shapes']} dW shape(s); {info_now['bgradb_fallbacks']} GEMMs summed dbias "
            "with kernels instead")
    out("all checks passed" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


def gpt2core_build_info() -> dict:
    import gpt2core
    return gpt2core.build_info()


console = cli.entry("gpt2core-doctor", main)

if __name__ == "__main__":
    sys.exit(console())
