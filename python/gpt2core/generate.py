"""Generate text: `python -m gpt2core.generate --model out/model.bin "prompt"` (console script
`gpt2core-generate`). Top-k sampling, seeded."""
from __future__ import annotations

import argparse
import sys

import numpy as np

from . import cli, tokenizer
from .model import load_model


def build_parser() -> argparse.ArgumentParser:
    ap = cli.ArgumentParser(prog="gpt2core-generate", description=__doc__)
    ap.add_argument("prompt", nargs="?", default="\n", help="text to continue")
    ap.add_argument("--model", required=True,
                    help="an llm.c model file (v3 fp32 or v5 bf16, e.g. out/model.bin), a training checkpoint "
                         "directory, a Hugging Face GPT-2 directory, or a Hub name such as gpt2")
    ap.add_argument("--max-new-tokens", type=cli.non_negative_int, default=64, help="tokens to add (default 64)")
    ap.add_argument("--top-k", type=cli.non_negative_int, default=50,
                    help="sample from the k most likely tokens (default 50; 0: all)")
    ap.add_argument("--temperature", type=cli.positive_float, default=1.0, help="softmax temperature > 0 "
                                                                                 "(default 1)")
    ap.add_argument("--num-samples", type=cli.positive_int, default=1, help="samples to draw (default 1)")
    ap.add_argument("--seed", type=cli.seed, default=42, help="sampling seed (default 42)")
    ap.add_argument("--device", type=cli.device, default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    return ap


def main(argv=None) -> list[str]:
    args = build_parser().parse_args(argv)
    try:
        cli.check_device_available(args.device)
        model = load_model(args.model, device=args.device)
    except BaseException as e:
        cli.reraise_as_exit("gpt2core-generate", e)
        raise
    prompt = tokenizer.encode(args.prompt) or [tokenizer.EOT]
    x = np.array([prompt] * args.num_samples)
    out = model.generate(x, args.max_new_tokens, top_k=args.top_k, temperature=args.temperature, seed=args.seed)
    texts = [args.prompt + tokenizer.decode(row[len(prompt):]) for row in out]
    for t in texts:
        print(t)
        print("-" * 40)
    return texts


# the console script `gpt2core-generate` (main() returns the texts to Python callers)
console = cli.entry("gpt2core-generate", main)

if __name__ == "__main__":
    sys.exit(console())
