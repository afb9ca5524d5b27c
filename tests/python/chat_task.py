"""The synthetic conversation task the SFT tests learn: the user writes "a+b" (two digits), the assistant answers
the sum. 100 problems; some conversations open with a system message, some hold two turns. A tiny model (C=32, two
layers) trained from random weights with gpt2core-train --sft answers >= 90% of them exactly after 300 steps;
random weights answer none.

trained() trains it once per test process (the SFT and server tests share it) and returns the run's folder."""
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
CONFIG = GPT2Config(block_size=64, n_layer=2, n_head=2, n_embd=32)
STEPS, B, T = 300, 8, 40


def conversation(rng) -> dict:
    a, b = PROBLEMS[rng.integers(len(PROBLEMS))]
    msgs = [{"role": "user", "content": f"{a}+{b}"}, {"role": "assistant", "content": str(a + b)}]
    if rng.random() < 0.2:
        msgs.insert(0, {"role": "system", "content": "Add."})
    if rng.random() < 0.2:
        c, d = PROBLEMS[rng.integers(len(PROBLEMS))]
        msgs += [{"role": "user", "content": f"{c}+{d}"}, {"role": "assistant", "content": str(c + d)}]
    return {"messages": msgs}


def write_conversations(path: Path, n: int, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    path.write_text("".join(json.dumps(conversation(rng)) + "\n" for _ in range(n)))
    return path


def exact_rate(model) -> float:
    """Fraction of the 100 problems the model answers exactly (greedy, one batch through the KV cache)."""
    prompts = [chat.prompt([{"role": "user", "content": f"{a}+{b}"}]) for a, b in PROBLEMS]
    out = model.generate(prompts, 3, top_k=1)
    return float(np.mean([chat.reply_text(o[len(p):]) == str(a + b)
                          for o, p, (a, b) in zip(out, prompts, PROBLEMS)]))


@functools.lru_cache(maxsize=1)
def trained() -> Path:
    """The run folder of the task trained from a random base model (base.bin beside it): model.bin, metrics."""
    from gpt2core.train import main
    root = Path(tempfile.mkdtemp(prefix="gpt2core-sft-"))
    atexit.register(shutil.rmtree, root, True)
    GPT2(CONFIG, seed=0).save(root / "base.bin")
    data = write_conversations(root / "task.jsonl", 2000)
    main(["--sft", str(data), "--init", str(root / "base.bin"), "-B", str(B), "-T", str(T), "--steps", str(STEPS),
          "--lr", "1e-2", "--val-every", str(STEPS), "--val-steps", "4", "--sample-tokens", "0",
          "--output-dir", str(root / "run")])
    return root
