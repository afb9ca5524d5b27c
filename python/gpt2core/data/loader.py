"""Shuffled, multi-epoch, rank-aware, resumable loader over token shards.

Layout of one epoch (the same on every rank, so ranks need no communication):

* A *window* is ``world_size * B * T`` consecutive tokens of a shard (plus one more token for the
  last target): exactly one global batch. A shard of n tokens holds ``(n - 1) // (world_size*B*T)``
  windows; its tail is not used in that epoch.
* With ``shuffle=True`` the order of the shards is permuted every epoch, and the order of the windows
  inside each shard is permuted too. Both permutations come from ``numpy.random.default_rng`` seeded
  with ``(seed, epoch)`` and ``(seed, epoch, shard)``, so the position (epoch, shard, window) is the
  whole state: nothing else needs saving to replay the exact same batches after a restart.
* With ``shuffle=False`` shards are read in sorted order and windows sequentially.
* Rank r takes rows ``r*B .. (r+1)*B`` of the window. So the ranks together see exactly what a single
  process with batch size ``world_size * B`` sees, and the state is the same on every rank: a run can
  resume with a different world_size as long as the global batch ``world_size * B`` is unchanged.

For validation, make the loader with ``shuffle=False`` (or any fixed seed) and call ``reset()`` before
each evaluation: it then yields the same batches every time.
"""
from __future__ import annotations

import glob as _glob
import os
import warnings
from pathlib import Path

import numpy as np

from .shards import ShardError, ShardReader, find_shards, read_header

STATE_VERSION = 1


def _resolve_files(data_dir_or_files, split: str) -> list[Path]:
    """A directory (its shards of `split`), a glob pattern, one shard file, or a list of shard files."""
    src = data_dir_or_files
    if isinstance(src, (str, os.PathLike)):
        s = os.fspath(src)
        if os.path.isdir(s):
            files = find_shards(s, split)
            if not files:
                others = sorted(p.name for p in Path(s).glob("*.bin"))
                hint = (f" (it has {len(others)} other .bin files, e.g. {others[0]})" if others else
                        " (it has no .bin files at all)")
                what = ("a validation shard: the first shard of a data set, named like "
                        "edufineweb_val_000000.bin" if split == "val" else
                        f"shards of the {split!r} split, named like *_{split}_000001.bin")
                raise FileNotFoundError(
                    f"no {split!r} shards in {s}{hint}; expected {what}. Make them with "
                    "`python -m gpt2core.data fineweb ...` or `python -m gpt2core.data shakespeare`.")
            return files
        if any(c in s for c in "*?["):
            files = sorted(Path(p) for p in _glob.glob(s))
            if not files:
                raise FileNotFoundError(f"no files match the pattern {s!r}")
            return files
        if not os.path.exists(s):
            raise FileNotFoundError(f"data path {s} does not exist")
        return [Path(s)]
    files = [Path(p) for p in src]
    if not files:
        raise ValueError("empty list of shard files")
    for p in files:
        if not p.exists():
            raise FileNotFoundError(f"shard {p} does not exist")
    return files


