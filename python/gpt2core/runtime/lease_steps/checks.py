"""The steps that check this build is right on this device: the doctor, the GPU test suite, a run killed with
SIGKILL that resumes bit for bit, two identical runs bit for bit, the bias-gradient GEMM epilogue, and the GPU's
losses against the CPU backend's."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from .common import Ctx, checkout, gpt2core_cmd, need_gpu, random_batch, random_token_config, shapes, time_steps


def step_doctor(budget: float, ctx: Ctx):
    """The doctor's build, library and correctness checks (and on a GPU its speed probe)."""
    seconds = 0 if ctx.dry or ctx.device != "cuda" else min(10, budget / 6)
    r = subprocess.run(gpt2core_cmd(ctx, "gpt2core.doctor", "--seconds", seconds), capture_output=True, text=True,
                       timeout=budget)
    yield {"ok": r.returncode == 0, "lines": r.stdout.splitlines(), "stderr": r.stderr[-2000:]}
    if r.returncode != 0:
        raise RuntimeError("the doctor failed a check (its lines are the row above)")


def step_gpu_tests(budget: float, ctx: Ctx):
    """tests/csrc/cuda/test_cuda_gpu.py (the real CUDA backend against the CPU backend); a dry run collects it."""
    tests = checkout(ctx, "tests", "csrc", "cuda", "test_cuda_gpu.py")
    if ctx.dry:
        cmd = [sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider", str(tests)]
    else:
        need_gpu(ctx, "the GPU test suite")
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=budget, cwd=tests.parents[3])
    tail = (r.stdout + r.stderr)[-3000:]
    summary = next((ln for ln in reversed(tail.splitlines()) if " passed" in ln or " failed" in ln or
                    "collected" in ln or " tests" in ln), "")
    yield {"ok": r.returncode == 0, "collect_only": ctx.dry, "summary": summary.strip(), "tail": tail}
    if r.returncode != 0:
        raise RuntimeError(f"pytest exited with {r.returncode}: {summary.strip()}")


RESUME_KILL = """
import os, signal, sys
from gpt2core.training import train
kill_after = int(sys.argv[1])
if kill_after:
    _save = train.Trainer.save_checkpoint
    def _save_then_die(self, step):
        _save(self, step)
        if step == kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
    train.Trainer.save_checkpoint = _save_then_die
sys.exit(train.console(sys.argv[2:]))
"""


def step_resume(budget: float, ctx: Ctx):
    """A run killed with SIGKILL right after a checkpoint resumes (--resume auto) to the uninterrupted run's weights
    and losses, bit for bit."""
    s = shapes(ctx)
    work = Path(ctx.work)
    script = work / "resume_train.py"
    script.write_text(RESUME_KILL)
    n = s["resume_steps"]
    args = ["--preset", s["preset"], "-B", s["B"], "-T", s["T"], "--steps", n, "--val-every", 0, "--sample-tokens", 0,
            "--device", ctx.device, "--checkpoint-every", n // 2, "--seed", 5, "--lr", 1e-3]

    def train(name, kill, *extra):
        r = subprocess.run([*ctx.python, str(script), str(kill), *map(str, args), "--output-dir", str(work / name),
                            *extra], capture_output=True, text=True, timeout=max(30, budget / 2))
        return r

    whole = train("whole", 0)
    if whole.returncode != 0:
        raise RuntimeError(f"the uninterrupted run failed: {whole.stdout[-800:]} {whole.stderr[-1500:]}")
    killed = train("run", n // 2)
    yield {"killed_with": killed.returncode, "checkpoints": sorted(p.name for p in (work / "run" / "checkpoints")
                                                                   .iterdir())}
    resumed = train("run", 0, "--resume", "auto")
    if resumed.returncode != 0:
        raise RuntimeError(f"the resumed run failed: {resumed.stderr[-1500:]}")
    same = (work / "run" / "model.bin").read_bytes() == (work / "whole" / "model.bin").read_bytes()

    def losses(d):
        return [json.loads(x)["loss"] for x in open(d / "metrics.jsonl") if '"loss"' in x and '"val_loss"' not in x]

    yield {"bit_identical": same, "losses_whole": losses(work / "whole"), "losses_resumed": losses(work / "run"),
           "resumed_line": "resumed from" in resumed.stdout + resumed.stderr}
    if not same:
        raise RuntimeError("the resumed run's model.bin differs from the uninterrupted run's")


def _run_bits(ctx: Ctx, deterministic: bool) -> bytes:
    from gpt2core import GPT2
    s = shapes(ctx)
    m = GPT2(random_token_config(ctx), device=ctx.device, seed=0, deterministic=deterministic)
    x = random_batch(m.config.vocab_size, *((s["B"], s["T"]) if ctx.dry else (4, 256)), seed=1)
    for _ in range(3 if not ctx.dry else 1):
        m.zero_grad()
        m.forward(x, x)
        m.backward()
        m.step(lr=1e-4)
    return m.flat_params().tobytes()


def step_bitwise(budget: float, ctx: Ctx):
    """Two identical runs (d12, B=4, T=256, 3 steps; bf16 on a GPU) compared bit for bit, with deterministic=True
    (the default) and, for the record, deterministic=False."""
    for d in (True, False):
        yield {"deterministic": d, "bit_identical": _run_bits(ctx, d) == _run_bits(ctx, d)}


def step_bgradb(budget: float, ctx: Ctx):
    """Whether cuBLASLt accepted the bias-gradient epilogue (build_info()'s refusal counts after a step)."""
    need_gpu(ctx, "the cuBLASLt epilogue")
    import gpt2core
    from gpt2core import GPT2
    s = shapes(ctx)
    m = GPT2(random_token_config(ctx), device="cuda", seed=0)
    time_steps(m, random_batch(m.config.vocab_size, *((s["B"], s["T"]) if ctx.dry else (8, 256))), 1, warmup=0)
    info = gpt2core.build_info()
    yield {"accepted": info["bgradb_refused_shapes"] == 0, "refused_shapes": info["bgradb_refused_shapes"],
           "fallbacks": info["bgradb_fallbacks"]}


def step_vs_cpu(budget: float, ctx: Ctx):
    """20 training steps of d12 (B=2, T=128) on the GPU against the CPU backend: losses side by side."""
    need_gpu(ctx, "compares the GPU with the CPU")
    from gpt2core import GPT2
    s = shapes(ctx)
    cfg = random_token_config(ctx)
    x = random_batch(cfg.vocab_size, *((s["B"], s["T"]) if ctx.dry else (2, 128)), seed=2)
    losses = {}
    for device in ("cuda", "cpu"):
        m = GPT2(cfg, device=device, seed=0)
        losses[device] = []
        for _ in range(4 if ctx.dry else 20):
            m.zero_grad()
            losses[device].append(float(m.forward(x, x)))
            m.backward()
            m.step(lr=3e-4)
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses["cuda"], losses["cpu"]))
    yield {"losses": losses, "max_relative_difference": worst}
