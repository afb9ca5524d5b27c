"""HellaSwag validation set -> rendered token rows, ready for completion-style scoring.

Where the data comes from
    rowanz/hellaswag (MIT), ``data/hellaswag_val.jsonl``: 10,042 items, downloaded from
    https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl when no local
    file is given. Local files may be that jsonl (or any subset of it), or the 6-lines-per-item text
    format used by llama.cpp (klosax/hellaswag_text_data ``hellaswag_val_full.txt``: line 1
    ``activity_label: ctx``, line 2 the gold label 0-3, lines 3-6 the endings).

One record (jsonl)
    {"ind": 24, "activity_label": "Roof shingle removal", "ctx_a": "A man is sitting on a roof.",
     "ctx_b": "he", "ctx": "A man is sitting on a roof. he", "split": "val", "split_type": "indomain",
     "label": 3, "endings": ["is using wrap to wrap a pair of skis.", "is ripping level tiles off.",
     "is holding a rubik's cube.", "starts pulling up roofing on a roof."],
     "source_id": "activitynet~v_-JhWjGDPHMY"}

Rendering (as build-nanogpt / llm.c do it)
    Each item gives 4 rows: the GPT-2 tokens of ``ctx`` followed by those of ``" " + ending``. Only the
    ending's tokens are scored: the model that assigns the lowest summed loss to the right ending gets
    ``acc``, the lowest mean loss per token ``acc_norm`` (gpt2core.evaluate.score_hellaswag).

Command and what it produces
    python -m gpt2core.data hellaswag --input ../shared/data/hellaswag/hellaswag_val_full.txt \\
        --out data/hellaswag/hellaswag_val.npz
        10,042 items (labels 0/1/2/3: 2515/2485/2584/2458) rendered into one .npz file.
    python -m gpt2core.data hellaswag            # downloads hellaswag_val.jsonl into data/hellaswag/
    Reference scores on the 10,042 items: GPT-2 124M acc 0.2859, acc_norm 0.2955; random guessing 0.25.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .. import cli
from ..formats.atomic import NPZ_ERRORS, atomic_write
from ..errors import FileFormatError
from ..progress import bar

HELLASWAG_URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"
DEFAULT_DIR = Path("data") / "hellaswag"
RENDER_VERSION = 1


class HellaSwagError(FileFormatError):
    """A HellaSwag file that cannot be read; the message names the file and line."""


# ------------------------------------------------------------------------------------ items
def _check_item(item, where: str) -> dict:
    for field in ("ctx", "label", "endings"):
        if field not in item:
            raise HellaSwagError(f"{where}: item has no {field!r} field (has: {', '.join(item)})")
    ctx, label, endings = item["ctx"], item["label"], item["endings"]
    if not isinstance(ctx, str) or not ctx.strip():
        raise HellaSwagError(f"{where}: 'ctx' must be a non-empty string, got {ctx!r}")
    if not isinstance(endings, list) or len(endings) != 4 or not all(isinstance(e, str) and e for e in endings):
        raise HellaSwagError(f"{where}: 'endings' must be a list of 4 non-empty strings, got {endings!r}")
    try:
        label = int(label)
    except (TypeError, ValueError):
        label = -1
    if label not in (0, 1, 2, 3):
        raise HellaSwagError(f"{where}: 'label' must be 0, 1, 2 or 3, got {item['label']!r}")
    out = {"ctx": ctx, "label": label, "endings": list(endings)}
    if "ind" in item:
        out["ind"] = item["ind"]
    return out


def read_jsonl(path, limit: int | None = None) -> list[dict]:
    """Items of rowanz's jsonl format: dicts with ctx (str), label (int), endings (4 str), ind."""
    path = Path(path)
    items = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if limit is not None and len(items) >= limit:
                break
            if not raw.strip():
                continue
            where = f"{path}: line {lineno}"
            try:
                rec = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as e:
                raise HellaSwagError(f"{where}: invalid UTF-8 at byte {e.start}") from None
            except json.JSONDecodeError as e:
                raise HellaSwagError(f"{where}: not valid JSON ({e.msg})") from None
            if not isinstance(rec, dict):
                raise HellaSwagError(f"{where}: expected a JSON object, got {type(rec).__name__}")
            items.append(_check_item(rec, where))
    return items


