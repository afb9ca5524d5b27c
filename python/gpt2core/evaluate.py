"""Evaluation: validation loss over fixed batches, and HellaSwag completion scoring.

Both work with any model object that has the GPT2 interface:
``forward(idx, targets)`` -> mean loss over targets != -1, ``token_losses()`` -> (B, T) per-token losses
of that forward (0 where targets == -1), and ``config.block_size``.

    python -m gpt2core.evaluate hellaswag --checkpoint out/model.bin      # or out/checkpoints/step_019073
        [--data data/hellaswag/hellaswag_val.npz | hellaswag_val.jsonl | hellaswag_val_full.txt]
    python -m gpt2core.evaluate val --checkpoint out/model.bin --data-dir data/edu_fineweb10B
        [--batch-size 8 --seq-len 1024 --steps 20]

GPT-2 124M (OpenAI's weights) scores acc 0.2859 / acc_norm 0.2955 on the 10,042 HellaSwag val items;
random guessing gives 0.25.
"""
from __future__ import annotations

import contextlib
import math
import sys
import time
import warnings

import numpy as np

from . import cli
from .data import hellaswag as _hs
from .model import load_model
from .progress import bar


# ------------------------------------------------------------------------------------ val loss
def evaluate_loss(model, loader, steps: int) -> float:
    """Mean of model.forward(x, y) over the first `steps` batches of `loader` (reset first, so the
    same batches every call). With several ranks each gets its own part; average the result across
    ranks (all-reduce) to get the loss of the global batches."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    n = getattr(loader, "batches_per_epoch", steps)
    if steps > n:
        warnings.warn(f"val_steps={steps} but the {getattr(loader, 'split', 'val')} data hold only {n} "
                      f"batches; evaluating on those {n}", stacklevel=2)
        steps = n
    loader.reset()
    total = 0.0
    for _ in range(steps):
        x, y = loader.next_batch()
        total += float(model.forward(x, y))
    loader.reset()
    return total / steps


# ------------------------------------------------------------------------------------ HellaSwag
def hellaswag_batches(data: "_hs.Rendered", items_per_batch: int, seq_len: int, item_ids):
    """Yield (item ids, idx (4k, seq_len) int32, targets (4k, seq_len) int32) where targets hold the
    ending tokens (at the position that predicts them) and -1 elsewhere. Every batch has the same
    shape (4 * items_per_batch rows; the last one padded with empty rows), so the model allocates once.
    Rows longer than seq_len + 1 tokens lose context tokens from the left; an ending longer than
    seq_len (not in HellaSwag with GPT-2's 1024) is scored on its first seq_len tokens."""
    rows_per_batch = 4 * items_per_batch
    for b0 in range(0, len(item_ids), items_per_batch):
        ids = item_ids[b0:b0 + items_per_batch]
        idx = np.zeros((rows_per_batch, seq_len), dtype=np.int32)
        tgt = np.full((rows_per_batch, seq_len), -1, dtype=np.int32)
        for k, i in enumerate(ids):
            c = int(data.ctx_lens[i])
            for r in range(4):
                row = data.row(i, r)
                # too long: drop context tokens from the left (keeping at least one), then, only if
                # the ending alone is longer than seq_len, its last tokens
                cut = min(max(0, len(row) - 1 - seq_len), c - 1)
                row = row[cut:cut + seq_len + 1]
                n = len(row) - 1
                idx[4 * k + r, :n] = row[:-1]
                tgt[4 * k + r, c - cut - 1:n] = row[c - cut:]
        yield ids, idx, tgt


def hellaswag_losses(model, data, items_per_batch: int = 4, item_ids=None, progress: bool = False):
    """Summed loss and token count of each ending: two (len(item_ids), 4) arrays (float64, int64).
    data is a Rendered set; item_ids defaults to all items."""
    if item_ids is None:
        item_ids = np.arange(len(data))
    item_ids = np.asarray(item_ids, dtype=np.int64)
    seq_len = min(int(model.config.block_size), max(1, data.max_row_len() - 1))
    row_lens = np.diff(data.offsets).reshape(-1, 4)[item_ids]
    n_long = int((row_lens - 1 > seq_len).sum())     # a row of n tokens is n - 1 positions
    if n_long:
        warnings.warn(f"{n_long} of {row_lens.size} HellaSwag rows are longer than the model's context "
                      f"(block_size {seq_len}: rows of up to {seq_len + 1} tokens fit); they are scored with "
                      "their context cut from the left", stacklevel=2)
    sums = np.zeros((len(item_ids), 4), dtype=np.float64)
    counts = np.zeros((len(item_ids), 4), dtype=np.int64)
    it = hellaswag_batches(data, items_per_batch, seq_len, item_ids)
    if progress:
        it = bar(it, total=math.ceil(len(item_ids) / items_per_batch), unit="batch", desc="hellaswag")
    done = 0
    for ids, idx, tgt in it:
        with getattr(model, "lock", None) or contextlib.nullcontext():  # the forward and ITS token losses
            model.forward(idx, tgt)
            token_losses = np.asarray(model.token_losses(), dtype=np.float64)
        mask = tgt != -1
        losses = np.where(mask, token_losses, 0.0)
        k = len(ids)
        sums[done:done + k] = losses.sum(axis=1)[:4 * k].reshape(k, 4)
        counts[done:done + k] = mask.sum(axis=1)[:4 * k].reshape(k, 4)
        done += k
        if progress:
            hits = (sums[:done] / counts[:done]).argmin(axis=1) == data.labels[item_ids[:done]]
            it.set_postfix(acc_norm=f"{hits.mean():.4f}", refresh=False)
    return sums, counts


def score_hellaswag(model, data=None, items_per_batch: int = 4, rank: int = 0, world_size: int = 1,
                    limit: int | None = None, progress: bool = False) -> dict:
    """Completion-style HellaSwag: for each item, the loss of each ending's tokens given the context.
    acc: the ending with the lowest summed loss is the gold one; acc_norm: lowest mean loss per token.

    data: a Rendered set, a path (.npz / .jsonl / 6-line .txt), or None (downloaded val set).
    With world_size > 1 this rank scores items i % world_size == rank; add up `n`, `correct` and
    `correct_norm` over ranks (all-reduce) and divide to get the accuracies of the whole set.
    Returns {n, correct, correct_norm, acc, acc_norm}."""
    cli.positive_int.check(items_per_batch, "items_per_batch")
    if limit is not None:
        cli.positive_int.check(limit, "limit")  # limit=0 would score nothing and report acc nan
    if not isinstance(data, _hs.Rendered):
        where = data if data is not None else "the downloaded HellaSwag set"
        data = _hs.load(data, limit)
        limit = None
    else:
        where = "the rendered HellaSwag set"
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if vocab is not None:
        _hs.check_vocab(data, int(vocab), where)
    n_items = len(data) if limit is None else min(limit, len(data))
    item_ids = np.arange(rank, n_items, world_size)
    sums, counts = hellaswag_losses(model, data, items_per_batch, item_ids, progress)
    labels = data.labels[item_ids]
    correct = int((sums.argmin(axis=1) == labels).sum())
    correct_norm = int(((sums / np.maximum(counts, 1)).argmin(axis=1) == labels).sum())
    n = int(len(item_ids))
    return {"n": n, "correct": correct, "correct_norm": correct_norm,
            "acc": correct / n if n else float("nan"), "acc_norm": correct_norm / n if n else float("nan")}


# ------------------------------------------------------------------------------------ CLI
def _cmd_hellaswag(args) -> int:
    try:
        data = _hs.load(args.data, args.limit)
        model = load_model(args.checkpoint, device=args.device)
        _hs.check_vocab(data, int(model.config.vocab_size), args.data or "the downloaded HellaSwag set")
    except (ValueError, OSError) as e:      # HellaSwagError, CheckpointError, missing files
        print(f"error: {e}", file=sys.stderr)
        return 1
    t0 = time.perf_counter()
    r = score_hellaswag(model, data, items_per_batch=args.items_per_batch, progress=not args.no_progress)
    dt = time.perf_counter() - t0
    print(f"hellaswag: {r['n']} items, acc {r['acc']:.4f} ({r['correct']}/{r['n']}), "
          f"acc_norm {r['acc_norm']:.4f} ({r['correct_norm']}/{r['n']}), {dt:.1f} s")
    return 0


def _cmd_val(args) -> int:
    from .data.loader import DataLoader
    try:
        model = load_model(args.checkpoint, device=args.device)
    except (ValueError, OSError) as e:      # CheckpointError
        print(f"error: {e}", file=sys.stderr)
        return 1
    T = args.seq_len or int(model.config.block_size)
    if T > model.config.block_size:  # a usage error (exit 2), named with both numbers
        raise cli.ArgError(f"--seq-len/-T {T} is more than the model's block_size {model.config.block_size} "
                           f"(--checkpoint {args.checkpoint}): use -T {model.config.block_size} or less")
    try:
        loader = DataLoader(args.data_dir, "val", args.batch_size, T, shuffle=False,
                            vocab_size=int(model.config.vocab_size))  # an id beyond it: ShardError naming the shard
    except (ValueError, OSError) as e:      # CheckpointError, ShardError, no val shard
        print(f"error: {e}", file=sys.stderr)
        return 1
    loss = evaluate_loss(model, loader, args.steps)
    print(f"val loss {loss:.4f} over {min(args.steps, loader.batches_per_epoch)} batches of "
          f"{args.batch_size}x{T} tokens")
    return 0


def main(argv=None) -> int:
    p = cli.ArgumentParser(prog="gpt2core-eval", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    h = sub.add_parser("hellaswag", help="HellaSwag accuracy of a checkpoint")
    h.add_argument("--checkpoint", "-c", required=True,
                   help="model file (llm.c .bin), training checkpoint directory or Hugging Face model")
    h.add_argument("--data", type=cli.existing_file,
                   help="rendered .npz, rowanz jsonl or 6-line .txt (default: download)")
    h.add_argument("--limit", type=cli.positive_int, help="only the first N items")
    h.add_argument("--items-per-batch", type=cli.positive_int, default=4, help="items per forward (4 rows each)")
    h.add_argument("--device", type=cli.device, default="cpu", help="cpu, cuda or cuda:N")
    h.add_argument("--no-progress", action="store_true")
    v = sub.add_parser("val", help="validation loss of a checkpoint on a shard directory")
    v.add_argument("--checkpoint", "-c", required=True)
    v.add_argument("--data-dir", required=True, type=cli.existing_dir, help="directory with *_val_*.bin shards")
    v.add_argument("--batch-size", "-B", type=cli.positive_int, default=8)
    v.add_argument("--seq-len", "-T", type=cli.positive_int, default=None, help="default: the model's block_size")
    v.add_argument("--steps", type=cli.positive_int, default=20)
    v.add_argument("--device", type=cli.device, default="cpu", help="cpu, cuda or cuda:N")
    args = p.parse_args(argv)
    return {"hellaswag": _cmd_hellaswag, "val": _cmd_val}[args.cmd](args)


console = cli.entry("gpt2core-eval", main)

__all__ = ["evaluate_loss", "score_hellaswag", "hellaswag_losses", "hellaswag_batches", "main", "console"]

if __name__ == "__main__":
    sys.exit(console())