class DataLoader:
    """Yields (x, y) int32 batches of shape (B, T), y being x shifted left by one token.

    Args:
        data_dir_or_files: directory with ``*_{split}_*.bin`` shards, a glob pattern, a shard file or
            a list of shard files.
        split: 'train' or 'val' (used to find shards in a directory, and in messages).
        B, T: per-rank batch size and sequence length.
        rank, world_size: this process's rank among world_size data-parallel processes.
        shuffle: permute shards and windows each epoch (from `seed`); False reads sequentially.
        seed: seed of the permutations.
        vocab_size: when given, each shard's token ids are checked to be below it the first time the
            shard is opened (ShardError naming the file and offset), not when a batch meets a bad id.

    Attributes: n_tokens (tokens in all shards), batches_per_epoch, tokens_per_epoch (used per epoch,
    all ranks together), epoch, files.
    """

    def __init__(self, data_dir_or_files, split: str, B: int, T: int, rank: int = 0,
                 world_size: int = 1, shuffle: bool = True, seed: int = 0, vocab_size: int | None = None):
        for name, v in (("B", B), ("T", T), ("world_size", world_size)):
            if int(v) != v or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        self.split, self.B, self.T = split, int(B), int(T)
        self.rank, self.world_size = int(rank), int(world_size)
        self.shuffle, self.seed = bool(shuffle), int(seed)
        self.vocab_size = vocab_size
        self._checked: set[int] = set()  # shards whose ids were checked against vocab_size
        self.window = self.world_size * self.B * self.T   # tokens per global batch (+1 for targets)

        files = _resolve_files(data_dir_or_files, split)
        sizes = [read_header(p) for p in files]           # validates every shard (ShardError names it)
        self.n_tokens = int(sum(sizes))
        usable, skipped = [], []
        for p, n in zip(files, sizes):
            (usable if (n - 1) // self.window >= 1 else skipped).append((p, n))
        need = (f"{self.window + 1} tokens for one batch (world_size*B*T + 1 = "
                f"{self.world_size}*{self.B}*{self.T} + 1)")
        if not usable:
            detail = ", ".join(f"{p} has {n}" for p, n in skipped[:3]) + (" ..." if len(skipped) > 3 else "")
            raise ShardError(f"{split} shards are too small: {detail} tokens, but a shard needs at least "
                             f"{need}; use a smaller B or T, or larger shards")
        for p, n in skipped:
            warnings.warn(f"skipping shard {p}: {n} tokens, fewer than {need}", stacklevel=2)
        self.files = [p for p, _ in usable]
        self._sizes = [n for _, n in usable]
        self._n_windows = [(n - 1) // self.window for _, n in usable]
        self.batches_per_epoch = int(sum(self._n_windows))
        self.tokens_per_epoch = self.batches_per_epoch * self.window
        self._tokens = None        # ShardReader of the current shard (pread, no memory map)
        self._tokens_shard = -1    # index into self.files of that reader
        self.reset()

    # ---------------------------------------------------------------- orders
    def _shard_order(self, epoch: int) -> np.ndarray:
        n = len(self.files)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch]).permutation(n)

    def _window_order(self, epoch: int, shard: int) -> np.ndarray:
        n = self._n_windows[shard]
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch, shard, 1]).permutation(n)

    def _enter(self, epoch: int, shard_pos: int, window_pos: int):
        self.epoch, self._shard_pos, self._window_pos = epoch, shard_pos, window_pos
        self._order = self._shard_order(epoch)
        self._windows = self._window_order(epoch, int(self._order[shard_pos]))

    # ---------------------------------------------------------------- API
    def reset(self):
        """Back to the first batch of epoch 0 (the same batches as right after construction)."""
        self._enter(0, 0, 0)
        self.step = 0

    def next_batch(self):
        """The next (x, y), both np.int32 of shape (B, T)."""
        shard = int(self._order[self._shard_pos])
        if self._tokens_shard != shard:
            if self._tokens is not None:
                self._tokens.close()
            self._tokens = ShardReader(self.files[shard])
            if self._tokens.n != self._sizes[shard]:
                raise ShardError(f"{self.files[shard]}: the shard changed while in use: {self._sizes[shard]:,} tokens "
                                 f"when the run started, {self._tokens.n:,} now. Was it re-prepared in place under "
                                 "this run? Prepare into a new folder, or let the preparation finish, then resume")
            if self.vocab_size is not None and shard not in self._checked:
                self._tokens.check_vocab(self.vocab_size)
            self._tokens_shard = shard
            self._checked.add(shard)
        start = int(self._windows[self._window_pos]) * self.window + self.rank * self.B * self.T
        buf = self._tokens.read(start, self.B * self.T + 1).astype(np.int32)
        x = buf[:-1].reshape(self.B, self.T)
        y = buf[1:].reshape(self.B, self.T)
        self.step += 1
        # advance: next window, next shard, next epoch
        if self._window_pos + 1 < len(self._windows):
            self._window_pos += 1
        elif self._shard_pos + 1 < len(self.files):
            self._enter(self.epoch, self._shard_pos + 1, 0)
        else:
            self._enter(self.epoch + 1, 0, 0)
        return x, y

    def __iter__(self):
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict:
        """The position (JSON-serialisable): epoch, shard, window and the seed that the permutations
        derive from. The same on every rank."""
        return {
            "version": STATE_VERSION,
            "split": self.split,
            "epoch": int(self.epoch),
            "shard_pos": int(self._shard_pos),
            "shard": self.files[int(self._order[self._shard_pos])].name,
            "window_pos": int(self._window_pos),
            "step": int(self.step),
            "seed": self.seed,
            "shuffle": self.shuffle,
            "global_batch_tokens": self.window,
            "files": [p.name for p in self.files],
        }

    def load_state_dict(self, d: dict):
        """Restore a position saved by state_dict(); the next batch is the one that would have come
        next in the saved run. The shard list and the global batch (world_size*B*T) must match."""
        if d.get("version") != STATE_VERSION:
            raise ValueError(f"unsupported loader state version {d.get('version')!r}")
        if d["global_batch_tokens"] != self.window:
            raise ValueError(
                f"loader state was saved with {d['global_batch_tokens']} tokens per global batch, this "
                f"loader has {self.window} (world_size*B*T = {self.world_size}*{self.B}*{self.T}); "
                "resume with the same global batch")
        names = [p.name for p in self.files]
        if d["files"] != names:
            raise ValueError(f"loader state was saved over shards {d['files'][:3]}... ({len(d['files'])} "
                             f"files), this loader has {names[:3]}... ({len(names)} files)")
        self.seed, self.shuffle = int(d["seed"]), bool(d["shuffle"])
        self._enter(int(d["epoch"]), int(d["shard_pos"]), int(d["window_pos"]))
        if not 0 <= self._window_pos < len(self._windows):
            raise ValueError(f"loader state has window_pos {self._window_pos} outside shard {d['shard']}")
        self.step = int(d.get("step", 0))

    def __repr__(self):
        return (f"DataLoader({self.split!r}, {len(self.files)} shards, {self.n_tokens:,} tokens, B={self.B}, "
                f"T={self.T}, rank={self.rank}/{self.world_size}, shuffle={self.shuffle}, seed={self.seed}, "
                f"{self.batches_per_epoch} batches/epoch)")


__all__ = ["DataLoader", "ShardError"]
