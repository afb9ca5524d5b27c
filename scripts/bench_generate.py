"""`scripts/bench.py --generate`: KV-cache generation speed against the weight-streaming bound and other engines.

    python scripts/bench.py --generate --preset d12 --threads 2 [--weights fp32 bf16 fp16] [--new-tokens 32]

For prompts of 8 and 512 tokens at batch 1 and 8 (--prompts, --batches): the prefill (ms: the prompts in one
pass, head on the last position, first token sampled) and the decode (tokens/s over --new-tokens steps, each a
forward of one token per sequence plus sampling; batch x steps / seconds). Random weights (seed 0): speed does
not depend on them, and greedy decoding keeps every sequence running.

The weight-streaming bound of batch-1 decode: the bytes of weights one decode step must read (every Linear
weight and bias, the layernorms, the head = wte, one wte and one wpe row; the KV cache read is listed apart)
divided by this machine's read bandwidth, measured in the same run by a GEMV over a matrix of the head's size
(numpy's BLAS, best of 5): decode tokens/s / bound is the fraction of the memory system the decode reaches.

Side by side, when installed: Hugging Face transformers' generate(use_cache=True) on the same weights (through
GPT2.save_pretrained), torch threads = --threads, greedy with min_new_tokens = max_new_tokens; prefill = a
generate of one new token, decode = the rest. llama.cpp (llama-cpp-python) is listed when importable only.
"""
from __future__ import annotations

import tempfile
import time

import numpy as np


def weight_bytes_per_token(cfg, weight_bytes: float = 4) -> int:
    """Bytes of weights one decode step reads: per layer qkv/attproj/fc/fcproj weights and biases and two
    layernorms, the final layernorm, the head (wte, Vp x C) and one row each of wte and wpe."""
    L, C, Vp = cfg.n_layer, cfg.n_embd, cfg.padded_vocab_size
    mats = L * 12 * C * C + Vp * C
    vecs = L * (3 * C + C + 4 * C + C + 4 * C) + 2 * C + 2 * C
    return int(mats * weight_bytes) + vecs * 4


def read_bandwidth(cfg, reps: int = 5) -> float:
    """Bytes/s of a GEMV over a (Vp, C) fp32 matrix (the head's size) through numpy's BLAS, best of reps."""
    rng = np.random.default_rng(0)
    W = rng.standard_normal((cfg.padded_vocab_size, cfg.n_embd), dtype=np.float32)
    v = rng.standard_normal(cfg.n_embd, dtype=np.float32)
    W @ v
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        W @ v
        best = min(best, time.perf_counter() - t0)
    return W.nbytes / best


def time_core(model, B: int, P: int, new: int):
    """(prefill ms, decode tokens/s) of the core's KV-cache path: B prompts of P tokens, `new` decode steps."""
    from gpt2core.inference import KVEngine
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, model.config.vocab_size, P).astype(np.int32) for _ in range(B)]
    slots = list(range(B))
    eng = KVEngine(model, B, min(model.config.block_size, P + new + 1))
    greedy = ([0.0] * B, [1] * B, [1.0] * B, [0] * B, slots, [0] * B)
    t0 = time.perf_counter()
    eng.prefill(slots, prompts)
    ids = eng.sample(slots, *greedy)
    t1 = time.perf_counter()
    for _ in range(new):
        eng.decode(slots, ids)
        ids = eng.sample(slots, *greedy)
    t2 = time.perf_counter()
    return 1e3 * (t1 - t0), B * new / (t2 - t1)


def time_hf(hf, torch, vocab: int, B: int, P: int, new: int):
    rng = np.random.default_rng(1)
    x = torch.tensor(rng.integers(0, vocab, (B, P)), dtype=torch.long)
    mask = torch.ones_like(x)
    kw = dict(attention_mask=mask, do_sample=False, use_cache=True, pad_token_id=0)
    with torch.inference_mode():
        hf.generate(x, max_new_tokens=2, min_new_tokens=2, **kw)  # warm-up
        t0 = time.perf_counter()
        hf.generate(x, max_new_tokens=1, min_new_tokens=1, **kw)
        t1 = time.perf_counter()
        hf.generate(x, max_new_tokens=new + 1, min_new_tokens=new + 1, **kw)
        t2 = time.perf_counter()
    prefill = t1 - t0
    return 1e3 * prefill, B * new / max(1e-9, (t2 - t1) - prefill)


