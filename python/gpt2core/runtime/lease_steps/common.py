"""What every lease step stands on: the context a step gets (Ctx), Skip, the shapes of a real step and of a dry run,
the source checkout, the command lines of gpt2core's own tools, scripts/gpu_model.py's figures, the timing of
training steps, and a run's validation curve read from its metrics.jsonl."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


def _checkout() -> Path:
    """The source checkout (scripts/, tests/): the one this file is in (run from source), else the working folder
    when it is one (a lease runs the installed wheel from the repository's root), else the former (no checkout)."""
    here = Path(__file__).resolve().parents[4]
    for root in (here, Path.cwd()):
        if (root / "scripts").is_dir() and (root / "tests").is_dir() and (root / "python" / "gpt2core").is_dir():
            return root
    return here


ROOT = _checkout()


def checkout(ctx: Ctx, *parts) -> Path:
    """A path in the source checkout the driver found (Skip where there is none)."""
    p = Path(ctx.root or ROOT, *parts)
    if not p.exists():
        raise Skip(f"no source checkout ({Path(*parts)} not found)")
    return p


class Skip(Exception):
    """The step cannot run here (the device at hand, a missing input): the reason."""


@dataclass
class Ctx:
    device: str = "cpu"             # cpu or cuda
    dry: bool = False               # tiny shapes
    work: str = "."                 # the step's scratch folder
    python: list = field(default_factory=lambda: [sys.executable])  # how a step starts gpt2core in a process
    data: str | None = None         # learn: the folder of scripts/lease_data.py (manifest.json + shards)
    hellaswag: str | None = None    # eval: HellaSwag's validation set (.txt / .jsonl / .npz)
    core_bundle: str | None = None  # eval: a CORE bundle (folder or zip)
    gpu: str = ""                   # the GPU's name ("" on the CPU)
    root: str = ""                  # the source checkout (scripts/, tests/) or ""


# The shapes of the real steps and of the dry run (ctx.dry)
REAL = {"preset": "d12", "B": 64, "T": 1024, "timing_steps": 5, "scale_steps": 3, "scale_max_B": 128,
        "scale_presets": ["d24", "d36", "d48"], "serve_streams": [1, 8, 32, 64], "serve_new": 128, "serve_prompt": 64,
        "fp16_steps": 50, "dp_B": 4, "dp_T": 256, "resume_steps": 6, "learn_B": 64, "learn_T": 1024}
DRY = {"preset": "tiny", "B": 2, "T": 32, "timing_steps": 1, "scale_steps": 1, "scale_max_B": 4,
       "scale_presets": ["dry"], "serve_streams": [1, 2], "serve_new": 4, "serve_prompt": 8, "fp16_steps": 3,
       "dp_B": 2, "dp_T": 16, "resume_steps": 4, "learn_B": 2, "learn_T": 32}


def shapes(ctx: Ctx) -> dict:
    return DRY if ctx.dry else REAL


def random_token_config(ctx: Ctx, preset: str = "d12"):
    """The model of a step that trains on random tokens: the preset, or in a dry run 2 layers of 64 with a vocabulary
    of 256 (tiny's 50,304 rows would make the emulated device's optimizer take seconds a step)."""
    from gpt2core import GPT2Config, PRESETS
    if ctx.dry:
        return GPT2Config(block_size=64, vocab_size=256, padded_vocab_size=256, n_layer=2, n_head=2, n_embd=64)
    return PRESETS[preset]


def need_gpu(ctx: Ctx, what: str) -> None:
    if ctx.device != "cuda":
        raise Skip(f"needs a GPU ({what}); --device {ctx.device}")


def gpt2core_cmd(ctx: Ctx, module: str, *args) -> list[str]:
    """The command line of `python -m <module> args` in the driver's Python (the emulated module in a test)."""
    return [*ctx.python, "-m", module, *map(str, args)]


def peak_tflops(ctx: Ctx, precision: str) -> float | None:
    from gpt2core.planning.perf import gpu_peak_tflops
    p = gpu_peak_tflops(ctx.gpu, precision) if ctx.gpu else None
    return p[0] if p else None


# ------------------------------------------------------------------------------------------ the paper model
def gpu_model_key(gpu: str) -> str | None:
    """scripts/gpu_model.py's GPU for this one: H100 for an H100 or H200 (the same SMs and clocks), A100, L4, ..."""
    if "H100" in gpu or "H200" in gpu:
        return "H100"
    return next((k for k in ("A100", "L4", "T4", "V100", "RTX4090") if k in gpu.replace(" ", "")), None)


def paper_model(ctx: Ctx, args: list[str], seconds: float) -> dict:
    """scripts/gpu_model.py's figures (--json) for args, within `seconds` (its training model emulates a step
    first: minutes where build/model holds no launch logs; --reuse takes them when it does). {"model": [...]} or
    {"model_skipped": why}."""
    script = Path(ctx.root or ROOT, "scripts", "gpu_model.py")
    key = gpu_model_key(ctx.gpu) or "H100"
    if not script.exists():
        return {"model_skipped": "no source checkout (scripts/gpu_model.py)"}
    out = Path(ctx.work) / f"model_{abs(hash(tuple(args))) % 10**8}.json"
    cmd = [sys.executable, str(script), "--gpu", key, *args, "--json", str(out)]
    if "--decode" not in args and (script.parents[1] / "build" / "model" / "ptxas.txt").exists():
        cmd.append("--reuse")
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=max(1.0, seconds))
    except subprocess.TimeoutExpired:
        return {"model_skipped": f"scripts/gpu_model.py took over {seconds:.0f} s (it emulates a step first; run it "
                                 "before the lease so that build/model holds its launch logs)"}
    if r.returncode != 0 or not out.exists():
        return {"model_skipped": f"scripts/gpu_model.py failed: {(r.stderr or r.stdout)[-300:]}"}
    note = "" if key in ctx.gpu or not ctx.gpu else f" ({ctx.gpu} modelled as {key})"
    return {"model": json.loads(out.read_text()), "model_gpu": key + note}


