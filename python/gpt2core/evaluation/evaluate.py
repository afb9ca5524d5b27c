"""Evaluation: validation loss and bits per byte over fixed batches, HellaSwag completion scoring, CORE.

Both work with any model object that has the GPT2 interface:
``forward(idx, targets)`` -> mean loss over targets != -1, ``token_losses()`` -> (B, T) per-token losses
of that forward (0 where targets == -1), and ``config.block_size``.

    python -m gpt2core.evaluate hellaswag --model out/model.bin      # or out/checkpoints/step_019073, or out
        [--data data/hellaswag/hellaswag_val.npz | hellaswag_val.jsonl | hellaswag_val_full.txt]
    python -m gpt2core.evaluate val --model out/model.bin --data-dir data/edu_fineweb10B
        [--batch-size 8 --seq-len 1024 --steps 20]            # val loss and bits per byte
    python -m gpt2core.evaluate core --model out/model.bin --bundle eval_bundle.zip
        [--max-per-task 100 --json core.json --csv core.csv]  # DCLM's CORE (gpt2core.core_eval)

Every subcommand names the model with --model (-m), as gpt2core-generate, -chat and -serve do; --checkpoint (-c)
is the same flag under its older name.

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

from .. import cli, tokenizer
from ..data import hellaswag as _hs
from ..model import load_model
from ..progress import bar


# ------------------------------------------------------------------------------------ val loss, bits per byte
def bpb_counts(losses, targets, token_bytes=None) -> tuple[float, int]:
    """(nats, bytes) of one batch for bits per byte, as nanochat's loss_eval defines it: each target token counts
    its UTF-8 bytes (tokenizer.token_bytes; a token holding part of a multi-byte character counts the bytes it
    holds) and its loss; targets that are ignored (< 0) or special (<|endoftext|>: 0 bytes, and any id beyond the
    GPT-2 vocabulary) count in neither."""
    tb = tokenizer.token_bytes() if token_bytes is None else np.asarray(token_bytes)
    y = np.asarray(targets)
    nb = np.zeros(y.shape, dtype=np.int64)
    ok = (y >= 0) & (y < len(tb))
    nb[ok] = tb[y[ok]]
    return float(np.asarray(losses, dtype=np.float64)[nb > 0].sum()), int(nb.sum())


def bits_per_byte(nats: float, nbytes: int) -> float:
    """nats / (ln 2 * bytes): the tokenizer-independent loss (NaN with no bytes)."""
    return nats / (math.log(2) * nbytes) if nbytes else float("nan")


def evaluate_val(model, loader, steps: int, bpb: bool = True) -> dict:
    """{"val_loss": the mean of model.forward(x, y) over the first `steps` batches of `loader` (reset first, so the
    same batches every call), "val_bpb": bits per byte over the same tokens (bpb_counts), with "val_nats" and
    "val_bytes" for summing over ranks}. With several ranks each gets its own part: average val_loss and sum
    val_nats / val_bytes across ranks (all-reduce), then bits_per_byte of the sums."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    n = getattr(loader, "batches_per_epoch", steps)
    if steps > n:
        warnings.warn(f"val_steps={steps} but the {getattr(loader, 'split', 'val')} data hold only {n} "
                      f"batches; evaluating on those {n}", stacklevel=2)
        steps = n
    loader.reset()
    total, nats, nbytes = 0.0, 0.0, 0
    for _ in range(steps):
        x, y = loader.next_batch()
        total += float(model.forward(x, y))
        if bpb:
            a, b = bpb_counts(model.token_losses(), y)
            nats, nbytes = nats + a, nbytes + b
    loader.reset()
    out = {"val_loss": total / steps}
    if bpb:
        out.update(val_bpb=bits_per_byte(nats, nbytes), val_nats=nats, val_bytes=nbytes)
    return out


def evaluate_loss(model, loader, steps: int) -> float:
    """Mean of model.forward(x, y) over the first `steps` batches of `loader` (reset first, so the
    same batches every call). With several ranks each gets its own part; average the result across
    ranks (all-reduce) to get the loss of the global batches."""
    return evaluate_val(model, loader, steps, bpb=False)["val_loss"]


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
        data = _hs.load(args.data, args.limit, flag="--data")
        model = load_model(args.model, device=args.device)
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
    from ..data.loader import DataLoader
    try:
        model = load_model(args.model, device=args.device)
    except (ValueError, OSError) as e:      # CheckpointError
        print(f"error: {e}", file=sys.stderr)
        return 1
    T = args.seq_len or int(model.config.block_size)
    if T > model.config.block_size:  # a usage error (exit 2), named with both numbers
        raise cli.ArgError(f"--seq-len/-T {T} is more than the model's block_size {model.config.block_size} "
                           f"(--model {args.model}): use -T {model.config.block_size} or less")
    try:
        loader = DataLoader(args.data_dir, "val", args.batch_size, T, shuffle=False,
                            vocab_size=int(model.config.vocab_size))  # an id beyond it: ShardError naming the shard
    except (ValueError, OSError) as e:      # CheckpointError, ShardError, no val shard
        print(f"error: {e}", file=sys.stderr)
        return 1
    r = evaluate_val(model, loader, args.steps)
    print(f"val loss {r['val_loss']:.4f} | val bpb {r['val_bpb']:.4f} over "
          f"{min(args.steps, loader.batches_per_epoch)} batches of {args.batch_size}x{T} tokens")
    return 0


