"""ZeRO checkpoints: every rank writes its own shard of the optimizer state, and `consolidate` merges the shards
into the full AdamW state that any world size resumes (the layout: gpt2core.formats.checkpoint's docstring)."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np

from .atomic import atomic_write
from .manifest import (Writing, checkpoint_bytes, checkpoint_dir, checkpoint_state, finish_checkpoint, shard_file,
                       write_json)
from .llmc import CheckpointError, NonFiniteError, first_nonfinite, save_model


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
    w = Writing(final, checkpoint_bytes(model, metrics_path, full_optimizer=False)
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
        with w, atomic_write(tmp / w(shard_file(rank, world))) as f:
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
            with np.load(tmp / shard_file(r, world), allow_pickle=False) as z:
                shards.append({"file": shard_file(r, world), "lo": int(z["lo"]), "hi": int(z["hi"])})
        st = checkpoint_state(step, model, state)
        st["zero"] = {"stage": 1, "world_size": world, "shards": shards}
        with w:
            write_json(tmp / w("state.json"), st)
            finish_checkpoint(tmp, final, step, w, zero={"stage": 1, "world_size": world})
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final
