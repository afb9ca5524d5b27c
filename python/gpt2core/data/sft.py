"""Conversations for supervised fine-tuning (gpt2core-train --sft): reading, rendering, packing, batches.

Input: OpenAI-style JSON lines, one conversation per line,

    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3?"},
                  {"role": "assistant", "content": "5"}]}

in a .jsonl file or a folder of them (every *.jsonl in it, in name order; blank lines are skipped). A bad line is
one SFTDataError naming the file, the line and the field ("data/a.jsonl:7: messages[1].role: must be one of
system, user, assistant, got 'bot'").

Each conversation is rendered by gpt2core.chat (ids, mask) and packed into rows of T + 1 tokens (the inputs are
row[:-1], the targets row[1:]): best fit, a conversation goes into the fullest row it still fits in, never split
over two rows, so a row holds whole conversations and padding. Targets are -1 (ignored by the loss) wherever the
token is not trained on (mask 0: system and user turns, start tokens, each conversation's leading <|endoftext|>,
so nothing is predicted across a boundary) and on the padding, as nanochat pads its SFT rows. A conversation
longer than T + 1 tokens is cut to T + 1 (counted; dropped if nothing trained on is left). Within a row the
conversations see the ones before them (no document mask), separated by <|endoftext|>, as in pre-training.

Validation: a seeded, held-out fraction of the conversations (val_frac), packed the same way.

SFTLoader has the DataLoader's face (next_batch, reset, state_dict / load_state_dict, batches_per_epoch, n_tokens),
so the training loop is the one of pre-training: each epoch shuffles the rows (seeded), a global batch is
world_size * B rows and rank r takes its B; the last batch of an epoch is completed with the epoch's first rows,
so every micro-batch has targets to score.
"""
from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .. import chat
from ..errors import FileFormatError

STATE_VERSION = 1
PAD = chat.BOS  # the input id of padding (its target is ignored)


class SFTDataError(FileFormatError):
    """A conversations file that cannot be used: names the file, the line and the field."""


def conversation_files(path) -> list[Path]:
    """The .jsonl files of `path`: the file itself, or every *.jsonl in a folder, in name order."""
    p = Path(path)
    if p.is_dir():
        files = sorted(f for f in p.glob("*.jsonl") if f.is_file())
        if not files:
            raise SFTDataError(f"{p}: no *.jsonl files in this folder (one {{\"messages\": [...]}} object per line)")
        return files
    if not p.exists():
        raise SFTDataError(f"{p}: no such file or folder")
    return [p]


def read_conversations(path) -> list[list[dict]]:
    """Every conversation's messages, in file and line order; SFTDataError for the first bad line."""
    out = []
    for f in conversation_files(path):
        try:
            with open(f, encoding="utf-8") as fh:
                for n, line in enumerate(fh, 1):
                    if not line.strip():
                        continue
                    try:
                        obj = json.loads(line)
                    except ValueError as e:
                        raise SFTDataError(f"{f}:{n}: not valid JSON ({e})") from None
                    if not isinstance(obj, dict) or "messages" not in obj:
                        raise SFTDataError(f"{f}:{n}: messages: each line must be an object "
                                           "{\"messages\": [{\"role\", \"content\"}, ...]}")
                    try:
                        chat.check_messages(obj["messages"])
                    except chat.ChatFormatError as e:
                        raise SFTDataError(f"{f}:{n}: {e.field}: {e.reason}") from None
                    out.append(obj["messages"])
        except UnicodeDecodeError as e:
            raise SFTDataError(f"{f}: not UTF-8 text ({e})") from None
        except OSError as e:
            raise SFTDataError(f"{f}: cannot read it ({e.strerror or e})") from None
    if not out:
        raise SFTDataError(f"{path}: no conversations")
    return out


