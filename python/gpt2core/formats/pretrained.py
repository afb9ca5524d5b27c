"""Pretrained weights from any source, and Hugging Face GPT-2 interop.

`read_weights(path)` reads whatever it is given into (GPT2Config, one flat fp32 vector in
`_C.param_names()` order): an llm.c model file (v3 or v5, llmc.py), a training checkpoint directory
(checkpoint.py, after checking its manifest), a Hugging Face GPT-2 directory, or a Hugging Face Hub name
such as "gpt2" (through huggingface_hub, when it is installed). `GPT2.from_pretrained` (model.py) builds a
model from them.

Hugging Face directories are those of `transformers`' GPT2LMHeadModel. A directory holds config.json (model_type "gpt2": vocab_size, n_positions, n_embd, n_layer, n_head)
and the weights in model.safetensors (preferred) or pytorch_model.bin. Keys are
`[transformer.]wte.weight`, `wpe.weight`, `h.{i}.ln_1.{weight,bias}`, `h.{i}.attn.c_attn.{weight,bias}`,
`h.{i}.attn.c_proj...`, `h.{i}.ln_2...`, `h.{i}.mlp.c_fc...`, `h.{i}.mlp.c_proj...`, `ln_f...`, and
`lm_head.weight` (tied to wte, usually omitted). HF's Conv1D stores weights as (in, out): the transpose
of our (out, in) Linear layout. c_attn is our qkvw (q, k, v stacked along the output dim, the same
order). HF has no padded vocab: on import the vocab is padded with zero rows (to a multiple of 128 by
default), on export the padding is dropped.

Safetensors files are read and written by the `safetensors` package (an optional dependency: `pip install
safetensors`), whose parser checks the header and offsets. torch is not needed: pytorch_model.bin (the zip
format of torch >= 1.6) is read with a restricted unpickler that only rebuilds tensors, after checking
each tensor lies inside its storage; torch is used instead when it is installed. Whatever the bytes,
every reader raises CheckpointError naming the file.
"""
from __future__ import annotations

import json
import os
import pickle
import re
import warnings
import zipfile
import zlib
from pathlib import Path

import numpy as np

from .. import _C
from .atomic import atomic_write
from .checkpoint import MANIFEST, list_checkpoints, load_checkpoint
from ..config import GPT2Config
from .llmc import CheckpointError, bf16_to_float32, read_model

SAFETENSORS_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2", "I64": "<i8", "I32": "<i4",
                      "I16": "<i2", "I8": "i1", "U8": "u1", "BOOL": "?"}
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?$")


# ------------------------------------------------------------------------------------ safetensors
def _safetensors(path):
    try:
        import safetensors
        import safetensors.numpy
    except ImportError:
        raise CheckpointError(f"{path}: reading or writing .safetensors needs the safetensors package "
                              "(pip install safetensors)") from None
    return safetensors


def read_safetensors(path) -> dict[str, np.ndarray]:
    """All tensors of a .safetensors file as numpy arrays (BF16 widened to float32), parsed by the
    `safetensors` package."""
    path = Path(path)
    st = _safetensors(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror})") from e
    try:
        tensors = st.deserialize(data)
    except st.SafetensorError as e:
        raise CheckpointError(f"{path}: corrupt or truncated safetensors file ({e})") from None
    out = {}
    for name, t in tensors:
        if t["dtype"] not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {t['dtype']}")
        a = np.frombuffer(t["data"], dtype=SAFETENSORS_DTYPES[t["dtype"]]).reshape(t["shape"])
        out[name] = bf16_to_float32(a).reshape(a.shape) if t["dtype"] == "BF16" else a
    return out


def write_safetensors(path, tensors: dict[str, np.ndarray], metadata: dict | None = None) -> Path:
    """Write float32 tensors as a .safetensors file (atomically), serialised by the `safetensors` package.
    metadata {"format": "pt"} is what transformers expects."""
    path = Path(path)
    st = _safetensors(path)
    data = st.numpy.save({k: np.ascontiguousarray(a, dtype="<f4") for k, a in tensors.items()},
                         metadata={str(k): str(v) for k, v in (metadata or {}).items()} or None)
    with atomic_write(path, tmp_name=f".{path.name}.{os.getpid()}.tmp", needed=len(data)) as f:
        f.write(data)
    return path


