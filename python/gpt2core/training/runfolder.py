"""A run folder belongs to one run.

`<output-dir>/run.json` (written atomically when a run takes the folder) records which run the folder holds: a
run id, when it started, and its config. Every checkpoint records the run id too. So

- a fresh run (no --resume) in a folder that holds another run is refused, naming the folder, the step it holds
  and the ways on: `--resume auto` (continue it), `--overwrite` (delete it and start over), or a new folder;
- `--resume auto` continues only the run the folder records: a checkpoint of another run, or a model of another
  shape, is refused rather than mixed in;
- `--overwrite` removes the old run's files (model.bin, metrics.jsonl, checkpoints/) before anything new is
  written, so nothing of it is left to be resumed by mistake; and only once the new run is known to start: taking
  a folder is two calls, `check_claim` (reads, refuses, writes nothing) and `Claim.commit` (removes, writes
  run.json), and gpt2core-train commits after every check that can fail (arguments, data, --init's weights read,
  the plan, the device), so a run refused for any of them leaves the old one byte for byte.

metrics.jsonl is appended one whole line at a time (append_line): one write(2) of the line, and if that fails
(ENOSPC, EFBIG, EIO) the file is cut back to its previous length, so a reader never sees half a record;
read_records skips a torn last line left by older versions or a crash mid-write.
"""
from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from ..formats.atomic import atomic_write
from ..errors import Error, write_error

RUN_FILE = "run.json"
METRICS = "metrics.jsonl"
MODEL = "model.bin"
CHECKPOINTS = "checkpoints"


class RunFolderError(Error):
    """The output folder holds another run (the message names it and the ways on)."""


def read_manifest(folder) -> dict | None:
    """The folder's run.json, None if it has none (a folder of an older version, or a new one). A damaged one is
    an error naming it."""
    p = Path(folder) / RUN_FILE
    try:
        raw = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    try:
        d = json.loads(raw)
        if not isinstance(d, dict) or not isinstance(d.get("run_id"), str):
            raise ValueError("no run_id")
        return d
    except ValueError as e:
        raise RunFolderError(f"{p}: not a gpt2core run record ({e}); remove it or choose another --output-dir") \
            from None


