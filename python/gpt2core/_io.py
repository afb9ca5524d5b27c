"""Atomic file writes: every file gpt2core writes appears whole or not at all."""
from __future__ import annotations

import contextlib
import os
from pathlib import Path


@contextlib.contextmanager
def atomic_write(path, mode: str = "wb", tmp_name: str | None = None):
    """Open a temporary file beside `path` (named path.name + ".tmp" unless tmp_name is given), yield it,
    then flush, fsync and rename it onto `path`. If the body raises, the temporary file is removed and
    `path` is untouched."""
    path = Path(path)
    tmp = path.with_name(tmp_name or path.name + ".tmp")
    try:
        with open(tmp, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
