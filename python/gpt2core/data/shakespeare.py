"""Tiny Shakespeare, the bundled sample corpus (karpathy/char-rnn, 1,115,394 characters, public domain).

    python -m gpt2core.data shakespeare --out data/shakespeare

writes tinyshakespeare_val_000000.bin (36,059 tokens) and tinyshakespeare_train_000001.bin
(301,966 tokens): nanoGPT's split, the first 90% of the characters for training, the last 10% for
validation, each GPT-2-tokenized.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from .. import cli, tokenizer
from .shards import shard_filename, write_shard

TEXT = tokenizer.ASSETS / "tinyshakespeare.txt"
NAME = "tinyshakespeare"


def prepare(out_dir, val_fraction: float = 0.1) -> list[Path]:
    """Tokenize the bundled text into a val shard and a train shard in out_dir; returns their paths."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    text = TEXT.read_text(encoding="utf-8")
    n_train = int(len(text) * (1.0 - val_fraction))
    out_dir = Path(out_dir)
    val = np.array(tokenizer.encode(text[n_train:]), dtype=np.uint16)
    train = np.array(tokenizer.encode(text[:n_train]), dtype=np.uint16)
    return [write_shard(out_dir / shard_filename(NAME, 0), val),
            write_shard(out_dir / shard_filename(NAME, 1), train)]


def ensure(out_dir) -> Path:
    """The shard directory, prepared on first use."""
    out_dir = Path(out_dir)
    if not (out_dir / shard_filename(NAME, 1)).exists():
        prepare(out_dir)
    return out_dir


def main(argv=None) -> int:
    ap = cli.ArgumentParser(prog="python -m gpt2core.data shakespeare", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=cli.output_dir, default="data/shakespeare", help="output directory for the shards")
    ap.add_argument("--val-fraction", type=cli.open_fraction, default=0.1,
                    help="the share of the text for validation, in (0, 1) (default 0.1)")
    args = ap.parse_args(argv)
    for p in prepare(args.out, args.val_fraction):
        print(f"wrote {p} ({(p.stat().st_size - 1024) // 2:,} tokens)")
    return 0


console = cli.entry("python -m gpt2core.data shakespeare", main)

if __name__ == "__main__":
    sys.exit(console())