def read_text(path, limit: int | None = None) -> list[dict]:
    """Items of the 6-line text format. The context is line 1 after the activity label and ': '."""
    path = Path(path)
    try:
        lines = [ln.removesuffix("\r") for ln in path.read_text(encoding="utf-8").split("\n")]
    except UnicodeDecodeError as e:
        raise HellaSwagError(f"{path}: invalid UTF-8 at byte {e.start}") from None
    if lines and lines[-1] == "":
        lines.pop()
    if len(lines) % 6:
        raise HellaSwagError(f"{path}: {len(lines)} lines, not a multiple of 6: the last item (from line "
                             f"{len(lines) - len(lines) % 6 + 1}) is missing a field; each item is "
                             "'label: context', the gold label, then 4 endings")
    items = []
    for i in range(0, len(lines), 6):
        if limit is not None and len(items) >= limit:
            break
        head, label, *endings = lines[i:i + 6]
        where = f"{path}: lines {i + 1}-{i + 6}"
        if not label.strip().isdigit():
            raise HellaSwagError(f"{where}: line {i + 2} should be the gold label 0-3, got {label!r}; "
                                 "the file is not in the 6-lines-per-item format or an item misses a line")
        _, sep, ctx = head.partition(": ")
        items.append(_check_item({"ctx": ctx if sep else head, "label": label.strip(), "endings": endings},
                                 where))
    return items


def download(dest_dir=DEFAULT_DIR, url: str = HELLASWAG_URL, flag: str = "--input") -> Path:
    """Download hellaswag_val.jsonl into dest_dir (once); returns its path. flag: the calling command's flag for
    a local copy, which the message of a failed download names."""
    dest = Path(dest_dir) / "hellaswag_val.jsonl"
    if dest.exists():
        return dest
    import urllib.request
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f"{dest.name}.{os.getpid()}.tmp")   # ranks may download at the same time
    try:
        with urllib.request.urlopen(url, timeout=60) as r, open(tmp, "wb") as f:
            while chunk := r.read(1 << 20):
                f.write(chunk)
    except Exception as e:
        tmp.unlink(missing_ok=True)
        raise HellaSwagError(
            f"could not download {url} ({e}); pass a local copy instead, e.g. {flag} "
            "path/to/hellaswag_val.jsonl (rowanz format) or hellaswag_val_full.txt (6-line text format)"
        ) from None
    os.replace(tmp, dest)
    return dest


def load_items(path=None, limit: int | None = None, flag: str = "--input") -> list[dict]:
    """Items from a jsonl or 6-line text file; with no path, the downloaded val set (flag: see download)."""
    if path is None:
        path = download(flag=flag)
    path = Path(path)
    if not path.is_file():
        raise HellaSwagError(f"{path}: no such file")
    with open(path, "rb") as f:
        first = f.read(1)
    items = read_jsonl(path, limit) if first == b"{" else read_text(path, limit)
    if not items:
        raise HellaSwagError(f"{path}: no items")
    return items


