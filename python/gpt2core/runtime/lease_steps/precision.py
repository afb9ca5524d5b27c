"""The steps that weigh a lower precision against bf16 on a GPU: fp16 with dynamic loss scaling, and FP8 (speed at
d12 / d24 / d48, then d24's validation curve on the carried tokens)."""
from __future__ import annotations

import subprocess
import time
from pathlib import Path

import numpy as np

from .common import (Ctx, Skip, gpt2core_cmd, need_gpu, random_batch, random_token_config, shapes, time_steps,
                     timing_row, val_records)


def step_fp16(budget: float, ctx: Ctx):
    """d12 with dynamic loss scaling (fp16), 50 steps against bf16 on the same batches: losses side by side, the
    scale and the skipped steps; tokens/s of each."""
    need_gpu(ctx, "fp16 and bf16 are CUDA precisions")
    from gpt2core import GPT2
    s = shapes(ctx)
    cfg = random_token_config(ctx)
    B, T = (s["B"], s["T"]) if ctx.dry else (16, 1024)
    rng = np.random.default_rng(3)
    batches = [rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32) for _ in range(4)]
    losses = {}
    for precision in ("bf16", "fp16"):
        m = GPT2(cfg, device="cuda", seed=0, precision=precision)
        losses[precision] = []
        t0 = time.perf_counter()
        for i in range(s["fp16_steps"]):
            x = batches[i % len(batches)]
            m.zero_grad()
            losses[precision].append(float(m.forward(x, x)))
            m.backward()
            m.step(lr=6e-4)
        dt = time.perf_counter() - t0
        yield {"precision": precision, "losses": losses[precision], "tokens_per_s": round(
            s["fp16_steps"] * B * T / dt, 1), "loss_scale": m.loss_scale if m.loss_scaling else None,
            "skipped_steps": m.skipped_steps}
        del m
    a, b = np.array(losses["fp16"]), np.array(losses["bf16"])
    yield {"max_relative_difference": float(np.max(np.abs(a - b) / np.abs(b))), "final": [a[-1], b[-1]]}


def step_fp8(budget: float, ctx: Ctx):
    """FP8 against bf16 (issue 49), on an sm_89 / sm_90 GPU: tokens/s of d12, d24 and d48 at the same micro-batch in
    each precision (the goal: d24 and d48 >= 1.2x bf16), then d24 trained on the carried tokens in both, the same
    batches in the same order, up to 300 steps as the budget allows: the validation curves side by side (the goal:
    FP8's final validation loss within 1% of bf16's, no loss non-finite)."""
    need_gpu(ctx, "FP8 is a CUDA precision")
    from gpt2core import GPT2, _C
    from gpt2core.model.gpt2 import FP8_ARCHS
    cap = _C.cuda_capability(0)
    if cap not in FP8_ARCHS:
        raise Skip(f"FP8 needs sm_89 / sm_90; {_C.cuda_device_name(0)} is sm_{cap}")
    t_start = time.perf_counter()
    s = shapes(ctx)
    B, T = (s["B"], s["T"]) if ctx.dry else (8, 1024)
    step_s = {}
    for preset in (["dry"] if ctx.dry else ["d12", "d24", "d48"]):
        cfg = random_token_config(ctx, preset)
        x = random_batch(cfg.vocab_size, B, T)
        tps = {}
        for precision in ("bf16", "fp8"):
            m = GPT2(cfg, device="cuda", seed=0, precision=precision)
            ms = time_steps(m, x, s["timing_steps"], warmup=1)
            row = timing_row(ctx, m, B, T, ms, preset=preset)
            tps[precision] = row["tokens_per_s"]
            step_s[(preset, precision)] = row["ms_per_step"] / 1e3
            yield row
            del m
        yield {"preset": preset, "fp8_over_bf16": round(tps["fp8"] / tps["bf16"], 4)}
    data = ctx.data
    if not data and not ctx.dry:
        raise Skip("the d24 loss curves need the carried tokens (--data: scripts/lease_data.py)")
    preset = "dry" if ctx.dry else "d24"
    left = budget - (time.perf_counter() - t_start)
    per = max(step_s[(preset, "bf16")], step_s[(preset, "fp8")]) * (64 if not ctx.dry else 1) / 8  # B=64 runs
    steps = 6 if ctx.dry else min(300, max(20, int(0.4 * left / (per * 1.15)) // 10 * 10))
    val_every = max(1, steps // 10)
    yield {"plan": {"preset": preset, "steps": steps, "val_every": val_every}}
    curves = {}
    for precision in ("bf16", "fp8"):
        out = Path(ctx.work) / f"fp8_{precision}"
        args = ["--preset", "tiny" if ctx.dry else preset, "--precision", precision, "-B", s["learn_B"],
                "-T", s["learn_T"], "--steps", steps, "--val-every", val_every, "--val-steps", 4 if ctx.dry else 16,
                "--sample-tokens", 0, "--device", "cuda", "--output-dir", out, "--seed", 1337, "--overwrite"]
        if data:
            args += ["--data-dir", data]
        log_path = Path(ctx.work) / f"fp8_{precision}.log"
        with open(log_path, "w") as log:  # a file, not a pipe nobody reads
            r = subprocess.run(gpt2core_cmd(ctx, "gpt2core.train", *args), stdout=log, stderr=subprocess.STDOUT)
        if r.returncode != 0:
            raise RuntimeError(f"gpt2core-train --precision {precision} exited with {r.returncode}: "
                               f"{log_path.read_text(errors='replace')[-1500:]}")
        curves[precision] = val_records(out / "metrics.jsonl")[0]
        for rec in curves[precision]:
            yield {"precision": precision, **rec}
    a, b = curves["fp8"][-1]["val_loss"], curves["bf16"][-1]["val_loss"]
    yield {"result": {"fp8_val_loss": a, "bf16_val_loss": b, "relative": round(a / b - 1, 5),
                      "goal": "within 1% of bf16's after 300 steps of d24", "goal_met": abs(a / b - 1) <= 0.01,
                      "all_finite": all(np.isfinite(r["val_loss"]) for c in curves.values() for r in c)}}
