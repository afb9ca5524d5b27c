"""Training checkpoints: directories that resume a run exactly (weights, AdamW state, data position).

A checkpoint is a directory `<output-dir>/checkpoints/step_NNNNNN/`:

    model.bin        the weights, an llm.c version-3 (fp32) model file (the CPU backend's master weights)
    adam_m.npy       AdamW first moments, all parameters flat in param_names() order, float32
    adam_v.npy       AdamW second moments, the same layout
    state.json       step, optimizer step count, next LR, train loader position, model config, the
                     training arguments, versions
    metrics.jsonl    a copy of the run's metrics up to this step
    manifest.json    written last: format, version, step, and the size and sha256 of every other file

A ZeRO-1 run (`--zero 1`, W ranks) writes no adam_m.npy / adam_v.npy: every rank r writes its own shard
`optim_shard_r{r}_of_{W}.npz` (lo, hi, num_parameters, step_count, and m, v of parameters [lo, hi)), state.json
records {"zero": {"stage": 1, "world_size": W, "shards": [{"file", "lo", "hi"}, ...]}}, and the manifest
(version 2, with "zero": {"stage": 1, "world_size": W}) is written by rank 0 only after every rank's shard is
on disk, and lists the shards like any other file: a missing or corrupt shard makes the checkpoint
incomplete. No rank holds the full optimizer state while saving or loading. Such a checkpoint resumes
only with W ranks and --zero 1 (CheckpointError otherwise, naming the way out):
`python -m gpt2core.checkpoint consolidate DIR` merges the shards into adam_m.npy / adam_v.npy (version 1),
which resumes with any world size; a ZeRO-1 run resuming a full checkpoint reads only its slice of it.

Everything is plain little-endian arrays and JSON, so a checkpoint does not depend on the device that
wrote it. A checkpoint is written into a hidden temporary directory that is renamed into place only
after its manifest is on disk: a crash mid-write leaves the previous checkpoints intact, and a
directory without a valid manifest, or whose files do not match it, is incomplete and is rejected.
`latest_checkpoint(dir)` (what `--resume auto` uses) returns the newest complete one.

The weights file is written and read by llmc.py; loading the weights of any source (llm.c file, checkpoint,
Hugging Face) into a new model is `GPT2.from_pretrained` (pretrained.py reads them).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import _C
from ._io import atomic_write
from .config import GPT2Config
from .llmc import CheckpointError, describe, fill_params, read_model, save_model

CHECKPOINT_FORMAT = "gpt2core-checkpoint"
CHECKPOINT_VERSION = 1   # full optimizer state (adam_m.npy, adam_v.npy)
CHECKPOINT_VERSIONS = (1, 2)  # 2: ZeRO-1, one optimizer shard file per rank
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")


# ------------------------------------------------------------------------------------ checkpoints
def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(1 << 22)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def _write_json(path: Path, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def _save_flat(path: Path, parts) -> None:
    n = sum(int(a.size) for a in parts)
    out = np.lib.format.open_memmap(path, mode="w+", dtype="<f4", shape=(n,))
    off = 0
    for a in parts:
        out[off:off + a.size] = a.reshape(-1)
        off += a.size
    out.flush()
    del out


def _fsync_dir(path: Path) -> None:
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


def _shard_file(rank: int, world: int) -> str:
    return f"optim_shard_r{rank}_of_{world}.npz"


def _checkpoint_state(step: int, model, state: dict | None) -> dict:
    names = list(_C.param_names())
    st = dict(state or {})
    st.update({
        "step": int(step),
        "optimizer": {"name": "adamw", "step_count": int(model.step_count), "param_order": names,
                      "num_parameters": int(model.num_parameters)},
        "model_config": model.config.to_dict(),
        "gpt2core_version": _C.build_info()["version"],
        "device": getattr(model, "device", "cpu"),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    })
    return st


def _finish_checkpoint(tmp: Path, final: Path, step: int, zero: dict | None = None) -> None:
    """Hash every file of `tmp` into its manifest (written last), then rename tmp onto `final` (swapping out
    an existing `final`). Version 1: full optimizer state; version 2: ZeRO-1 shards (`zero` in the manifest)."""
    files = {}
    for f in sorted(tmp.iterdir()):
        files[f.name] = {"bytes": f.stat().st_size, "sha256": _sha256(f)}
    manifest = {"format": CHECKPOINT_FORMAT, "version": 2 if zero else 1, "step": int(step), "files": files}
    if zero:
        manifest["zero"] = zero
    _write_json(tmp / MANIFEST, manifest)
    _fsync_dir(tmp)
    root = final.parent
    if final.exists():  # the same step written again (e.g. by a resumed run): swap it out
        old = root / f".{final.name}.old-{os.getpid()}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _fsync_dir(root)


def save_checkpoint(root, step: int, model, state: dict | None = None, metrics_path=None, zero=None) -> Path:
    """Write a checkpoint of `model` (weights, AdamW moments, step count) after `step` optimizer steps
    into root/step_NNNNNN, atomically. `state` (JSON-serialisable: loader position, args...) goes into
    state.json; the file at metrics_path (if it exists) is copied. Returns the directory.

    zero: the `distributed.DataParallel` of a ZeRO-1 run. Then this is a collective call (every rank calls
    it, `root` on a file system all ranks share): rank 0 writes model.bin, state.json and metrics.jsonl, every
    rank writes its own optimizer shard (see _save_sharded), and no rank holds the full AdamW state."""
    if zero is not None and getattr(zero, "zero", 0):
        return _save_sharded(Path(root), step, model, state, metrics_path, zero)
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = checkpoint_dir(root, step)
    tmp = root / f".{final.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        names = list(_C.param_names())
        save_model(model, tmp / "model.bin")
        m, v = model.opt_state()
        _save_flat(tmp / "adam_m.npy", [m[k] for k in names])
        _save_flat(tmp / "adam_v.npy", [v[k] for k in names])
        _write_json(tmp / "state.json", _checkpoint_state(step, model, state))
        if metrics_path is not None and Path(metrics_path).exists():
            shutil.copyfile(metrics_path, tmp / "metrics.jsonl")
        _finish_checkpoint(tmp, final, step)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _save_sharded(root: Path, step: int, model, state, metrics_path, dp) -> Path:
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
        with atomic_write(tmp / _shard_file(rank, world)) as f:
            np.savez(f, lo=np.int64(dp.lo), hi=np.int64(dp.hi), num_parameters=np.int64(model.num_parameters),
                     step_count=np.int64(model.step_count), m=np.asarray(dp.m, dtype="<f4"),
                     v=np.asarray(dp.v, dtype="<f4"))
        if rank == 0:
            save_model(model, tmp / "model.bin")
            if metrics_path is not None and Path(metrics_path).exists():
                shutil.copyfile(metrics_path, tmp / "metrics.jsonl")
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
        _write_json(tmp / "state.json", st)
        _finish_checkpoint(tmp, final, step, zero={"stage": 1, "world_size": world})
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


@dataclass
class Checkpoint:
    """A verified checkpoint directory: its manifest, its state.json, and loaders for its arrays."""
    path: Path
    step: int
    state: dict
    manifest: dict = field(repr=False)

    @property
    def config(self) -> GPT2Config:
        return GPT2Config(**self.state["model_config"])

    @property
    def metrics_path(self) -> Path | None:
        p = self.path / "metrics.jsonl"
        return p if p.exists() else None

    def read_weights(self) -> tuple[GPT2Config, np.ndarray]:
        """(config, the weights as one flat fp32 vector) from model.bin; optimizer state: see restore()."""
        return read_model(self.path / "model.bin", config=self.config)

    @property
    def zero(self) -> dict | None:
        """{"stage": 1, "world_size": W, "shards": [{"file", "lo", "hi"}, ...]} for a checkpoint written by a
        ZeRO-1 run (its optimizer state is in per-rank shard files), None for a full one."""
        z = self.state.get("zero")
        return z if z and z.get("stage") == 1 else None

    def layout_error(self, world_size: int, zero: bool) -> CheckpointError:
        """The error for resuming this ZeRO-1 checkpoint with another world size, or without ZeRO-1."""
        saved = self.zero["world_size"]
        now = ("a single process" if world_size == 1 else
               f"{'ZeRO-1' if zero else 'plain data parallel (no ZeRO-1)'} over {world_size} ranks")
        return CheckpointError(
            f"{self.path}: this checkpoint was written by a ZeRO-1 run with world size {saved} (each rank saved "
            f"its own shard of the AdamW state), but this run has world size {world_size} ({now}). Resume it with "
            f"{saved} ranks and --zero 1, or first merge the shards into the full optimizer state with "
            f"`python -m gpt2core.checkpoint consolidate {self.path}`; a consolidated checkpoint resumes with any "
            "world size, with or without --zero 1")

    def _moments(self, check_finite: bool = True):
        n = int(self.state["optimizer"]["num_parameters"])
        out = []
        for name in ("adam_m.npy", "adam_v.npy"):
            p = self.path / name
            try:
                a = np.load(p, mmap_mode="r", allow_pickle=False)
            except (OSError, ValueError) as e:
                raise CheckpointError(f"{p}: cannot read optimizer state ({e})") from e
            if a.dtype != np.dtype("<f4") or a.shape != (n,):
                raise CheckpointError(f"{p}: expected float32 of shape ({n},), got {a.dtype} {a.shape}")
            if check_finite and not np.isfinite(a).all():
                raise CheckpointError(f"{p}: optimizer state contains NaN or Inf")
            out.append(a)
        return out

    def _read_shard(self, rank: int) -> tuple[int, int, np.ndarray, np.ndarray]:
        """(lo, hi, m, v) of ZeRO-1 shard `rank`, checked against state.json (only that range is read)."""
        z = self.zero
        info = z["shards"][rank]
        p = self.path / info["file"]
        n, steps = int(self.state["optimizer"]["num_parameters"]), int(self.state["optimizer"]["step_count"])
        try:
            with np.load(p, allow_pickle=False) as f:
                lo, hi, fn, fs = (int(f[k]) for k in ("lo", "hi", "num_parameters", "step_count"))
                m, v = f["m"], f["v"]
        except (OSError, ValueError, KeyError) as e:
            raise CheckpointError(f"{p}: cannot read optimizer shard ({e})") from e
        if (lo, hi) != (info["lo"], info["hi"]) or fn != n or fs != steps:
            raise CheckpointError(f"{p}: shard holds [{lo}, {hi}) of {fn} parameters at optimizer step {fs}; "
                                  f"state.json says [{info['lo']}, {info['hi']}) of {n} at step {steps}")
        for name, a in (("m", m), ("v", v)):
            if a.dtype != np.dtype("<f4") or a.shape != (hi - lo,):
                raise CheckpointError(f"{p}: {name} should be float32 of shape ({hi - lo},), got {a.dtype} {a.shape}")
            if not np.isfinite(a).all():
                raise CheckpointError(f"{p}: optimizer state {name} contains NaN or Inf")
        return lo, hi, m, v

    def load_optimizer_shard(self, rank: int, world_size: int, lo: int, hi: int, m_out, v_out) -> None:
        """ZeRO-1 resume: fill m_out, v_out (length hi - lo) with the AdamW moments of parameters [lo, hi).
        From a ZeRO-1 checkpoint the world size and this rank's range must match what was saved (else
        layout_error); from a full checkpoint the range is sliced from the memory-mapped adam_m/adam_v.
        Either way only this rank's range is read into memory."""
        if self.zero is None:
            am, av = self._moments(check_finite=False)
            for name, src, dst in (("adam_m.npy", am, m_out), ("adam_v.npy", av, v_out)):
                part = src[lo:hi]
                if not np.isfinite(part).all():
                    raise CheckpointError(f"{self.path / name}: optimizer state contains NaN or Inf")
                dst[:] = part
            return
        if self.zero["world_size"] != world_size:
            raise self.layout_error(world_size, zero=True)
        info = self.zero["shards"][rank]
        if (info["lo"], info["hi"]) != (lo, hi):
            raise CheckpointError(f"{self.path}: ZeRO-1 shard {rank} covers parameters [{info['lo']}, {info['hi']}) "
                                  f"but this run's rank {rank} updates [{lo}, {hi}); merge the shards with "
                                  f"`python -m gpt2core.checkpoint consolidate {self.path}` and resume from that")
        _, _, m, v = self._read_shard(rank)
        m_out[:] = m
        v_out[:] = v

    def restore(self, model, optimizer: bool = True) -> None:
        """Load weights, AdamW moments and step count into an existing model of the same shape.
        optimizer=False skips the moments (ZeRO-1 resume: each rank then calls load_optimizer_shard); a
        ZeRO-1 checkpoint's moments can only be restored that way (or after `consolidate`)."""
        if optimizer and self.zero is not None:
            raise self.layout_error(1, zero=False)
        if model.config != self.config:
            raise CheckpointError(f"{self.path}: checkpoint holds a model of shape {describe(self.config)}, the "
                                  f"model to restore into is {describe(model.config)}")
        _, flat = read_model(self.path / "model.bin", config=self.config)
        order = self.state["optimizer"]["param_order"]
        if list(order) != list(_C.param_names()):
            raise CheckpointError(f"{self.path}: optimizer state is in parameter order {order}, this version "
                                  f"uses {list(_C.param_names())}")
        if not optimizer:
            fill_params(model, flat, self.path / "model.bin")
            model.step_count = int(self.state["optimizer"]["step_count"])
            return
        am, av = self._moments()
        fill_params(model, flat, self.path / "model.bin")
        m, v = model.opt_state()
        off = 0
        for name in order:
            p = model.params[name]
            m[name][...] = am[off:off + p.size].reshape(p.shape)
            v[name][...] = av[off:off + p.size].reshape(p.shape)
            off += p.size
        model.step_count = int(self.state["optimizer"]["step_count"])


