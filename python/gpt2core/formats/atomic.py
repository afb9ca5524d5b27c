"""Atomic file writes: every file gpt2core writes appears whole or not at all, and a failed write is a
WriteError naming the file (see errors.py), never a half-written file."""
from __future__ import annotations

import contextlib
import io
import os
import tokenize
import zipfile
import zlib
from pathlib import Path

import numpy as np

from ..errors import write_error


# what np.load raises on a malformed .npy / .npz (beyond OSError for an unreadable file): a bad header or zip
# directory, a truncated or corrupt member, a member that is not an array, an unknown compression; numpy parses
# a version-1 header with tokenize, whose TokenError a mangled header raises
NPZ_ERRORS = (OSError, ValueError, KeyError, TypeError, EOFError, SyntaxError, OverflowError, NotImplementedError,
              zipfile.BadZipFile, zlib.error, tokenize.TokenError)


@contextlib.contextmanager
def atomic_write(path, mode: str = "wb", tmp_name: str | None = None, needed: int | None = None):
    """Open a temporary file beside `path` (named path.name + ".tmp" unless tmp_name is given), yield it,
    then flush, fsync and rename it onto `path`. If the body raises, the temporary file is removed and
    `path` is untouched; an OSError of the write (disk full, I/O error, permission) becomes a WriteError
    naming `path` and the `needed` bytes, when given."""
    path = Path(path)
    tmp = path.with_name(tmp_name or path.name + ".tmp")
    try:
        with open(tmp, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        raise write_error(e, path, needed) from e
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()


def write_flat_npy(f, n: int, parts) -> None:
    """Write the float32 arrays `parts` (an iterable, read one at a time), flattened and concatenated into
    n values, to the open file `f` as one 1-D .npy array, with plain writes: no memory map, so a full disk
    is an OSError here, not a SIGBUS later."""
    np.lib.format.write_array_header_1_0(f, {"descr": "<f4", "fortran_order": False, "shape": (n,)})
    written = 0
    for a in parts:
        a = np.ascontiguousarray(a, dtype="<f4")
        f.write(a.data)
        written += a.size
    if written != n:
        raise ValueError(f"{getattr(f, 'name', f)}: wrote {written} values, the header says {n}")


def npy_bytes(n: int) -> int:
    """Size of the .npy file write_flat_npy writes for n float32 values: its header, then 4n bytes."""
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False, "shape": (n,)})
    return header.tell() + 4 * n
