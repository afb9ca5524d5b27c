"""ZeRO checkpoints: every rank writes its own shard of the optimizer state, and `consolidate` merges the shards
into the full AdamW state that any world size resumes (the layout: gpt2core.formats.checkpoint's docstring)."""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import numpy as np

from .atomic import npy_bytes, write_flat_npy
from .atomic import atomic_write
from .checkpoint import (CheckpointError, _checkpoint_bytes, _checkpoint_state, _finish_checkpoint, _shard_file,
                         _write_json, _Writing, checkpoint_dir, load_checkpoint)
from .llmc import NonFiniteError, first_nonfinite, save_model


def save_sharded(root: Path, step: int, model, state, metrics_path, dp) -> Path:
    """ZeRO-1 checkpoint, a collective over dp.comm. In order:

    1. rank 0 creates the temporary directory .step_NNNNNN.tmp-<rank 0's pid> and broadcasts the pid (or -1
       if it failed), so every rank writes into the same directory;
    2. every rank writes optim_shard_r<rank>_of_<world>.npz (lo, hi, num_parameters, step_count, m, v of its
       range [lo, hi)) with atomic_write; rank 0 also writes model.bin and metrics.jsonl;
    3. an allreduce of failure flags: the barrier after which every shard is on disk (and every rank learns
       whether one failed, in which case all raise and rank 0 removes the directory);
    4. rank 0 reads each shard's [lo, hi) back (a few bytes), writes state.json with them, hashes all files
       into the manifest and renames the directory into place.

    Pruning (train.py, rank 0, after this returns) therefore never meets a directory another rank is still
    writing. Returns the final directory on every rank (on ranks > 0 rank 0 may still be finishing it)."""
    comm = dp.comm
    rank, world = comm.rank, comm.size
    final = checkpoint_dir(root, step)
    flag = np.zeros(1, dtype=np.float32)
    error = None
    w = _Writing(final, _checkpoint_bytes(model, metrics_path, full_optimizer=False)
                 + 2 * 4 * (dp.hi - dp.lo) + 1024)
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            tmp = root / f".{final.name}.tmp-{os.getpid()}"
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
            flag[0] = os.getpid()  # exact in float32: Linux pids are below 2**22
        except OSError as e:
            error, flag[0] = e, -1
    comm.broadcast(flag, root=0)
    if flag[0] < 0:
        raise CheckpointError(f"{final}: rank 0 could not create the checkpoint directory"
                              + (f" ({error})" if error else "")) from error
    tmp = root / f".{final.name}.tmp-{int(flag[0])}"
    try:
        bad = first_nonfinite([("adam_m", dp.m), ("adam_v", dp.v)]
                              + (list(model.params.items()) if rank == 0 else []))
        if bad:
            raise NonFiniteError(f"{final}: refusing to write a checkpoint with non-finite state on rank {rank} "
                                 f"({bad}); the previous checkpoints are kept")
        with w, atomic_write(tmp / w(_shard_file(rank, world))) as f:
            np.savez(f, lo=np.int64(dp.lo), hi=np.int64(dp.hi), num_parameters=np.int64(model.num_parameters),
                     step_count=np.int64(model.step_count), m=np.asarray(dp.m, dtype="<f4"),
                     v=np.asarray(dp.v, dtype="<f4"))
        if rank == 0:
            with w:
                save_model(model, tmp / w("model.bin"))
                if metrics_path is not None and Path(metrics_path).exists():
                    shutil.copyfile(metrics_path, tmp / w("metrics.jsonl"))
        flag[0] = 0.0
    except Exception as e:  # noqa: BLE001 -- reported to every rank below, then re-raised here
        error, flag[0] = e, 1.0
    comm.allreduce(flag, "sum")  # the barrier: every shard is written (or some rank failed)
    if flag[0] > 0:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if error is not None:
            raise error
        raise CheckpointError(f"{final}: {int(flag[0])} other rank(s) failed to write their optimizer shard; "
                              "checkpoint abandoned")
    if rank != 0:
        return final
    try:
        shards = []
        for r in range(world):
            with np.load(tmp / _shard_file(r, world), allow_pickle=False) as z:
                shards.append({"file": _shard_file(r, world), "lo": int(z["lo"]), "hi": int(z["hi"])})
        st = _checkpoint_state(step, model, state)
        st["zero"] = {"stage": 1, "world_size": world, "shards": shards}
        with w:
            _write_json(tmp / w("state.json"), st)
            _finish_checkpoint(tmp, final, step, w, zero={"stage": 1, "world_size": world})
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final
def consolidate(path, out=None) -> Path:
    """Merge a ZeRO-1 checkpoint's optimizer shards into full adam_m.npy / adam_v.npy, so that any world
    size (a single process, plain data parallel, or ZeRO-1 over another number of ranks) can resume it.

    Writes `out` (default: replaces `path` itself), atomically like save_checkpoint: a temporary directory
    renamed into place after its manifest. Appends one shard's moments at a time to the output files, so it
    never holds the full optimizer state in memory. Returns the verified consolidated checkpoint's path."""
    ck = load_checkpoint(path)
    if ck.zero is None:
        raise CheckpointError(f"{ck.path}: not a ZeRO-1 checkpoint; it already holds the full optimizer state")
    dest = Path(out) if out is not None else ck.path
    tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}"
    n = int(ck.state["optimizer"]["num_parameters"])
    with _Writing(dest, sum(f.stat().st_size for f in ck.path.iterdir()) + 2 * npy_bytes(n)) as w:
        dest.parent.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        try:
            for name in ("model.bin", "metrics.jsonl"):
                if (ck.path / name).exists():
                    shutil.copyfile(ck.path / name, tmp / w(name))
            # the shards tile [0, n) in rank order (load_checkpoint checked it): append them one at a time,
            # each moment in turn, so that only one shard's m or v is in memory
            for i, name in enumerate(("adam_m.npy", "adam_v.npy")):
                with open(tmp / w(name), "wb") as f:
                    write_flat_npy(f, n, (ck._read_shard(r)[2 + i] for r in range(ck.zero["world_size"])))
                    f.flush()
                    os.fsync(f.fileno())
            st = dict(ck.state)
            st["consolidated_from"] = {"zero": st.pop("zero"), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                       time.gmtime())}
            _write_json(tmp / w("state.json"), st)
            _finish_checkpoint(tmp, dest, ck.step, w)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return load_checkpoint(dest).path
