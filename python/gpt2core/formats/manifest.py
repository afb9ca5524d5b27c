"""How a checkpoint directory is written (the format: gpt2core.formats.checkpoint's docstring): files written and
fsynced into a hidden temporary directory, hashed into manifest.json written last, then the directory renamed into
place; an OSError on the way becomes a WriteError naming the file and the bytes needed. Shared by the
single-process writer (checkpoint.py) and ZeRO's per-rank writer (zero_shards.py)."""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from pathlib import Path

from .. import _C
from ..errors import WriteError, write_error
from .atomic import npy_bytes, write_flat_npy
from .llmc import NonFiniteError, first_nonfinite

CHECKPOINT_FORMAT = "gpt2core-checkpoint"
CHECKPOINT_VERSION = 1   # full optimizer state (adam_m.npy, adam_v.npy)
CHECKPOINT_VERSIONS = (1, 2)  # 2: ZeRO-1, one optimizer shard file per rank
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(1 << 22)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def write_json(path: Path, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def save_flat(path: Path, parts) -> None:
    with open(path, "wb") as f:
        write_flat_npy(f, sum(int(a.size) for a in parts), parts)
        f.flush()
        os.fsync(f.fileno())


class Writing:
    """Turns an OSError raised while writing the checkpoint `final` into a WriteError naming the file being
    written (`self.file`, as it will be named in `final`) and the checkpoint's `needed` bytes."""

    def __init__(self, final: Path, needed: int):
        self.final, self.needed, self.file = final, needed, None

    def __call__(self, name: str) -> str:
        self.file = name
        return name

    def __enter__(self):
        return self

    def __exit__(self, kind, e, tb):
        if isinstance(e, OSError):
            if isinstance(e, WriteError) and isinstance(e.__cause__, OSError):
                e = e.__cause__  # a file writer's own WriteError: re-worded for the whole checkpoint
            raise write_error(e, self.final / self.file if self.file else self.final, self.needed,
                              what="write checkpoint") from e
        return False


def checkpoint_bytes(model, metrics_path, full_optimizer: bool = True) -> int:
    """About how many bytes a checkpoint of `model` takes: model.bin, the AdamW moments, metrics, JSON."""
    n = model.num_parameters
    metrics = Path(metrics_path).stat().st_size if metrics_path is not None and Path(metrics_path).exists() else 0
    return 1024 + 4 * n + (2 * npy_bytes(n) if full_optimizer else 0) + metrics + (16 << 10)  # + JSON


def check_finite_state(model, path) -> None:
    """Raise NonFiniteError (naming `path` and the tensor) when the weights or AdamW moments hold NaN or
    Inf: such a state is never written, since resuming from it could only produce NaN."""
    names = list(model.params)
    m, v = model.opt_state()
    bad = first_nonfinite([(k, model.params[k]) for k in names] + [(f"adam_m[{k}]", m[k]) for k in names]
                          + [(f"adam_v[{k}]", v[k]) for k in names])
    if bad:
        raise NonFiniteError(f"{path}: refusing to write a checkpoint with non-finite state ({bad}); the "
                             "previous checkpoints are kept")


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def checkpoint_dir(root, step: int) -> Path:
    return Path(root) / f"step_{step:06d}"


def shard_file(rank: int, world: int) -> str:
    return f"optim_shard_r{rank}_of_{world}.npz"


def checkpoint_state(step: int, model, state: dict | None) -> dict:
    names = list(model.params)  # the config's tensors in layout order (GPT-2: llm.c's 16)
    st = dict(state or {})
    st.update({
        "step": int(step),
        "optimizer": {"name": "adamw", "step_count": int(model.step_count), "param_order": names,
                      "num_parameters": int(model.num_parameters), "loss_scaler": model.loss_scaler_state()},
        "model_config": model.config.to_dict(),
        "gpt2core_version": _C.build_info()["version"],
        "device": getattr(model, "device", "cpu"),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    })
    return st


def finish_checkpoint(tmp: Path, final: Path, step: int, w: Writing, zero: dict | None = None) -> None:
    """Hash every file of `tmp` into its manifest (written last), then rename tmp onto `final` (swapping out
    an existing `final`). Version 1: full optimizer state; version 2: ZeRO-1 shards (`zero` in the manifest)."""
    files = {}
    for f in sorted(tmp.iterdir()):
        files[f.name] = {"bytes": f.stat().st_size, "sha256": sha256_file(f)}
    manifest = {"format": CHECKPOINT_FORMAT, "version": 2 if zero else 1, "step": int(step), "files": files}
    if zero:
        manifest["zero"] = zero
    write_json(tmp / w(MANIFEST), manifest)
    fsync_dir(tmp)
    root = final.parent
    w("")  # renaming into place
    if final.exists():  # the same step written again (e.g. by a resumed run): swap it out
        old = root / f".{final.name}.old-{os.getpid()}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    fsync_dir(root)
