"""The steps that measure how fast this device trains and evaluates: the d12 step (cuDNN's attention and ours,
beside the paper model), d24 / d36 / d48 at the largest batch the memory plan allows, HellaSwag and CORE items/s,
and scripts/bench.py's speed ladder and GEMM timings."""
from __future__ import annotations

import subprocess
import time
from pathlib import Path

from .common import (ROOT, Ctx, Skip, checkout, need_gpu, paper_model, random_batch, random_token_config, shapes,
                     time_steps, timing_row)


def step_d12_step(budget: float, ctx: Ctx):
    """d12, B=64, T=1024, bf16: the step with cuDNN's attention and with gpt2core's flash kernels (per-phase times),
    beside scripts/gpu_model.py's modelled range for this GPU."""
    from gpt2core import GPT2
    s = shapes(ctx)
    atts = ("cudnn", "flash") if ctx.device == "cuda" else ("auto",)
    t0 = time.perf_counter()
    cfg = random_token_config(ctx)
    for att in atts:
        m = GPT2(cfg, device=ctx.device, seed=0, attention=att if ctx.device == "cuda" else None)
        ms = time_steps(m, random_batch(cfg.vocab_size, s["B"], s["T"]), s["timing_steps"])
        yield timing_row(ctx, m, s["B"], s["T"], ms, preset=s["preset"] if not ctx.dry else "dry", attention=att)
        del m
    left = budget - (time.perf_counter() - t0) - 5
    if ctx.device == "cuda" and not ctx.dry:
        yield {"paper_model": paper_model(ctx, ["--attention", "cudnn", "flash", "-B", str(s["B"]), "-T",
                                                str(s["T"])], left)}


def step_recipe_profile(budget: float, ctx: Ctx):
    """scripts/bench.py --recipe gpt2 modern --profile at d12, T=1024 (issue 51): each recipe's training step split
    by op (attention with rotary and QK-norm, RMSNorm, ReLU², the soft-capped head, AdamW, Muon's Newton-Schulz), one
    model per recipe in one process, alternating rounds, and the modern recipe's time per token against the GPT-2
    recipe's, each with its own tokens per optimizer step. B=64 where both models fit (100 GiB free), else 32."""
    import importlib.util
    s = shapes(ctx)
    B = s["B"]
    if ctx.device == "cuda" and not ctx.dry:
        from gpt2core import _C
        B = 64 if _C.cuda_mem_info(0)[0] >= 100 * 2**30 else 32
    spec = importlib.util.spec_from_file_location("gpt2core_lease_bench", checkout(ctx, "scripts", "bench.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    r = bench.main(["--preset", s["preset"], "-B", str(B), "-T", str(s["T"]), "--device", ctx.device,
                    "--recipe", "gpt2", "modern", "--profile", "--steps", "1" if ctx.dry else "3",
                    "--rounds", "1" if ctx.dry else "2", "--warmup", "1"])
    for recipe, run in r["recipes"].items():
        yield {"recipe": recipe, "B": B, "T": s["T"], "preset": s["preset"],
               **{k: round(v, 4) if isinstance(v, float) else v for k, v in run.items() if k != "ops"},
               "ops_ms": {k: round(v, 4) for k, v in run["ops"].items()}}


def step_scale(budget: float, ctx: Ctx):
    """d24, d36, d48 in bf16 at T=1024: the largest micro-batch the memory plan allows at each recompute level on
    this GPU, with cuDNN's attention and ours: tokens/s, MFU, forward / backward / optimizer times; then
    --offload optimizer at d48 with layer recompute, B=4, with the gradients' copies overlapped with backward and
    without (the GPU notes' two bench commands). gpu_model.py models C=768 only: no paper figure here."""
    from gpt2core import GPT2, _C
    from gpt2core.planning import memplan
    s = shapes(ctx)
    T = s["T"]
    if ctx.device == "cuda":
        free = _C.cuda_mem_info(0)[0]
        budget_bytes = memplan.budget_of(free, measured=True)
    for preset in s["scale_presets"]:
        cfg = random_token_config(ctx, preset)
        # cuDNN's attention first (the faster on an H100), then ours; within each, the cheapest recompute first
        for att in (("cudnn", "flash") if ctx.device == "cuda" else ("auto",)):
            for recompute in ("none", "gelu", "layer"):
                extra = {}
                if ctx.device == "cuda":
                    o = memplan.Options(device="cuda", precision="bf16", recompute=recompute,
                                        attention="flash" if att == "flash" else "cudnn")
                    B = memplan.largest_batch(cfg, T, o, budget_bytes)
                    if B is None:
                        yield {"preset": preset, "recompute": recompute, "attention": att, "fits": False}
                        continue
                    if B > s["scale_max_B"]:  # tokens/s no longer grows with B long before this
                        extra = {"plan_allows_B": B}
                        B = s["scale_max_B"]
                else:
                    B = s["B"]
                m = GPT2(cfg, device=ctx.device, seed=0, attention=None if att == "auto" else att)
                m.recompute = recompute
                ms = time_steps(m, random_batch(cfg.vocab_size, B, T), s["scale_steps"], warmup=1)
                yield timing_row(ctx, m, B, T, ms, preset=preset, recompute=recompute, attention=att, **extra)
                del m
    if ctx.device != "cuda":
        yield {"offload": "skipped: --offload optimizer needs a GPU"}
        return
    preset = s["scale_presets"][-1]
    cfg = random_token_config(ctx, preset)
    m = GPT2(cfg, device="cuda", seed=0)
    m.recompute = "layer"
    m.offload = True
    B = 4 if not ctx.dry else s["B"]
    for prefetch in (True, False):  # the gradients' copies overlapped with backward, and at the step
        ms = time_steps(m, random_batch(cfg.vocab_size, B, T), 2, warmup=1, prefetch=prefetch)
        yield timing_row(ctx, m, B, T, ms, preset=preset, recompute="layer", attention="auto", offload="optimizer",
                         prefetch=prefetch)


