"""`scripts/bench.py --serve`: gpt2core-serve under concurrent streaming clients, and llama.cpp's llama-server on the
same weights side by side when --llama-server PATH is given (one server after the other, never both at once).

    python scripts/bench.py --serve --preset d12 --threads 2 --serve-weights fp32 int8 \
        --clients 1 4 8 16 --llama-server ~/llama.cpp/build/bin/llama-server

Per server and weights: for each number of clients N, N clients each send one streamed request at the same moment
(a prompt of --serve-prompt tokens, --new-tokens new tokens, greedy); reported: generated tokens/s over the
wall time of the round, and time to first token (the first SSE chunk that carries text) p50 / p95 over the N
requests. Then the head-of-line case: one request for 400 tokens, and 1 s later 4 short ones (8 tokens); reported:
the short ones' time to first token p50 / p95, its ratio to an idle server's (1 client) p50 and to the p95 of the
same 4 short requests (new prompts, same length) sent together to the idle server (what the long one adds: 4
prompts cost 4 prefills whatever the scheduling), and when the long one finished. A round of 1 client runs first,
untimed (warm-up).

The gpt2core server gets the model as an llm.c file (saved from the preset's random weights or --load), --max-batch
= the largest client count, --threads. llama-server gets the same weights converted to GGUF by llama.cpp's own
converter (bench_llamacpp.py: F32 beside fp32, Q8_0 beside int8; it needs llama-cpp-python's sdist converter, as
--generate), -np = the largest client count, continuous batching, the same threads. llama-server itself is built
from the llama.cpp sources llama-cpp-python's sdist vendors (vendor/llama.cpp):
    cmake -S vendor/llama.cpp -B build -DLLAMA_CURL=OFF -DGGML_NATIVE=ON && cmake --build build --target llama-server
Every request has a prompt of its own (the next --serve-prompt tokens of tiny Shakespeare; each server gets the same
sequence of prompts): llama-server keeps a slot's KV cache and reuses the longest common prefix of the next prompt
(`cache_prompt`, on by default), so a repeated prompt would time one token of prefill there and all of it here.
Figures are wall-clock on whatever else the machine runs: on a shared machine compare ratios from one run.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from gpt2core.distributed.launch import free_port
from gpt2core.inference.serve import wait_ready
from gpt2core.inference.stream_clients import stream_burst

HOL_LONG, HOL_SHORT, HOL_N, HOL_DELAY = 400, 8, 4, 1.0


class Prompts:
    """Prompts of P tokens, each one new: consecutive slices of a long token list (wrapping around)."""

    def __init__(self, tokens: list[int], P: int):
        self.tokens, self.P, self.at = tokens, P, 0

    def next(self) -> list[int]:
        if self.at + self.P > len(self.tokens):
            self.at = 0
        self.at += self.P
        return self.tokens[self.at - self.P:self.at]


def measure(url: str, prompts: Prompts, clients: list[int], new: int, block: int, log=print) -> dict:
    body = lambda: dict(prompt=prompts.next(), max_tokens=new, temperature=0)  # noqa: E731
    stream_burst(url, [body()])  # warm-up
    res = {"clients": {}}
    for n in clients:
        outs, wall = stream_burst(url, [body() for _ in range(n)])
        ttft = [o["ttft"] for o in outs if "ttft" in o]
        res["clients"][n] = {"tok_s": sum(o["tokens"] for o in outs) / wall, "ttft_p50": float(np.median(ttft)),
                             "ttft_p95": float(np.percentile(ttft, 95))}
        log(f"    {n:>2} clients: {res['clients'][n]['tok_s']:7.1f} tok/s, first token p50 "
            f"{1e3 * res['clients'][n]['ttft_p50']:6.0f} ms, p95 {1e3 * res['clients'][n]['ttft_p95']:6.0f} ms")
    P = prompts.P
    long = dict(prompt=prompts.next(), max_tokens=min(HOL_LONG, block - P), temperature=0)
    shorts = [dict(prompt=prompts.next(), max_tokens=HOL_SHORT, temperature=0) for _ in range(HOL_N)]
    outs, _ = stream_burst(url, [long] + shorts, [0.0] + [HOL_DELAY] * HOL_N)
    sh = [o["ttft"] for o in outs[1:]]
    idle = res["clients"].get(1, {}).get("ttft_p50") or stream_burst(url, [body()])[0][0]["ttft"]
    # the same shorts (new prompts of the same length) at the same moment on the idle server: what the long one adds
    alone, _ = stream_burst(url, [dict(prompt=prompts.next(), max_tokens=HOL_SHORT, temperature=0)
                                  for _ in range(HOL_N)])
    res["hol"] = {"short_ttft_p50": float(np.median(sh)), "short_ttft_p95": float(np.percentile(sh, 95)),
                  "idle_ttft": idle, "idle_shorts_ttft_p95": float(np.percentile([o["ttft"] for o in alone], 95)),
                  "long_s": outs[0]["end"] - outs[0]["start"],
                  "shorts_done_first": all(o["end"] < outs[0]["end"] for o in outs[1:])}
    h = res["hol"]
    log(f"    head of line: shorts' first token p50 {1e3 * h['short_ttft_p50']:.0f} ms, p95 "
        f"{1e3 * h['short_ttft_p95']:.0f} ms: {h['short_ttft_p95'] / idle:.1f}x an idle server's 1 client "
        f"({1e3 * idle:.0f} ms), {h['short_ttft_p95'] / h['idle_shorts_ttft_p95']:.1f}x the same {HOL_N} shorts' p95 "
        f"on an idle server ({1e3 * h['idle_shorts_ttft_p95']:.0f} ms); the long one took {h['long_s']:.1f} s; shorts "
        f"done first: {h['shorts_done_first']}")
    return res


def start_gpt2core(model_file: str, weights: str, threads: int, slots: int, log=print):
    port = free_port()
    cmd = [sys.executable, "-m", "gpt2core.serve", "--model", model_file, "--port", str(port), "--threads",
           str(threads), "--max-batch", str(slots), "--weights", weights, "--max-queue", "1000"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, proc)
    return proc, url


def start_llama(binary: str, gguf: Path, threads: int, slots: int, ctx: int):
    port = free_port()
    cmd = [binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-np", str(slots), "-c",
           str(ctx * slots), "--threads", str(threads), "--threads-batch", str(threads), "-cb"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, proc)
    return proc, url


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def format_table(results: dict, clients: list[int]) -> str:
    """One row per workload; a column pair per (engine, weights); ratios gpt2core / llama-server where both ran."""
    cols = list(results)
    lines = ["| workload | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for n in clients:
        cells = [f"{r['clients'][n]['tok_s']:.1f} tok/s · {1e3 * r['clients'][n]['ttft_p50']:.0f} ms "
                 f"(p95 {1e3 * r['clients'][n]['ttft_p95']:.0f})" for r in results.values()]
        lines.append(f"| {n} client{'s' * (n > 1)} | " + " | ".join(cells) + " |")
    cells = [f"shorts p95 {1e3 * r['hol']['short_ttft_p95']:.0f} ms = {r['hol']['short_ttft_p95'] / r['hol']['idle_ttft']:.1f}x "
             f"1 idle client, {r['hol']['short_ttft_p95'] / r['hol']['idle_shorts_ttft_p95']:.1f}x the shorts alone"
             for r in results.values()]
    lines.append(f"| head of line ({HOL_LONG} then {HOL_N}x{HOL_SHORT}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ratios(results: dict, clients: list[int]) -> list[str]:
    out = []
    for w in ("fp32", "int8"):
        ours, theirs = results.get(f"gpt2core {w}"), results.get(f"llama-server {'F32' if w == 'fp32' else 'Q8_0'}")
        if not (ours and theirs):
            continue
        for n in clients:
            a, b = ours["clients"][n], theirs["clients"][n]
            out.append(f"{w} {n:>2} clients: throughput x{a['tok_s'] / b['tok_s']:.2f}, first token p50 "
                       f"x{a['ttft_p50'] / b['ttft_p50']:.2f} (gpt2core / llama-server)")
    return out


def serve_bench(args) -> dict:
    from gpt2core import GPT2, load_model, tokenizer
    from gpt2core.config import get_preset

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    threads = args.threads or os.cpu_count()
    clients = sorted(set(args.clients))
    slots = max(clients + [HOL_N + 1])
    model = load_model(args.load) if args.load else GPT2(get_preset(args.preset), seed=0, training=False)
    text = (tokenizer.ASSETS / "tinyshakespeare.txt").read_text(encoding="utf-8")[:200_000]
    tokens = tokenizer.encode(text)

    def run(url):  # every server gets the same sequence of prompts
        return measure(url, Prompts(tokens, args.serve_prompt), clients, args.new_tokens, model.config.block_size)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_file = args.load or str(model.save(Path(tmp) / "model.bin"))
        for w in args.serve_weights:
            print(f"gpt2core-serve, {w} weights, {threads} threads, {slots} slots:", flush=True)
            proc, url = start_gpt2core(model_file, w, threads, slots)
            try:
                results[f"gpt2core {w}"] = run(url)
            finally:
                stop(proc)
        if args.llama_server:
            import bench_llamacpp as lc
            try:
                import llama_cpp
                version = getattr(llama_cpp, "__version__", "unknown")
            except ImportError:
                version = "unknown"
            types = [{"fp32": "f32", "int8": "q8_0"}[w] for w in args.serve_weights if w in ("fp32", "int8")]
            try:
                conv = lc.find_converter(version, args.llama_cpp_dir)
                paths = lc.convert(model, lc.model_key(model.config, model.flat_params()), types, conv, version)
            except Exception as e:
                print(f"llama-server not measured: the GGUF conversion failed ({type(e).__name__}: {e})")
                paths = {}
            for t, p in paths.items():
                print(f"llama-server {t.upper()}, {threads} threads, -np {slots}:", flush=True)
                proc, url = start_llama(args.llama_server, p, threads, slots, model.config.block_size)
                try:
                    results[f"llama-server {t.upper()}"] = run(url)
                finally:
                    stop(proc)
    print(format_table(results, clients))
    for line in ratios(results, clients):
        print(line)
    return results
