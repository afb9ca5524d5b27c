"""Token shards in llm.c's layout.

A shard is a header of 256 little-endian int32 (magic 20240520, version 1, number of tokens, then
zeros) followed by that many uint16 tokens. The file size must be exactly 1024 + 2*n.
A shard is named ``<name>_<split>_<index>.bin``; shard 0 of a data set (``<name>_val_000000.bin``) is
validation, the others (``<name>_train_000001.bin``, ...) are training data.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np

from ..formats.atomic import atomic_write
from ..errors import FileFormatError

MAGIC = 20240520
VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
SPLITS = ("train", "val")
# <name>_<split>_<index>.bin, the split read from the end, so a name may hold anything (llm.c's small
# sets, tiny_shakespeare_val.bin, have no index; the name may be empty: val_000000.bin)
_SHARD_NAME = re.compile(rf"(?:(?P<name>.*)_)?(?P<split>{'|'.join(SPLITS)})(?:_(?P<index>\d+))?\.bin")


class ShardError(FileFormatError):
    """A token shard that cannot be read: the message names the file and what is wrong."""


def write_shard(path, tokens) -> Path:
    """Write `tokens` (ints in [0, 65535]) as a shard. Atomic: written to a temporary name, then
    renamed, so an interrupted write never leaves a file with a valid-looking header."""
    path = Path(path)
    toks = np.asarray(tokens)
    if toks.ndim != 1:
        raise ValueError(f"{path}: tokens must be 1-D, got shape {toks.shape}")
    if toks.size and (toks.min() < 0 or toks.max() > 65535):
        raise ValueError(f"{path}: token ids must fit in uint16 (0..65535), got range "
                         f"[{int(toks.min())}, {int(toks.max())}]")
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[0], header[1], header[2] = MAGIC, VERSION, toks.size
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(path, needed=HEADER_BYTES + 2 * toks.size) as f:
        f.write(header.tobytes())
        f.write(toks.astype("<u2", copy=False).tobytes())
    return path


def read_header(path) -> int:
    """Validate a shard's header and size; return its number of tokens."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(HEADER_BYTES)
    except OSError as e:
        raise ShardError(f"{path}: cannot read shard ({e.strerror})") from e
    if len(raw) < HEADER_BYTES:
        raise ShardError(f"{path}: truncated shard header ({len(raw)} bytes, need {HEADER_BYTES})")
    header = np.frombuffer(raw, dtype="<i4")
    if header[0] != MAGIC:
        raise ShardError(f"{path}: bad magic number {int(header[0])} (expected {MAGIC}); "
                         "not a gpt2core/llm.c token shard")
    if header[1] != VERSION:
        raise ShardError(f"{path}: unsupported shard version {int(header[1])} (expected {VERSION})")
    n = int(header[2])
    if n < 0 or size != HEADER_BYTES + 2 * n:
        raise ShardError(f"{path}: header says {n} tokens ({HEADER_BYTES + 2 * n} bytes) but the file "
                         f"has {size} bytes; the shard is truncated or corrupt")
    return n


