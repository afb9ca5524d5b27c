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

Side by side in the same run, when installed, on the same weights and the same prompt ids (--load PATH: a model
file instead of the preset's random weights):
- Hugging Face transformers' generate(use_cache=True), through the project's HF export (GPT2.save_pretrained),
  torch threads = --threads, greedy, no end-of-text stop; prefill = a generate of one new token, decode = the rest.
- llama.cpp through llama-cpp-python (bench_llamacpp.py): the HF export converted by llama.cpp's own
  convert_hf_to_gguf.py to F32, F16 and Q8_0 (--llama-types; cached under ~/.cache/gpt2core/bench), batch 1,
  n_threads = --threads, the prompt in one llama_decode, greedy. Our fp32 is compared with F32, bf16 / fp16 with F16.
Ratios are of speeds, ours / theirs (above 1: ours is faster): prefill x = their ms / our ms, decode x = our
tokens/s / theirs. "same" is how many of the new+1 greedy ids (the first from the prefill) agree with ours from
the start; where fp32 ones part, the gap between the two tokens' logits in our full forward is printed (random
weights give near-ties: a gap of ~1e-6 is a tie, not an error).
"""
from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

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


def make_prompts(vocab: int, B: int, P: int) -> list[np.ndarray]:
    """B random prompts of P token ids (seed 1): the same ids for every engine."""
    rng = np.random.default_rng(1)
    return [rng.integers(0, vocab, P).astype(np.int32) for _ in range(B)]


def time_core(model, prompts, new: int):
    """(prefill ms, decode tokens/s, greedy ids (B, new+1)) of the core's KV-cache path: the prompts in one
    prefill, then `new` decode steps (after an untimed warm-up of the same prefill and two steps)."""
    from gpt2core.inference import KVEngine
    B, P = len(prompts), len(prompts[0])
    slots = list(range(B))
    eng = KVEngine(model, B, min(model.config.block_size, P + new + 1))
    greedy = ([0.0] * B, [1] * B, [1.0] * B, [0] * B, slots, [0] * B)
    eng.prefill(slots, prompts)  # warm-up (as the other engines get): a prefill and two decode steps, untimed
    for _ in range(2):
        eng.decode(slots, eng.sample(slots, *greedy))
    out = []
    t0 = time.perf_counter()
    eng.prefill(slots, prompts)
    ids = eng.sample(slots, *greedy)
    t1 = time.perf_counter()
    out.append(ids)
    for _ in range(new):
        eng.decode(slots, ids)
        ids = eng.sample(slots, *greedy)
        out.append(ids)
    t2 = time.perf_counter()
    return 1e3 * (t1 - t0), B * new / (t2 - t1), np.stack([np.asarray(i) for i in out], axis=1)


class Isolated:
    """An engine timed in a process of its own (spawned, one worker): torch's and llama.cpp's thread pools never
    share a process with the core's OpenMP threads or with each other. In one process, the threads of whichever
    engine ran last kept spinning into the next one's timing (measured: our fp32 decode 12.8 tokens/s beside
    torch and llama.cpp in the process, 34.9 alone, minutes apart on the same quiet machine)."""

    def __init__(self, init, *initargs):
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor
        self.pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=init,
                                        initargs=initargs)

    def __call__(self, fn, *args):
        return self.pool.submit(fn, *args).result()

    def close(self):
        self.pool.shutdown()


_HF = None  # (transformers' model, torch) in an Isolated worker


def _hf_init(folder: str, threads: int):
    global _HF
    import torch
    import transformers
    torch.set_num_threads(threads)
    transformers.utils.logging.disable_progress_bar()
    hf = transformers.GPT2LMHeadModel.from_pretrained(folder, dtype=torch.float32).eval()
    # greedy to the last token: no end-of-text stop (and so no min_new_tokens suppressing it), as the core runs
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    _HF = hf, torch


def _hf_versions() -> str:
    import transformers
    hf, torch = _HF
    return f"transformers {transformers.__version__}, torch {torch.__version__} ({torch.get_num_threads()} threads)"


def _hf_time(prompts, new: int):
    hf, torch = _HF
    return time_hf(hf, torch, prompts, new)


def load_hf(model, threads: int, folder: str):
    """(transformers' GPT2LMHeadModel of `model`'s weights through the project's HF export, in an Isolated
    worker, versions); raises where transformers or torch cannot be imported."""
    model.save_pretrained(folder)
    hf = Isolated(_hf_init, folder, threads)
    try:
        return hf, hf(_hf_versions)
    except BaseException:
        hf.close()
        raise


def time_hf(hf, torch, prompts, new: int):
    """(prefill ms, decode tokens/s, greedy ids (B, new+1)) of transformers' generate(use_cache=True)."""
    x = torch.tensor(np.stack(prompts), dtype=torch.long)
    kw = dict(attention_mask=torch.ones_like(x), do_sample=False, use_cache=True)
    with torch.inference_mode():
        hf.generate(x, max_new_tokens=2, **kw)  # warm-up
        t0 = time.perf_counter()
        hf.generate(x, max_new_tokens=1, **kw)
        t1 = time.perf_counter()
        out = hf.generate(x, max_new_tokens=new + 1, **kw)
        t2 = time.perf_counter()
    prefill = t1 - t0
    ids = out[:, x.shape[1]:].numpy()
    if ids.shape[1] != new + 1:
        raise RuntimeError(f"transformers' generate made {ids.shape[1]} tokens, not {new + 1}")
    return 1e3 * prefill, len(prompts) * new / max(1e-9, (t2 - t1) - prefill), ids


