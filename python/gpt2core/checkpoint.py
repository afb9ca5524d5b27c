"""Saving and loading: llm.c model files, training checkpoints that resume exactly, any-format loading.

llm.c model files (see DESIGN.md): a header of 256 int32 -- magic 20240326, version, max_seq_len,
vocab_size, n_layer, n_head, n_embd, padded_vocab_size -- then the 16 parameter tensors in the order
of `_C.param_names()`, layers stacked, Linear weights (out, in), wte with its padded rows.
Version 3 stores them as fp32, version 5 as bf16. Export to bf16 rounds each fp32 weight to the
nearest bf16 with ties to even (the rounding of torch's `.to(torch.bfloat16)` and of llm.c); import
widens bf16 to fp32 exactly, so export -> import -> export gives the same bytes.

Training checkpoints are directories `<output-dir>/checkpoints/step_NNNNNN/`:

    model.bin        the weights, an llm.c version-3 (fp32) model file (the CPU backend's master weights)
    adam_m.npy       AdamW first moments, all parameters flat in param_names() order, float32
    adam_v.npy       AdamW second moments, the same layout
    state.json       step, optimizer step count, next LR, train loader position, model config, the
                     training arguments, versions
    metrics.jsonl    a copy of the run's metrics up to this step
    manifest.json    written last: format, step, and the size and sha256 of every other file

Everything is plain little-endian arrays and JSON, so a checkpoint does not depend on the device that
wrote it. A checkpoint is written into a hidden temporary directory that is renamed into place only
after its manifest is on disk: a crash mid-write leaves the previous checkpoints intact, and a
directory without a valid manifest, or whose files do not match it, is incomplete and is rejected.
`latest_checkpoint(dir)` (what `--resume auto` uses) returns the newest complete one.

`load_model(path)` reads whatever it is given: an llm.c model file (v3 or v5), a training checkpoint
directory, a Hugging Face GPT-2 directory (model.safetensors or pytorch_model.bin + config.json), or a
Hugging Face Hub name such as "gpt2" (through huggingface_hub, when it is installed).
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

MODEL_MAGIC = 20240326
MODEL_VERSIONS = {3: "float32", 5: "bfloat16"}
CHECKPOINT_FORMAT = "gpt2core-checkpoint"
CHECKPOINT_VERSION = 1
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(ValueError):
    """A model file or checkpoint that cannot be used: the message names the file and what is wrong."""


# ------------------------------------------------------------------------------------ bf16
def float32_to_bf16(x) -> np.ndarray:
    """fp32 -> bf16 bit patterns (uint16), rounding to nearest with ties to even; NaN stays (quiet) NaN,
    values beyond the largest bf16 round to +-inf."""
    u = np.ascontiguousarray(x, dtype="<f4").view("<u4")
    rounded = ((u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)).astype("<u2")
    nan = np.isnan(np.asarray(x, dtype=np.float32))
    if nan.any():
        rounded[nan] = ((u[nan] >> np.uint32(16)) | np.uint32(0x0040)).astype("<u2")
    return rounded


def bf16_to_float32(b) -> np.ndarray:
    """bf16 bit patterns (uint16) -> fp32, exactly."""
    return (np.asarray(b, dtype="<u2").astype("<u4") << np.uint32(16)).view("<f4")


# ------------------------------------------------------------------------------------ llm.c files
def save_model(model, path, dtype: str = "float32") -> Path:
    """Write the weights as an llm.c model file, atomically (temporary file + rename).
    dtype "float32" writes version 3, "bfloat16" version 5 (round to nearest even)."""
    if dtype in ("float32", "fp32"):
        version = 3
    elif dtype in ("bfloat16", "bf16"):
        version = 5
    else:
        raise ValueError(f"dtype must be 'float32' (llm.c version 3) or 'bfloat16' (version 5), got {dtype!r}")
    path = Path(path)
    c = model.config
    header = np.zeros(256, dtype="<i4")
    header[:8] = [MODEL_MAGIC, version, c.block_size, c.vocab_size, c.n_layer, c.n_head, c.n_embd, c.padded_vocab_size]
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(path, tmp_name=f".{path.name}.{os.getpid()}.tmp") as f:
        f.write(header.tobytes())
        for name in _C.param_names():
            p = model.params[name]
            if version == 3:
                f.write(np.ascontiguousarray(p, dtype="<f4").tobytes())
            else:
                f.write(float32_to_bf16(p).tobytes())
    return path


def _read_header(path: Path) -> tuple[GPT2Config, int]:
    try:
        with open(path, "rb") as f:
            raw = f.read(1024)
    except IsADirectoryError:
        raise CheckpointError(f"{path}: is a directory, not an llm.c model file") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read model file ({e.strerror})") from e
    if len(raw) < 1024:
        raise CheckpointError(f"{path}: truncated header ({len(raw)} bytes, need 1024)")
    h = np.frombuffer(raw, dtype="<i4")
    if h[0] != MODEL_MAGIC:
        raise CheckpointError(f"{path}: bad magic {int(h[0])} (expected {MODEL_MAGIC}); not an llm.c/gpt2core model file")
    version = int(h[1])
    if version not in MODEL_VERSIONS:
        raise CheckpointError(f"{path}: unsupported model file version {version} "
                              "(this reader handles 3 = fp32 and 5 = bf16)")
    try:
        config = GPT2Config(block_size=int(h[2]), vocab_size=int(h[3]), n_layer=int(h[4]), n_head=int(h[5]),
                            n_embd=int(h[6]), padded_vocab_size=int(h[7]) or int(h[3]))
    except ValueError as e:
        raise CheckpointError(f"{path}: header describes an invalid model: {e}") from e
    return config, version


def read_model_header(path) -> GPT2Config:
    """The model shape stored in an llm.c model file's header (version 3 or 5)."""
    return _read_header(Path(path))[0]