def generate_bench(args) -> dict:
    from gpt2core import GPT2, _C
    from gpt2core.config import get_preset

    if args.threads:
        _C.set_num_threads(args.threads)
    threads = _C.get_num_threads()
    cfg = get_preset(args.preset)
    model = GPT2(cfg, seed=0, device=args.device, training=False)
    bw = read_bandwidth(cfg)
    wbytes = weight_bytes_per_token(cfg, 4)
    bound = bw / wbytes
    print(f"generate: preset {args.preset} ({model.num_parameters:,} parameters), device {args.device}, "
          f"{threads} threads, CPU ISA {_C.cpu_isa()}")
    print(f"read bandwidth (GEMV over a {cfg.padded_vocab_size} x {cfg.n_embd} fp32 matrix, numpy BLAS): "
          f"{bw / 1e9:.1f} GB/s; weights read per decode step: {wbytes / 1e6:.0f} MB fp32 -> "
          f"weight-streaming bound {bound:.1f} tokens/s at batch 1")
    hf = torch = None
    try:
        import torch
        import transformers
        torch.set_num_threads(threads)
        tmp = tempfile.mkdtemp(prefix="gpt2core-bench-hf-")
        model.save_pretrained(tmp)
        hf = transformers.GPT2LMHeadModel.from_pretrained(tmp).eval()
        print(f"Hugging Face transformers {transformers.__version__}, torch {torch.__version__} "
              f"({torch.get_num_threads()} threads): side by side")
    except Exception as e:  # not installed (or not loadable): the core's figures alone
        print(f"Hugging Face transformers not measured ({type(e).__name__}: {e})")
    try:
        import llama_cpp  # noqa: F401
        print("llama-cpp-python is installed, but the GGUF conversion is not wired into this benchmark: not measured")
    except Exception:
        print("llama.cpp not measured (llama-cpp-python not installed: building it takes long on 2 cores)")
    rows = []
    hdr = (f"{'weights':>7} {'prompt':>6} {'batch':>5} | {'prefill ms':>10} {'decode tok/s':>12} {'of bound':>8} | "
           f"{'HF prefill ms':>13} {'HF tok/s':>8} {'x HF':>6}")
    print(hdr)
    print("-" * len(hdr))
    hf_done = {}
    for kind in args.weights:
        if kind != "fp32":
            model = GPT2(cfg, seed=0, device=args.device, training=False)
            model.inference_weights = kind
        kbound = bw / weight_bytes_per_token(cfg, {"fp32": 4, "int8": 1 + 4 / 32}.get(kind, 2))
        for P in args.prompts:
            for B in args.batches:
                pre, tps = time_core(model, B, P, args.new_tokens)
                r = {"weights": kind, "prompt": P, "batch": B, "prefill_ms": pre, "decode_tok_s": tps,
                     "bound_tok_s": kbound, "of_bound": tps / kbound if B == 1 else None}
                line = (f"{kind:>7} {P:>6} {B:>5} | {pre:>10.1f} {tps:>12.1f} " +
                        (f"{100 * tps / kbound:>7.0f}%" if B == 1 else f"{'':>8}"))
                if hf is not None:
                    if (P, B) not in hf_done:
                        hf_done[P, B] = time_hf(hf, torch, cfg.vocab_size, B, P, args.new_tokens)
                    hpre, htps = hf_done[P, B]
                    r.update(hf_prefill_ms=hpre, hf_decode_tok_s=htps)
                    line += f" | {hpre:>13.1f} {htps:>8.1f} {tps / htps:>5.1f}x"
                print(line, flush=True)
                rows.append(r)
    print("(of bound: batch-1 decode tokens/s / the weight-streaming bound of those weights: fp32 "
          f"{bound:.1f}, 16-bit {bw / weight_bytes_per_token(cfg, 2):.1f} tokens/s)")
    b1 = {(r["weights"], r["prompt"]): r for r in rows if r["batch"] == 1}
    for r in rows:
        k = (r["weights"], r["prompt"])
        if r["batch"] > 1 and k in b1:
            print(f"{r['weights']}: batch {r['batch']} / batch 1 tokens/s at prompt {r['prompt']}: "
                  f"{r['decode_tok_s'] / b1[k]['decode_tok_s']:.1f}x")
    return {"bandwidth_GBps": bw / 1e9, "bound_tok_s": bound, "weight_bytes": wbytes, "threads": threads,
            "rows": rows}