def step_eval(budget: float, ctx: Ctx):
    """HellaSwag's 10,042 validation items on this device (d12, random weights: speed, not accuracy): items/s; and
    CORE over a bundle (--core-bundle, else scripts/lease_core_bundle.py's from the same HellaSwag items and tiny
    Shakespeare): items/s."""
    from gpt2core import GPT2, PRESETS
    from gpt2core.evaluation.evaluate import score_hellaswag
    path = ctx.hellaswag
    if not path:
        raise Skip("no HellaSwag set (--hellaswag: the shared data's hellaswag_val_full.txt)")
    s = shapes(ctx)
    m = GPT2(PRESETS[s["preset"]], device=ctx.device, seed=0)
    limit = 16 if ctx.dry else None
    t0 = time.perf_counter()
    r = score_hellaswag(m, path, items_per_batch=4 if ctx.dry else 64, limit=limit)
    dt = time.perf_counter() - t0
    yield {"hellaswag": r, "seconds": round(dt, 2), "items_per_s": round(r["n"] / dt, 1), "preset": s["preset"]}
    bundle = ctx.core_bundle
    script = Path(ctx.root or ROOT, "scripts", "lease_core_bundle.py")
    if not bundle and script.exists():  # built here from HellaSwag's items and tiny Shakespeare (seconds)
        bundle = str(Path(ctx.work) / "core_bundle")
        r = subprocess.run([*ctx.python, str(script), "--hellaswag", path, "--out", bundle], capture_output=True,
                           text=True, timeout=120)
        if r.returncode != 0:
            raise RuntimeError(f"scripts/lease_core_bundle.py failed: {r.stderr[-1500:]}")
        yield {"core_bundle": r.stdout.strip()}
    if not bundle:
        yield {"core": "skipped: no CORE bundle (--core-bundle) and no scripts/lease_core_bundle.py to build one"}
        return
    from gpt2core.evaluation.core_eval import evaluate_core
    t0 = time.perf_counter()
    res = evaluate_core(m, bundle, max_per_task=4 if ctx.dry else None)
    dt = time.perf_counter() - t0
    n = sum(t["n"] for t in res["tasks"].values())
    yield {"core": res["core"], "items": n, "seconds": round(dt, 2), "items_per_s": round(n / dt, 1)}


def _bench(ctx: Ctx, budget: float, *args):
    bench = checkout(ctx, "scripts", "bench.py")
    s = shapes(ctx)
    r = subprocess.run([*ctx.python, str(bench), "--preset", s["preset"], "-B", str(s["B"] if ctx.dry else 16), "-T",
                        str(s["T"]), "--device", ctx.device, "--steps", "1" if ctx.dry else "3", *args],
                       capture_output=True, text=True, timeout=budget)
    yield {"ok": r.returncode == 0, "tail": (r.stdout + r.stderr)[-3000:]}
    if r.returncode != 0:
        raise RuntimeError(f"scripts/bench.py {' '.join(args)} exited with {r.returncode}")


def step_ladder(budget: float, ctx: Ctx):
    """scripts/bench.py --ladder at d12 (B=16, T=1024)."""
    need_gpu(ctx, "the speed ladder's rungs are CUDA options")
    yield from _bench(ctx, budget, "--ladder")


def step_gemm(budget: float, ctx: Ctx):
    """cuBLASLt GEMM timings for GPT-2 124M's shapes (scripts/bench.py --profile)."""
    need_gpu(ctx, "cuBLASLt timings")
    yield from _bench(ctx, budget, "--profile")