def write_manifest(folder, run_id: str, config: dict, model: dict, resumed_from: str | None = None) -> dict:
    """Record (atomically) that `folder` holds run `run_id`."""
    d = {"format": "gpt2core-run", "version": 1, "run_id": run_id,
         "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "model": model, "config": config}
    if resumed_from:
        d["resumed_from"] = resumed_from
    data = (json.dumps(d, indent=1, sort_keys=True) + "\n").encode()
    with atomic_write(Path(folder) / RUN_FILE, needed=len(data)) as f:
        f.write(data)
    return d


def new_run_id() -> str:
    return uuid.uuid4().hex[:16]


def _last_step(metrics: Path) -> int | None:
    last = None
    for rec in read_records(metrics):
        if isinstance(rec.get("step"), int) and "loss" in rec:
            last = rec["step"]
    return last


def describe(folder) -> str | None:
    """What run `folder` holds, in words ("run 1a2b... at step 20 of 20, finished (model.bin)"), or None if it
    holds none: no run.json, model.bin, checkpoints or training records (a prepared data/ subfolder alone is no
    run)."""
    from ..formats.checkpoint import list_checkpoints
    folder = Path(folder)
    man = read_manifest(folder)
    ckpts = list_checkpoints(folder / CHECKPOINTS) if (folder / CHECKPOINTS).is_dir() else []
    step = _last_step(folder / METRICS) if (folder / METRICS).is_file() else None
    finished = (folder / MODEL).exists()
    if not ckpts and step is None and not finished:  # a run.json alone: a run that failed before its first step
        return None
    parts = [f"run {man['run_id']}" if man else "a run"]
    steps = (man or {}).get("config", {}).get("steps")
    if step is not None:
        parts.append(f"at step {step}" + (f" of {steps}" if steps else ""))
    if ckpts:
        parts.append(f"checkpoints up to step {ckpts[0][0]}")
    if finished:
        parts.append(f"finished ({MODEL})")
    return ", ".join(parts)


def remove_run(folder) -> list[Path]:
    """Delete the run files of `folder` (run.json, model.bin, metrics.jsonl, checkpoints/); returns what went.
    Anything else in the folder (prepared data, the user's files) stays."""
    folder, gone = Path(folder), []
    for name in (RUN_FILE, MODEL, METRICS, CHECKPOINTS):
        p = folder / name
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        elif p.exists() or p.is_symlink():
            p.unlink()
        else:
            continue
        gone.append(p)
    return gone


@dataclass
class Claim:
    """A folder checked for a run (check_claim) and not yet changed: commit() takes it."""
    folder: Path
    record: dict               # the manifest the run writes under (a fresh one: written by commit)
    previous: str | None = None  # --overwrite: the run commit removes (describe's words)
    fresh: bool = False        # commit writes record as the folder's run.json

    def commit(self, log=print) -> dict:
        """Take the folder: remove the previous run's files (--overwrite), write run.json of a fresh run; returns
        the record. Call once everything that could refuse the new run has been checked."""
        if self.previous:
            gone = remove_run(self.folder)
            log(f"--overwrite: removed the previous run in {self.folder} ({self.previous}): "
                + ", ".join(p.name for p in gone))
            self.previous = None
        if self.fresh:
            r = self.record
            self.record = write_manifest(self.folder, r["run_id"], r["config"], r["model"])
            self.fresh = False
        return self.record


def check_claim(folder, config: dict, model: dict, resume: str | None, overwrite: bool) -> Claim:
    """Check that `folder` can be taken for a run of `config` (TrainConfig.to_dict()) and `model`
    (GPT2Config.to_dict()), writing nothing: a RunFolderError names the folder and the ways on. Under the folder's
    RunLock; the returned Claim's commit() then takes it.

    resume None: the folder must hold no run, unless overwrite (commit then deletes the old run's files first).
    resume 'auto': the run the folder records continues; a folder whose model shape differs is refused, and so is
    a finished run without checkpoints (there is nothing to continue, and starting over would replace it).
    resume DIR: as 'auto' when the folder records a run; a folder that holds none starts one from that checkpoint."""
    folder = Path(folder)
    held = describe(folder)
    man = read_manifest(folder)
    ways = (f"continue it with --resume auto, start over with --overwrite (deletes its {MODEL}, {METRICS} and "
            f"{CHECKPOINTS}/), or choose another --output-dir")
    previous = None
    if overwrite and held:
        previous, held, man = held, None, None
    if resume is None:
        if held:
            raise RunFolderError(f"{folder} holds another run ({held}); {ways}")
        record = {"run_id": new_run_id(), "config": config, "model": model}
        return Claim(folder, record, previous, fresh=True)
    if man is not None and man.get("model") not in (None, model):
        raise RunFolderError(f"{folder} holds a run of another model ({_shape(man['model'])}, this one is "
                             f"{_shape(model)}); use the same --preset, --block-size and --padded-vocab-size, or "
                             f"choose another --output-dir")
    if resume == "auto" and held and (folder / MODEL).exists():
        from ..formats.checkpoint import list_checkpoints
        if not list_checkpoints(folder / CHECKPOINTS):
            raise RunFolderError(f"{folder} holds a finished run without checkpoints ({held}): --resume auto has "
                                 f"nothing to continue; start over with --overwrite, or choose another --output-dir")
    if man is None:  # a new folder, or one of an older version: adopt it (the checkpoints' run id, if any)
        return Claim(folder, {"run_id": None, "config": config, "model": model, "adopt": True}, previous)
    return Claim(folder, man, previous)


def claim(folder, config: dict, model: dict, resume: str | None, overwrite: bool, log=print) -> dict:
    """check_claim and commit at once (for a caller with nothing else to check first); returns the manifest the
    run writes under."""
    return check_claim(folder, config, model, resume, overwrite).commit(log)


def _shape(m: dict) -> str:
    return ", ".join(f"{k} {m.get(k)}" for k in ("n_layer", "n_head", "n_embd", "block_size", "padded_vocab_size"))


def append_line(path, line: str) -> None:
    """Append one record line to `path` whole or not at all: one write(2) in O_APPEND mode, and if it fails or is
    short (ENOSPC, EFBIG past RLIMIT_FSIZE, EIO) the file is cut back to its length before, and a WriteError
    naming the path is raised."""
    data = (line.rstrip("\n") + "\n").encode()
    path = Path(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
    except OSError as e:
        raise write_error(e, path, len(data), what="append to") from e
    try:
        before = os.fstat(fd).st_size
        try:
            done = 0
            while done < len(data):  # one write(2), unless it is short (a limit reached mid-line): the rest then
                n = os.write(fd, data[done:])  # fails with the reason (ENOSPC, EFBIG)
                if n <= 0:
                    raise OSError(28, os.strerror(28))
                done += n
        except OSError as e:
            try:
                os.ftruncate(fd, before)
            except OSError:
                pass
            raise write_error(e, path, len(data), what="append to") from e
    finally:
        os.close(fd)


def read_records(path) -> list[dict]:
    """The JSON records of a metrics.jsonl, skipping a torn last line (no newline yet: a crash or a full disk
    mid-write). A damaged line elsewhere is an error naming the file and line."""
    path = Path(path)
    raw = path.read_bytes()
    lines = raw.split(b"\n")
    out = []
    for i, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            if i == len(lines):  # the last line, without its newline: torn
                continue
            raise RunFolderError(f"{path}: line {i}: not valid JSON") from None
        if isinstance(rec, dict):
            out.append(rec)
    return out


def whole_lines(data: bytes) -> bytes:
    """`data` (a metrics.jsonl's bytes) without a torn last line."""
    if not data or data.endswith(b"\n"):
        return data
    cut = data.rfind(b"\n")
    return data[:cut + 1] if cut >= 0 else b""


__all__ = ["RunFolderError", "RUN_FILE", "Claim", "check_claim", "claim", "describe", "read_manifest", "write_manifest",
           "remove_run", "append_line", "read_records", "whole_lines", "new_run_id"]