# ------------------------------------------------------------------------------------ rendering
@dataclass
class Rendered:
    """4 rows per item, stored flat. Row r of item i = tokens[offsets[4i + r]:offsets[4i + r + 1]];
    its first ctx_lens[i] tokens are the context, the rest the ending."""
    tokens: np.ndarray     # (sum of row lengths,) int32
    offsets: np.ndarray    # (4N + 1,) int64
    ctx_lens: np.ndarray   # (N,) int32
    labels: np.ndarray     # (N,) int8

    def __len__(self):
        return int(self.labels.size)

    def row(self, item: int, ending: int) -> np.ndarray:
        k = 4 * item + ending
        return self.tokens[self.offsets[k]:self.offsets[k + 1]]

    def item(self, i: int):
        """(tokens (4, L) int32 zero-padded, mask (4, L) int8 with 1 on ending tokens, label)."""
        rows = [self.row(i, r) for r in range(4)]
        L = max(len(r) for r in rows)
        tokens = np.zeros((4, L), dtype=np.int32)
        mask = np.zeros((4, L), dtype=np.int8)
        for r, row in enumerate(rows):
            tokens[r, :len(row)] = row
            mask[r, int(self.ctx_lens[i]):len(row)] = 1
        return tokens, mask, int(self.labels[i])

    def max_row_len(self) -> int:
        return int(np.diff(self.offsets).max()) if len(self) else 0

    def subset(self, idx) -> "Rendered":
        idx = np.asarray(idx, dtype=np.int64)
        rows = (4 * idx[:, None] + np.arange(4)).reshape(-1)
        lens = np.diff(self.offsets)[rows]
        offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        tokens = (np.concatenate([self.tokens[self.offsets[k]:self.offsets[k + 1]] for k in rows])
                  if rows.size else np.zeros(0, np.int32))
        return Rendered(tokens.astype(np.int32), offsets, self.ctx_lens[idx].copy(), self.labels[idx].copy())


def render_item(item: dict, enc=None):
    """(context token ids, [ending token ids x4]) of one item: ctx, then " " + ending."""
    if enc is None:
        from ..tokenizer import get_encoding
        enc = get_encoding()
    ctx = enc.encode_ordinary(item["ctx"])
    return ctx, [enc.encode_ordinary(" " + e) for e in item["endings"]]


