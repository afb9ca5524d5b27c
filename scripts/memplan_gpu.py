#!/usr/bin/env python3
"""The memory plan (gpt2core.memplan) against a real GPU: for each case (preset, B, recompute level) one process
builds the model on cuda:0, runs one training step (forward, backward, AdamW) and reads the device's free memory
(cudaMemGetInfo) before the model and after the step. The difference is everything the run allocated (the
cuBLAS / cuDNN handles and lazily loaded kernels included, which the plan does not count). Beside it: the plan's
total and the ms per step (median of --steps after one warm-up), so the cost of each recompute level is measured,
not only modelled. Then, per --bitwise case, the parameters after 3 steps with each recompute level, bit for bit.

    python scripts/memplan_gpu.py --cases d12:16:none d12:16:layer d24:8:none d24:8:layer --json out.json

Needs a GPU (scripts/memplan_check.py does the same comparison on the emulated device). Run on an H200 on
2026-11-28: docs/GPU_H100_2026-11-28.md ("A third lease")."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


def one_case(preset: str, B: int, T: int, recompute: str, precision: str, attention: str, steps: int,
             offload: str = "none") -> dict:
    import numpy as np

    from gpt2core import GPT2, _C, memplan

    free0, total = _C.cuda_mem_info(0)
    m = GPT2(preset, device="cuda", seed=0, precision=precision, attention=attention)
    m.recompute = recompute
    m.offload = offload == "optimizer"
    x = np.random.default_rng(0).integers(0, m.config.vocab_size, (B, T), dtype=np.int32)
    times = []
    for i in range(steps + 1):
        t0 = time.perf_counter()
        m.zero_grad()
        loss = float(m.forward(x, x))
        m.backward()
        m.step(lr=1e-4)
        m.grad_norm()  # a device read: the step has finished
        times.append(time.perf_counter() - t0)
        if i == 0:
            free1, _ = _C.cuda_mem_info(0)
    used = free0 - free1
    o = memplan.Options(device="cuda", precision=m.precision, recompute=recompute, offload=offload,
                        attention="flash" if attention in ("auto", "flash") else attention)
    parts = memplan.memory(preset, B, T, o)
    host = parts.pop("host")
    planned = memplan.total(parts)
    ms = 1e3 * float(np.median(times[1:])) if steps else None
    return {"preset": preset, "B": B, "T": T, "recompute": recompute, "offload": offload, "planned_host_bytes": host,
            "precision": m.precision,
            "attention": attention, "used_bytes": used, "planned_bytes": planned, "planned_parts": parts,
            "difference": (used - planned) / planned, "ms_per_step": ms, "loss": loss, "gpu_total_bytes": total,
            "tokens_per_s": B * T / (ms / 1e3) if ms else None}


def bitwise(preset: str, precision: str, attention: str, B: int = 4, T: int = 256) -> dict:
    import numpy as np

    from gpt2core import GPT2

    x = np.random.default_rng(1).integers(0, 50000, (B, T), dtype=np.int32)
    out = {}
    for level, fused in (("none", True), ("none", False), ("gelu", True), ("layer", True)):
        m = GPT2(preset, device="cuda", seed=0, precision=precision, attention=attention, fused=fused)
        m.recompute = level
        level += "" if fused else "_unfused"
        losses = []
        for _ in range(3):
            m.zero_grad()
            losses.append(float(m.forward(x, x)))
            m.backward()
            m.step(lr=1e-3)
        out[level] = (m.flat_params().tobytes(), losses)
        del m
    return {"preset": preset, "precision": precision, "attention": attention,
            "losses": {k: v[1] for k, v in out.items()},
            "gelu_equal": out["gelu"][0] == out["none"][0], "layer_equal": out["layer"][0] == out["none"][0],
            # 16-bit GPT-2: the gelu level's activation is the separate kernel's (csrc/model/gpt2.cpp), = unfused none
            "gelu_equal_unfused": out["gelu"][0] == out["none_unfused"][0]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", nargs="*", default=["d12:16:none", "d12:16:layer"],
                    help="PRESET:B:RECOMPUTE[:optimizer], each in a process of its own (:optimizer: "
                         "--offload optimizer)")
    ap.add_argument("-T", type=int, default=1024)
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--attention", default="flash")
    ap.add_argument("--steps", type=int, default=2, help="timed steps after the measured first one")
    ap.add_argument("--bitwise", nargs="*", default=[], help="PRESET:PRECISION:ATTENTION, recompute levels compared")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per case")
    ap.add_argument("--json", help="write every result here")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # the subprocess side: a JSON list of one_case's arguments
    args = ap.parse_args(argv)
    if args.one:
        kind, *a = json.loads(args.one)
        print(json.dumps(one_case(*a) if kind == "case" else bitwise(*a)))
        return 0
    jobs = [["case", p, int(b), args.T, r, args.precision, args.attention, args.steps, (o or ["none"])[0]]
            for p, b, r, *o in (c.split(":") for c in args.cases)]
    jobs += [["bitwise", *c.split(":")] for c in args.bitwise]
    results = []
    for job in jobs:
        t0 = time.perf_counter()
        try:
            r = subprocess.run([sys.executable, __file__, "--one", json.dumps(job)], capture_output=True, text=True,
                               timeout=args.timeout)
            res = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else \
                {"job": job, "failed": r.stderr[-1500:]}
        except subprocess.TimeoutExpired:
            res = {"job": job, "failed": f"timeout {args.timeout} s"}
        res["seconds"] = round(time.perf_counter() - t0, 1)
        results.append(res)
        if "used_bytes" in res:
            print(f"{res['preset']} B={res['B']} T={res['T']} {res['precision']} recompute={res['recompute']:<5} "
                  f"offload={res['offload']:<9} "
                  f"used {res['used_bytes'] / 2**30:7.3f} GiB planned {res['planned_bytes'] / 2**30:7.3f} GiB "
                  f"({res['difference']:+.2%})  {res['ms_per_step']:.1f} ms/step {res['tokens_per_s']:,.0f} tok/s",
                  flush=True)
        else:
            print(json.dumps(res)[:1800], flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if all("failed" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
