"""Benchmark training steps: ms/step, tokens/s, achieved GFLOP/s and utilisation (MFU).

    python scripts/bench.py --preset d12 -B 4 -T 64 --threads 2            # CPU backend
    python scripts/bench.py --preset d12 -B 64 -T 1024 --device cuda       # GPU (CUDA backend)
    python scripts/bench.py --preset d12 -B 64 -T 1024 --device cuda --nproc 8 --scaling \
        --total-batch-tokens 524288                                          # data parallel, vs 1 GPU

Data parallel (--nproc N): N processes started through gpt2core.launch (Gloo on the CPU, NCCL with each
process on GPU LOCAL_RANK), each on its own random micro-batch of B x T, with gradient accumulation up to
--total-batch-tokens (default B*T*N). Rank 0 prints ms/step (slowest rank), total tokens/s and per process,
the time rank 0 waited for gradient collectives (DataParallel.last_comm_ms) and utilisation per device.
--scaling also runs 1 process with the same preset, B, T and threads per process, and prints the scaling
efficiency = tokens/s with N / (N x tokens/s with 1). `torchrun --nproc_per_node N scripts/bench.py ...` works too.

--compare-native measures this install's CPU core (portable: instruction-set variants picked at run time, what
a wheel ships) against a -march=native build of the same sources (built into build/native-cpu, incremental),
in alternating rounds of child processes so that both see the same machine load:
    python scripts/bench.py --preset d12 -B 4 -T 64 --compare-native

FLOPs per token are 6*N + 6*L*C*T (forward + backward, N = parameters less wpe). The CPU peak is
measured: the best of 3 products of two 2048 x 2048 fp32 matrices through the core's GEMM (the BLAS and
thread split the model's matmuls use), once per CPU model, thread count and BLAS, then read from
$XDG_CACHE_HOME/gpt2core/cpu_peak.json (~/.cache/gpt2core/...); --measure-peak measures again,
--peak-gflops overrides it. GPU peaks are the dense bf16 / fp16 / tf32 tensor-core figures.

--sft times supervised fine-tuning steps (conversation rows packed by gpt2core.data.sft, the targets outside the
assistant's turns ignored, each batch read through its loader) against pre-training steps (random tokens) at the same
preset, B and T, in alternating rounds (--rounds) so that both see the same machine load:
    python scripts/bench.py --sft --preset s4 -B 4 -T 256 --threads 2 --rounds 3

--serve benchmarks the completions server under concurrent streaming clients, beside llama.cpp's llama-server
(scripts/bench_serve.py):
    python scripts/bench.py --serve --preset d12 --threads 2 --clients 1 4 8 16 --llama-server PATH

--generate benchmarks KV-cache generation instead (scripts/bench_generate.py: prefill ms, decode tokens/s, the
weight-streaming bound, Hugging Face transformers and llama.cpp side by side when installed, greedy ids compared):
    python scripts/bench.py --generate --preset d12 --threads 2 --prompts 8 200 --batches 1

--eval benchmarks scoring instead (scripts/bench_eval.py: CORE items/s, lm-eval with --model gpt2core, and lm-eval's
--model hf on the HF export when torch and transformers are installed, with the ratio):
    python scripts/bench.py --eval --preset d12 --threads 2 --eval-items 64
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from gpt2core import cli
from gpt2core.perf import GPU_PEAK_TFLOPS, gpu_peak_tflops


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@functools.lru_cache(maxsize=None)
def cpu_peak_gflops(threads: int, measure: bool = False, n: int = 2048) -> tuple[float, str]:
    """(fp32 GFLOP/s, where it comes from): the best of 3 (n, n) @ (n, n) products through _C.matmul, the
    core's GEMM, measured once per CPU model, thread count and BLAS and cached in the user's cache directory
    (measure=True: measure again)."""
    from gpt2core import _C, build_info

    blas = build_info()["blas"]
    how = f"sgemm {n}^3 through {blas} on {threads} thread{'s' * (threads > 1)}"
    path = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gpt2core" / "cpu_peak.json"
    key = f"{cpu_name()} | {how}"
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    if key in cache and not measure:
        return cache[key]["gflops"], f"cached: {how}, measured {cache[key]['date']}; {path}, --measure-peak to redo"
    a, b = np.random.default_rng(0).standard_normal((2, n, n), dtype=np.float32)
    seconds = []
    for _ in range(3):
        t0 = time.perf_counter()
        _C.matmul(a, b)
        seconds.append(time.perf_counter() - t0)
    gflops = round(2 * n**3 / min(seconds) / 1e9, 1)
    cache[key] = {"gflops": gflops, "date": time.strftime("%Y-%m-%d %H:%M")}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(cache, indent=1))
    os.replace(tmp, path)    # atomic: a concurrent bench reads the old file or the new one
    return gflops, f"measured: {how}; cached in {path}"


def build_parser() -> argparse.ArgumentParser:
    ap = cli.ArgumentParser(prog="scripts/bench.py", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="d12")
    ap.add_argument("--padded-vocab-size", type=cli.positive_int, default=None,
                    help="override the padded vocab (50257: no padding, the 'vocab padded to 50304' rung off)")
    ap.add_argument("-B", "--batch-size", type=cli.positive_int, default=4, help="micro-batch per process")
    ap.add_argument("-T", "--seq-len", type=cli.positive_int, default=64)
    ap.add_argument("--device", type=cli.device, default="cpu", help="cpu, cuda or cuda:N")
    ap.add_argument("--steps", type=cli.positive_int, default=5, help="timed steps")
    ap.add_argument("--warmup", type=cli.non_negative_int, default=2, help="untimed steps first")
    ap.add_argument("--threads", type=cli.positive_int, default=None,
                    help="threads per process (default: all cores; with --nproc N, cores / N)")
    ap.add_argument("--peak-gflops", type=cli.positive_float, default=None, help="override the peak used for utilisation")
    ap.add_argument("--measure-peak", action="store_true",
                    help="CPU: measure the sgemm peak again instead of reading the cached figure")
    ap.add_argument("--breakdown", action="store_true", help="also time forward / backward / optimizer")
    ap.add_argument("--precision", choices=["fp32", "tf32", "bf16", "fp16", "fp8"], default=None,
                    help="fp32, tf32, bf16 or fp16 mixed precision (CUDA); fp8: bf16 with the blocks' Linear layers in "
                         "FP8 (sm_89 / sm_90); default bf16 on sm_80+, fp16 on sm_70 / sm_75, else fp32")
    ap.add_argument("--fp8-head", action="store_true", help="--precision fp8: the head in FP8 too")
    ap.add_argument("--attention", choices=["auto", "flash", "cudnn", "naive"], default=None, help="CUDA attention kernel")
    ap.add_argument("--no-fused", action="store_true",
                    help="CUDA: separate residual + layernorm and matmul + GELU kernels (the unfused rung)")
    ap.add_argument("--matmul-tuning", action="store_true",
                    help="CUDA: time cuBLASLt's candidate algorithms once per shape (the ladder's last rung)")
    ap.add_argument("--no-deterministic", action="store_true",
                    help="CUDA: let cuDNN's attention backward accumulate with atomics (GPT2(deterministic=False))")
    ap.add_argument("--recompute", choices=["none", "gelu", "layer"], default="none",
                    help="what backward recomputes: gelu (one MLP activation buffer), layer (each block's forward "
                         "again just before its backward)")
    ap.add_argument("--recompute-gelu", action="store_true", help="--recompute gelu")
    ap.add_argument("--model", metavar="GPU", default=None,
                    help="print the roofline model (scripts/gpu_model.py, MODELLED figures) of this GPU (H100, A100, "
                         "L4, T4, RTX4090) for the preset, B and T, instead of running")
    ap.add_argument("--recipe", nargs="+", choices=["gpt2", "modern"], default=["gpt2"],
                    help="training recipe(s) (gpt2core-train --recipe): each one's architecture, optimizer and "
                         "tokens per optimizer step; two or more are timed in alternating --rounds and compared per "
                         "token (the last against the first)")
    ap.add_argument("--profile", action="store_true",
                    help="per-op profile of one training step: forward, loss, backward and optimizer split by op "
                         "(GPT2's core timing each op between two synchronisations), per --recipe side by side; "
                         "CUDA: also the measured step beside the roofline model's (gpu_model.py)")
    ap.add_argument("--newton-schulz", action="store_true",
                    help="time Muon's Newton-Schulz alone over the preset's Muon matrices (one optimizer step's, at "
                         "--muon-ns-steps): the unbatched op (each matrix's GEMMs split over the threads), the batched "
                         "op in fp32 and in bf16, alternating --rounds rounds")
    ap.add_argument("--muon-ns-steps", type=cli.non_negative_int, default=5, help="--newton-schulz: iterations")
    ap.add_argument("--ladder", action="store_true",
                    help="run every rung of the speed ladder (baseline, tf32, bf16, fusion, flash attention, padded "
                         "vocab, CUDA graphs) one after another and print them side by side")
    ap.add_argument("--plot", nargs="?", const="ladder.png", default=None, metavar="PNG",
                    help="with --ladder: also draw it as a bar chart of ms/step and speed-up (default: ladder.png; "
                         "needs matplotlib)")
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="replay each micro-step and the optimizer step from CUDA graphs (--breakdown then times "
                         "forward and backward together)")
    ap.add_argument("--sft", action="store_true",
                    help="time SFT steps (packed conversation rows, masked targets) against pre-training steps at the "
                         "same shape, alternating --rounds rounds")
    ap.add_argument("--sft-data", metavar="JSONL", default=None,
                    help="--sft: conversations to pack (default: random ones, 4 to T/8 tokens per turn)")
    gen = ap.add_argument_group("generation (KV cache; scripts/bench_generate.py)")
    gen.add_argument("--generate", action="store_true",
                     help="prefill ms and decode tokens/s for each prompt length and batch, the weight-streaming "
                          "bound, and Hugging Face transformers side by side when installed")
    gen.add_argument("--prompts", type=int, nargs="+", default=[8, 512], help="--generate: prompt lengths")
    gen.add_argument("--batches", type=int, nargs="+", default=[1, 8], help="--generate: batch sizes")
    gen.add_argument("--new-tokens", type=int, default=32,
                     help="--generate: decode steps timed; --serve: new tokens per request")
    gen.add_argument("--weights", nargs="+", choices=["fp32", "bf16", "fp16", "int8"], default=["fp32", "bf16"],
                     help="--generate: the weights decode reads (16-bit: widened to fp32 in registers), each measured")
    gen.add_argument("--load", metavar="PATH", default=None,
                     help="--generate: measure this model (any file load_model reads) instead of the preset's random "
                          "weights, e.g. a trained one, where greedy ids of the engines are best compared")
    gen.add_argument("--llama-types", nargs="+", choices=["f32", "f16", "q8_0"], default=["f32", "f16", "q8_0"],
                     help="--generate: llama.cpp GGUF weights converted and measured when llama-cpp-python is installed")
    gen.add_argument("--llama-cpp-dir", metavar="DIR", default=None,
                     help="--generate: a llama.cpp source folder whose convert_hf_to_gguf.py converts the model "
                          "(default: the one in the installed llama-cpp-python's sdist, fetched once into "
                          "~/.cache/gpt2core/bench)")
    ev = ap.add_argument_group("evaluation speed (CORE, lm-eval; scripts/bench_eval.py)")
    ev.add_argument("--eval", action="store_true",
                    help="benchmark CORE's and lm-eval's scoring instead, beside lm-eval's hf model when installed")
    ev.add_argument("--eval-items", type=cli.positive_int, default=64, help="--eval: HellaSwag items scored")
    ev.add_argument("--eval-data", default=None, metavar="PATH",
                    help="--eval: HellaSwag jsonl / 6-line txt (default: tests/data/hellaswag_val_120.jsonl)")
    ev.add_argument("--eval-batch-tokens", type=cli.positive_int, default=4096, help="--eval: positions per forward")
    ev.add_argument("--eval-hf-batch", type=cli.positive_int, default=16, help="--eval: lm-eval hf batch size")
    ev.add_argument("--eval-harness", choices=["lm-eval", "none"], default="lm-eval",
                    help="--eval: none measures CORE alone")
    sv = ap.add_argument_group("serving (gpt2core-serve vs llama-server; scripts/bench_serve.py)")
    sv.add_argument("--serve", action="store_true",
                    help="generated tokens/s and time to first token at --clients concurrent streaming clients, and "
                         "the head-of-line case, for gpt2core-serve and llama-server (--llama-server) side by side")
    sv.add_argument("--clients", type=cli.positive_int, nargs="+", default=[1, 4, 8, 16],
                    help="--serve: concurrent clients per round")
    sv.add_argument("--serve-weights", nargs="+", choices=["fp32", "bf16", "fp16", "int8"], default=["fp32", "int8"],
                    help="--serve: gpt2core-serve --weights, each measured (llama-server: F32 beside fp32, Q8_0 "
                         "beside int8)")
    sv.add_argument("--serve-prompt", type=cli.positive_int, default=32, help="--serve: prompt tokens per request")
    sv.add_argument("--llama-server", metavar="PATH", default=None,
                    help="--serve: a llama-server binary (built from the llama.cpp sources llama-cpp-python's sdist "
                         "vendors) to measure on the same weights")
    c = ap.add_argument_group("portable vs native CPU code")
    c.add_argument("--compare-native", action="store_true",
                   help="time this install against a -march=native build of the CPU core, alternating rounds")
    c.add_argument("--rounds", type=cli.positive_int, default=3, help="--compare-native: rounds of (portable, native); --sft: of (pre-training, sft)")
    c.add_argument("--native-module", default=None,
                   help="--compare-native: an already built native _C module instead of building build/native-cpu")
    g = ap.add_argument_group("data parallel (processes started through gpt2core.launch; Gloo on CPU, NCCL on CUDA)")
    g.add_argument("--nproc", type=cli.positive_int, default=1, help="processes (one per GPU with --device cuda)")
    g.add_argument("--scaling", action="store_true",
                   help="also run 1 process with the same per-process settings and print the scaling efficiency")
    g.add_argument("--total-batch-tokens", type=cli.positive_int, default=None,
                   help="tokens per optimizer step; gradient accumulation makes up the rest (default B*T*processes)")
    g.add_argument("--zero", type=int, choices=[0, 1, 2], default=0,
                   help="1: ZeRO-1 (sharded AdamW state); 2: ZeRO-2 (gradients sharded too)")
    g.add_argument("--offload", action="store_true",
                   help="--offload optimizer: master weights and AdamW moments in pinned host memory, AdamW on the "
                        "host (CUDA; with ZeRO each rank offloads its shard)")
    g.add_argument("--no-prefetch", action="store_true",
                   help="--offload in one process: copy the gradients to the host at the step, not during the last "
                        "micro-step's backward (GPT2.prefetch_grads)")
    g.add_argument("--no-overlap-comm", action="store_true", help="one gradient allreduce after backward")
    g.add_argument("--dist-timeout", type=cli.seconds, default=300.0, help="seconds a collective waits for the others")
    g.add_argument("--result-json", default=None, help=argparse.SUPPRESS)  # rank 0 writes its figures here
    return ap


def timed_steps(model, ddp, rng, vocab, B, T, accum, warmup, steps, next_batch=None, prefetch=False, step_kw=None):
    """Run warmup + steps optimizer steps of `accum` micro-steps each on random tokens (or each on next_batch()'s
    (x, y), read inside the timed step); returns the timed steps' wall times and their forward / backward /
    optimizer parts (seconds) and comm times (ms). prefetch: an offloaded model copies the last micro-step's
    gradients to the host during its backward (as gpt2core-train does in one process). step_kw: the keywords of
    GPT2.step (a recipe's optimizer; default AdamW at lr 1e-4)."""
    x = rng.integers(0, vocab, size=(B, T), dtype=np.int32)
    y = rng.integers(0, vocab, size=(B, T), dtype=np.int32)
    parts = {"fwd": [], "bwd": [], "opt": []}
    times, comm = [], []
    net = ddp or model  # the same methods: DataParallel averages the gradients during the last backward
    for i in range(warmup + steps):
        fwd = bwd = 0.0
        t0 = time.perf_counter()
        net.zero_grad()
        for micro in range(accum):
            ta = time.perf_counter()
            if next_batch is not None:
                x, y = next_batch()
            if prefetch and micro == accum - 1:
                model.prefetch_grads()
            if model.cuda_graphs:  # one graph launch for forward and backward: no split to time
                net.forward_backward(x, y, 1.0 / accum)
                tb = ta
            else:
                net.forward(x, y)
                tb = time.perf_counter()
                net.backward(1.0 / accum)
            fwd, bwd = fwd + tb - ta, bwd + time.perf_counter() - tb
        t2 = time.perf_counter()
        net.step(**(step_kw or {"lr": 1e-4}))
        if model.cuda_graphs:
            model.take_loss()  # as the training loop does once per step
        t3 = time.perf_counter()
        if i >= warmup:
            times.append(t3 - t0)
            parts["fwd"].append(fwd); parts["bwd"].append(bwd); parts["opt"].append(t3 - t2)
            comm.append(ddp.last_comm_ms if ddp else 0.0)
    if model.cuda_graphs:  # forward and backward are one graph launch: report them together
        parts = {"fwd+bwd": [f + b for f, b in zip(parts["fwd"], parts["bwd"])], "opt": parts["opt"]}
    return times, parts, comm


def peak_gflops(args, device, precision, threads) -> tuple[float | None, str, str]:
    """(peak GFLOP/s or None if unknown, where it comes from, the device's name) for utilisation / MFU."""
    from gpt2core import _C

    if device == "cpu":
        peak, how = (args.peak_gflops, "given") if args.peak_gflops else cpu_peak_gflops(threads, args.measure_peak)
        return peak, how, "CPU"
    peak, how = args.peak_gflops, "given"
    name = _C.cuda_device_name(int(device.partition(":")[2] or 0))
    if not peak and (found := gpu_peak_tflops(name, precision)):
        peak, how = found[0] * 1e3, f"{found[1]} dense {precision}"
    return peak, how, name


def peak_line(args, device, gflops, precision, threads, what=""):
    """The utilisation line: the CPU's measured sgemm peak or the GPU's dense tensor-core peak (per process /
    device)."""
    peak, how, name = peak_gflops(args, device, precision, threads)
    if device == "cpu":
        return f"CPU fp32 peak {peak:.1f} GFLOP/s ({how}){what} | utilisation {100 * gflops / peak:.1f}%"
    if peak:
        return f"GPU {name} | MFU {100 * gflops / peak:.1f}% of {peak / 1e3:.1f} TFLOP/s ({how}){what}"
    return ("GPU peak table (dense TFLOP/s bf16 or fp16/tf32/fp32): " +
            ", ".join(f"{k} {v[0]:.0f}/{v[1]:.0f}/{v[2]:.0f}" for k, v in GPU_PEAK_TFLOPS.items()))


def bench_config(args):
    from gpt2core.config import get_preset

    cfg = get_preset(args.preset)
    return cfg.replace(padded_vocab_size=args.padded_vocab_size) if args.padded_vocab_size else cfg


def single(args):
    """One process, no communication: the original benchmark and its output."""
    from gpt2core import GPT2, _C, build_info

    if args.threads:
        _C.set_num_threads(args.threads)
    threads = _C.get_num_threads()
    cfg = bench_config(args)
    model = GPT2(cfg, device=args.device, seed=0, precision=args.precision, attention=args.attention,
                 fused=not args.no_fused, matmul_tuning=args.matmul_tuning, deterministic=not args.no_deterministic,
                 fp8_head=args.fp8_head)
    model.recompute = "gelu" if args.recompute_gelu else args.recompute
    model.offload = args.offload
    model.cuda_graphs = args.cuda_graphs
    B, T = args.batch_size, args.seq_len
    total = args.total_batch_tokens or B * T
    if total % (B * T):
        raise SystemExit(f"bench: --total-batch-tokens {total} is not a multiple of B*T = {B * T}")
    accum = total // (B * T)
    times, parts, _ = timed_steps(model, None, np.random.default_rng(0), cfg.vocab_size, B, T, accum,
                                  args.warmup, args.steps, prefetch=args.offload and not args.no_prefetch)
    dt = float(np.median(times))
    tps = total / dt
    flops = cfg.flops_per_token(T)
    gflops = tps * flops / 1e9
    info = build_info()
    print(f"gpt2core {info['version']} | {args.device} | BLAS {info['blas']} | threads {threads} | "
          f"CPU code {info['cpu_isa']}")
    print(f"preset {args.preset} ({model.num_parameters:,} params) | precision {model.precision} | B={B} T={T} | "
          f"grad_accum {accum} | recompute {model.recompute} | offload {model.offload} | "
          f"{flops / 1e9:.3f} GFLOP/token")
    print(f"ms/step {dt * 1e3:.1f} (median of {args.steps}) | tokens/s {tps:,.0f} | GFLOP/s {gflops:.1f}")
    if args.breakdown:
        print(" | ".join(f"{k} {np.median(v) * 1e3:.1f} ms" for k, v in parts.items()))
    print(peak_line(args, args.device, gflops, model.precision, threads))
    if args.profile and args.device.startswith("cuda"):
        modelled_vs_measured(args, cfg, dt)
    return {"ms_per_step": dt * 1e3, "tok_per_s": tps, "gflops": gflops}


def recipe_setup(args, recipe: str):
    """(model config, GPT2.step keywords, tokens per optimizer step) of a --recipe as gpt2core-train runs it: the
    recipe's architecture on --preset, its optimizer at a step past every warm-up (the LR does not change the cost),
    and --total-batch-tokens, else the recipe's own tokens per step (TrainConfig.tokens_per_step: the modern
    recipe accumulates until Newton-Schulz is its --newton-schulz-share of the step's FLOPs), else B*T."""
    from gpt2core.config import TrainConfig
    from gpt2core.training.train import step_kwargs

    tc = TrainConfig.from_recipe(recipe, preset=args.preset, seq_len=args.seq_len)
    cfg = tc.model_config()
    if args.padded_vocab_size:
        cfg = cfg.replace(padded_vocab_size=args.padded_vocab_size)
    kw = step_kwargs(tc, max(tc.warmup, tc.muon_momentum_warmup))
    B, T = args.batch_size, args.seq_len
    total = args.total_batch_tokens or tc.tokens_per_step(cfg, B * T)
    if total % (B * T):
        raise cli.ArgError(f"--recipe {recipe}: {total} tokens per step is not a multiple of B*T = {B * T}")
    return cfg, kw, total


PHASES = ("forward", "loss", "backward", "optimizer")


def profile_table(runs: dict) -> list[str]:
    """The per-op table of --profile: one row per op (grouped by phase, in the order the ops first ran), per recipe
    its ms per optimizer step and share of the step, means over the timed steps; the phases' sums, what no op holds
    (Python, zero_grad, the batch's upload) and the step."""
    names = list(dict.fromkeys(n for r in runs.values() for n in r["ops"]))
    names.sort(key=lambda n: PHASES.index(n.split(".")[0]) if n.split(".")[0] in PHASES else len(PHASES))
    head = f"{'op (ms per optimizer step)':<40}" + "".join(f"{k:>18}" for k in runs)
    lines = [head, "-" * len(head)]

    def row(label, vals):
        cells = "".join(f"{'-':>18}" if v is None else f"{v:>10.2f} {100 * v / r['ms_per_step_mean']:>5.1f}%"
                        for v, r in zip(vals, runs.values()))
        return f"{label:<40}{cells}"

    for phase in PHASES:
        ops = [n for n in names if n.startswith(phase + ".")]
        lines += [row(n, [r["ops"].get(n) for r in runs.values()]) for n in ops]
        if ops:
            lines.append(row(f"  = {phase}", [sum(v for k, v in r["ops"].items() if k.startswith(phase + "."))
                                               for r in runs.values()]))
    lines.append(row("  in no op (Python, zero_grad, upload)",
                     [r["ms_per_step_mean"] - sum(r["ops"].values()) for r in runs.values()]))
    lines.append(row("  step (mean)", [r["ms_per_step_mean"] for r in runs.values()]))
    return lines


def recipes(args):
    """One process, one model per --recipe (each with its own architecture, optimizer and tokens per step), timed in
    --rounds alternating rounds so that all see the same machine load; with --profile, each op's ms per optimizer
    step. Prints each recipe's ms/step and tokens/s, and each later recipe's time per token against the first's."""
    from gpt2core import GPT2, _C, build_info

    if args.threads:
        _C.set_num_threads(args.threads)
    B, T = args.batch_size, args.seq_len
    models = {}
    for recipe in args.recipe:
        cfg, kw, total = recipe_setup(args, recipe)
        model = GPT2(cfg, device=args.device, seed=0, precision=args.precision, attention=args.attention,
                     fused=not args.no_fused, matmul_tuning=args.matmul_tuning,
                     deterministic=not args.no_deterministic)
        model.recompute = "gelu" if args.recompute_gelu else args.recompute
        timed_steps(model, None, np.random.default_rng(0), cfg.vocab_size, B, T, total // (B * T), args.warmup, 0,
                    step_kw=kw)
        model._m.profile = args.profile  # noqa: SLF001 (the core's per-op timers; clears them)
        models[recipe] = (model, cfg, kw, total)
    times = {r: [] for r in models}
    for _ in range(args.rounds):
        for recipe, (model, cfg, kw, total) in models.items():
            times[recipe] += timed_steps(model, None, np.random.default_rng(0), cfg.vocab_size, B, T,
                                         total // (B * T), 0, args.steps, step_kw=kw)[0]
    info = build_info()
    print(f"gpt2core {info['version']} | {args.device} | BLAS {info['blas']} | threads {_C.get_num_threads()} | "
          f"CPU code {info['cpu_isa']} | preset {args.preset} | B={B} T={T} | {args.rounds} rounds of {args.steps} "
          f"steps, recipes alternating")
    runs = {}
    for recipe, (model, cfg, kw, total) in models.items():
        dt = float(np.median(times[recipe]))
        n = len(times[recipe])
        ops = {name: 1e3 * sec / n for name, sec, _ in model._m.op_profile} if args.profile else {}  # noqa: SLF001
        runs[recipe] = {"ms_per_step": dt * 1e3, "ms_per_step_mean": 1e3 * float(np.mean(times[recipe])),
                        "tok_per_s": total / dt, "tokens_per_step": total,
                        "ms_per_ktok": 1e6 * dt / total, "ops": ops, "params": model.num_parameters}
        print(f"--recipe {recipe:<7} ({model.num_parameters:,} params, optimizer {kw.get('optimizer', 'adamw')}) | "
              f"{total} tokens per step (grad_accum {total // (B * T)}) | ms/step {dt * 1e3:.1f} (median of {n}) | "
              f"tokens/s {total / dt:,.0f} | ms per 1K tokens {1e6 * dt / total:.1f}")
    if args.profile:
        print("\n".join(profile_table(runs)))
    first = args.recipe[0]
    for recipe in args.recipe[1:]:
        ratio = runs[recipe]["ms_per_ktok"] / runs[first]["ms_per_ktok"]
        runs[recipe]["time_per_token_vs_first"] = ratio
        print(f"time per token, --recipe {recipe} / --recipe {first}: {ratio:.3f}x")
    return {"recipes": runs}


def muon_runs(cfg) -> list[tuple[int, int, int]]:
    """(matrices, rows, cols) of each run of same-shape Muon matrices of a config, as the core batches them: q, k, v of
    every layer (qkvw), attprojw's, fcw's and fcprojw's layers."""
    L, C = cfg.n_layer, cfg.n_embd
    return [(3 * L, C, C), (L, C, C), (L, 4 * C, C), (L, C, 4 * C)]


def newton_schulz_bench(args):
    """--newton-schulz: ms per optimizer step of Newton-Schulz over the preset's Muon matrices, three ways, in
    alternating rounds (the median of each), with the GFLOP/s of each (4 k^2 w + 2 k^3 per iteration of a k x w wide
    form)."""
    from gpt2core import _C
    from gpt2core.config import get_preset

    if args.threads:
        _C.set_num_threads(args.threads)
    cfg, steps = get_preset(args.preset), args.muon_ns_steps
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal(r, dtype=np.float32) for r in muon_runs(cfg)]
    flops = sum(b * steps * (4 * min(r, c) ** 2 * max(r, c) + 2 * min(r, c) ** 3) for b, r, c in muon_runs(cfg))
    ways = {"unbatched fp32 (before)": dict(per_matrix=True), "batched fp32": {}, "batched bf16": dict(
        ns_dtype="bfloat16")}
    times = {k: [] for k in ways}
    for _ in range(args.rounds):
        for k, kw in ways.items():
            t0 = time.perf_counter()
            for x in xs:
                _C.newton_schulz(x, steps, **kw)
            times[k].append(time.perf_counter() - t0)
    print(f"Newton-Schulz, preset {args.preset}: {sum(b for b, _, _ in muon_runs(cfg))} matrices in runs "
          + ", ".join(f"{b} x ({r}, {c})" for b, r, c in muon_runs(cfg)) + f" | {steps} iterations, "
          f"{flops / 1e9:.1f} GFLOP per optimizer step | threads {_C.get_num_threads()} | AVX512-BF16 "
          f"{_C.has_avx512_bf16()} | median of {args.rounds} alternating rounds")
    base = float(np.median(times["unbatched fp32 (before)"]))
    out = {}
    for k, v in times.items():
        t = float(np.median(v))
        out[k] = t * 1e3
        print(f"{k:>24}: {t * 1e3:9.1f} ms per optimizer step | {flops / t / 1e9:6.1f} GFLOP/s | {base / t:.2f}x")
    return {"ms_per_step": out}


def random_conversations(n: int, T: int, seed: int = 0) -> list:
    """n conversations of 1 to 3 exchanges, each turn 4 to T/8 random BPE tokens of text (bench data, --sft: most
    fit a row of T)."""
    from gpt2core import tokenizer
    rng = np.random.default_rng(seed)
    text = lambda: tokenizer.decode(rng.integers(0, 50000, rng.integers(4, max(5, T // 8))))  # noqa: E731
    return [[{"role": r, "content": text()} for _ in range(rng.integers(1, 4)) for r in ("user", "assistant")]
            for _ in range(n)]


def sft_vs_pretrain(args):
    """--sft: SFT steps (conversations packed into B x T rows, targets -1 outside the assistant's turns, each batch
    from the SFT loader) against pre-training steps (random tokens) on the same model, alternating rounds."""
    from gpt2core import GPT2, _C, chat
    from gpt2core.data import sft

    if args.threads:
        _C.set_num_threads(args.threads)
    cfg = chat.chat_config(bench_config(args))
    model = GPT2(cfg, device=args.device, seed=0, precision=args.precision, attention=args.attention)
    B, T = args.batch_size, args.seq_len
    convs = sft.read_conversations(args.sft_data) if args.sft_data else random_conversations(max(64, 4 * B), T)
    packed = sft.pack([chat.render(m) for m in convs], T)
    loader = sft.SFTLoader(packed, "train", B, T, seed=0)
    times = {"pre-training": [], "sft": []}
    for _ in range(args.rounds):
        times["pre-training"] += timed_steps(model, None, np.random.default_rng(0), cfg.vocab_size, B, T, 1,
                                             args.warmup, args.steps)[0]
        times["sft"] += timed_steps(model, None, np.random.default_rng(0), cfg.vocab_size, B, T, 1, args.warmup,
                                    args.steps, next_batch=loader.next_batch)[0]
    print(f"preset {args.preset} | {args.device} | threads {_C.get_num_threads()} | B={B} T={T} | {args.rounds} "
          f"rounds of {args.steps} steps each | sft rows: {loader.describe()}")
    tps = {}
    for k, v in times.items():
        tps[k] = B * T / float(np.median(v))
        print(f"{k:>12}: ms/step {np.median(v) * 1e3:.1f} (median of {len(v)}) | tokens/s {tps[k]:,.0f}")
    print(f"sft / pre-training tokens/s: {tps['sft'] / tps['pre-training']:.3f} (positions per second, padding "
          "included; targets trained on per epoch: " f"{loader.trained_tokens:,} of {packed.rows * T:,})")
    return {"pretrain_tok_per_s": tps["pre-training"], "sft_tok_per_s": tps["sft"]}


def gpu_model_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_model", Path(__file__).with_name("gpu_model.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_model"] = mod
    spec.loader.exec_module(mod)
    return mod


def modelled_vs_measured(args, cfg, measured_s):
    """The measured micro-step (this run) beside the model's for the GPU this runs on, when the model knows it."""
    from gpt2core import _C

    gm = gpu_model_module()
    name = _C.cuda_device_name(0)
    key = next((k for k in gm.GPUS if k.lower() in name.lower().replace(" ", "")), None)
    if key is None or cfg.n_layer < 1:
        print(f"--profile: no model of '{name}' (gpu_model.GPUS: {', '.join(gm.GPUS)})")
        return
    target = gm.Config(B=args.batch_size, T=args.seq_len, C=cfg.n_embd, NH=cfg.n_head, L=cfg.n_layer,
                       V=cfg.vocab_size, Vp=cfg.padded_vocab_size, maxT=cfg.block_size)
    gpu = gm.GPUS[key]  # a GPU without bf16 runs fp16, and cuDNN's fused attention needs sm_80+
    att = "cudnn" if args.attention in (None, "auto", "cudnn") and gpu.bf16 else "flash"
    counts = gm.launch_counts(att, gm.ROOT / "build" / "model", target, reuse=True, precision=gpu.precision)
    rows = gm.model(counts, target, gpu, gm.read_ptxas(gm.ROOT / "build" / "model" / "ptxas.txt"), 2)
    step = sum(r.seconds for r in rows)  # one micro-step and the optimizer step, as timed_steps runs them
    print(f"step: measured {measured_s * 1e3:.2f} ms | MODELLED {step * 1e3:.2f} ms ({gm.GPUS[key].name}, "
          f"{att} attention) | measured / modelled {measured_s / step:.2f}")


# The speed ladder, cumulative: each rung keeps the ones above it and switches one optimisation on.
# (rung, what it changes, the model settings it changes)
LADDER = [
    ("baseline", "fp32, materialised attention, unfused, vocab 50257",
     dict(precision="fp32", attention="naive", fused=False, padded=False, graphs=False, matmul_tuning=False)),
    ("tf32", "TF32 tensor-core matmuls", dict(precision="tf32")),
    ("fp16", "fp16 mixed precision", dict(precision="fp16")),
    ("bf16", "bf16 mixed precision", dict(precision="bf16")),
    ("fused", "residual+layernorm and GELU-in-matmul fusion", dict(fused=True)),
    ("flash", "flash attention (auto: cuDNN if it checks out, else ours)", dict(attention="auto")),
    ("vocab 50304", "vocab padded to a multiple of 128", dict(padded=True)),
    ("cuda graphs", "micro-step and optimizer step replayed from CUDA graphs", dict(graphs=True)),
    ("tuned gemms", "cuBLASLt's candidate algorithms timed once per shape", dict(matmul_tuning=True)),
    ("fp8", "the blocks' Linear layers in FP8 (per-tensor current scaling)", dict(precision="fp8")),
]
CPU_RUNGS = {"baseline", "vocab 50304"}  # the CPU backend is fp32 with materialised attention, unfused
# the compute capability a precision needs (model.pick_precision refuses it below): a GPU without it skips that
# rung, and the rungs after it keep the last precision it has (fp16 on sm_70 / sm_75)
MIN_CAPABILITY = {"fp32": 0, "fp16": 70, "tf32": 80, "bf16": 80, "fp8": 89}
FP8_ARCHS = (89, 90)  # FP8 tensor cores: Ada and Hopper (gpt2core.model.gpt2.FP8_ARCHS)


def ladder(args):
    """Every rung of LADDER in one process, one model at a time, printed side by side."""
    from gpt2core import GPT2, _C, build_info

    if args.threads:
        _C.set_num_threads(args.threads)
    threads = _C.get_num_threads()
    base_cfg = bench_config(args)
    B, T = args.batch_size, args.seq_len
    cpu = args.device == "cpu"
    flops = base_cfg.flops_per_token(T)
    print(f"gpt2core {build_info()['version']} | {args.device} | preset {args.preset} | B={B} T={T} | "
          f"{flops / 1e9:.3f} GFLOP/token | speed ladder, each rung adds one optimisation")
    print(f"{'rung':<12} | {'ms/step':>9} | {'tokens/s':>10} | {'TFLOP/s':>8} | {'MFU':>6} | {'speed-up':>8} | adds")
    capability = 0 if cpu else _C.cuda_capability(int(args.device.partition(":")[2] or 0))
    s, rows, base = {}, [], None
    for rung, what, change in LADDER:
        need = change.get("precision", "fp32")
        if not cpu and (capability < MIN_CAPABILITY[need] or (need == "fp8" and capability not in FP8_ARCHS)):
            print(f"{rung:<12} | {'-':>9} | {'-':>10} | {'-':>8} | {'-':>6} | {'-':>8} | {what} (needs sm_"
                  + ("89 / sm_90)" if need == "fp8" else f"{MIN_CAPABILITY[need]}+)"))
            continue
        s.update(change)
        if cpu and rung not in CPU_RUNGS:
            print(f"{rung:<12} | {'-':>9} | {'-':>10} | {'-':>8} | {'-':>6} | {'-':>8} | {what} (CUDA only)")
            continue
        cfg = base_cfg.replace(padded_vocab_size=base_cfg.padded_vocab_size if s["padded"] else base_cfg.vocab_size)
        model = GPT2(cfg, device=args.device, seed=0, precision=None if cpu else s["precision"],
                     attention=None if cpu else s["attention"], fused=s["fused"], matmul_tuning=s["matmul_tuning"],
                     deterministic=not args.no_deterministic)
        model.recompute = "gelu" if args.recompute_gelu else args.recompute
        model.cuda_graphs = s["graphs"]
        times, _, _ = timed_steps(model, None, np.random.default_rng(0), cfg.vocab_size, B, T, 1, args.warmup,
                                  args.steps)
        if s["graphs"] and not model.cuda_graphs:  # the capture failed and the model fell back (see stderr)
            what += " (capture failed: ran directly)"
        del model  # frees its device memory before the next rung
        dt = float(np.median(times))
        tps = B * T / dt
        gflops = tps * flops / 1e9
        peak, _, _ = peak_gflops(args, args.device, "fp32" if cpu else s["precision"], threads)
        base = base or tps
        mfu = f"{100 * gflops / peak:.1f}%" if peak else "-"
        print(f"{rung:<12} | {dt * 1e3:>9.1f} | {tps:>10,.0f} | {gflops / 1e3:>8.3f} | {mfu:>6} | "
              f"{tps / base:>7.2f}x | {what}")
        rows.append({"rung": rung, "ms_per_step": dt * 1e3, "tok_per_s": tps, "gflops": gflops})
    print("MFU is against the dense peak of each rung's precision (fp32, tf32, fp16, bf16); the speed-up against the "
          "baseline's tokens/s")
    return {"ladder": rows}


def worker(args):
    """One rank of a run started by a launcher (gpt2core.launch, torchrun, srun): DataParallel over the
    process group, its own random micro-batch; rank 0 reports. With WORLD_SIZE=1: no communication."""
    from gpt2core import GPT2, _C, build_info
    from gpt2core.distributed import DataParallel, from_env, init_process_group

    env = from_env()
    W = env.world_size
    device = f"cuda:{env.local_rank}" if args.device == "cuda" and W > 1 else args.device
    comm = init_process_group(env, timeout=args.dist_timeout, device=device) if W > 1 else None
    if args.threads:
        _C.set_num_threads(args.threads)
    threads = _C.get_num_threads()
    cfg = bench_config(args)
    B, T = args.batch_size, args.seq_len
    total = args.total_batch_tokens or B * T * W
    if total % (B * T * W):
        raise SystemExit(f"bench: --total-batch-tokens {total} is not a multiple of B*T*processes = {B * T * W}")
    accum = total // (B * T * W)
    model = GPT2(cfg, device=device, seed=0, precision=args.precision, attention=args.attention,
                 fused=not args.no_fused, matmul_tuning=args.matmul_tuning, deterministic=not args.no_deterministic)
    model.recompute = "gelu" if args.recompute_gelu else args.recompute
    model.offload = args.offload
    model.cuda_graphs = args.cuda_graphs
    ddp = None
    if comm is not None:
        ddp = DataParallel(model, comm, zero=args.zero, grad_accum=accum,
                           overlap=False if args.no_overlap_comm or args.cuda_graphs else None)
    times, parts, comm_ms = timed_steps(model, ddp, np.random.default_rng(env.rank), cfg.vocab_size, B, T, accum,
                                        args.warmup, args.steps,
                                        prefetch=args.offload and ddp is None and not args.no_prefetch)
    mine = np.zeros(2 * W, dtype=np.float32)  # every rank's median step time and comm time, gathered by a sum
    mine[env.rank], mine[W + env.rank] = np.median(times) * 1e3, np.median(comm_ms)
    if comm is not None:
        comm.allreduce(mine, "sum")
    if not env.is_master:
        return {}
    ms = float(mine[:W].max())  # the job moves at its slowest rank's pace
    tps = total / (ms / 1e3)
    flops = cfg.flops_per_token(T)
    gflops = tps / W * flops / 1e9  # per process / device
    info = build_info()
    r = {"processes": W, "ms_per_step": ms, "tok_per_s": tps, "tok_per_s_per_proc": tps / W,
         "comm_ms": float(mine[W]), "gflops_per_proc": gflops, "grad_accum": accum, "threads": threads}
    print(f"gpt2core {info['version']} | {device} | BLAS {info['blas']} | threads {threads} per process | "
          f"{W} process{'es' * (W > 1)}" + (f" ({comm.backend})" if comm else ""))
    print(f"preset {args.preset} ({model.num_parameters:,} params) | precision {model.precision} | B={B} T={T} "
          f"per process | grad_accum {accum} | {total:,} tokens/step | {flops / 1e9:.3f} GFLOP/token")
    if ddp:
        print(ddp.describe())
    if W > 1:
        print(f"ms/step {ms:.1f} (median of {args.steps}, slowest rank) | tokens/s {tps:,.0f} ({tps / W:,.0f} per "
              f"process) | comm {r['comm_ms']:.1f} ms/step (rank 0) | GFLOP/s {gflops:.1f} per process")
    else:
        print(f"ms/step {ms:.1f} (median of {args.steps}) | tokens/s {tps:,.0f} | GFLOP/s {gflops:.1f}")
    if args.breakdown:
        print(" | ".join(f"{k} {np.median(v) * 1e3:.1f} ms" for k, v in parts.items()) + " (rank 0)")
    print(peak_line(args, device, gflops, model.precision, threads, " per process" if W > 1 else ""))
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(r, f)
    return r


def build_native_module() -> Path:
    """The CPU core (_C, no CUDA, no Gloo) built with GPT2CORE_NATIVE=ON (-march=native) in build/native-cpu."""
    import pybind11

    root = Path(__file__).resolve().parent.parent
    build = root / "build" / "native-cpu"
    subprocess.run(["cmake", "-S", str(root), "-B", str(build), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                    "-DGPT2CORE_NATIVE=ON", "-DGPT2CORE_CUDA=OFF", "-DGPT2CORE_GLOO=OFF",
                    f"-DPython_EXECUTABLE={sys.executable}", f"-Dpybind11_DIR={pybind11.get_cmake_dir()}"],
                   check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", str(build), "--target", "_C"], check=True, stdout=subprocess.DEVNULL)
    return next(build.glob("_C.*.so"))


def compare_native(args, argv):
    """--compare-native: the installed package as it is, then the same package with its _C replaced by a
    -march=native build, alternating for --rounds rounds; prints the median ms/step of each and their ratio."""
    import gpt2core

    native = Path(args.native_module) if args.native_module else build_native_module()
    child = [a for a in argv if a not in ("--compare-native",)]
    child = [a for i, a in enumerate(child) if a != "--native-module" and (i == 0 or child[i - 1] != "--native-module")]
    ms = {"portable": [], "native": []}
    with tempfile.TemporaryDirectory() as tmp:
        staged = Path(tmp) / "gpt2core"  # the installed Python package with the native core in place of _C
        shutil.copytree(Path(gpt2core.__file__).parent, staged, ignore=shutil.ignore_patterns("_C.*", "__pycache__"))
        shutil.copy2(native, staged / native.name)
        for r in range(args.rounds):
            for label in ms:
                env = dict(os.environ)
                if label == "native":
                    env["PYTHONPATH"] = os.pathsep.join([tmp, env.get("PYTHONPATH", "")])
                p = subprocess.run([sys.executable, os.path.abspath(__file__), *child], env=env,
                                   capture_output=True, text=True)
                if p.returncode:
                    raise SystemExit(f"bench: the {label} run failed:\n{p.stdout}{p.stderr}")
                isa = re.search(r"CPU code (\S+)", p.stdout).group(1)
                ms[label].append(float(re.search(r"^ms/step ([0-9.]+)", p.stdout, re.M).group(1)))
                print(f"round {r + 1} {label:<8} ({isa}): {ms[label][-1]:.1f} ms/step")
    port, nat = (float(np.median(v)) for v in ms.values())
    print(f"portable {port:.1f} ms/step | native {nat:.1f} ms/step (medians of {args.rounds} rounds) | "
          f"portable / native = {port / nat:.3f}")
    return {"portable_ms": port, "native_ms": nat, "ratio": port / nat}


def launch(argv: list[str], nproc: int, threads: int | None) -> dict:
    """Run this script on `nproc` processes through gpt2core.launch; returns rank 0's figures."""
    from gpt2core import launch as gpt2core_launch

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        extra = (["--threads", str(threads)] if threads else []) + ["--result-json", out]
        ns = gpt2core_launch.build_parser().parse_args(["--nproc-per-node", str(nproc), "--master-port", "auto",
                                                        os.path.abspath(__file__)])
        ns.args = [*argv, *extra]  # set here: the launcher's parser would take --nproc for its own option
        sys.stdout.flush()
        code = gpt2core_launch.launch(ns)
        if code:
            raise SystemExit(f"bench: the {nproc}-process run failed (exit code {code})")
        with open(out) as f:
            return json.load(f)


def data_parallel(args, argv):
    """--nproc N (and --scaling): start the runs, then print the scaling table."""
    N = args.nproc
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads = args.threads or (max(1, cores // N) if args.device == "cpu" else None)
    for n in ((1, N) if args.scaling else (N,)):
        if args.total_batch_tokens and args.total_batch_tokens % (args.batch_size * args.seq_len * n):
            raise SystemExit(f"bench: --total-batch-tokens {args.total_batch_tokens} is not a multiple of "
                             f"B*T*processes = {args.batch_size * args.seq_len * n}")
    runs = []
    if args.scaling:
        print("== 1 process")
        runs.append(launch(argv, 1, threads))
        print(f"== {N} processes")
    runs.append(launch(argv, N, threads))
    if args.device == "cpu" and N * threads > cores:
        print(f"note: {N} processes x {threads} threads share {cores} cores: the {N}-process figures measure "
              f"contention for the cores, not what {N} separate devices would do")
    if not args.scaling:
        return runs[-1]
    base = runs[0]["tok_per_s"]
    print(f"\nscaling: preset {args.preset} | {args.device} | B={args.batch_size} T={args.seq_len} per process | "
          f"threads {runs[0]['threads']} per process | zero {args.zero}"
          f"{' | no overlap' if args.no_overlap_comm else ''}")
    print(f"{'processes':>9} | {'grad_accum':>10} | {'ms/step':>9} | {'tokens/s':>10} | {'per process':>11} | "
          f"{'comm ms':>7} | {'efficiency':>10}")
    for r in runs:
        eff = r["tok_per_s"] / (r["processes"] * base)
        comm = f"{r['comm_ms']:.1f}" if r["processes"] > 1 else "-"
        print(f"{r['processes']:>9} | {r['grad_accum']:>10} | {r['ms_per_step']:>9.1f} | {r['tok_per_s']:>10,.0f} | "
              f"{r['tok_per_s_per_proc']:>11,.0f} | {comm:>7} | {100 * eff:>9.1f}%")
    eff = runs[-1]["tok_per_s"] / (N * base)
    print(f"scaling efficiency 1 -> {N} processes: {eff:.3f} "
          f"(= {runs[-1]['tok_per_s']:,.0f} / ({N} x {base:,.0f}) tokens/s)")
    return {"runs": runs, "efficiency": eff}


def check_switches(ap, args) -> None:
    """Switches that would do nothing here are usage errors (exit 2), not silently ignored."""
    if args.device == "cpu":
        for flag in ("matmul_tuning", "cuda_graphs", "offload"):
            if getattr(args, flag):
                ap.error(f"--{flag.replace('_', '-')} needs --device cuda (it does nothing on the CPU)")
    if args.no_prefetch and not args.offload:
        ap.error("--no-prefetch needs --offload (it chooses when the offloaded step's gradients are copied)")
    if args.nproc == 1 and not args.scaling and "WORLD_SIZE" not in os.environ and not args.result_json:
        for flag, on in ((f"--zero {args.zero}", args.zero), ("--no-overlap-comm", args.no_overlap_comm)):
            if on:
                ap.error(f"{flag} needs a data-parallel run (--nproc N > 1 or --scaling)")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = build_parser()
    args = ap.parse_args(argv)
    check_switches(ap, args)
    if not args.generate:
        cfg = bench_config(args)
        if args.seq_len > cfg.block_size:  # a usage error naming both numbers, not the core's refusal mid-run
            raise cli.ArgError(f"-T/--seq-len {args.seq_len} is more than preset {args.preset}'s block_size "
                               f"{cfg.block_size}: use -T {cfg.block_size} or less")
    if args.model:
        return gpu_model_module().main(["--gpu", args.model, "-B", str(args.batch_size), "-T", str(args.seq_len),
                                        "--layers", str(cfg.n_layer)]) == 0
    if args.result_json or ("WORLD_SIZE" in os.environ and args.nproc == 1 and not args.scaling):
        return worker(args) or True  # one rank under a launcher (ours, or torchrun scripts/bench.py ...)
    if args.compare_native:
        return compare_native(args, argv)
    if args.serve:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from bench_serve import serve_bench
        return serve_bench(args)
    if args.generate:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from bench_generate import generate_bench
        return generate_bench(args)
    if args.sft:
        return sft_vs_pretrain(args)
    if args.eval:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from bench_eval import eval_bench
        return eval_bench(args)
    if args.nproc > 1 or args.scaling:
        return data_parallel(args, argv)
    if args.newton_schulz:
        return newton_schulz_bench(args)
    if len(args.recipe) > 1 or args.recipe != ["gpt2"] or (args.profile and args.device == "cpu"):
        return recipes(args)
    if not args.ladder:
        return single(args)
    result = ladder(args)
    if args.plot:
        from gpt2core.plot import plot_ladder
        plot_ladder(result["ladder"], args.plot, title=f"speed ladder: {args.device}, preset {args.preset}, "
                                                       f"B={args.batch_size} T={args.seq_len}")
        print(f"wrote {args.plot}")
    return result


if __name__ == "__main__":
    sys.exit(cli.entry("scripts/bench.py", lambda argv: 0 if main(argv) else 1)())
