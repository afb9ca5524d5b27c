"""Training checkpoints: directories that resume a run exactly (weights, AdamW state, data position).

A checkpoint is a directory `<output-dir>/checkpoints/step_NNNNNN/`:

    model.bin        the weights, an llm.c version-3 (fp32) model file (the CPU backend's master weights)
    adam_m.npy       AdamW first moments, all parameters flat in model.params order, float32
    adam_v.npy       AdamW second moments, the same layout
    state.json       step, optimizer step count, next LR, train loader position, model config, the
                     training arguments, versions; with loss scaling the scaler's state (optimizer.loss_scaler:
                     scale, clean, skipped)
    metrics.jsonl    a copy of the run's metrics up to this step
    manifest.json    written last: format, version, step, and the size and sha256 of every other file

A ZeRO-1 or ZeRO-2 run (`--zero 1|2`, W ranks; the same layout: "stage" 1 names it, the sharded optimizer state,
whichever stage wrote it) writes no adam_m.npy / adam_v.npy: every rank r writes its own shard
`optim_shard_r{r}_of_{W}.npz` (lo, hi, num_parameters, step_count, and m, v of parameters [lo, hi)), state.json
records {"zero": {"stage": 1, "world_size": W, "shards": [{"file", "lo", "hi"}, ...]}}, and the manifest
(version 2, with "zero": {"stage": 1, "world_size": W}) is written by rank 0 only after every rank's shard is
on disk, and lists the shards like any other file: a missing or corrupt shard makes the checkpoint
incomplete. No rank holds the full optimizer state while saving or loading. Such a checkpoint resumes
only with W ranks and --zero 1 or 2 (CheckpointError otherwise, naming the way out):
`python -m gpt2core.checkpoint consolidate DIR` merges the shards into adam_m.npy / adam_v.npy (version 1),
which resumes with any world size; a ZeRO-1 run resuming a full checkpoint reads only its slice of it.

Everything is plain little-endian arrays and JSON, so a checkpoint does not depend on the device that
wrote it. A checkpoint is written into a hidden temporary directory that is renamed into place only
after its manifest is on disk: a crash mid-write leaves the previous checkpoints intact, and a
directory without a valid manifest, or whose files do not match it, is incomplete and is rejected.
`latest_checkpoint(dir)` (what `--resume auto` uses) returns the newest complete one whose weights and
moments are finite. Files are written with plain writes, never through memory maps (a full disk under a
map is SIGBUS): a failed write is a WriteError naming the file and the bytes needed, after the temporary
directory is removed; NaN or Inf state is refused before anything is written (NonFiniteError).

The weights file is written and read by llmc.py; loading the weights of any source (llm.c file, checkpoint,
Hugging Face) into a new model is `GPT2.from_pretrained` (pretrained.py reads them).
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .atomic import NPZ_ERRORS, npy_bytes, write_flat_npy
from ..config import GPT2Config
from .llmc import CheckpointError, NonFiniteError, describe, fill_params, first_nonfinite, read_model, save_model
from .manifest import (CHECKPOINT_FORMAT, CHECKPOINT_VERSION, CHECKPOINT_VERSIONS, MANIFEST, _STEP_DIR,  # noqa: F401
                       Writing, check_finite_state, checkpoint_bytes, checkpoint_dir, checkpoint_state,
                       finish_checkpoint, save_flat, sha256_file, shard_file, write_json)
from .runlock import pid_alive

def save_checkpoint(root, step: int, model, state: dict | None = None, metrics_path=None, zero=None) -> Path:
    """Write a checkpoint of `model` (weights, AdamW moments, step count) after `step` optimizer steps
    into root/step_NNNNNN, atomically. `state` (JSON-serialisable: loader position, args...) goes into
    state.json; the file at metrics_path (if it exists) is copied. Returns the directory.

    zero: the `distributed.DataParallel` of a ZeRO-1 run. Then this is a collective call (every rank calls
    it, `root` on a file system all ranks share): rank 0 writes model.bin, state.json and metrics.jsonl, every
    rank writes its own optimizer shard (zero_shards.save_sharded), and no rank holds the full AdamW state."""
    if zero is not None and getattr(zero, "zero", 0):
        from .zero_shards import save_sharded
        return save_sharded(Path(root), step, model, state, metrics_path, zero)
    root = Path(root)
    final = checkpoint_dir(root, step)
    check_finite_state(model, final)
    tmp = root / f".{final.name}.tmp-{os.getpid()}"
    with Writing(final, checkpoint_bytes(model, metrics_path)) as w:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        try:
            names = list(model.params)
            save_model(model, tmp / w("model.bin"))
            m, v = model.opt_state()
            save_flat(tmp / w("adam_m.npy"), [m[k] for k in names])
            save_flat(tmp / w("adam_v.npy"), [v[k] for k in names])
            write_json(tmp / w("state.json"), checkpoint_state(step, model, state))
            if metrics_path is not None and Path(metrics_path).exists():
                shutil.copyfile(metrics_path, tmp / w("metrics.jsonl"))
            finish_checkpoint(tmp, final, step, w)
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
            f"{saved} ranks and --zero 1 (or 2), or first merge the shards into the full optimizer state with "
            f"`python -m gpt2core.checkpoint consolidate {self.path}`; a consolidated checkpoint resumes with any "
            "world size, with or without --zero 1")

    def _moments(self, check_finite: bool = True):
        n = int(self.state["optimizer"]["num_parameters"])
        out = []
        for name in ("adam_m.npy", "adam_v.npy"):
            p = self.path / name
            try:
                a = np.load(p, mmap_mode="r", allow_pickle=False)
            except NPZ_ERRORS as e:
                raise CheckpointError(f"{p}: cannot read optimizer state ({e})") from e
            if not isinstance(a, np.ndarray) or a.dtype != np.dtype("<f4") or a.shape != (n,):
                got = f"{a.dtype} {a.shape}" if isinstance(a, np.ndarray) else "an .npz archive"
                raise CheckpointError(f"{p}: expected a float32 .npy of shape ({n},), got {got}")
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
        except NPZ_ERRORS as e:
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
        if list(order) != list(model.params):
            raise CheckpointError(f"{self.path}: optimizer state is in parameter order {order}, this version "
                                  f"uses {list(model.params)}")
        # the loss scaler continues where it was (ignored by a model without loss scaling: an fp16 run's
        # checkpoint continues in fp32 on the CPU without one; a run without it gives a scaling model none)
        model.load_loss_scaler_state(self.state["optimizer"].get("loss_scaler"))
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


# what malformed JSON (a list where a dict belongs, a string for a number, a float of 1e999) raises
_MALFORMED = (ValueError, KeyError, TypeError, AttributeError, OverflowError, IndexError)


def _read_manifest(path: Path) -> tuple[dict, dict, int, int]:
    """(manifest, its files {name: {bytes, sha256}}, step, ZeRO-1 world size or 0), checked for shape."""
    mpath = path / MANIFEST
    try:
        manifest = json.loads(mpath.read_bytes())
        files, step = manifest["files"], manifest["step"]
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        if not isinstance(files, dict) or not all(isinstance(v, dict) for v in files.values()):
            raise TypeError("'files' must map file names to {bytes, sha256}")
        odd = [n for n in files if n in ("", ".", "..") or "/" in n or "\\" in n]
        if odd:
            raise ValueError(f"'files' lists {odd[0]!r}, not a file name inside the checkpoint")
        zero = manifest.get("zero")
        world = zero["world_size"] if zero else 0
        if not isinstance(world, int) or not 0 <= world <= len(files):
            raise ValueError(f"ZeRO-1 world size {world!r} is not the number of shard files")
    except OSError as e:
        raise CheckpointError(f"{mpath}: cannot read ({e.strerror or e})") from None
    except _MALFORMED as e:
        raise CheckpointError(f"{mpath}: corrupt manifest ({type(e).__name__}: {e})") from None
    if manifest.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{mpath}: not a gpt2core checkpoint manifest (format {manifest.get('format')!r})")
    if manifest.get("version") not in CHECKPOINT_VERSIONS:
        raise CheckpointError(f"{mpath}: unsupported checkpoint version {manifest.get('version')!r} "
                              f"(this reader handles {', '.join(map(str, CHECKPOINT_VERSIONS))})")
    return manifest, files, step, world


def _read_state(path: Path, world: int, optim: list[str]) -> dict:
    """state.json, checked for everything restore() and resume read from it."""
    try:
        state = json.loads((path / "state.json").read_bytes())
        config = GPT2Config(**state["model_config"])
        opt = state["optimizer"]
        count, n, order = opt["step_count"], opt["num_parameters"], opt["param_order"]
        if not isinstance(count, int) or count < 0:
            raise ValueError(f"optimizer step_count must be a non-negative integer, got {count!r}")
        if n != config.num_parameters():
            raise ValueError(f"num_parameters {n!r} is not the {config.num_parameters()} of its model_config")
        if not isinstance(order, list) or not all(isinstance(k, str) for k in order):
            raise TypeError(f"param_order must be a list of names, got {order!r}")
        scaler = opt.get("loss_scaler")
        if scaler is not None and not (isinstance(scaler["scale"], float) and math.isfinite(scaler["scale"])
                                       and scaler["scale"] > 0 and all(isinstance(scaler[k], int) and scaler[k] >= 0
                                                                       for k in ("clean", "skipped"))):
            raise ValueError(f"loss_scaler must hold a finite scale > 0 and counts clean, skipped >= 0, got {scaler!r}")
        if world:  # the shards tile [0, num_parameters) in rank order
            shards = state["zero"]["shards"]
            bounds = [0] + [int(s["hi"]) for s in shards]
            if (state["zero"]["world_size"] != world or len(shards) != world
                    or [s["file"] for s in shards] != optim or [int(s["lo"]) for s in shards] != bounds[:-1]
                    or bounds != sorted(bounds) or bounds[-1] != n):
                raise ValueError(f"ZeRO-1 shards {shards} do not tile the parameters over world size {world}")
        return state
    except OSError as e:
        raise CheckpointError(f"{path / 'state.json'}: cannot read ({e.strerror or e})") from None
    except _MALFORMED as e:
        raise CheckpointError(f"{path / 'state.json'}: corrupt or incomplete state ({type(e).__name__}: "
                              f"{e})") from None


def _check_finite_files(ck: "Checkpoint") -> None:
    """CheckpointError naming the file when the weights or AdamW moments of `ck` hold NaN or Inf."""
    _, flat = ck.read_weights()
    bad = first_nonfinite([("model.bin", flat)])
    if bad:
        raise CheckpointError(f"{ck.path / 'model.bin'}: weights contain NaN or Inf ({bad})")
    if ck.zero is None:
        ck._moments()  # raises on NaN or Inf
    else:
        for r in range(ck.zero["world_size"]):
            ck._read_shard(r)


def load_checkpoint(path, verify: bool = True) -> Checkpoint:
    """Open a checkpoint directory, checking that it is complete: the manifest exists and parses, every file
    it lists is there with the recorded size and sha256, state.json describes it, and (with verify) its
    weights and AdamW moments are finite. Raises CheckpointError naming the file otherwise."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a checkpoint directory (no such directory)")
    mpath = path / MANIFEST
    if not mpath.exists():
        raise CheckpointError(f"{path}: incomplete checkpoint: no {MANIFEST} (it is written last, so the save "
                              "was interrupted)")
    manifest, files, step, world = _read_manifest(path)
    optim = [shard_file(r, world) for r in range(world)] if world else ["adam_m.npy", "adam_v.npy"]
    for required in ("model.bin", "state.json", *optim):
        if required not in files:
            raise CheckpointError(f"{mpath}: manifest does not list {required}"
                                  + (f" (the optimizer shard of rank {optim.index(required)} of this ZeRO-1 "
                                     f"checkpoint)" if world and required in optim else ""))
    for name, info in files.items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"{f}: missing (listed in the manifest)")
        size = f.stat().st_size
        if size != info.get("bytes"):
            raise CheckpointError(f"{f}: has {size} bytes, the manifest says {info.get('bytes')}; truncated or "
                                  "modified")
        if verify and sha256_file(f) != info.get("sha256"):
            raise CheckpointError(f"{f}: sha256 does not match the manifest; the file is corrupt")
    state = _read_state(path, world, optim)
    if state.get("step") != step:
        raise CheckpointError(f"{path}: manifest says step {step}, state.json says {state.get('step')}")
    ck = Checkpoint(path=path, step=step, state=state, manifest=manifest)
    if verify:
        _check_finite_files(ck)
    return ck


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
    return removed + remove_stale_temporaries(root)