@dataclass
class Packed:
    """Rows of T + 1 tokens: ids (R, T + 1) uint16 and trained (R, T + 1) bool (mask; False on padding), and what
    packing did."""
    ids: np.ndarray
    trained: np.ndarray
    conversations: int
    tokens: int        # not padding
    truncated: int
    dropped: int

    @property
    def rows(self) -> int:
        return len(self.ids)

    def batch(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(x, y) int32 (len(rows), T) of these rows: y = -1 where the next token is not trained on."""
        ids = self.ids[rows].astype(np.int32)
        y = np.where(self.trained[rows, 1:], ids[:, 1:], -1).astype(np.int32)
        return np.ascontiguousarray(ids[:, :-1]), y


def pack(rendered, T: int) -> Packed:
    """Best-fit packing of (ids, mask) pairs into rows of T + 1 tokens (see the module docstring)."""
    W = T + 1
    free: list[tuple[int, int]] = []   # (room left, row), sorted
    rows: list[list[tuple[np.ndarray, np.ndarray]]] = []
    truncated = dropped = 0
    for ids, mask in rendered:
        if len(ids) > W:
            ids, mask = ids[:W], mask[:W]
            truncated += 1
            if not mask[1:].any():
                dropped += 1
                continue
        n = len(ids)
        i = bisect.bisect_left(free, (n, -1))
        if i < len(free):
            room, r = free.pop(i)
        else:
            room, r = W, len(rows)
            rows.append([])
        rows[r].append((ids, mask))
        if room - n > 0:
            bisect.insort(free, (room - n, r))
    out_ids = np.full((len(rows), W), PAD, dtype=np.uint16)
    out_mask = np.zeros((len(rows), W), dtype=bool)
    for r, docs in enumerate(rows):
        at = 0
        for ids, mask in docs:
            out_ids[r, at:at + len(ids)] = ids
            out_mask[r, at:at + len(ids)] = mask.astype(bool)
            at += len(ids)
    return Packed(out_ids, out_mask, len(rendered) - dropped, sum(len(d[0]) for r in rows for d in r), truncated,
                  dropped)


def split(conversations: list, val_frac: float, seed: int) -> tuple[list, list]:
    """(train, val): a seeded val_frac of the conversations held out (at least one when val_frac > 0 and there are
    two or more), each part in its original order."""
    n = len(conversations)
    n_val = min(n - 1, max(1, round(val_frac * n))) if val_frac > 0 and n > 1 else 0
    held = set(np.random.default_rng([seed, 7]).permutation(n)[:n_val].tolist())
    return ([c for i, c in enumerate(conversations) if i not in held],
            [c for i, c in enumerate(conversations) if i in held])


def load(path, T: int, val_frac: float, seed: int) -> tuple[Packed, Packed | None]:
    """(train rows, validation rows or None) of a conversations file or folder."""
    train, val = split(read_conversations(path), val_frac, seed)
    packs = [pack([chat.render(m) for m in part], T) if part else None for part in (train, val)]
    if packs[0].conversations == 0:
        raise SFTDataError(f"{path}: every conversation is longer than -T {T} + 1 tokens with nothing trained on in "
                           "its first T + 1: raise -T")
    return packs[0], packs[1]


class SFTLoader:
    """(x, y) int32 (B, T) batches of packed conversation rows (DataLoader's interface; see the module docstring).
    n_tokens: tokens in the rows that are not padding; trained_tokens: targets scored per epoch."""

    def __init__(self, packed: Packed, split: str, B: int, T: int, rank: int = 0, world_size: int = 1,
                 shuffle: bool = True, seed: int = 0):
        if packed.ids.shape[1] != T + 1:
            raise ValueError(f"rows are packed for T={packed.ids.shape[1] - 1}, not T={T}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        self.packed, self.split, self.B, self.T = packed, split, int(B), int(T)
        self.rank, self.world_size, self.shuffle, self.seed = int(rank), int(world_size), bool(shuffle), int(seed)
        self.global_rows = self.world_size * self.B
        self.batches_per_epoch = math.ceil(packed.rows / self.global_rows)
        self.n_tokens = packed.tokens
        self.trained_tokens = int(packed.trained[:, 1:].sum())
        self.reset()

    def _order(self, epoch: int) -> np.ndarray:
        n = self.packed.rows
        order = np.random.default_rng([self.seed, epoch, 11]).permutation(n) if self.shuffle else np.arange(n)
        need = self.batches_per_epoch * self.global_rows
        return np.resize(order, need)  # the last batch completed with the epoch's first rows

    def reset(self) -> None:
        self.epoch, self.pos, self.step = 0, 0, 0
        self._rows = self._order(0)

    def next_batch(self) -> tuple[np.ndarray, np.ndarray]:
        start = self.pos * self.global_rows + self.rank * self.B
        x, y = self.packed.batch(self._rows[start:start + self.B])
        self.step += 1
        self.pos += 1
        if self.pos == self.batches_per_epoch:
            self.epoch, self.pos = self.epoch + 1, 0
            self._rows = self._order(self.epoch)
        return x, y

    def state_dict(self) -> dict:
        return {"version": STATE_VERSION, "kind": "sft", "split": self.split, "epoch": self.epoch, "pos": self.pos,
                "step": self.step, "seed": self.seed, "shuffle": self.shuffle, "rows": self.packed.rows,
                "global_rows": self.global_rows}

    def load_state_dict(self, d: dict) -> None:
        if d.get("version") != STATE_VERSION or d.get("kind") != "sft":
            raise ValueError(f"not a conversation loader state (version {d.get('version')!r}, kind {d.get('kind')!r})")
        if d["rows"] != self.packed.rows or d["global_rows"] != self.global_rows:
            raise ValueError(f"loader state was saved over {d['rows']} rows in global batches of {d['global_rows']}, "
                             f"this loader has {self.packed.rows} rows and world_size*B = {self.global_rows}: resume "
                             "with the same conversations, -T, -B and number of processes")
        self.seed, self.shuffle = int(d["seed"]), bool(d["shuffle"])
        self.epoch, self.pos, self.step = int(d["epoch"]), int(d["pos"]), int(d["step"])
        self._rows = self._order(self.epoch)

    def describe(self) -> str:
        p = self.packed
        cells = p.rows * (self.T + 1)
        return (f"{p.conversations:,} conversations in {p.rows:,} rows of {self.T + 1} tokens "
                f"({100 * (1 - self.n_tokens / cells):.0f}% padding, {self.trained_tokens:,} targets trained on"
                + (f", {p.truncated} cut to the row length" if p.truncated else "")
                + (f", {p.dropped} dropped: nothing trained on within the row length" if p.dropped else "") + ")")
