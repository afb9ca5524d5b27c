#!/usr/bin/env python3
"""The memory plan (gpt2core.memplan) against what the emulated CUDA device really allocates, at shapes too costly
for the test suite (a d12-wide layer takes ~20 s of CPU per step under the emulator). tests/csrc/cuda/
test_cuda_emu_memplan.py runs the same comparison at small shapes.

For each precision, recompute level and offload setting: a model of the shape on the emulated device (build/emu-py,
built by the tests' fixture: `pytest tests/csrc/cuda/test_cuda_emu.py -k reports_cuda` builds it), one forward +
backward and one optimizer step, then the device memory in use (the emulator's cudaMemGetInfo: every cudaMalloc,
scratch included) beside the plan (library_workspace=0: the emulator's matmul seam allocates no cuBLASLt workspace).

    python scripts/memplan_check.py                                   # d12 width (C=768, 12 heads), 2 layers, T=128
    python scripts/memplan_check.py --n-layer 12 -T 1024 --precision bf16 --recompute none layer

Measured (issue 37, a busy 2-core machine): C=768, 12 heads, 2 layers, B=1, T=128, bf16: none planned 269,309,000
bytes, allocated 269,310,560 (-0.0006%); layer 265,958,472 vs 265,960,032. With --offload optimizer (2026-11-28):
none 96,822,344 planned vs 96,823,912 allocated (-0.0016%), layer 93,471,816 vs 93,473,384 (-0.0017%).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
CLASSES = {"fp32": "Model", "bf16": "ModelBF16", "fp16": "ModelF16"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--n-embd", type=int, default=768)
    ap.add_argument("--n-head", type=int, default=12)
    ap.add_argument("-B", type=int, default=1)
    ap.add_argument("-T", type=int, default=128)
    ap.add_argument("--precision", nargs="+", default=["bf16"], choices=list(CLASSES))
    ap.add_argument("--recompute", nargs="+", default=["none", "layer"], choices=["none", "gelu", "layer"])
    ap.add_argument("--offload", nargs="+", default=["none"], choices=["none", "optimizer"],
                    help="--offload optimizer: the master weights and moments in pinned host memory (not counted)")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT / "build" / "emu-py"))
    import gpt2core_cuda_emu as emu

    from gpt2core import GPT2Config, memplan

    cfg = dict(max_seq_len=args.T, vocab_size=97, padded_vocab_size=128, n_layer=args.n_layer, n_head=args.n_head,
               n_embd=args.n_embd)
    config = GPT2Config(block_size=args.T, vocab_size=97, padded_vocab_size=128, n_layer=args.n_layer,
                        n_head=args.n_head, n_embd=args.n_embd)
    rng = np.random.default_rng(0)
    worst = 0.0
    for precision in args.precision:
        for level, offload in ((r, o) for r in args.recompute for o in args.offload):
            free0, _ = emu.cuda_mem_info(0)
            m = getattr(emu, CLASSES[precision])(**cfg, device="cuda", attention="flash")
            m.recompute = level
            m.offload = offload == "optimizer"
            x = rng.integers(0, 97, (args.B, args.T)).astype(np.int32)
            m.forward_backward(x, x, 1.0)
            m.optimizer_step(lr=1e-3, step=1)
            used = free0 - emu.cuda_mem_info(0)[0]
            o = memplan.Options(precision=precision, recompute=level, offload=offload, attention="flash",
                                library_workspace=0)
            planned = memplan.total(memplan.memory(config, args.B, args.T, o))
            rel = (planned - used) / used
            worst = max(worst, abs(rel))
            print(f"{precision:5} {level:6} {offload:9} planned {planned:>14,} allocated {used:>14,} ({rel:+.4%})",
                  flush=True)
            del m
    return 0 if worst <= 0.02 else 1


if __name__ == "__main__":
    sys.exit(main())
