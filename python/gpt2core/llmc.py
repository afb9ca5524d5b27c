"""llm.c model files: the weights of a GPT-2 in the format llm.c reads and writes.

A header of 256 int32 -- magic 20240326, version, max_seq_len, vocab_size, n_layer, n_head, n_embd,
padded_vocab_size -- then the 16 parameter tensors in the order of `_C.param_names()`, layers stacked,
Linear weights (out, in), wte with its padded rows. Version 3 stores them as fp32, version 5 as bf16.
Export to bf16 rounds each fp32 weight to the nearest bf16 with ties to even (the rounding of torch's
`.to(torch.bfloat16)` and of llm.c); import widens bf16 to fp32 exactly, so export -> import -> export
gives the same bytes.

This module knows the format, not the model class: it writes any object with `config` and `params`, and
reads into (GPT2Config, one flat fp32 vector in param_names() order). `GPT2.save` and
`GPT2.from_pretrained` (model.py) are the usual entry points.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from . import _C
from ._io import atomic_write
from .config import GPT2Config
from .errors import Error, FileFormatError

MODEL_MAGIC = 20240326
MODEL_VERSIONS = {3: "float32", 5: "bfloat16"}


class CheckpointError(FileFormatError):
    """A model file or checkpoint that cannot be used: the message names the file and what is wrong."""


class NonFiniteError(Error, ValueError):
    """Weights or optimizer moments holding NaN or Inf, which gpt2core never writes to disk."""


def first_nonfinite(named_arrays) -> str | None:
    """The first (name, array) pair holding NaN or Inf as "<count> NaN/Inf values in tensor <name>", else None."""
    for name, a in named_arrays:
        if not np.isfinite(a).all():
            return f"{int(np.size(a) - np.isfinite(a).sum())} NaN/Inf values in tensor {name}"
    return None


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


# ------------------------------------------------------------------------------------ write
def save_model(model, path, dtype: str = "float32") -> Path:
    """Write model.params (a GPT2, or anything with `config` and `params`) as an llm.c model file,
    atomically (temporary file + rename). dtype "float32" writes version 3, "bfloat16" version 5
    (round to nearest even)."""
    if dtype in ("float32", "fp32"):
        version = 3
    elif dtype in ("bfloat16", "bf16"):
        version = 5
    else:
        raise ValueError(f"dtype must be 'float32' (llm.c version 3) or 'bfloat16' (version 5), got {dtype!r}")
    path = Path(path)
    bad = first_nonfinite((name, model.params[name]) for name in _C.param_names())
    if bad:
        raise NonFiniteError(f"{path}: refusing to write non-finite weights ({bad})")
    c = model.config
    header = np.zeros(256, dtype="<i4")
    header[:8] = [MODEL_MAGIC, version, c.block_size, c.vocab_size, c.n_layer, c.n_head, c.n_embd, c.padded_vocab_size]
    path.parent.mkdir(parents=True, exist_ok=True)
    needed = 1024 + (4 if version == 3 else 2) * c.num_parameters()
    with atomic_write(path, tmp_name=f".{path.name}.{os.getpid()}.tmp", needed=needed) as f:
        f.write(header.tobytes())
        for name in _C.param_names():
            p = model.params[name]
            if version == 3:
                f.write(np.ascontiguousarray(p, dtype="<f4").tobytes())
            else:
                f.write(float32_to_bf16(p).tobytes())
    return path


# ------------------------------------------------------------------------------------ read
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


def read_model(path, config: GPT2Config | None = None) -> tuple[GPT2Config, np.ndarray]:
    """(config, all weights as one flat fp32 vector) of an llm.c model file, checked against its header
    (and against `config`, when given)."""
    path = Path(path)
    hconfig, version = _read_header(path)
    if config is not None and hconfig != config:
        raise CheckpointError(f"{path}: the file holds a model of shape {describe(hconfig)}, but {describe(config)} "
                              "was expected")
    n = hconfig.num_parameters()
    itemsize = 4 if version == 3 else 2
    expected = 1024 + itemsize * n
    try:
        size = path.stat().st_size
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read model file ({e.strerror})") from e
    if size != expected:
        raise CheckpointError(f"{path}: file has {size} bytes but the header's model ({describe(hconfig)}, "
                              f"{MODEL_VERSIONS[version]}) needs {expected}; truncated or corrupt")
    try:
        raw = np.fromfile(path, dtype="<f4" if version == 3 else "<u2", offset=1024)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read model file ({e.strerror or e})") from e
    if raw.size != n:  # the file changed since its size was checked
        raise CheckpointError(f"{path}: read {raw.size} of {n} values; the file is being changed or truncated")
    return hconfig, raw if version == 3 else bf16_to_float32(raw)


def fill_params(model, flat: np.ndarray, path) -> None:
    """Copy a flat fp32 vector (param_names order) into model.params; NaN/Inf are rejected by tensor name
    (`path` names the source in the error)."""
    if flat.size != model.num_parameters:
        raise CheckpointError(f"{path}: holds {flat.size} values, the model has {model.num_parameters} parameters")
    chunks, off = [], 0
    for name in _C.param_names():
        size = model.params[name].size
        chunks.append((name, flat[off:off + size]))
        off += size
    bad = first_nonfinite(chunks)
    if bad:
        raise CheckpointError(f"{path}: weights contain NaN or Inf ({bad})")
    for name, chunk in chunks:
        model.params[name][...] = chunk.reshape(model.params[name].shape)
    model.params_changed()


def describe(c: GPT2Config) -> str:
    """A model shape for error messages."""
    return (f"n_layer={c.n_layer} n_head={c.n_head} n_embd={c.n_embd} block_size={c.block_size} "
            f"vocab_size={c.vocab_size} padded_vocab_size={c.padded_vocab_size}")


__all__ = ["CheckpointError", "NonFiniteError", "first_nonfinite", "MODEL_MAGIC", "MODEL_VERSIONS", "save_model", "read_model", "read_model_header",
           "fill_params", "float32_to_bf16", "bf16_to_float32", "describe"]