# ------------------------------------------------------------------------------------------ timing helpers
def random_batch(vocab: int, B: int, T: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, (B, T), dtype=np.int32)


def time_steps(m, x, steps: int, step_kw: dict | None = None, warmup: int = 2, prefetch: bool = False) -> dict:
    """Median forward / backward / optimizer times (ms) of `steps` training steps after `warmup`, each phase ended
    by a device read (forward returns the loss, grad_norm reads the gradients). prefetch: with offload, the
    gradients go to the host during backward (GPT2.prefetch_grads), as gpt2core-train does."""
    parts = {"forward": [], "backward": [], "optimizer": []}
    for i in range(steps + warmup):
        t0 = time.perf_counter()
        m.zero_grad()
        m.forward(x, x)
        t1 = time.perf_counter()
        if prefetch:
            m.prefetch_grads()
        m.backward()
        m.grad_norm()
        t2 = time.perf_counter()
        m.step(**(step_kw or {"lr": 1e-4}))
        t3 = time.perf_counter()
        if i >= warmup:
            for k, v in zip(parts, (t1 - t0, t2 - t1, t3 - t2)):
                parts[k].append(v)
    return {k: 1e3 * float(np.median(v)) for k, v in parts.items()}


def timing_row(ctx: Ctx, m, B: int, T: int, phase_ms: dict, **extra) -> dict:
    step_ms = sum(phase_ms.values())
    tps = B * T / (step_ms / 1e3)
    peak = peak_tflops(ctx, m.precision)
    mfu = tps * m.config.flops_per_token(T) / 1e12 / peak if peak else None
    return {**extra, "B": B, "T": T, "precision": m.precision, "ms_per_step": round(step_ms, 3),
            "tokens_per_s": round(tps, 1), "mfu": None if mfu is None else round(mfu, 4),
            "phase_ms": {k: round(v, 3) for k, v in phase_ms.items()}}


# ------------------------------------------------------------------------------------------ a run's validation curve
def val_records(metrics: Path) -> tuple[list[dict], float]:
    """The validation records of a run's metrics.jsonl so far, each with the training seconds before it (the sum
    of the steps' dt_ms: validation time excluded), and the tokens per step."""
    per_step, train_s, out = None, 0.0, []
    if not metrics.exists():
        return out, 0
    for line in metrics.read_text().splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue  # a line being written
        if "run" in r:
            per_step = r["run"].get("tokens_per_step")
        elif "val_loss" in r:
            out.append({"step": r["step"], "tokens": r["step"] * (per_step or 0), "train_seconds": round(train_s, 3),
                        "val_loss": r["val_loss"]})
        elif "dt_ms" in r:
            train_s += r["dt_ms"] / 1e3
    return out, per_step or 0