def render(items, enc=None, progress: bool = False) -> Rendered:
    """Render items (from load_items) into token rows; progress: a tqdm bar on a terminal."""
    if enc is None:
        from ..tokenizer import get_encoding
        enc = get_encoding()
    ctxs, ends = [], []
    with bar(total=len(items), enabled=progress, unit="item", desc="hellaswag: tokenizing") as pb:
        for i in range(0, len(items), 500):  # in chunks, so that the bar moves
            chunk = items[i:i + 500]
            ctxs += enc.encode_ordinary_batch([it["ctx"] for it in chunk])
            ends += enc.encode_ordinary_batch([" " + e for it in chunk for e in it["endings"]])
            pb.update(len(chunk))
    rows, ctx_lens = [], np.zeros(len(items), dtype=np.int32)
    for i, ctx in enumerate(ctxs):
        ctx_lens[i] = len(ctx)
        rows += [ctx + ends[4 * i + r] for r in range(4)]
    lens = np.array([len(r) for r in rows], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    tokens = np.fromiter((t for r in rows for t in r), dtype=np.int32, count=int(lens.sum()))
    labels = np.array([it["label"] for it in items], dtype=np.int8)
    return Rendered(tokens, offsets, ctx_lens, labels)


def save(rendered: Rendered, path) -> Path:
    """Write a rendered set as .npz (atomically: temporary name, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(path) as f:
        np.savez(f, version=np.int32(RENDER_VERSION), tokens=rendered.tokens.astype(np.uint16),
                 offsets=rendered.offsets, ctx_lens=rendered.ctx_lens, labels=rendered.labels)
    return path


def load_rendered(path) -> Rendered:
    """A rendered set saved by save(), checked so that scoring can index it blindly: HellaSwagError naming
    the file otherwise."""
    path = Path(path)
    try:
        z = np.load(path, allow_pickle=False)
        if not isinstance(z, np.lib.npyio.NpzFile):
            raise HellaSwagError(f"{path}: a .npy array, not a rendered HellaSwag .npz archive")
        with z:
            version = z["version"]
            if version.shape != () or version.dtype.kind not in "iu" or int(version) != RENDER_VERSION:
                raise HellaSwagError(f"{path}: rendered format version {version!r}, expected {RENDER_VERSION}; "
                                     "render it again")
            arrays = {k: z[k] for k in ("tokens", "offsets", "ctx_lens", "labels")}
    except HellaSwagError:
        raise
    except NPZ_ERRORS as e:
        raise HellaSwagError(f"{path}: not a rendered HellaSwag file ({type(e).__name__}: {e})") from None
    bad = [k for k, a in arrays.items() if a.ndim != 1 or a.dtype.kind not in "iu"]
    if bad:
        raise HellaSwagError(f"{path}: {bad[0]} is {arrays[bad[0]].dtype} of shape {arrays[bad[0]].shape}, not a "
                             "1-D integer array; render it again")
    r = Rendered(arrays["tokens"].astype(np.int32), arrays["offsets"].astype(np.int64),
                 arrays["ctx_lens"].astype(np.int64), arrays["labels"].astype(np.int64))
    n = r.labels.size
    lens = np.diff(r.offsets)
    ok = (r.offsets.size == 4 * n + 1 and r.ctx_lens.size == n and r.offsets[0] == 0
          and r.offsets[-1] == r.tokens.size and (lens > 0).all() and ((r.labels >= 0) & (r.labels < 4)).all()
          and ((r.ctx_lens >= 0) & (r.ctx_lens < lens.reshape(n, 4).min(axis=1, initial=1 << 62))).all()
          and (arrays["tokens"] >= 0).all() and (arrays["tokens"] <= 65535).all())
    if not ok:
        raise HellaSwagError(f"{path}: inconsistent rendered HellaSwag file (offsets, context lengths, labels or "
                             "token ids out of range); render it again")
    return Rendered(r.tokens, r.offsets, r.ctx_lens.astype(np.int32), r.labels.astype(np.int8))


def check_vocab(rendered: Rendered, vocab_size: int, path) -> None:
    """HellaSwagError naming `path` unless every token id of the set is below the model's vocab_size (a set
    rendered with another tokenizer, or a damaged .npz)."""
    if rendered.tokens.size and int(rendered.tokens.max()) >= vocab_size:
        i = int(np.argmax(rendered.tokens >= vocab_size))
        raise HellaSwagError(f"{path}: token id {int(rendered.tokens[i])} (position {i}) is not below the model's "
                             f"vocabulary size {vocab_size}; render the set with the model's tokenizer")


def load(path=None, limit: int | None = None, progress: bool = False, flag: str = "--input") -> Rendered:
    """A rendered set from a .npz made by `prepare`, or rendered now from a jsonl / text file (or the
    downloaded val set when path is None; flag: the caller's flag for a local copy, named when the download
    fails). `limit` keeps the first items; progress: see render."""
    if path is not None and str(path).endswith(".npz"):
        r = load_rendered(path)
        return r.subset(np.arange(min(limit, len(r)))) if limit is not None else r
    return render(load_items(path, limit, flag), progress=progress)


def prepare(input=None, out=None, limit: int | None = None, log=print) -> Path:
    """Read (or download) the val set, render it, save it as .npz; returns the .npz path."""
    src = Path(input) if input is not None else download()
    items = load_items(src, limit)
    out = Path(out) if out is not None else DEFAULT_DIR / "hellaswag_val.npz"
    r = render(items, progress=True)
    save(r, out)
    counts = np.bincount(r.labels, minlength=4)
    log(f"{len(r):,} items from {src} -> {out} (labels 0/1/2/3: {'/'.join(map(str, counts))}, "
        f"longest row {r.max_row_len()} tokens)")
    return out


def add_arguments(p: argparse.ArgumentParser):
    p.add_argument("--input", "-i", type=cli.existing_file, help="local hellaswag_val.jsonl or 6-line .txt file "
                                         "(default: download rowanz/hellaswag's val set)")
    p.add_argument("--out", "-o", type=cli.output_file, help=f"output .npz (default: {DEFAULT_DIR / 'hellaswag_val.npz'})")
    p.add_argument("--limit", type=cli.positive_int, help="keep only the first N items")


def run(args) -> int:
    try:
        prepare(args.input, args.out, args.limit)
    except HellaSwagError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def main(argv=None) -> int:
    p = cli.ArgumentParser(prog="python -m gpt2core.data hellaswag",
                                description="Render the HellaSwag val set for evaluation")
    add_arguments(p)
    return run(p.parse_args(argv))


console = cli.entry("python -m gpt2core.data hellaswag", main)

if __name__ == "__main__":
    sys.exit(console())