def load_checkpoint(path, verify: bool = True) -> Checkpoint:
    """Open a checkpoint directory, checking that it is complete: the manifest exists and parses, and
    every file it lists is there with the recorded size and sha256. Raises CheckpointError otherwise."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a checkpoint directory (no such directory)")
    mpath = path / MANIFEST
    if not mpath.exists():
        raise CheckpointError(f"{path}: incomplete checkpoint: no {MANIFEST} (it is written last, so the save "
                              "was interrupted)")
    try:
        manifest = json.loads(mpath.read_text())
        files = manifest["files"]
        step = int(manifest["step"])
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{mpath}: corrupt manifest ({e})") from None
    if manifest.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{mpath}: not a gpt2core checkpoint manifest (format {manifest.get('format')!r})")
    if manifest.get("version") not in CHECKPOINT_VERSIONS:
        raise CheckpointError(f"{mpath}: unsupported checkpoint version {manifest.get('version')!r} "
                              f"(this reader handles {', '.join(map(str, CHECKPOINT_VERSIONS))})")
    zero = manifest.get("zero")
    try:
        world = int(zero["world_size"]) if zero else 0
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{mpath}: corrupt manifest ({e})") from None
    optim = [_shard_file(r, world) for r in range(world)] if zero else ["adam_m.npy", "adam_v.npy"]
    for required in ("model.bin", "state.json", *optim):
        if required not in files:
            raise CheckpointError(f"{mpath}: manifest does not list {required}"
                                  + (f" (the optimizer shard of rank {optim.index(required)} of this ZeRO-1 "
                                     f"checkpoint)" if zero and required in optim else ""))
    for name, info in files.items():
        f = path / name
        if not f.exists():
            raise CheckpointError(f"{f}: missing (listed in the manifest)")
        size = f.stat().st_size
        if size != info.get("bytes"):
            raise CheckpointError(f"{f}: has {size} bytes, the manifest says {info.get('bytes')}; truncated or "
                                  "modified")
        if verify and _sha256(f) != info.get("sha256"):
            raise CheckpointError(f"{f}: sha256 does not match the manifest; the file is corrupt")
    try:
        state = json.loads((path / "state.json").read_text())
        GPT2Config(**state["model_config"])
        state["optimizer"]["step_count"], state["optimizer"]["num_parameters"]
        if zero:  # the shards tile [0, num_parameters) in rank order
            shards = state["zero"]["shards"]
            bounds = [0] + [int(s["hi"]) for s in shards]
            if (int(state["zero"]["world_size"]) != world or len(shards) != world
                    or [s["file"] for s in shards] != optim or [int(s["lo"]) for s in shards] != bounds[:-1]
                    or bounds[-1] != int(state["optimizer"]["num_parameters"])):
                raise ValueError(f"ZeRO-1 shards {shards} do not tile the parameters over world size {world}")
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path / 'state.json'}: corrupt or incomplete state ({e})") from None
    if int(state.get("step", -1)) != step:
        raise CheckpointError(f"{path}: manifest says step {step}, state.json says {state.get('step')}")
    return Checkpoint(path=path, step=step, state=state, manifest=manifest)


def list_checkpoints(root) -> list[tuple[int, Path]]:
    """(step, dir) of every step_NNNNNN directory under root, newest first (complete or not)."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for d in root.iterdir():
        mt = _STEP_DIR.match(d.name)
        if mt and d.is_dir():
            out.append((int(mt.group(1)), d))
    return sorted(out, reverse=True)