_TEMPORARY = re.compile(r"^\.step_\d+\.(tmp|old)-(\d+)$")


def remove_stale_temporaries(root, locked: bool = False) -> list[Path]:
    """Delete the temporary directories (.step_NNNNNN.tmp-PID, .old-PID) under root that a save killed
    mid-way left behind, possibly filling the disk: those of processes no longer running on this machine,
    or with locked=True (the caller holds the output folder's RunLock, so no other run writes there) all
    but this process's own. Returns what was deleted."""
    root = Path(root)
    removed = []
    if root.is_dir():
        for d in root.iterdir():
            mt = _TEMPORARY.match(d.name)
            if mt and int(mt.group(2)) != os.getpid() and (locked or not pid_alive(int(mt.group(2)))):
                shutil.rmtree(d, ignore_errors=True)
                removed.append(d)
    return removed


# ------------------------------------------------------------------------------------ ZeRO shards -> full state
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
    with Writing(dest, sum(f.stat().st_size for f in ck.path.iterdir()) + 2 * npy_bytes(n)) as w:
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
            write_json(tmp / w("state.json"), st)
            finish_checkpoint(tmp, dest, ck.step, w)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return load_checkpoint(dest).path


def main(argv=None) -> None:
    from .. import cli
    ap = cli.ArgumentParser(prog="python -m gpt2core.checkpoint", description="Training checkpoint tools.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("consolidate", help="merge a ZeRO-1 checkpoint's per-rank optimizer shards into the full "
                                           "AdamW state, resumable with any world size")
    c.add_argument("dir", type=cli.existing_dir, help="checkpoint directory (step_NNNNNN)")
    c.add_argument("--out", type=cli.output_dir, default=None, help="write the result here instead of replacing DIR")
    args = ap.parse_args(argv)
    try:
        path = consolidate(args.dir, args.out)
    except CheckpointError as e:
        raise SystemExit(f"gpt2core.checkpoint: {e}") from e
    print(f"consolidated {args.dir} -> {path} (full adam_m.npy / adam_v.npy)")


__all__ = ["CheckpointError", "NonFiniteError", "Checkpoint", "save_checkpoint", "load_checkpoint",
           "latest_checkpoint", "list_checkpoints", "prune_checkpoints", "remove_stale_temporaries", "checkpoint_dir",
           "consolidate", "check_finite_state"]


if __name__ == "__main__":
    from .. import cli as _cli
    sys.exit(_cli.entry("python -m gpt2core.checkpoint", main)())