def _load_llmc(path: Path, device: str = "cpu", config: GPT2Config | None = None):
    from .model import GPT2

    hconfig, flat = _read_llmc(path, config)
    model = GPT2(hconfig, device=device, init=False)
    _fill_params(model, flat, path)
    return model


def _read_llmc(path: Path, config: GPT2Config | None = None) -> tuple[GPT2Config, np.ndarray]:
    """(config, all weights as one flat fp32 vector) of an llm.c model file, checked against its header."""
    hconfig, version = _read_header(path)
    if config is not None and hconfig != config:
        raise CheckpointError(f"{path}: the file holds a model of shape {_shape(hconfig)}, but {_shape(config)} "
                              "was expected")
    n = hconfig.num_parameters()
    itemsize = 4 if version == 3 else 2
    expected = 1024 + itemsize * n
    size = path.stat().st_size
    if size != expected:
        raise CheckpointError(f"{path}: file has {size} bytes but the header's model ({_shape(hconfig)}, "
                              f"{MODEL_VERSIONS[version]}) needs {expected}; truncated or corrupt")
    if version == 3:
        flat = np.fromfile(path, dtype="<f4", offset=1024)
    else:
        flat = bf16_to_float32(np.fromfile(path, dtype="<u2", offset=1024))
    return hconfig, flat


def _fill_params(model, flat: np.ndarray, path) -> None:
    """Copy a flat fp32 vector (param_names order) into the model; NaN/Inf are rejected by tensor name."""
    if flat.size != model.num_parameters:
        raise CheckpointError(f"{path}: holds {flat.size} values, the model has {model.num_parameters} parameters")
    off = 0
    for name in _C.param_names():
        p = model.params[name]
        chunk = flat[off:off + p.size]
        if not np.isfinite(chunk).all():
            bad = int(np.size(chunk) - np.isfinite(chunk).sum())
            raise CheckpointError(f"{path}: weights contain NaN or Inf ({bad} values in tensor {name})")
        p[...] = chunk.reshape(p.shape)
        off += p.size
    model.params_changed()


def _shape(c: GPT2Config) -> str:
    return (f"n_layer={c.n_layer} n_head={c.n_head} n_embd={c.n_embd} block_size={c.block_size} "
            f"vocab_size={c.vocab_size} padded_vocab_size={c.padded_vocab_size}")


