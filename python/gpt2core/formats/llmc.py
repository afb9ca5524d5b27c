"""llm.c model files: the weights of a GPT-2 in the format llm.c reads and writes, and gpt2core's extension of it
for the modern architecture.

A header of 256 int32 -- magic 20240326, version, max_seq_len, vocab_size, n_layer, n_head, n_embd,
padded_vocab_size -- then the 16 parameter tensors in the order of `_C.param_names()`, layers stacked,
Linear weights (out, in), wte with its padded rows. Version 3 stores them as fp32, version 5 as bf16.
Export to bf16 rounds each fp32 weight to the nearest bf16 with ties to even (the rounding of torch's
`.to(torch.bfloat16)` and of llm.c); import widens bf16 to fp32 exactly, so export -> import -> export
gives the same bytes.

A model llm.c cannot run (GPT2Config's architecture fields other than GPT-2's, zero_init_proj included so that the
file carries the full config) is written as gpt2core's extension: version 1003 (fp32) or 1005 (bf16), which llm.c
refuses ("Bad version"), with the architecture in header slots 8..16 -- position (0 learned, 1 rope), rope_base
(float32 bits), norm (0 layernorm, 1 rmsnorm), qk_norm, activation (0 gelu, 1 relu2), bias, tie_embeddings,
zero_init_proj, logit_softcap (float32 bits, 0: none) -- and the tensors the config has, in its layout order
(model.params: llm.c's order without the absent ones, lm_head last). save_model(..., format="llmc") is the llm.c
export: it refuses such a model, naming the fields llm.c cannot represent.

This module knows the format, not the model class: it writes any object with `config` and `params`, and
reads into (GPT2Config, one flat fp32 vector in param_names() order). `GPT2.save` and
`GPT2.from_pretrained` (model.py) are the usual entry points.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from .. import _C
from .atomic import atomic_write
from ..config import GPT2Config
from ..errors import Error, FileFormatError

MODEL_MAGIC = 20240326
MODEL_VERSIONS = {3: "float32", 5: "bfloat16", 1003: "float32", 1005: "bfloat16"}
EXT = 1000  # gpt2core's extended versions: llm.c's + EXT
_POS, _NORM, _ACT = ("learned", "rope"), ("layernorm", "rmsnorm"), ("gelu", "relu2")


def _f32_bits(x: float) -> int:
    return int(np.array([x], dtype="<f4").view("<i4")[0])


def _bits_f32(i) -> float:
    return float(np.array([i], dtype="<i4").view("<f4")[0])


def _is_llmc(c: GPT2Config) -> bool:
    """Every architecture field at its default: a plain llm.c file holds the full config."""
    return c.to_dict() == GPT2Config(block_size=c.block_size, vocab_size=c.vocab_size,
                                     padded_vocab_size=c.padded_vocab_size, n_layer=c.n_layer, n_head=c.n_head,
                                     n_embd=c.n_embd).to_dict()


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
def save_model(model, path, dtype: str = "float32", format: str = "auto") -> Path:
    """Write model.params (a GPT2, or anything with `config` and `params`) as an llm.c model file,
    atomically (temporary file + rename). dtype "float32" writes version 3, "bfloat16" version 5
    (round to nearest even). format "auto": a model with the modern architecture is written in gpt2core's
    extension (versions 1003 / 1005, see the module's doc); "llmc": llm.c's format only, refusing (ValueError
    naming the fields) a model llm.c cannot represent."""
    if dtype in ("float32", "fp32"):
        version = 3
    elif dtype in ("bfloat16", "bf16"):
        version = 5
    else:
        raise ValueError(f"dtype must be 'float32' (llm.c version 3) or 'bfloat16' (version 5), got {dtype!r}")
    if format not in ("auto", "llmc"):
        raise ValueError(f"format must be 'auto' or 'llmc', got {format!r}")
    path = Path(path)
    c = model.config
    if format == "llmc" and c.non_gpt2_fields():
        raise ValueError(f"{path}: llm.c's model format holds GPT-2 only, and this model has "
                         f"{', '.join(c.non_gpt2_fields())}; save it with format='auto' (gpt2core's extension)")
    bad = first_nonfinite(model.params.items())
    if bad:
        raise NonFiniteError(f"{path}: refusing to write non-finite weights ({bad})")
    header = np.zeros(256, dtype="<i4")
    header[:8] = [MODEL_MAGIC, version, c.block_size, c.vocab_size, c.n_layer, c.n_head, c.n_embd, c.padded_vocab_size]
    if format == "auto" and not _is_llmc(c):
        header[1] += EXT
        header[8:17] = [_POS.index(c.position), _f32_bits(c.rope_base), _NORM.index(c.norm), int(c.qk_norm),
                        _ACT.index(c.activation), int(c.bias), int(c.tie_embeddings), int(c.zero_init_proj),
                        _f32_bits(c.logit_softcap or 0.0)]
    path.parent.mkdir(parents=True, exist_ok=True)
    needed = 1024 + (4 if version == 3 else 2) * c.num_parameters()
    with atomic_write(path, tmp_name=f".{path.name}.{os.getpid()}.tmp", needed=needed) as f:
        f.write(header.tobytes())
        for name, p in model.params.items():  # the config's tensors in layout order (GPT-2: llm.c's 16)
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
                              "(this reader handles 3 = fp32 and 5 = bf16, and gpt2core's 1003 and 1005)")
    arch = {}
    if version > EXT:
        try:
            a = [int(x) for x in h[8:17]]
            softcap = _bits_f32(a[8])
            arch = dict(position=_POS[a[0]], rope_base=_bits_f32(a[1]), norm=_NORM[a[2]], qk_norm=bool(a[3]),
                        activation=_ACT[a[4]], bias=bool(a[5]), tie_embeddings=bool(a[6]), zero_init_proj=bool(a[7]),
                        logit_softcap=softcap or None)
            if any(x not in (0, 1) for x in (a[0], a[2], a[3], a[4], a[5], a[6], a[7])):
                raise IndexError
        except IndexError:
            raise CheckpointError(f"{path}: header holds an unknown architecture {list(map(int, h[8:17]))}") from None
    try:
        config = GPT2Config(block_size=int(h[2]), vocab_size=int(h[3]), n_layer=int(h[4]), n_head=int(h[5]),
                            n_embd=int(h[6]), padded_vocab_size=int(h[7]) or int(h[3]), **arch)
    except ValueError as e:
        raise CheckpointError(f"{path}: header describes an invalid model: {e}") from e
    return config, version


def read_model_header(path) -> GPT2Config:
    """The model shape (and architecture) stored in a model file's header (version 3 or 5; 1003 or 1005)."""
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
    itemsize = 4 if MODEL_VERSIONS[version] == "float32" else 2
    expected = 1024 + itemsize * n
    try:
        size = path.stat().st_size
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read model file ({e.strerror})") from e
    if size != expected:
        raise CheckpointError(f"{path}: file has {size} bytes but the header's model ({describe(hconfig)}, "
                              f"{MODEL_VERSIONS[version]}) needs {expected}; truncated or corrupt")
    try:
        raw = np.fromfile(path, dtype="<f4" if itemsize == 4 else "<u2", offset=1024)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read model file ({e.strerror or e})") from e
    if raw.size != n:  # the file changed since its size was checked
        raise CheckpointError(f"{path}: read {raw.size} of {n} values; the file is being changed or truncated")
    return hconfig, raw if itemsize == 4 else bf16_to_float32(raw)


def fill_params(model, flat: np.ndarray, path) -> None:
    """Copy a flat fp32 vector (model.params order: the config's tensors in layout order) into model.params;
    NaN/Inf are rejected by tensor name (`path` names the source in the error)."""
    if flat.size != model.num_parameters:
        raise CheckpointError(f"{path}: holds {flat.size} values, the model has {model.num_parameters} parameters")
    chunks, off = [], 0
    for name in model.params:
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
    """A model shape (and a non-GPT-2 architecture) for error messages."""
    arch = [f"{k}={v!r}" for k, v in c.to_dict().items() if k in _ARCH and v != getattr(GPT2Config, k)]
    return (f"n_layer={c.n_layer} n_head={c.n_head} n_embd={c.n_embd} block_size={c.block_size} "
            f"vocab_size={c.vocab_size} padded_vocab_size={c.padded_vocab_size}" + "".join(" " + a for a in arch))


_ARCH = ("position", "rope_base", "norm", "qk_norm", "activation", "bias", "tie_embeddings", "zero_init_proj",
         "logit_softcap")


__all__ = ["CheckpointError", "NonFiniteError", "first_nonfinite", "MODEL_MAGIC", "MODEL_VERSIONS", "save_model", "read_model", "read_model_header",
           "fill_params", "float32_to_bf16", "bf16_to_float32", "describe"]
