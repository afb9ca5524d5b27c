"""The learn step: how far --recipe modern gets on the carried tokens against --recipe gpt2 (the tokens and the
training seconds to reach gpt2's final validation loss), with the helpers that check the carried shards and read
the curves."""
from __future__ import annotations

import hashlib
import json
import subprocess
import time
from pathlib import Path

from .common import Ctx, Skip, gpt2core_cmd, paper_model, random_batch, shapes, time_steps, val_records


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
    """The optimizer step's share of a training step for both recipes at learn's shape (the Muon step's cost), and
    each recipe's time per token with its own tokens per optimizer step (TrainConfig.tokens_per_step: k
    micro-batches of forward + backward, then one optimizer step): ms_per_1k_tokens, and under "ratio" the modern
    recipe's over the GPT-2 recipe's (issue 51's GPU goal: <= 1.10 at d12 B=64 T=1024)."""
    from gpt2core import GPT2
    from gpt2core.training import train
    s = shapes(ctx)
    out = {}
    micro = s["learn_B"] * s["learn_T"]
    for recipe in ("gpt2", "modern"):
        cfg = train.parse_args(["--recipe", recipe, "--preset", s["preset"], "-B", str(s["learn_B"]), "-T",
                                str(s["learn_T"]), "--steps", "100"])
        m = GPT2(cfg.model_config(), device=ctx.device, seed=0)
        kw = train.step_kwargs(cfg, 10)
        ms = time_steps(m, random_batch(m.config.vocab_size, s["learn_B"], s["learn_T"]), steps, kw)
        k = cfg.tokens_per_step(m.config, micro) // micro
        own = (k * (ms["forward"] + ms["backward"]) + ms["optimizer"]) / (k * micro) * 1e3
        out[recipe] = {"optimizer": cfg.optimizer, "phase_ms": {k: round(v, 3) for k, v in ms.items()},
                       "optimizer_share": round(ms["optimizer"] / sum(ms.values()), 4),
                       "micro_batches_per_step": k, "ms_per_1k_tokens": round(own, 4)}
        del m
    out["ratio"] = round(out["modern"]["ms_per_1k_tokens"] / out["gpt2"]["ms_per_1k_tokens"], 4)
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
    step_s = max(sum(p["phase_ms"].values()) for r, p in probe.items() if r != "ratio") / 1e3
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