class ShardReader:
    """A shard open for reading windows of tokens with pread(2): no memory map, so a shard truncated or rewritten
    in place under a running job (a re-run preparation, a shared file system) is a ShardError naming the file at
    the next read, never a SIGBUS. A shard replaced by rename (write_shard) keeps being read as it was opened."""

    def __init__(self, path):
        self.path = Path(path)
        self.n = read_header(self.path)
        try:
            self._fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as e:
            raise ShardError(f"{self.path}: cannot open shard ({e.strerror})") from e

    def __len__(self) -> int:
        return self.n

    def read(self, start: int, count: int) -> np.ndarray:
        """Tokens [start, start + count) as a uint16 array (a copy)."""
        if not 0 <= start <= start + count <= self.n:
            raise ValueError(f"{self.path}: tokens [{start}, {start + count}) outside the shard's {self.n}")
        want = 2 * count
        buf = bytearray(want)
        view, got = memoryview(buf), 0
        try:
            while got < want:
                k = os.preadv(self._fd, [view[got:]], HEADER_BYTES + 2 * start + got) if hasattr(os, "preadv") \
                    else _pread_into(self._fd, view[got:], HEADER_BYTES + 2 * start + got)
                if k == 0:
                    break
                got += k
        except OSError as e:
            raise ShardError(f"{self.path}: cannot read tokens {start:,}..{start + count:,} ({e.strerror})") from e
        if got < want:
            size = _size_of(self._fd)
            raise ShardError(f"{self.path}: the shard shrank while in use: it had {HEADER_BYTES + 2 * self.n:,} bytes "
                             f"when opened, now {size:,}; reading tokens {start:,}..{start + count:,} failed. Was it "
                             "truncated or re-prepared in place under this run? Prepare into a new folder, or let "
                             "the preparation finish, then resume")
        return np.frombuffer(buf, dtype="<u2")

    def check_vocab(self, vocab_size: int) -> None:
        """ShardError unless every id is below vocab_size (read in 32 Mi-token chunks)."""
        chunk = 1 << 25
        for lo in range(0, self.n, chunk):
            check_tokens(self.read(lo, min(chunk, self.n - lo)), vocab_size, self.path, offset=lo)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def _pread_into(fd: int, view: memoryview, offset: int) -> int:
    data = os.pread(fd, len(view), offset)
    view[:len(data)] = data
    return len(data)


def _size_of(fd: int) -> int:
    try:
        return os.fstat(fd).st_size
    except OSError:
        return -1


def load_tokens(path, vocab_size: int | None = None) -> np.ndarray:
    """The tokens of a shard as a uint16 array, read into memory (pread: no memory map that a truncation could
    turn into SIGBUS). With vocab_size, every id is checked to be below it: ShardError names the file and the
    first bad offset."""
    r = ShardReader(path)
    try:
        tokens = r.read(0, r.n)
    finally:
        r.close()
    if vocab_size is not None:
        check_tokens(tokens, vocab_size, path)
    return tokens


def check_tokens(tokens: np.ndarray, vocab_size: int, path, offset: int = 0) -> None:
    """ShardError unless every id of `tokens` (a shard's from token `offset` on, read from `path`) is below
    vocab_size. Reads in 64 MiB chunks: the max of each, and only where it is too large, where the first bad id is."""
    chunk = 1 << 25
    for lo in range(0, tokens.size, chunk):
        part = tokens[lo:lo + chunk]
        if part.size and int(part.max()) >= vocab_size:
            j = lo + int(np.argmax(part >= vocab_size))
            i = offset + j
            raise ShardError(f"{path}: token id {int(tokens[j])} at token offset {i:,} (byte {HEADER_BYTES + 2 * i:,})"
                             f" is not below the vocabulary size {vocab_size}; the shard was made with another "
                             "tokenizer, or is corrupt")


def shard_filename(name: str, index: int) -> str:
    """<name>_val_000000.bin for shard 0, <name>_train_<index>.bin for the others."""
    return f"{name}_{'val' if index == 0 else 'train'}_{index:06d}.bin"


def parse_shard_filename(filename: str):
    """(name, split, index or None) of a shard file name, or None when it is not one."""
    m = _SHARD_NAME.fullmatch(filename)
    if m is None:
        return None
    return m["name"] or "", m["split"], None if m["index"] is None else int(m["index"])


def check_name(name: str) -> str:
    """A data set name for new shards: non-empty, no path separator, and no part (between '_') that
    is a split, since glob patterns such as llm.c's ``*_val_*.bin`` would then match the other split."""
    parts = name.split("_")
    if not name or "/" in name or "\\" in name or any(p in SPLITS for p in parts):
        raise ValueError(f"shard name {name!r} is ambiguous or not a file name: it must be non-empty, without "
                         f"'/', and without a '_'-separated part {' or '.join(map(repr, SPLITS))} (shards are "
                         f"named <name>_<split>_<index>.bin and found by patterns like *_val_*.bin)")
    return name


def find_shards(data_dir, split: str) -> list[Path]:
    """Sorted shard files of a split ('train' or 'val') in `data_dir`, named <name>_<split>_<index>.bin."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise FileNotFoundError(f"data directory {data_dir} does not exist")
    return sorted(p for p in data_dir.glob("*.bin") if (s := parse_shard_filename(p.name)) and s[1] == split)