# ------------------------------------------------------------------------------------ pytorch_model.bin
_TORCH_STORAGES = {"FloatStorage": "<f4", "DoubleStorage": "<f8", "HalfStorage": "<f2", "BFloat16Storage": "bf16",
                   "LongStorage": "<i8", "IntStorage": "<i4", "ShortStorage": "<i2", "CharStorage": "i1",
                   "ByteStorage": "u1", "BoolStorage": "?"}


# what a malformed archive or pickle raises while the restricted unpickler runs: bad opcodes or arguments
# (pickle's own errors, wrong types or arity, bad keys), a truncated or corrupt zip member, deep nesting
_UNPICKLE_ERRORS = (pickle.UnpicklingError, EOFError, ValueError, TypeError, KeyError, IndexError, AttributeError,
                    OverflowError, RecursionError, NotImplementedError, OSError, zipfile.BadZipFile, zlib.error)


class _StorageType:
    def __init__(self, name):
        self.name = name
        self.dtype = _TORCH_STORAGES[name]


def _ints(x, what: str) -> tuple[int, ...]:
    if not isinstance(x, (tuple, list)) or not all(type(v) is int and v >= 0 for v in x):
        raise pickle.UnpicklingError(f"tensor {what} {x!r} is not a tuple of non-negative ints")
    return tuple(x)


def _rebuild_tensor(storage, offset, size, stride, *rest):
    """The tensor (offset, size, stride) of `storage`, copied; refused unless it lies inside the storage
    (as_strided itself would read whatever memory the strides point at)."""
    if not isinstance(storage, np.ndarray):
        raise pickle.UnpicklingError(f"tensor storage is a {type(storage).__name__}, not a storage")
    (offset,), size, stride = _ints((offset,), "offset"), _ints(size, "size"), _ints(stride, "stride")
    if len(size) != len(stride):
        raise pickle.UnpicklingError(f"tensor size {size} and stride {stride} differ in length")
    a = bf16_to_float32(storage) if getattr(storage, "_bf16", False) else storage
    last = offset + sum((n - 1) * st for n, st in zip(size, stride)) if all(size) else offset - 1
    if last >= a.size:
        raise pickle.UnpicklingError(f"tensor of size {size}, stride {stride} at offset {offset} exceeds its "
                                     f"storage ({a.size} elements)")
    if not all(size):
        return np.zeros(size, dtype=a.dtype)
    view = np.lib.stride_tricks.as_strided(a[offset:], shape=size, strides=[n * a.dtype.itemsize for n in stride])
    return np.array(view)


class _Bf16Array(np.ndarray):
    _bf16 = True


class _TorchUnpickler(pickle.Unpickler):
    """Rebuilds only tensors, OrderedDicts and plain containers: anything else is refused."""

    def __init__(self, f, zf: zipfile.ZipFile, prefix: str, path: Path):
        super().__init__(f)
        self.zf, self.prefix, self.path = zf, prefix, path

    def find_class(self, module, name):
        if module == "collections" and name == "OrderedDict":
            import collections
            return collections.OrderedDict
        if module == "torch._utils" and name in ("_rebuild_tensor_v2", "_rebuild_tensor"):
            return _rebuild_tensor
        if module == "torch._utils" and name == "_rebuild_parameter":
            return lambda data, requires_grad=False, hooks=None, *a: data
        if module == "torch" and name in _TORCH_STORAGES:
            return _StorageType(name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} (only tensors are read without torch)")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and pid and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"unsupported persistent id {pid!r}")
        stype, key = pid[1], pid[2]
        if not isinstance(stype, _StorageType):
            raise pickle.UnpicklingError(f"unsupported storage type {stype!r}")
        try:
            raw = self.zf.read(f"{self.prefix}data/{key}")
        except KeyError:
            raise CheckpointError(f"{self.path}: storage {key} is missing from the archive; truncated") from None
        if stype.dtype == "bf16":
            return np.frombuffer(raw, dtype="<u2").view(_Bf16Array)
        return np.frombuffer(raw, dtype=np.dtype(stype.dtype))


