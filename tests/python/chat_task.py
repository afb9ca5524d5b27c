"""The synthetic conversation task the SFT tests learn: the user writes two digits "a,b", the assistant answers them
reversed, "b,a" (100 problems; each digit and the comma is one GPT-2 token, so a conversation is 11 tokens).

A tiny model (two layers, C=32, an untied head) trained from random weights with gpt2core-train --sft answers
>= 90% of the problems exactly after 150 steps of 16 conversations, one per row (-T 10); random weights answer none.
Measured while choosing it: the sum of two digits stays at chance over 300 steps at this size (the model learns
the answers' distribution, not the addition); with a tied head, copying the digits sits on a plateau for longer
(the tied output keeps predicting the token it reads); rows of 40 tokens packing 3-4 conversations learn more slowly
within the same number of steps (attention starts spread over the other conversations). The CI-sized run stays
within seconds this way.

trained() trains it once per test process (the SFT and server tests share it) and returns the folder."""
from __future__ import annotations

import atexit
import functools
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np

from gpt2core import GPT2, chat
from gpt2core.config import GPT2Config

PROBLEMS = [(a, b) for a in range(10) for b in range(10)]
CONFIG = GPT2Config(block_size=32, n_layer=2, n_head=2, n_embd=32, tie_embeddings=False)
STEPS, B, T = 150, 16, 10


def question(a: int, b: int) -> str:
    return f"{a},{b}"


def answer(a: int, b: int) -> str:
    return f"{b},{a}"


def write_conversations(path: Path, n: int, seed: int = 0, system: float = 0.0) -> Path:
    """n conversations of random problems; a fraction `system` of them opens with a system message."""
    rng = np.random.default_rng(seed)
    lines = []
    for _ in range(n):
        a, b = PROBLEMS[rng.integers(len(PROBLEMS))]
        msgs = [{"role": "user", "content": question(a, b)}, {"role": "assistant", "content": answer(a, b)}]
        if rng.random() < system:
            msgs.insert(0, {"role": "system", "content": "Reverse."})
        lines.append(json.dumps({"messages": msgs}) + "\n")
    path.write_text("".join(lines))
    return path


def exact_rate(model) -> float:
    """Fraction of the 100 problems the model answers exactly (greedy, one batch through the KV cache)."""
    prompts = [chat.prompt([{"role": "user", "content": question(a, b)}]) for a, b in PROBLEMS]
    out = model.generate(prompts, 5, top_k=1)
    return float(np.mean([chat.reply_text(o[len(p):]) == answer(a, b)
                          for o, p, (a, b) in zip(out, prompts, PROBLEMS)]))


@functools.lru_cache(maxsize=1)
def trained() -> Path:
    """The folder of the task trained from a random base model: base.bin, task.jsonl and run/ (model.bin,
    metrics.jsonl) of `gpt2core-train --sft task.jsonl --init base.bin`."""
    from gpt2core.train import main
    root = Path(tempfile.mkdtemp(prefix="gpt2core-sft-"))
    atexit.register(shutil.rmtree, root, True)
    GPT2(CONFIG, seed=0).save(root / "base.bin")
    data = write_conversations(root / "task.jsonl", 2000)
    main(["--sft", str(data), "--init", str(root / "base.bin"), "-B", str(B), "-T", str(T), "--steps", str(STEPS),
          "--lr", "1e-2", "--val-every", "0", "--sample-tokens", "0", "--output-dir", str(root / "run")])
    return root
