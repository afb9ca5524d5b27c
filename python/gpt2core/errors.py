"""The package's error types for files it cannot read or write.

Every reader (llm.c model files, safetensors, pytorch_model.bin, .npz, token shards, checkpoints,
HellaSwag files) raises a subclass of `FileFormatError` whose message names the file and what is wrong,
whatever the bytes: `except gpt2core.errors.FileFormatError` catches all of them. A failed write
(disk full, I/O error, permission) raises `WriteError`, an OSError with the same errno, naming the path
and the bytes the write needed.
"""
from __future__ import annotations

import errno as _errno
import os
import shutil
from pathlib import Path


class Error(Exception):
    """Every error of gpt2core's own: its message is the whole story (it names the file, flag or cause), so a
    console script prints it as one line and exits 1 (see gpt2core.cli), with no traceback."""


class ArgError(Error, ValueError):
    """A bad argument (a flag or a function argument): the message names it. Console scripts exit 2 (usage)."""


class Preempted(Error):
    """The run stopped on SIGTERM/SIGINT after writing a checkpoint. Console scripts exit 75 (EX_TEMPFAIL)."""


class DeviceUnavailable(Error, RuntimeError):
    """A well-formed device that this machine or build cannot run (no CUDA backend, no such GPU)."""


class FileFormatError(Error, ValueError):
    """A file that cannot be used: the message names the file and what is wrong."""


class WriteError(Error, OSError):
    """A write that failed (ENOSPC, EIO, EACCES, EFBIG...): the message names the path, the reason and the
    bytes needed; `errno` is the original one. Whatever was half written has been removed."""

    def __str__(self) -> str:  # the message alone, without OSError's "[Errno n]" prefix
        return self.strerror


def write_error(e: OSError, path, needed: int | None = None, what: str = "write") -> WriteError:
    """A WriteError for OSError `e` raised while writing `path` (`needed` bytes in all): the message says
    what failed, why (strerror and errno name) and, for a full disk, how much was needed and is free."""
    path = Path(path)
    reason = e.strerror or str(e)
    name = _errno.errorcode.get(e.errno, "") if e.errno else ""
    msg = f"{path}: cannot {what}: {reason}" + (f" ({name})" if name else "")
    if needed is not None:
        msg += f"; it needs {_size(needed)}"
        if e.errno in (_errno.ENOSPC, _errno.EDQUOT):
            free = _free_bytes(path)
            if free is not None:
                msg += f", {_size(free)} free on that file system"
    if e.errno in (_errno.EACCES, _errno.EPERM, _errno.EROFS):
        msg += f" (check the permissions of {path.parent})"
    err = WriteError(e.errno, msg)
    err.filename = os.fspath(path)
    return err


def _free_bytes(path: Path) -> int | None:
    for p in (path, *path.parents):
        try:
            return shutil.disk_usage(p).free
        except OSError:
            continue
    return None


def _size(n: int) -> str:
    return f"{n:,} bytes ({n / 2**20:,.1f} MiB)" if n >= 2**20 else f"{n:,} bytes"


__all__ = ["Error", "ArgError", "Preempted", "DeviceUnavailable", "FileFormatError", "WriteError", "write_error"]


def utf8_text(raw: bytes, what: str) -> str:
    """raw decoded as UTF-8, or FileFormatError "<what> is not UTF-8 text (byte 0x.. on line N)"."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise FileFormatError(f"{what} is not UTF-8 text (byte 0x{raw[e.start]:02x} on line {line})") from None