def read_torch_bin(path) -> dict[str, np.ndarray]:
    """The state dict of a pytorch_model.bin as numpy float32 arrays. Uses torch when installed,
    otherwise reads the zip format (torch >= 1.6) with a restricted unpickler."""
    path = Path(path)
    try:
        import torch  # noqa: F401
    except ImportError:
        torch = None
    if torch is not None:
        try:
            sd = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - torch raises many kinds
            raise CheckpointError(f"{path}: torch cannot load it ({e})") from e
        return {k: v.float().numpy() if v.is_floating_point() else v.numpy() for k, v in sd.items()}
    try:
        zf = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, EOFError, ValueError):
        raise CheckpointError(f"{path}: not a zip archive: truncated, or the legacy torch format, which needs "
                              "torch installed") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror})") from e
    with zf:
        pkl = [n for n in zf.namelist() if n.endswith("data.pkl")]
        if not pkl:
            raise CheckpointError(f"{path}: no data.pkl in the archive; not a torch checkpoint")
        prefix = pkl[0][:-len("data.pkl")]
        try:
            with zf.open(pkl[0]) as f:
                sd = _TorchUnpickler(f, zf, prefix, path).load()
        except CheckpointError:
            raise
        except _UNPICKLE_ERRORS as e:
            raise CheckpointError(f"{path}: cannot unpickle the state dict ({type(e).__name__}: {e})") from None
    if not isinstance(sd, dict) or not all(isinstance(k, str) and isinstance(v, np.ndarray) for k, v in sd.items()):
        raise CheckpointError(f"{path}: holds a {type(sd).__name__}, not a state dict of named tensors")
    return {k: v.astype(np.float32) if v.dtype.kind == "f" else v for k, v in sd.items()}


# ------------------------------------------------------------------------------------ config
def _pad(v: int, multiple: int = 128) -> int:
    return (v + multiple - 1) // multiple * multiple


def config_from_hf(cfg: dict, path, padded_vocab_size: int | None = None) -> GPT2Config:
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{path}: holds a JSON {type(cfg).__name__}, not an object of settings")
    if cfg.get("model_type", "gpt2") != "gpt2":
        raise CheckpointError(f"{path}: model_type is {cfg.get('model_type')!r}, only 'gpt2' is supported")
    act = cfg.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh", "relu2"):
        raise CheckpointError(f"{path}: activation_function {act!r} is not supported (gpt2core has the tanh "
                              "GELU, 'gelu_new', and relu(x)^2, 'relu2')")
    try:
        n_embd = int(cfg["n_embd"])
        n_inner = cfg.get("n_inner")
        if n_inner is not None and int(n_inner) != 4 * n_embd:
            raise CheckpointError(f"{path}: n_inner={n_inner}; gpt2core supports only 4 * n_embd = {4 * n_embd}")
        if float(cfg.get("layer_norm_epsilon", 1e-5)) != 1e-5:
            warnings.warn(f"{path}: layer_norm_epsilon={cfg['layer_norm_epsilon']}, gpt2core uses 1e-5",
                          stacklevel=3)
        V = int(cfg["vocab_size"])
        return GPT2Config(block_size=int(cfg.get("n_positions", cfg.get("n_ctx", 1024))), vocab_size=V,
                          padded_vocab_size=int(padded_vocab_size or _pad(V)), n_layer=int(cfg["n_layer"]),
                          n_head=int(cfg["n_head"]), n_embd=n_embd,
                          activation="relu2" if act == "relu2" else "gelu",
                          tie_embeddings=cfg.get("tie_word_embeddings", True) is not False)
    except KeyError as e:
        raise CheckpointError(f"{path}: config.json lacks {e.args[0]!r}") from None
    except (TypeError, ValueError, OverflowError) as e:
        raise CheckpointError(f"{path}: config.json describes an invalid model: {e}") from None


# the modern fields GPT2LMHeadModel cannot express, and why; bias=False (zero biases), an untied head
# (tie_word_embeddings false + lm_head.weight) and relu2 (transformers' activation "relu2") it can
HF_UNREPRESENTABLE = {
    "position": "GPT-2's positions are the learned wpe table, with no rotary embedding",
    "rope_base": "GPT-2's positions are the learned wpe table, with no rotary embedding",
    "norm": "GPT-2's norms are LayerNorms (mean subtracted), not a gain-less RMSNorm",
    "qk_norm": "GPT-2's attention normalises neither q nor k",
    "logit_softcap": "GPT-2's head has no soft-cap of the logits",
}