def latest_checkpoint(root, log=None) -> Checkpoint | None:
    """The newest complete checkpoint under root (verified), or None. Incomplete or corrupt ones are
    skipped, each with a message through `log` (default: warnings.warn)."""
    for _, d in list_checkpoints(root):
        try:
            return load_checkpoint(d)
        except CheckpointError as e:
            msg = f"skipping checkpoint {d}: {e}"
            if log is None:
                warnings.warn(msg, stacklevel=2)
            else:
                log(msg)
    return None


def prune_checkpoints(root, keep_last: int) -> list[Path]:
    """Delete all but the newest keep_last step_NNNNNN directories (and stale temporary ones left by a
    crash); returns what was deleted."""
    root = Path(root)
    removed = []
    if keep_last and keep_last > 0:
        for _, d in list_checkpoints(root)[keep_last:]:
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    if root.is_dir():
        for d in root.iterdir():
            if d.name.startswith(".step_") and (".tmp-" in d.name or ".old-" in d.name):
                pid = d.name.rsplit("-", 1)[-1]
                if pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
                    shutil.rmtree(d, ignore_errors=True)
                    removed.append(d)
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ------------------------------------------------------------------------------------ ZeRO-1 shards -> full state
def consolidate(path, out=None) -> Path:
    """Merge a ZeRO-1 checkpoint's optimizer shards into full adam_m.npy / adam_v.npy, so that any world
    size (a single process, plain data parallel, or ZeRO-1 over another number of ranks) can resume it.

    Writes `out` (default: replaces `path` itself), atomically like save_checkpoint: a temporary directory
    renamed into place after its manifest. Reads one shard at a time into memory-mapped output files, so it
    never holds the full optimizer state in memory. Returns the verified consolidated checkpoint's path."""
    ck = load_checkpoint(path)
    if ck.zero is None:
        raise CheckpointError(f"{ck.path}: not a ZeRO-1 checkpoint; it already holds the full optimizer state")
    dest = Path(out) if out is not None else ck.path
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        for name in ("model.bin", "metrics.jsonl"):
            if (ck.path / name).exists():
                shutil.copyfile(ck.path / name, tmp / name)
        n = int(ck.state["optimizer"]["num_parameters"])
        am = np.lib.format.open_memmap(tmp / "adam_m.npy", mode="w+", dtype="<f4", shape=(n,))
        av = np.lib.format.open_memmap(tmp / "adam_v.npy", mode="w+", dtype="<f4", shape=(n,))
        for r in range(ck.zero["world_size"]):
            lo, hi, m, v = ck._read_shard(r)
            am[lo:hi], av[lo:hi] = m, v
            del m, v
        am.flush(), av.flush()
        del am, av
        st = dict(ck.state)
        st["consolidated_from"] = {"zero": st.pop("zero"), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                   time.gmtime())}
        _write_json(tmp / "state.json", st)
        _finish_checkpoint(tmp, dest, ck.step)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return load_checkpoint(dest).path


def main(argv=None) -> None:
    import argparse
    ap = argparse.ArgumentParser(prog="python -m gpt2core.checkpoint", description="Training checkpoint tools.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("consolidate", help="merge a ZeRO-1 checkpoint's per-rank optimizer shards into the full "
                                           "AdamW state, resumable with any world size")
    c.add_argument("dir", help="checkpoint directory (step_NNNNNN)")
    c.add_argument("--out", default=None, help="write the result here instead of replacing DIR")
    args = ap.parse_args(argv)
    try:
        path = consolidate(args.dir, args.out)
    except CheckpointError as e:
        raise SystemExit(f"gpt2core.checkpoint: {e}") from e
    print(f"consolidated {args.dir} -> {path} (full adam_m.npy / adam_v.npy)")


__all__ = ["CheckpointError", "Checkpoint", "save_checkpoint", "load_checkpoint", "latest_checkpoint",
           "list_checkpoints", "prune_checkpoints", "checkpoint_dir", "consolidate"]


if __name__ == "__main__":
    main()