def _no_init():
    pass


def tie_gap(model, prompt, ours, theirs):
    """(position, our logit of our token - our logit of theirs, largest |logit|) at the first place the greedy ids
    part, from the core's full forward of prompt + ours[:position] (None when they agree)."""
    from bench_llamacpp import common_prefix
    i = common_prefix(ours, theirs)
    if i >= min(len(ours), len(theirs)):
        return None
    x = np.concatenate([np.asarray(prompt), np.asarray(ours[:i])]).astype(np.int32)[None, -model.config.block_size:]
    _, logits = model.forward(x, return_logits=True)
    z = logits[0, -1, :model.config.vocab_size]
    return i, float(z[ours[i]] - z[theirs[i]]), float(np.abs(z).max())


# ----------------------------------------------------------------------------------------------- the table
COLS_CORE = f"{'weights':>7} {'prompt':>6} {'batch':>5} | {'prefill ms':>10} {'decode tok/s':>12} {'of bound':>8}"
COLS_HF = f" | {'HF prefill ms':>13} {'HF tok/s':>8} {'pre x':>6} {'dec x':>6} {'same':>5}"
COLS_LLAMA = (f" | {'llama.cpp':>9} {'prefill ms':>10} {'tok/s':>7} {'pre x':>6} {'dec x':>6} {'same':>5}")


def format_header(hf: bool, llama: bool) -> str:
    return COLS_CORE + (COLS_HF if hf else "") + (COLS_LLAMA if llama else "")


def format_row(r: dict, hf: bool, llama: bool) -> str:
    """One table line from a result row (keys of generate_bench's rows); engines not measured for it: dashes."""
    of = r.get("of_bound")
    line = (f"{r['weights']:>7} {r['prompt']:>6} {r['batch']:>5} | {r['prefill_ms']:>10.1f} "
            f"{r['decode_tok_s']:>12.1f} " + (f"{100 * of:>7.0f}%" if of is not None else f"{'':>8}"))
    n = r.get("new_tokens", 0) + 1

    def engine(prefix: str, pre_w: int, tps_w: int, label: str = "") -> str:
        """One engine's columns: [label] prefill ms, tokens/s, ratios ours / theirs, same ids (dashes: not run)."""
        if r.get(f"{prefix}_decode_tok_s") is None:
            return " | " + (f"{label:>9} " if label else "") + f"{'-':>{pre_w}} {'-':>{tps_w}} {'':>6} {'':>6} {'':>5}"
        pre, tps, same = r[f"{prefix}_prefill_ms"], r[f"{prefix}_decode_tok_s"], r.get(f"{prefix}_same")
        return (" | " + (f"{label:>9} " if label else "") + f"{pre:>{pre_w}.1f} {tps:>{tps_w}.1f} "
                f"{pre / r['prefill_ms']:>5.2f}x {r['decode_tok_s'] / tps:>5.2f}x "
                + (f"{same:>2}/{n:<2}" if same is not None else f"{'':>5}"))
    if hf:
        line += engine("hf", 13, 8)
    if llama:
        line += engine("llama", 10, 7, (r.get("llama_type") or "-").upper())
    return line


