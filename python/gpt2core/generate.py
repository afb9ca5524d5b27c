"""Generate text: `python -m gpt2core.generate --model out/model.bin "prompt"` (console script
`gpt2core-generate`). Top-k sampling, seeded."""
from __future__ import annotations

import argparse

import numpy as np

from . import tokenizer
from .llmc import CheckpointError
from .model import load_model


def non_negative_int(s: str) -> int:
    k = int(s)
    if k < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (0: sample from the whole vocabulary), got {k}")
    return k


def main(argv=None) -> list[str]:
    ap = argparse.ArgumentParser(prog="gpt2core-generate", description=__doc__)
    ap.add_argument("prompt", nargs="?", default="\n", help="text to continue")
    ap.add_argument("--model", required=True,
                    help="an llm.c model file (v3 fp32 or v5 bf16, e.g. out/model.bin), a training checkpoint "
                         "directory, a Hugging Face GPT-2 directory, or a Hub name such as gpt2")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--top-k", type=non_negative_int, default=50,
                    help="sample from the k most likely tokens (default 50; 0: all)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--num-samples", type=int, default=1)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    try:
        model = load_model(args.model, device=args.device)
    except CheckpointError as e:
        raise SystemExit(f"gpt2core-generate: {e}") from e
    prompt = tokenizer.encode(args.prompt) or [tokenizer.EOT]
    x = np.array([prompt] * args.num_samples)
    out = model.generate(x, args.max_new_tokens, top_k=args.top_k, temperature=args.temperature, seed=args.seed)
    texts = [args.prompt + tokenizer.decode(row[len(prompt):]) for row in out]
    for t in texts:
        print(t)
        print("-" * 40)
    return texts


if __name__ == "__main__":
    main()