def config_to_hf(c: GPT2Config) -> dict:
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": c.vocab_size, "n_positions": c.block_size, "n_ctx": c.block_size,
        "n_embd": c.n_embd, "n_layer": c.n_layer, "n_head": c.n_head, "n_inner": None,
        "activation_function": "relu2" if c.activation == "relu2" else "gelu_new", "layer_norm_epsilon": 1e-5,
        "initializer_range": 0.02,
        "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1, "summary_type": "cls_index",
        "summary_use_proj": True, "summary_activation": None, "summary_proj_to_labels": True,
        "summary_first_dropout": 0.1, "scale_attn_weights": True, "use_cache": True,
        "bos_token_id": 50256, "eos_token_id": 50256, "tie_word_embeddings": bool(c.tie_embeddings),
        "torch_dtype": "float32",
    }


# ------------------------------------------------------------------------------------ state dicts
# (our name, HF name inside block i or at the top, transposed)
_LAYER_MAP = [("ln1w", "ln_1.weight", False), ("ln1b", "ln_1.bias", False),
              ("qkvw", "attn.c_attn.weight", True), ("qkvb", "attn.c_attn.bias", False),
              ("attprojw", "attn.c_proj.weight", True), ("attprojb", "attn.c_proj.bias", False),
              ("ln2w", "ln_2.weight", False), ("ln2b", "ln_2.bias", False),
              ("fcw", "mlp.c_fc.weight", True), ("fcb", "mlp.c_fc.bias", False),
              ("fcprojw", "mlp.c_proj.weight", True), ("fcprojb", "mlp.c_proj.bias", False)]
_IGNORED = re.compile(r"^h\.\d+\.attn\.(bias|masked_bias)$")


def state_dict_to_params(sd: dict, config: GPT2Config, path) -> np.ndarray:
    """A HF GPT-2 state dict -> our flat fp32 parameter vector (param_names order, padded vocab)."""
    sd = {(k[len("transformer."):] if k.startswith("transformer.") else k): v for k, v in sd.items()}
    c, L, C, V = config, config.n_layer, config.n_embd, config.vocab_size
    used = set()

    def get(key, shape):
        if key not in sd:
            raise CheckpointError(f"{path}: missing tensor {key!r}")
        a = np.asarray(sd[key])
        if tuple(a.shape) != tuple(shape):
            raise CheckpointError(f"{path}: tensor {key!r} has shape {tuple(a.shape)}, config.json implies "
                                  f"{tuple(shape)}")
        used.add(key)
        return a.astype(np.float32, copy=False)

    out = {}
    hf_wte = get("wte.weight", (V, C))  # first: the file's own tensor bounds what config.json makes us allocate
    wte = np.zeros((c.padded_vocab_size, C), dtype=np.float32)
    wte[:V] = hf_wte
    out["wte"] = wte
    out["wpe"] = get("wpe.weight", (c.block_size, C))
    per_layer = {"ln1w": (C,), "ln1b": (C,), "qkvw": (3 * C, C), "qkvb": (3 * C,), "attprojw": (C, C),
                 "attprojb": (C,), "ln2w": (C,), "ln2b": (C,), "fcw": (4 * C, C), "fcb": (4 * C,),
                 "fcprojw": (C, 4 * C), "fcprojb": (C,)}
    for ours, theirs, transposed in _LAYER_MAP:
        shape = per_layer[ours]
        hf_shape = shape[::-1] if transposed else shape
        stack = []
        for i in range(L):
            a = get(f"h.{i}.{theirs}", hf_shape)
            stack.append(a.T if transposed else a)
        out[ours] = np.stack(stack)
    out["lnfw"] = get("ln_f.weight", (C,))
    out["lnfb"] = get("ln_f.bias", (C,))
    names = list(_C.param_names())
    if not c.tie_embeddings:  # config.json's tie_word_embeddings false: the head is its own tensor, last
        head = np.zeros((c.padded_vocab_size, C), dtype=np.float32)
        head[:V] = get("lm_head.weight", (V, C))
        out["lm_head"] = head
        names.append("lm_head")
    elif "lm_head.weight" in sd:
        lm = np.asarray(sd["lm_head.weight"])
        if lm.shape != (V, C) or not np.array_equal(lm.astype(np.float32), wte[:V]):
            raise CheckpointError(f"{path}: lm_head.weight differs from wte.weight, and config.json ties them "
                                  "(tie_word_embeddings true)")
        used.add("lm_head.weight")
    extra = [k for k in sd if k not in used and not _IGNORED.match(k)]
    if extra:
        raise CheckpointError(f"{path}: unexpected tensors {extra[:5]}{' ...' if len(extra) > 5 else ''}; "
                              f"is this a GPT-2 with n_layer={L}?")
    return np.concatenate([out[n].reshape(-1) for n in names])