def _cmd_core(args) -> int:
    from . import core_eval
    from ..distributed import parallel as distributed
    env, comm, device = distributed.setup(args.device)
    say = print if env.is_master else (lambda *a, **k: None)
    tasks = core_eval.load_bundle(args.bundle, args.tasks)
    model = load_model(args.model, device=device)
    t0 = time.perf_counter()
    r = core_eval.evaluate_core(model, tasks, max_per_task=args.max_per_task, batch_tokens=args.batch_tokens,
                                rank=env.rank, world_size=env.world_size, comm=comm,
                                progress=env.is_master and not args.no_progress, log=say)
    say(f"CORE {r['core']:.4f} over {len(r['tasks'])} tasks ({sum(t['n'] for t in r['tasks'].values())} items, "
        f"{time.perf_counter() - t0:.1f} s)")
    if env.is_master:
        for path, write in ((args.json, core_eval.write_json), (args.csv, core_eval.write_csv)):
            if path:
                say(f"wrote {write(r, path)}")
    return 0


MODEL_HELP = ("the model: an llm.c model file (e.g. out/model.bin), a training checkpoint directory, a run folder "
              "(its model.bin), a Hugging Face directory or Hub name (--checkpoint, -c: the same flag)")


def _add_model_flag(p) -> None:
    """--model (-m), with --checkpoint (-c), the older name val and hellaswag took, as its alias."""
    p.add_argument("--model", "-m", "--checkpoint", "-c", dest="model", required=True, metavar="MODEL",
                   help=MODEL_HELP)


def _notice(message, category, filename, lineno, file=None, line=None) -> None:
    """warnings.showwarning for the command line: one line, "gpt2core-eval: warning: ...", no source line."""
    print(f"gpt2core-eval: warning: {message}", file=sys.stderr, flush=True)


def main(argv=None) -> int:
    p = cli.ArgumentParser(prog="gpt2core-eval", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    h = sub.add_parser("hellaswag", help="HellaSwag accuracy of a model")
    _add_model_flag(h)
    h.add_argument("--data", type=cli.existing_file,
                   help="rendered .npz, rowanz jsonl or 6-line .txt (default: download)")
    h.add_argument("--limit", type=cli.positive_int, help="only the first N items")
    h.add_argument("--items-per-batch", type=cli.positive_int, default=4, help="items per forward (4 rows each)")
    h.add_argument("--device", type=cli.device, default="cpu", help="cpu, cuda or cuda:N")
    h.add_argument("--no-progress", action="store_true")
    v = sub.add_parser("val", help="validation loss and bits per byte of a model on a shard directory")
    _add_model_flag(v)
    v.add_argument("--data-dir", required=True, type=cli.existing_dir, help="directory with *_val_*.bin shards")
    v.add_argument("--batch-size", "-B", type=cli.positive_int, default=8)
    v.add_argument("--seq-len", "-T", type=cli.positive_int, default=None, help="default: the model's block_size")
    v.add_argument("--steps", type=cli.positive_int, default=20)
    v.add_argument("--device", type=cli.device, default="cpu", help="cpu, cuda or cuda:N")
    c = sub.add_parser("core", help="DCLM's CORE score over an eval bundle (gpt2core.core_eval)")
    _add_model_flag(c)
    c.add_argument("--bundle", required=True, type=cli.existing_path,
                   help="the eval bundle: its folder or zip (core.yaml, eval_meta_data.csv, eval_data/); nanochat's "
                        "is https://karpathy-public.s3.us-west-2.amazonaws.com/eval_bundle.zip")
    c.add_argument("--max-per-task", type=cli.positive_int, help="only the first N items of each task (file order)")
    c.add_argument("--tasks", nargs="+", metavar="LABEL", help="only these tasks of core.yaml")
    c.add_argument("--batch-tokens", type=cli.positive_int, default=4096,
                   help="positions per forward (rows of one batch x their longest length; default 4096)")
    c.add_argument("--json", type=cli.output_file, help="write {core, tasks: {label: {accuracy, centered, "
                                                        "random_baseline, n}}} here")
    c.add_argument("--csv", type=cli.output_file, help="write the per-task table here")
    c.add_argument("--device", type=cli.device, default="cpu", help="cpu, cuda or cuda:N")
    c.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    with warnings.catch_warnings():  # the package's warnings (rows cut to the context, ...) as one-line notices
        warnings.simplefilter("default")
        warnings.showwarning = _notice
        return {"hellaswag": _cmd_hellaswag, "val": _cmd_val, "core": _cmd_core}[args.cmd](args)


console = cli.entry("gpt2core-eval", main)

__all__ = ["evaluate_loss", "evaluate_val", "bpb_counts", "bits_per_byte", "score_hellaswag", "hellaswag_losses",
           "hellaswag_batches", "main", "console"]

if __name__ == "__main__":
    sys.exit(console())
