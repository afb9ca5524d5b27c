"""Model files in llm.c's layout (see DESIGN.md): a header of 256 int32, then the 16 parameter tensors.

Header: magic 20240326, version (3 = fp32), max_seq_len, vocab_size, n_layer, n_head, n_embd,
padded_vocab_size. Tensors in the order of `_C.param_names()`, Linear weights (out, in).
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from . import _C
from .config import GPT2Config

MODEL_MAGIC = 20240326


class CheckpointError(ValueError):
    """A model file that cannot be used: the message names the file and what is wrong."""


def save_model(model, path) -> Path:
    """Write the weights as an llm.c version-3 (fp32) model file, atomically."""
    path = Path(path)
    c = model.config
    header = np.zeros(256, dtype="<i4")
    header[:8] = [MODEL_MAGIC, 3, c.block_size, c.vocab_size, c.n_layer, c.n_head, c.n_embd, c.padded_vocab_size]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(header.tobytes())
        for name in _C.param_names():
            f.write(np.ascontiguousarray(model.params[name], dtype="<f4").tobytes())
    os.replace(tmp, path)
    return path


def read_model_header(path) -> GPT2Config:
    path = Path(path)
    try:
        raw = path.read_bytes()[:1024]
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read model file ({e.strerror})") from e
    if len(raw) < 1024:
        raise CheckpointError(f"{path}: truncated header ({len(raw)} bytes, need 1024)")
    h = np.frombuffer(raw, dtype="<i4")
    if h[0] != MODEL_MAGIC:
        raise CheckpointError(f"{path}: bad magic {int(h[0])} (expected {MODEL_MAGIC}); not an llm.c/gpt2core model file")
    if h[1] != 3:
        raise CheckpointError(f"{path}: unsupported model file version {int(h[1])} (this reader handles 3 = fp32)")
    try:
        return GPT2Config(block_size=int(h[2]), vocab_size=int(h[3]), n_layer=int(h[4]), n_head=int(h[5]),
                          n_embd=int(h[6]), padded_vocab_size=int(h[7]) or int(h[3]))
    except ValueError as e:
        raise CheckpointError(f"{path}: header describes an invalid model: {e}") from e


def load_model(path, device: str = "cpu"):
    """A GPT2 with the weights of an llm.c version-3 model file."""
    from .model import GPT2

    path = Path(path)
    config = read_model_header(path)
    model = GPT2(config, device=device, init=False)
    expected = 1024 + 4 * model.num_parameters
    size = path.stat().st_size
    if size != expected:
        raise CheckpointError(f"{path}: file has {size} bytes but the header's model needs {expected}; truncated or corrupt")
    flat = np.fromfile(path, dtype="<f4", offset=1024)
    if not np.isfinite(flat).all():
        raise CheckpointError(f"{path}: weights contain NaN or Inf")
    off = 0
    for name in _C.param_names():
        p = model.params[name]
        p[...] = flat[off:off + p.size].reshape(p.shape)
        off += p.size
    return model