def params_to_state_dict(model) -> dict[str, np.ndarray]:
    """Our parameters -> a HF GPT2LMHeadModel state dict (prefix 'transformer.', Conv1D (in, out), the
    padded vocab rows dropped, lm_head omitted since it is tied)."""
    c = model.config
    shapes = c.replace(bias=True).param_shapes()  # a bias-free model: zero biases
    p = {k: model.params[k] if k in model.params else np.zeros(shapes[k], np.float32) for k in shapes}
    sd = {"transformer.wte.weight": p["wte"][:c.vocab_size], "transformer.wpe.weight": p["wpe"]}
    for i in range(c.n_layer):
        for ours, theirs, transposed in _LAYER_MAP:
            a = p[ours][i]
            sd[f"transformer.h.{i}.{theirs}"] = a.T if transposed else a
    sd["transformer.ln_f.weight"] = p["lnfw"]
    sd["transformer.ln_f.bias"] = p["lnfb"]
    if not c.tie_embeddings:
        sd["lm_head.weight"] = model.params["lm_head"][:c.vocab_size]
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in sd.items()}


# ------------------------------------------------------------------------------------ entry points
def looks_like_hub_id(s: str) -> bool:
    return bool(_HUB_ID.match(s)) and not s.endswith((".bin", ".safetensors", ".json", ".npz"))


def _hub_download(repo_id: str) -> Path:
    try:
        import huggingface_hub
    except ImportError:
        raise CheckpointError(
            f"{repo_id}: no such local file or directory, and fetching it from the Hugging Face Hub needs the "
            "huggingface_hub package (pip install huggingface_hub); or pass a local directory with config.json "
            "and model.safetensors") from None
    try:
        d = huggingface_hub.snapshot_download(repo_id, allow_patterns=["config.json", "model.safetensors"])
        if not (Path(d) / "model.safetensors").exists():
            d = huggingface_hub.snapshot_download(repo_id, allow_patterns=["config.json", "pytorch_model.bin"])
    except Exception as e:  # noqa: BLE001 - network, auth, missing repo...
        raise CheckpointError(f"{repo_id}: could not fetch it from the Hugging Face Hub ({type(e).__name__}: "
                              f"{e}); without network access, pass a local directory") from e
    return Path(d)


