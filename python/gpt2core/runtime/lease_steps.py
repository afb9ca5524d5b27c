"""The lease's steps (issue 48): what a GPU lease measures, one function per step, in value order (STEPS).

Each step is a generator `step(budget, ctx)` that yields rows (dicts) as it measures them; the driver
(gpt2core.runtime.calibrate) runs each in a subprocess of its own (`python -m gpt2core.runtime.lease_steps NAME ROWS
CTX`), which writes every row to ROWS as one JSON line the moment it is made, so a step killed at its bound keeps
what it measured. A step that cannot run on the device at hand raises Skip(why). A step never reads another step's
rows. ctx.dry: the step at tiny shapes (a preset of 2 layers, T=32), which the CPU backend (--device cpu) and the
emulated device run in seconds, so that a lease never meets a crash a dry run could have found.

Where scripts/gpu_model.py models a figure (the d12 training step, KV-cache decoding; C=768 only, H100 and A100:
an H200 is the H100's compute with 1.4x the bandwidth), the step prints the model's figure beside the measured one.
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np



def _checkout() -> Path:
    """The source checkout (scripts/, tests/): the one this file is in (run from source), else the working folder
    when it is one (a lease runs the installed wheel from the repository's root), else the former (no checkout)."""
    here = Path(__file__).resolve().parents[3]
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


# ------------------------------------------------------------------------------------------ the steps
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


def _learn_cmd(ctx: Ctx, recipe: str, data: str | None, out: Path, steps: int, val_every: int) -> list[str]:
    s = shapes(ctx)
    args = ["--recipe", recipe, "--preset", s["preset"], "-B", s["learn_B"], "-T", s["learn_T"],
            "--steps", steps, "--val-every", val_every, "--val-steps", 4 if ctx.dry else 16, "--sample-tokens", 0,
            "--device", ctx.device, "--output-dir", out, "--seed", 1337, "--overwrite"]
    if data:
        args += ["--data-dir", data]
    return gpt2core_cmd(ctx, "gpt2core.train", *args)


def check_manifest(folder: Path) -> dict:
    """scripts/lease_data.py's manifest.json, every file's sha256 and token count checked."""
    from gpt2core.data.shards import read_header
    m = json.loads((folder / "manifest.json").read_text())
    for f in m["files"]:
        p = folder / f["path"]
        if hashlib.sha256(p.read_bytes()).hexdigest() != f["sha256"]:
            raise ValueError(f"{p}: sha256 differs from manifest.json's (a damaged copy)")
        if read_header(p) != f["tokens"]:
            raise ValueError(f"{p}: {read_header(p)} tokens, manifest.json says {f['tokens']}")
    return m


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


def reach(curve: list[dict], target: float, key: str) -> float | None:
    """`key` (tokens or train_seconds) at which the val curve first reaches target, linear between evaluations."""
    prev = None
    for r in curve:
        if r["val_loss"] <= target:
            if prev is None or prev["val_loss"] == r["val_loss"]:
                return float(r[key])
            f = (prev["val_loss"] - target) / (prev["val_loss"] - r["val_loss"])
            return prev[key] + f * (r[key] - prev[key])
        prev = r
    return None


def muon_share(ctx: Ctx, steps: int) -> dict:
    """The optimizer step's share of a training step for both recipes at learn's shape (the Muon step's cost)."""
    from gpt2core import GPT2
    from gpt2core.training import train
    s = shapes(ctx)
    out = {}
    for recipe in ("gpt2", "modern"):
        cfg = train.parse_args(["--recipe", recipe, "--preset", s["preset"], "-T", str(s["learn_T"]),
                                "--steps", "100"])
        m = GPT2(cfg.model_config(), device=ctx.device, seed=0)
        kw = train.step_kwargs(cfg, 10)
        ms = time_steps(m, random_batch(m.config.vocab_size, s["learn_B"], s["learn_T"]), steps, kw)
        out[recipe] = {"optimizer": cfg.optimizer, "phase_ms": {k: round(v, 3) for k, v in ms.items()},
                       "optimizer_share": round(ms["optimizer"] / sum(ms.values()), 4)}
        del m
    return out


def step_learn(budget: float, ctx: Ctx):
    """d12 at T=1024 on the carried tokens: --recipe gpt2 against --recipe modern, the same tokens in the same order
    (same seed, batch and data), validation every k steps; the tokens and the training seconds --recipe modern
    needs to reach the GPT-2 recipe's final validation loss, and the Muon step's share of the step. Sized to fit:
    a probe of both recipes' step times, then as many steps as the budget holds for both runs."""
    t_start = time.perf_counter()
    s = shapes(ctx)
    data, train_tokens = ctx.data, None
    if data:
        m = check_manifest(Path(data))
        train_tokens = sum(f["tokens"] for f in m["files"][1:])
        yield {"data": data, "source": m["source"], "licence": m["licence"], "validation_tokens":
               m["files"][0]["tokens"], "training_tokens": train_tokens}
    elif not ctx.dry:
        raise Skip("no --data folder (scripts/lease_data.py --out DIR makes it; the lease carries it)")
    probe = muon_share(ctx, 2 if ctx.dry else 5)
    yield {"muon_share": probe}
    step_s = max(sum(p["phase_ms"].values()) for p in probe.values()) / 1e3
    left = budget - (time.perf_counter() - t_start)
    # both runs in what is left: each ~40% of it (start-up, validation and the model's loading take the rest)
    steps = 8 if ctx.dry else max(20, int(0.40 * left / (step_s * 1.15)) // 10 * 10)
    val_every = max(1, steps // 10)
    per_step = s["learn_B"] * s["learn_T"]
    yield {"plan": {"steps": steps, "val_every": val_every, "tokens_per_step": per_step,
                    "probe_step_s": round(step_s, 4), "budget_left_s": round(left, 1),
                    "passes_over_the_data": round(steps * per_step / train_tokens, 2) if train_tokens else None}}
    curves = {}
    for recipe in ("gpt2", "modern"):
        out = Path(ctx.work) / f"learn_{recipe}"
        log_path = Path(ctx.work) / f"learn_{recipe}.log"
        with open(log_path, "w") as log:  # a file, not a pipe: a line a step would fill a pipe nobody reads
            proc = subprocess.Popen(_learn_cmd(ctx, recipe, data, out, steps, val_every), stdout=log,
                                    stderr=subprocess.STDOUT)
        seen = 0
        while True:
            done = proc.poll() is not None
            recs, _ = val_records(out / "metrics.jsonl")
            for r in recs[seen:]:
                yield {"recipe": recipe, **r}
            seen = len(recs)
            if done:
                break
            time.sleep(0.5)
        if proc.returncode != 0:
            raise RuntimeError(f"gpt2core-train --recipe {recipe} exited with {proc.returncode}: "
                               f"{log_path.read_text(errors='replace')[-1500:]}")
        curves[recipe] = val_records(out / "metrics.jsonl")[0]
    target = curves["gpt2"][-1]["val_loss"]
    res = {"target_val_loss": target, "gpt2_tokens": curves["gpt2"][-1]["tokens"],
           "gpt2_train_seconds": curves["gpt2"][-1]["train_seconds"]}
    for key in ("tokens", "train_seconds"):
        got = reach(curves["modern"], target, key)
        res[f"modern_{key}"] = got
        res[f"{key}_ratio"] = None if got is None else round(got / res[f"gpt2_{key}"], 4)
    res["goal"] = "modern reaches gpt2's final val loss in <= 0.5x its tokens and <= 0.6x its seconds"
    res["goal_met"] = (res["tokens_ratio"] is not None and res["tokens_ratio"] <= 0.5
                       and res["train_seconds_ratio"] <= 0.6)
    yield {"result": res}
    if ctx.device == "cuda" and not ctx.dry:
        yield {"paper_model": paper_model(ctx, ["--attention", "cudnn", "-B", str(s["learn_B"]), "-T",
                                                str(s["learn_T"])], max(1.0, budget - (time.perf_counter() - t_start)
                                                                        - 5))}


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


def _free_port() -> int:
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        return sk.getsockname()[1]


def step_serve(budget: float, ctx: Ctx):
    """gpt2core-serve on this device, d12 (bf16 weights on a GPU), continuous batching at 1, 8, 32 and 64 concurrent
    streams: tokens/s and time to first token p50 / p95, against GPT2.generate's tokens/s at the same batch (the
    scheduler's cost); beside scripts/gpu_model.py --decode's modelled decode rate."""
    import httpx  # noqa: F401  (the clients; fails here, not in a thread)
    from gpt2core import GPT2, PRESETS
    s = shapes(ctx)
    cfg = PRESETS[s["preset"]]
    weights = "bf16" if ctx.device == "cuda" else "fp32"
    model_file = Path(ctx.work) / "serve_model.bin"
    GPT2(cfg, device="cpu", seed=0).save(model_file)
    port, slots = _free_port(), max(s["serve_streams"])
    cmd = gpt2core_cmd(ctx, "gpt2core.serve", "--model", model_file, "--port", port, "--device", ctx.device,
                       "--max-batch", slots, "--weights", weights, "--max-queue", 1000)
    log = open(Path(ctx.work) / "serve.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    rng = np.random.default_rng(0)
    P, new = s["serve_prompt"], s["serve_new"]
    served = {}
    try:
        from ..inference.serve import wait_ready
        wait_ready(url, proc, min(300, budget / 2))
        _round(url, [rng.integers(0, 50257, P).tolist()], new)  # warm-up
        for n in s["serve_streams"]:
            outs, wall = _round(url, [rng.integers(0, 50257, P).tolist() for _ in range(n)], new)
            ttft = [o["ttft"] for o in outs]
            served[n] = sum(o["tokens"] for o in outs) / wall
            yield {"streams": n, "tokens_per_s": round(served[n], 1),
                   "ttft_p50_ms": round(1e3 * float(np.median(ttft)), 2),
                   "ttft_p95_ms": round(1e3 * float(np.percentile(ttft, 95)), 2), "weights": weights}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    from gpt2core.model import load_model
    m = load_model(model_file, device=ctx.device, inference_weights=weights)
    for n in s["serve_streams"]:
        idx = rng.integers(0, 50257, (n, P)).astype(np.int32)
        m.generate(idx[:, :P], 2, top_k=1)  # warm-up
        t0 = time.perf_counter()
        gen = np.asarray(m.generate(idx, new, top_k=1))[:, P:]
        dt = time.perf_counter() - t0
        # tokens made: up to and with a row's first <|endoftext|> (the rest is padding), as the server counts them
        made = sum(int(np.argmax(r == 50256)) + 1 if (r == 50256).any() else len(r) for r in gen)
        # the goal (issue 48): the server at 64 streams >= 0.7x generate's tokens/s at batch 64
        yield {"generate_batch": n, "tokens_per_s": round(made / dt, 1),
               "served_over_generate": round(served[n] / (made / dt), 4)}
    if ctx.device == "cuda" and not ctx.dry:
        yield {"paper_model": paper_model(ctx, ["--decode"], 60)}



def _round(url: str, prompts: list, new: int) -> tuple[list[dict], float]:
    """One streamed greedy completion per prompt, all sent at the same moment: per request the time to the first
    chunk with text and the tokens made; the round's wall time."""
    import threading

    import httpx
    outs = [{} for _ in prompts]
    clients = [httpx.Client(timeout=600) for _ in prompts]
    ready = threading.Barrier(len(prompts) + 1)

    def go(i):
        ready.wait()
        t0 = time.monotonic()
        body = {"prompt": prompts[i], "max_tokens": new, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        try:
            with clients[i].stream("POST", url + "/v1/completions", json=body) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    ev = json.loads(line[6:])
                    if ev.get("usage"):
                        outs[i]["tokens"] = ev["usage"]["completion_tokens"]
                    if any(ch.get("text") for ch in ev.get("choices") or []):
                        outs[i].setdefault("ttft", time.monotonic() - t0)
        except Exception as e:  # noqa: BLE001 - raised below, from the step's thread
            outs[i]["error"] = f"{type(e).__name__}: {e}"

    ts = [threading.Thread(target=go, args=(i,)) for i in range(len(prompts))]
    for t in ts:
        t.start()
    ready.wait()
    t0 = time.monotonic()
    for t in ts:
        t.join()
    wall = time.monotonic() - t0
    for c in clients:
        c.close()
    bad = [o for o in outs if "error" in o or "ttft" not in o]
    if bad:
        raise RuntimeError(f"{len(bad)} of {len(outs)} streamed requests failed: {bad[0]}")
    return outs, wall


DP_RANK = """
import json, os, sys
import numpy as np
from gpt2core import GPT2, GPT2Config
from gpt2core.distributed import DataParallel, setup
out, device, config, B, T, zero, offload, world = sys.argv[1:9]
B, T, zero, offload, world = int(B), int(T), int(zero), offload == "1", int(world)
rank = 0
comm = None
if world > 1:
    env, comm, _ = setup("cpu", timeout=120)  # Gloo between the ranks (NCCL refuses two ranks on one GPU)
    rank = env.rank
cfg = GPT2Config(**json.loads(config))
m = GPT2(cfg, device=device, seed=7)
if offload:
    m.offload = True
model = DataParallel(m, comm, zero=zero, grad_accum=1 if world > 1 else 2) if comm is not None else m
rng = np.random.default_rng(100)
losses = []
for step in range(3):
    model.zero_grad()
    xs = [rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32) for _ in range(2)]
    if world > 1:
        model.forward_backward(xs[rank], xs[rank], grad_scale=1.0)
    else:
        for x in xs:
            m.forward_backward(x, x, grad_scale=0.5)
    losses.append(float(model.take_loss()))
    model.step(lr=1e-3, grad_clip=1.0)
np.save(out + f".rank{rank}.npy", m.flat_params())
if rank == 0:
    json.dump(losses, open(out + ".json", "w"))
"""


def step_dp(budget: float, ctx: Ctx):
    """Two ranks over Gloo (on one GPU: NCCL refuses two ranks on one device) at ZeRO 0, 1, 2 and with optimizer
    offload, against one process with two micro-steps, against ZeRO 0 and (offload) against the same stage without
    it: the same weights bit for bit, or how far apart (the CPU's tests find ZeRO and one process equal to fp32
    rounding: the gradients are summed in another order; offload = no offload bit for bit). Then NCCL with one
    rank and every collective the trainer calls (allreduce, reduce_scatter, all_gather, broadcast, barrier, and a
    DataParallel step at ZeRO 0/1/2) run once on real streams."""
    from gpt2core import _C
    from gpt2core.distributed.launch import free_port
    if not _C.dist.have_gloo():
        raise Skip("this build has no Gloo")
    s = shapes(ctx)
    work = Path(ctx.work)
    script = work / "dp_rank.py"
    script.write_text(DP_RANK)
    common = [ctx.device, json.dumps(asdict(random_token_config(ctx))), s["dp_B"], s["dp_T"]]

    def run(name, zero, offload, world):
        out = str(work / name)
        port = free_port()
        procs = []
        for r in range(world):
            env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
            procs.append(subprocess.Popen([*ctx.python, str(script), out, *map(str, common), str(zero),
                                           "1" if offload else "0", str(world)], env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
        logs = [p.communicate(timeout=max(30, budget / 3))[0] for p in procs]
        if any(p.returncode != 0 for p in procs):
            raise RuntimeError(f"dp run {name} failed: {logs[0][-1500:]} {logs[-1][-1500:]}")
        return [np.load(out + f".rank{r}.npy") for r in range(world)], json.load(open(out + ".json"))

    (ref,), ref_losses = run("one", 0, False, 1)
    yield {"run": "one process, two micro-steps", "losses": ref_losses}
    offloads = (False, True) if ctx.device == "cuda" else (False,)
    zero0 = None
    for zero in (0, 1, 2):
        on_device = None
        for off in offloads:
            (p, p1), losses = run(f"z{zero}{'_off' if off else ''}", zero, off, 2)
            zero0 = p if zero0 is None else zero0
            row = {"run": f"2 ranks over Gloo, ZeRO {zero}" + (", offload" if off else ""), "losses": losses,
                   "replicas_bit_identical": bool(np.array_equal(p, p1)),
                   "same_bits_as_zero0": bool(np.array_equal(p, zero0)),
                   "same_bits_as_one_process": bool(np.array_equal(p, ref)),
                   "max_abs_diff_to_one_process": float(np.max(np.abs(p - ref)))}
            if off:  # the optimizer on the host: the same bits as this ZeRO stage on the device
                row["same_bits_as_without_offload"] = bool(np.array_equal(p, on_device))
            on_device = p
            yield row
    if ctx.device != "cuda" or not _C.dist.have_nccl():
        yield {"nccl": "skipped: " + ("--device cpu" if ctx.device != "cuda" else "this build has no NCCL")}
        return
    yield {"nccl": _nccl_one_rank(s, random_token_config(ctx))}


def _nccl_one_rank(s: dict, cfg) -> dict:
    from gpt2core import GPT2, _C
    from gpt2core.distributed import DataParallel
    from gpt2core.distributed.launch import free_port
    t0 = time.perf_counter()
    comm = _C.dist.init_nccl(0, 1, "127.0.0.1", free_port(), timeout=60.0, device=0)
    m = GPT2(cfg, device="cuda", seed=0)
    comm.use_stream_of(m._m)
    g = m.flat_grads()
    done = {}
    g[...] = 1.0
    comm.allreduce(g, "sum")
    done["allreduce"] = bool(np.all(g == 1.0))
    comm.reduce_scatter(g, "sum")
    comm.all_gather(g)
    done["reduce_scatter+all_gather"] = bool(np.all(g == 1.0))
    comm.broadcast(g, 0)
    comm.barrier()
    done["broadcast+barrier"] = True
    x = random_batch(cfg.vocab_size, 2, s["dp_T"])
    for zero in (0, 1, 2):
        mz = GPT2(cfg, device="cuda", seed=0)
        dp = DataParallel(mz, comm, zero=zero)
        dp.zero_grad()
        dp.forward_backward(x, x)
        loss = dp.take_loss()
        dp.step(lr=1e-4)
        done[f"DataParallel zero={zero}"] = bool(np.isfinite(loss))
        del dp, mz
    return {"collectives": done, "seconds": round(time.perf_counter() - t0, 2)}


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


def step_gemm(budget: float, ctx: Ctx):
    """cuBLASLt GEMM timings for GPT-2 124M's shapes (scripts/bench.py --profile)."""
    need_gpu(ctx, "cuBLASLt timings")
    yield from _bench(ctx, budget, "--profile")


@dataclass(frozen=True)
class Step:
    name: str
    what: str
    bound: float      # seconds on a real lease
    dry_bound: float  # seconds at tiny shapes (CPU or the emulated device)


# the value order: what a user asks first comes first (issue 48). The first four's bounds (the doctor, the GPU tests,
# learn sized to its bound, the d12 step) add up to 530 s: one 10-minute lease with a minute for the install
# (--budget 540); the next lease continues with scale
STEPS = [
    Step("doctor", "build, libraries, correctness on every device", 90, 120),
    Step("gpu_tests", "the GPU test suite against the CPU backend", 150, 120),
    Step("learn", "d12 T=1024: --recipe modern against gpt2 to gpt2's final val loss, tokens and seconds", 200, 300),
    Step("d12_step", "d12 B=64 T=1024 step time, cuDNN and flash attention, against the paper model", 90, 120),
    Step("scale", "d24/d36/d48 bf16 at the largest batch per recompute level: tokens/s, MFU, phases", 420, 240),
    Step("serve", "gpt2core-serve at 1/8/32/64 streams against generate at the same batch", 240, 180),
    Step("dp", "2 ranks over Gloo (ZeRO 0/1/2, offload) bit for bit; NCCL's collectives on one rank", 240, 240),
    Step("fp16", "d12 fp16 with dynamic loss scaling, 50 steps against bf16", 120, 120),
    Step("fp8", "FP8 against bf16: d12/d24/d48 tokens/s at one batch, d24's loss on the carried tokens", 360, 240),
    Step("eval", "HellaSwag's 10,042 items (and a CORE bundle) on this device: items/s", 240, 120),
    Step("resume", "a run killed with SIGKILL after a checkpoint resumes bit-exactly", 180, 180),
    Step("bitwise", "two identical bf16 runs bit for bit", 120, 120),
    Step("bgradb", "was the bias-gradient GEMM epilogue accepted", 60, 120),
    Step("ladder", "the speed ladder at d12", 300, 120),
    Step("vs_cpu", "20 steps of d12 against the CPU reference", 120, 120),
    Step("gemm", "GEMM timings by shape", 120, 120),
]
FUNCS = {s.name: globals()[f"step_{s.name}"] for s in STEPS}
SKIPPED_EXIT = 3  # the exit status of a step that raised Skip


def run_step(name: str, rows_path: Path, budget: float, ctx: Ctx, funcs: dict | None = None) -> int:
    """One step in this process (funcs: the step functions by name, default FUNCS): each row appended to
    rows_path as one JSON line as soon as it is made."""
    with open(rows_path, "a") as f:
        def put(row):
            f.write(json.dumps(row, default=_jsonable) + "\n")
            f.flush()
        try:
            for row in (funcs or FUNCS)[name](budget, ctx):
                put(row)
        except Skip as e:
            put({"skipped": str(e)})
            return SKIPPED_EXIT
    return 0


def _jsonable(o):
    if isinstance(o, bytes):
        return o.hex()
    if isinstance(o, (np.integer, np.floating, np.bool_)):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    return str(o)


def ctx_to_json(ctx: Ctx) -> str:
    return json.dumps(asdict(ctx))


def main(argv: list[str], funcs: dict | None = None) -> int:
    """The step process: NAME ROWS BUDGET CTX_JSON (the driver's command line for it)."""
    name, rows, budget, ctx_json = argv[:4]
    return run_step(name, Path(rows), float(budget), Ctx(**json.loads(ctx_json)), funcs)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