def load_model(path, device: str = "cpu", padded_vocab_size: int | None = None):
    """A GPT2 from any supported source:

    * an llm.c model file, version 3 (fp32) or 5 (bf16);
    * a training checkpoint directory (its model.bin, after checking the manifest);
    * a Hugging Face GPT-2 directory: config.json + model.safetensors or pytorch_model.bin;
    * a Hugging Face Hub repo id such as "gpt2" (needs huggingface_hub and network access).

    padded_vocab_size applies to Hugging Face models only (default: vocab rounded up to 128).
    Problems raise CheckpointError naming the file."""
    p = Path(path)
    if p.is_dir():
        if (p / MANIFEST).exists() or (p / "state.json").exists():
            return load_checkpoint(p).load_model(device=device)
        if any((p / n).exists() for n in ("config.json", "model.safetensors", "pytorch_model.bin")):
            from . import hf
            return hf.load_pretrained(p, device=device, padded_vocab_size=padded_vocab_size)
        raise CheckpointError(f"{p}: directory holds neither a gpt2core checkpoint (manifest.json) nor a Hugging "
                              "Face model (config.json)")
    if p.exists():
        return _load_llmc(p, device=device)
    from . import hf
    if hf.looks_like_hub_id(str(path)):
        return hf.load_pretrained(str(path), device=device, padded_vocab_size=padded_vocab_size)
    raise CheckpointError(f"{p}: no such file or directory")


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


def save_checkpoint(root, step: int, model, state: dict | None = None, metrics_path=None) -> Path:
    """Write a checkpoint of `model` (weights, AdamW moments, step count) after `step` optimizer steps
    into root/step_NNNNNN, atomically. `state` (JSON-serialisable: loader position, args...) goes into
    state.json; the file at metrics_path (if it exists) is copied. Returns the directory."""
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
        _write_json(tmp / "state.json", st)
        if metrics_path is not None and Path(metrics_path).exists():
            shutil.copyfile(metrics_path, tmp / "metrics.jsonl")
        files = {}
        for f in sorted(tmp.iterdir()):
            files[f.name] = {"bytes": f.stat().st_size, "sha256": _sha256(f)}
        _write_json(tmp / MANIFEST, {"format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION,
                                     "step": int(step), "files": files})
        _fsync_dir(tmp)
        if final.exists():  # the same step written again (e.g. by a resumed run): swap it out
            old = root / f".{final.name}.old-{os.getpid()}"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _fsync_dir(root)
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

    def load_model(self, device: str = "cpu"):
        """A GPT2 with the checkpoint's weights (optimizer state not restored: see restore())."""
        return _load_llmc(self.path / "model.bin", device=device, config=self.config)

    def _moments(self):
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
            if not np.isfinite(a).all():
                raise CheckpointError(f"{p}: optimizer state contains NaN or Inf")
            out.append(a)
        return out

    def restore(self, model) -> None:
        """Load weights, AdamW moments and step count into an existing model of the same shape."""
        if model.config != self.config:
            raise CheckpointError(f"{self.path}: checkpoint holds a model of shape {_shape(self.config)}, the "
                                  f"model to restore into is {_shape(model.config)}")
        _, flat = _read_llmc(self.path / "model.bin", config=self.config)
        order = self.state["optimizer"]["param_order"]
        if list(order) != list(_C.param_names()):
            raise CheckpointError(f"{self.path}: optimizer state is in parameter order {order}, this version "
                                  f"uses {list(_C.param_names())}")
        am, av = self._moments()
        _fill_params(model, flat, self.path / "model.bin")
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
    if manifest.get("version") != CHECKPOINT_VERSION:
        raise CheckpointError(f"{mpath}: unsupported checkpoint version {manifest.get('version')!r} "
                              f"(this reader handles {CHECKPOINT_VERSION})")
    for required in ("model.bin", "adam_m.npy", "adam_v.npy", "state.json"):
        if required not in files:
            raise CheckpointError(f"{mpath}: manifest does not list {required}")
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


__all__ = ["CheckpointError", "Checkpoint", "save_model", "load_model", "read_model_header", "float32_to_bf16",
           "bf16_to_float32", "save_checkpoint", "load_checkpoint", "latest_checkpoint", "list_checkpoints",
           "prune_checkpoints", "checkpoint_dir"]