def setup_llama(model, cfg, args, threads: int, log=print):
    """{llama.cpp type: GGUF path} of `model` (converted once, then from the cache), or None with the reason
    printed when llama-cpp-python is missing or the conversion cannot run."""
    try:
        import llama_cpp
    except ImportError:
        log("llama.cpp not measured (llama-cpp-python is not installed; `pip install llama-cpp-python` builds it: "
            "long on a small machine)")
        return None
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_llamacpp as lc
    version = getattr(llama_cpp, "__version__", "unknown")
    try:
        conv = lc.find_converter(version, args.llama_cpp_dir, log=log)
        key = lc.model_key(cfg, model.flat_params())
        paths = lc.convert(model, key, args.llama_types, conv, version, log=log)
    except Exception as e:  # no converter, no network, a converter that refuses: our figures stand alone
        log(f"llama.cpp not measured ({type(e).__name__}: {e})")
        return None
    log(f"llama.cpp (llama-cpp-python {version}; {threads} threads) side by side: "
        + ", ".join(f"{t.upper()} {p}" for t, p in paths.items()))
    return paths


def generate_bench(args) -> dict:
    from gpt2core import GPT2, _C, load_model
    from gpt2core.config import get_preset

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_llamacpp as lc

    if args.threads:
        _C.set_num_threads(args.threads)
    threads = _C.get_num_threads()

    def build(kind):
        if args.load:
            return load_model(args.load, device=args.device, inference_weights=kind)
        m = GPT2(get_preset(args.preset), seed=0, device=args.device, training=False)
        if kind != "fp32":
            m.inference_weights = kind
        return m
    model = build("fp32")
    base = model  # the fp32 model: what HF and llama.cpp get, and what judges a disagreement
    cfg = model.config
    bw = read_bandwidth(cfg)
    wbytes = weight_bytes_per_token(cfg, 4)
    bound = bw / wbytes
    what = f"model {args.load}" if args.load else f"preset {args.preset} (random weights, seed 0)"
    print(f"generate: {what}, {model.num_parameters:,} parameters, device {args.device}, "
          f"{threads} threads, CPU ISA {_C.cpu_isa()}")
    print(f"read bandwidth (GEMV over a {cfg.padded_vocab_size} x {cfg.n_embd} fp32 matrix, numpy BLAS): "
          f"{bw / 1e9:.1f} GB/s; weights read per decode step: {wbytes / 1e6:.0f} MB fp32 -> "
          f"weight-streaming bound {bound:.1f} tokens/s at batch 1")
    hf = None
    hf_dir = tempfile.TemporaryDirectory(prefix="gpt2core-bench-hf-")
    try:
        hf, versions = load_hf(base, threads, hf_dir.name)
        print(f"Hugging Face {versions} side by side, in a process of its own")
    except Exception as e:  # not installed (or not loadable): the core's figures alone
        print(f"Hugging Face transformers not measured ({type(e).__name__}: {e})")
    ggufs = setup_llama(base, cfg, args, threads) if args.device == "cpu" else None
    llama = Isolated(_no_init) if ggufs is not None else None
    hdr = format_header(hf is not None, ggufs is not None)
    print(hdr)
    print("-" * len(hdr))
    rows, hf_done, fp32_ids, gaps = [], {}, {}, []
    new = args.new_tokens
    for kind in args.weights:
        if kind != "fp32":
            model = build(kind)
        kbound = bw / weight_bytes_per_token(cfg, {"fp32": 4, "int8": 1 + 4 / 32}.get(kind, 2))
        for P in args.prompts:
            for B in args.batches:
                prompts = make_prompts(cfg.vocab_size, B, P)
                pre, tps, ids = time_core(model, prompts, new)
                if kind == "fp32" and B == 1:
                    fp32_ids[P] = ids[0]
                r = {"weights": kind, "prompt": P, "batch": B, "new_tokens": new, "prefill_ms": pre,
                     "decode_tok_s": tps, "bound_tok_s": kbound, "of_bound": tps / kbound if B == 1 else None}
                if hf is not None:
                    if (P, B) not in hf_done:
                        hf_done[P, B] = hf(_hf_time, prompts, new)
                    hpre, htps, hids = hf_done[P, B]
                    r.update(hf_prefill_ms=hpre, hf_decode_tok_s=htps,
                             hf_same=min(lc.common_prefix(ids[b], hids[b]) for b in range(B)))
                    if kind == "fp32" and B == 1:
                        gaps.append(("HF", P, tie_gap(base, prompts[0], ids[0], hids[0])))
                lt = lc.OURS_TO_GGUF.get(kind)
                if ggufs is not None and B == 1 and lt in ggufs:
                    lpre, ltps, lids = llama(lc.time_llamacpp, ggufs[lt], prompts[0], new, threads)
                    r.update(llama_type=lt, llama_prefill_ms=lpre, llama_decode_tok_s=ltps,
                             llama_same=lc.common_prefix(ids[0], lids))
                    if kind == "fp32":
                        gaps.append((f"llama.cpp {lt.upper()}", P, tie_gap(base, prompts[0], ids[0], lids)))
                print(format_row(r, hf is not None, ggufs is not None), flush=True)
                rows.append(r)
    print("(of bound: batch-1 decode tokens/s / the weight-streaming bound of those weights: fp32 "
          f"{bound:.1f}, 16-bit {bw / weight_bytes_per_token(cfg, 2):.1f} tokens/s; pre x, dec x: speed ratios ours "
          "/ theirs, above 1 = ours faster; same: greedy ids equal to ours from the start, of new+1)")
    b1 = {(r["weights"], r["prompt"]): r for r in rows if r["batch"] == 1}
    for r in rows:
        k = (r["weights"], r["prompt"])
        if r["batch"] > 1 and k in b1:
            print(f"{r['weights']}: batch {r['batch']} / batch 1 tokens/s at prompt {r['prompt']}: "
                  f"{r['decode_tok_s'] / b1[k]['decode_tok_s']:.1f}x")
    extra = []
    if ggufs is not None:  # llama.cpp weights none of ours was compared with (Q8_0 when int8 is not among --weights)
        used = {lc.OURS_TO_GGUF.get(k) for k in args.weights}
        for lt in [t for t in ggufs if t not in used]:
            for P in args.prompts:
                prompts = make_prompts(cfg.vocab_size, 1, P)
                lpre, ltps, lids = llama(lc.time_llamacpp, ggufs[lt], prompts[0], new, threads)
                same = lc.common_prefix(fp32_ids[P], lids) if P in fp32_ids else None
                extra.append({"llama_type": lt, "prompt": P, "llama_prefill_ms": lpre, "llama_decode_tok_s": ltps,
                              "same_as_our_fp32": same})
                print(f"llama.cpp {lt.upper()} alone, prompt {P}, batch 1: prefill {lpre:.1f} ms, decode {ltps:.1f} "
                      "tokens/s" + (f", greedy ids same as our fp32: {same}/{new + 1}" if same is not None else ""),
                      flush=True)
    for who, P, g in gaps:
        if g is None:
            print(f"greedy ids, fp32, prompt {P}: {who} = ours for all {new + 1} tokens")
        else:
            i, d, zmax = g
            tie = abs(d) <= 1e-4 * zmax  # fp32 engines differ by ~1e-6 of the logits' scale
            print(f"greedy ids, fp32, prompt {P}: {who} parts from ours at token {i + 1} of {new + 1}; there our "
                  f"logit of our token - of theirs = {d:.2e} (largest |logit| {zmax:.3g}: "
                  f"{'a near-tie' if tie else 'NOT a near-tie: a real difference'})")
    for engine in (hf, llama):
        if engine is not None:
            engine.close()
    hf_dir.cleanup()
    return {"bandwidth_GBps": bw / 1e9, "bound_tok_s": bound, "weight_bytes": wbytes, "threads": threads,
            "rows": rows, "llama_alone": extra}