def read_hf(path, padded_vocab_size: int | None = None) -> tuple[GPT2Config, np.ndarray, Path]:
    """(config, flat weights, the file they came from) of a local HF GPT-2 directory, or a Hub repo id such
    as "gpt2"."""
    p = Path(path)
    if not p.exists():
        if not looks_like_hub_id(str(path)):
            raise CheckpointError(f"{p}: no such directory")
        p = _hub_download(str(path))
    if not p.is_dir():
        raise CheckpointError(f"{p}: a Hugging Face model is a directory (config.json + model.safetensors)")
    cfg_path = p / "config.json"
    try:
        cfg = json.loads(cfg_path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{cfg_path}: missing; a Hugging Face model directory needs config.json") from None
    except OSError as e:
        raise CheckpointError(f"{cfg_path}: cannot read ({e.strerror or e})") from None
    except ValueError as e:
        raise CheckpointError(f"{cfg_path}: not valid JSON ({e})") from None
    config = config_from_hf(cfg, cfg_path, padded_vocab_size)
    if (p / "model.safetensors").exists():
        wpath = p / "model.safetensors"
        sd = read_safetensors(wpath)
    elif (p / "pytorch_model.bin").exists():
        wpath = p / "pytorch_model.bin"
        sd = read_torch_bin(wpath)
    else:
        shards = sorted(p.glob("model-*.safetensors"))
        if not shards:
            raise CheckpointError(f"{p}: no model.safetensors or pytorch_model.bin")
        wpath, sd = p, {}
        for s in shards:
            sd.update(read_safetensors(s))
    return config, state_dict_to_params(sd, config, wpath), wpath


def read_weights(path, padded_vocab_size: int | None = None) -> tuple[GPT2Config, np.ndarray, Path]:
    """(config, flat fp32 weights in param_names() order, the file they came from) of any supported source:

    * an llm.c model file, version 3 (fp32) or 5 (bf16);
    * a training checkpoint directory (its model.bin, after checking the manifest);
    * a run folder, gpt2core-train's --output-dir (its model.bin: the finished run's model);
    * a Hugging Face GPT-2 directory: config.json + model.safetensors or pytorch_model.bin;
    * a Hugging Face Hub repo id such as "gpt2" (needs huggingface_hub and network access).

    padded_vocab_size applies to Hugging Face models only (default: vocab rounded up to 128).
    Problems raise CheckpointError naming the file."""
    p = Path(path)
    if p.is_dir():
        if (p / MANIFEST).exists() or (p / "state.json").exists():
            ck = load_checkpoint(p)
            return (*ck.read_weights(), ck.path / "model.bin")
        if any((p / n).exists() for n in ("config.json", "model.safetensors", "pytorch_model.bin")):
            return read_hf(p, padded_vocab_size)
        if (p / "model.bin").is_file():  # a run folder (gpt2core-train --output-dir): the run's final model
            return (*read_model(p / "model.bin"), p / "model.bin")
        steps = list_checkpoints(p / "checkpoints")
        if steps:  # a run folder of a run that has not finished
            raise CheckpointError(f"{p}: a run folder without model.bin (the run has not finished): give one of its "
                                  f"checkpoints, e.g. {steps[0][1]}")
        raise CheckpointError(f"{p}: directory holds neither a gpt2core checkpoint (manifest.json), a run's model.bin "
                              "nor a Hugging Face model (config.json)")
    if p.exists():
        return (*read_model(p), p)
    if looks_like_hub_id(str(path)):
        return read_hf(str(path), padded_vocab_size)
    raise CheckpointError(f"{p}: no such file or directory")


def save_pretrained(model, path) -> Path:
    """Write config.json + model.safetensors that transformers' GPT2LMHeadModel.from_pretrained loads. Of the
    modern fields GPT-2's format holds bias=False (as zero biases), an untied head (tie_word_embeddings false and
    lm_head.weight) and activation relu2 (transformers' "relu2"); rotary positions, RMSNorm, QK-norm and the logit
    soft-cap it cannot (HF_UNREPRESENTABLE says why): such a model is refused, naming the fields (no weights are
    written)."""
    p = Path(path)
    c = model.config
    unrepresentable = [f for f in c.non_gpt2_fields() if f.split("=")[0] in HF_UNREPRESENTABLE]
    if unrepresentable:
        why = sorted({HF_UNREPRESENTABLE[f.split("=")[0]] for f in unrepresentable})
        raise ValueError(f"{p}: the Hugging Face GPT-2 format cannot represent {', '.join(unrepresentable)} "
                         f"({'; '.join(why)}); save this model with GPT2.save (gpt2core's model file) instead")
    p.mkdir(parents=True, exist_ok=True)
    write_safetensors(p / "model.safetensors", params_to_state_dict(model), metadata={"format": "pt"})
    with open(p / "config.json", "w") as f:
        json.dump(config_to_hf(model.config), f, indent=2)
        f.write("\n")
    return p


__all__ = ["HF_UNREPRESENTABLE", "read_weights", "read_hf", "save_pretrained", "read_safetensors",
           "write_safetensors", "read_torch_bin", "config_from_hf", "config_to_hf", "state_dict_to_params",
           "params_to_state_dict"]
