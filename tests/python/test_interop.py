"""Hugging Face GPT-2 interop: a small random model in HF's layout (Conv1D weights (in, out), c_attn, tied wte)
is checked against a numpy forward written from HF's semantics; save_pretrained round trips; pytorch_model.bin
without torch; Hub names; bad directories; and the CLIs (generate, evaluate) on every format."""
import json
import pickle
import sys
import types
import zipfile
from collections import OrderedDict

import numpy as np
import pytest

from gpt2core import GPT2, GPT2Config, llmc, load_model, pretrained
from gpt2core import checkpoint as ck
from gpt2core.llmc import CheckpointError

L, NH, C, V, NPOS = 2, 2, 32, 97, 16
HF_CONFIG = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": V, "n_positions": NPOS,
             "n_ctx": NPOS, "n_embd": C, "n_layer": L, "n_head": NH, "n_inner": None,
             "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5, "tie_word_embeddings": True}


def hf_state(seed=0, prefix="transformer."):
    """Random GPT-2 weights as a HF GPT2LMHeadModel state dict (float32, Conv1D (in, out))."""
    rng = np.random.default_rng(seed)

    def r(*shape, s=0.1):
        return (rng.standard_normal(shape) * s).astype(np.float32)

    sd = {f"{prefix}wte.weight": r(V, C), f"{prefix}wpe.weight": r(NPOS, C)}
    for i in range(L):
        h = f"{prefix}h.{i}."
        sd.update({h + "ln_1.weight": 1 + r(C), h + "ln_1.bias": r(C),
                   h + "attn.c_attn.weight": r(C, 3 * C), h + "attn.c_attn.bias": r(3 * C),
                   h + "attn.c_proj.weight": r(C, C), h + "attn.c_proj.bias": r(C),
                   h + "ln_2.weight": 1 + r(C), h + "ln_2.bias": r(C),
                   h + "mlp.c_fc.weight": r(C, 4 * C), h + "mlp.c_fc.bias": r(4 * C),
                   h + "mlp.c_proj.weight": r(4 * C, C), h + "mlp.c_proj.bias": r(C),
                   # old checkpoints carry the causal mask as a buffer: ignored on import
                   h + "attn.bias": np.tril(np.ones((NPOS, NPOS), np.float32))[None, None]})
    sd[f"{prefix}ln_f.weight"] = 1 + r(C)
    sd[f"{prefix}ln_f.bias"] = r(C)
    return sd


def hf_forward(sd, idx):
    """Logits (B, T, V) in float64, written from HF's GPT2LMHeadModel: Conv1D is x @ W + b with W (in, out);
    c_attn's output splits into q, k, v along the last dim; tanh GELU; lm_head = wte^T."""
    g = {k.replace("transformer.", ""): v.astype(np.float64) for k, v in sd.items()}
    B, T = idx.shape
    hs = C // NH

    def ln(x, w, b):
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + 1e-5) * w + b

    x = g["wte.weight"][idx] + g["wpe.weight"][:T]
    for i in range(L):
        p = lambda n: g[f"h.{i}.{n}"]  # noqa: E731
        h = ln(x, p("ln_1.weight"), p("ln_1.bias"))
        q, k, v = np.split(h @ p("attn.c_attn.weight") + p("attn.c_attn.bias"), 3, axis=-1)
        q, k, v = (a.reshape(B, T, NH, hs).transpose(0, 2, 1, 3) for a in (q, k, v))
        att = q @ k.transpose(0, 1, 3, 2) / np.sqrt(hs)
        att = np.where(np.tril(np.ones((T, T), bool)), att, -np.inf)
        att = np.exp(att - att.max(-1, keepdims=True))
        att /= att.sum(-1, keepdims=True)
        y = (att @ v).transpose(0, 2, 1, 3).reshape(B, T, C)
        x = x + y @ p("attn.c_proj.weight") + p("attn.c_proj.bias")
        h = ln(x, p("ln_2.weight"), p("ln_2.bias")) @ p("mlp.c_fc.weight") + p("mlp.c_fc.bias")
        h = 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h ** 3)))
        x = x + h @ p("mlp.c_proj.weight") + p("mlp.c_proj.bias")
    return ln(x, g["ln_f.weight"], g["ln_f.bias"]) @ g["wte.weight"].T


def write_hf_dir(d, sd, writer="gpt2core", config=None):
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(config or HF_CONFIG))
    if writer == "safetensors":
        st = pytest.importorskip("safetensors.numpy")
        st.save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    else:
        pretrained.write_safetensors(d / "model.safetensors", sd, metadata={"format": "pt"})
    return d


IDX = np.random.default_rng(7).integers(0, V, (2, NPOS))


def our_logits(m, idx=IDX):
    return m.forward(idx, return_logits=True)[1]


# ------------------------------------------------------------------------------------ import / export
@pytest.mark.parametrize("writer,prefix", [("safetensors", "transformer."), ("safetensors", ""),
                                           ("gpt2core", "transformer.")])
def test_from_pretrained_matches_hf_semantics(tmp_path, writer, prefix):
    sd = hf_state(0, prefix)
    d = write_hf_dir(tmp_path / "hf", sd, writer)
    m = GPT2.from_pretrained(d)
    assert m.config == GPT2Config(block_size=NPOS, vocab_size=V, padded_vocab_size=128, n_layer=L, n_head=NH,
                                  n_embd=C)
    got = our_logits(m)
    np.testing.assert_array_equal(got[..., V:], 0.0)  # padded vocab rows are zero
    # fp32 core vs float64 reference: ~1e-6 relative per op over a few layers
    np.testing.assert_allclose(got[..., :V], hf_forward(sd, IDX), rtol=0, atol=2e-5)
    # the transposition really matters: a model without it gives other logits
    np.testing.assert_array_equal(m.params["qkvw"][1], sd[f"{prefix}h.1.attn.c_attn.weight"].T)
    assert GPT2.from_pretrained(d, padded_vocab_size=V).config.padded_vocab_size == V


def test_save_pretrained_round_trip(tmp_path):
    sd = hf_state(1)
    src = GPT2.from_pretrained(write_hf_dir(tmp_path / "src", sd))
    out = src.save_pretrained(tmp_path / "out")
    cfg = json.loads((out / "config.json").read_text())
    for k in ("vocab_size", "n_embd", "n_layer", "n_head", "n_positions", "activation_function", "model_type"):
        assert cfg[k] == HF_CONFIG[k], k
    back = pretrained.read_safetensors(out / "model.safetensors")
    expected = {k: v for k, v in sd.items() if not k.endswith(".attn.bias")}
    assert sorted(back) == sorted(expected)  # HF names, no lm_head (tied), no padded rows
    for k, v in expected.items():
        np.testing.assert_array_equal(back[k], v, err_msg=k)
    np.testing.assert_array_equal(our_logits(GPT2.from_pretrained(out)), our_logits(src))


def test_save_pretrained_readable_by_safetensors_package(tmp_path):
    st = pytest.importorskip("safetensors")
    from safetensors.numpy import load_file
    src = GPT2.from_pretrained(write_hf_dir(tmp_path / "src", hf_state(2)))
    out = src.save_pretrained(tmp_path / "out")
    sd = load_file(str(out / "model.safetensors"))
    assert sd["transformer.h.0.attn.c_attn.weight"].shape == (C, 3 * C)
    assert sd["transformer.wte.weight"].shape == (V, C)
    with st.safe_open(str(out / "model.safetensors"), "np") as f:
        assert f.metadata() == {"format": "pt"}


def test_transformers_logits_match(tmp_path):
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import torch
    src = GPT2.from_pretrained(write_hf_dir(tmp_path / "src", hf_state(3)))
    out = src.save_pretrained(tmp_path / "out")
    ref = transformers.GPT2LMHeadModel.from_pretrained(str(out)).eval()
    with torch.no_grad():
        want = ref(torch.from_numpy(IDX.astype(np.int64))).logits.numpy()
    np.testing.assert_allclose(our_logits(src)[..., :V], want, rtol=0, atol=1e-4)  # fp32 vs fp32, other op order


def test_llmc_export_of_hf_model(tmp_path):
    m = GPT2.from_pretrained(write_hf_dir(tmp_path / "hf", hf_state(4)))
    p = m.save(tmp_path / "m.bin")
    np.testing.assert_array_equal(our_logits(load_model(p)), our_logits(m))
    assert llmc.read_model_header(p).padded_vocab_size == 128


# ------------------------------------------------------------------------------------ pytorch_model.bin
class _Storage:
    def __init__(self, key, arr):
        self.key, self.arr = key, arr


def write_torch_zip(path, sd, monkeypatch):
    """A pytorch_model.bin in torch's zip format (data.pkl + data/<key>), written with the same pickle
    opcodes torch.save uses, through stand-in torch modules (torch itself is not needed)."""
    torch = types.ModuleType("torch")
    tutils = types.ModuleType("torch._utils")

    def _rebuild_tensor_v2(*a):
        raise AssertionError("never called")
    _rebuild_tensor_v2.__module__, _rebuild_tensor_v2.__qualname__ = "torch._utils", "_rebuild_tensor_v2"
    FloatStorage = type("FloatStorage", (), {"__module__": "torch"})
    torch.FloatStorage, torch._utils, tutils._rebuild_tensor_v2 = FloatStorage, tutils, _rebuild_tensor_v2
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setitem(sys.modules, "torch._utils", tutils)

    class Tensor:
        def __init__(self, storage, offset, shape, stride):
            self.args = (storage, offset, tuple(shape), tuple(stride), False, OrderedDict())

        def __reduce__(self):
            return (_rebuild_tensor_v2, self.args)

    storages, obj = {}, OrderedDict()
    for name, (arr, shared_with, transposed) in sd.items():
        if shared_with:
            obj[name] = Tensor(storages[shared_with], 0, arr.shape, (arr.shape[1], 1))
            continue
        st = _Storage(str(len(storages)), arr.T.copy() if transposed else arr)
        storages[name] = st
        if transposed:  # a non-contiguous tensor: the storage holds its transpose
            obj[name] = Tensor(st, 0, arr.shape, (1, arr.shape[0]))
        else:
            obj[name] = Tensor(st, 0, arr.shape, tuple(s // 4 for s in arr.strides))

    class P(pickle.Pickler):
        def persistent_id(self, o):
            if isinstance(o, _Storage):
                return ("storage", FloatStorage, o.key, "cpu", o.arr.size)
            return None

    import io
    buf = io.BytesIO()
    P(buf, protocol=2).dump(obj)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", buf.getvalue())
        z.writestr("archive/version", "3\n")
        for st in storages.values():
            z.writestr(f"archive/data/{st.key}", np.ascontiguousarray(st.arr, "<f4").tobytes())
    monkeypatch.delitem(sys.modules, "torch")
    monkeypatch.delitem(sys.modules, "torch._utils")


def test_pytorch_model_bin_without_torch(tmp_path, monkeypatch):
    sd = hf_state(5)
    entries = {k: (v, None, k.endswith("c_fc.weight")) for k, v in sd.items()}
    entries["lm_head.weight"] = (sd["transformer.wte.weight"], "transformer.wte.weight", False)  # tied storage
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(HF_CONFIG))
    write_torch_zip(d / "pytorch_model.bin", entries, monkeypatch)
    monkeypatch.setitem(sys.modules, "torch", None)  # as on a machine without torch
    m = GPT2.from_pretrained(d)
    np.testing.assert_allclose(our_logits(m)[..., :V], hf_forward(sd, IDX), rtol=0, atol=2e-5)
    # a pickle that asks for anything but tensors is refused
    evil = tmp_path / "evil"
    evil.mkdir()
    (evil / "config.json").write_text(json.dumps(HF_CONFIG))
    with zipfile.ZipFile(evil / "pytorch_model.bin", "w") as z:
        z.writestr("archive/data.pkl", pickle.dumps(OrderedDict(x=print), protocol=2))
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin: cannot unpickle .*refusing to load (__builtin__|builtins)\.print"):
        GPT2.from_pretrained(evil)
    (evil / "pytorch_model.bin").write_bytes(b"\x80\x02not a zip")
    with pytest.raises(CheckpointError, match="pytorch_model.bin: not a zip archive"):
        GPT2.from_pretrained(evil)


def test_pytorch_model_bin_with_torch(tmp_path):
    torch = pytest.importorskip("torch")
    sd = hf_state(6)
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(HF_CONFIG))
    torch.save({k: torch.from_numpy(v) for k, v in sd.items()}, d / "pytorch_model.bin")
    np.testing.assert_allclose(our_logits(GPT2.from_pretrained(d))[..., :V], hf_forward(sd, IDX), atol=2e-5)


# ------------------------------------------------------------------------------------ Hub names
def test_hub_name_without_huggingface_hub(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    with pytest.raises(CheckpointError, match="gpt2: no such local file or directory.*huggingface_hub"):
        GPT2.from_pretrained("gpt2")


def test_hub_name_through_huggingface_hub(tmp_path, monkeypatch):
    sd = hf_state(8)
    local = write_hf_dir(tmp_path / "snap", sd)
    calls = []

    def snapshot_download(repo_id, allow_patterns=None):
        calls.append((repo_id, allow_patterns))
        if repo_id == "nobody/nothing":
            raise ConnectionError("no network")
        return str(local)

    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "huggingface_hub", types.SimpleNamespace(snapshot_download=snapshot_download))
    m = GPT2.from_pretrained("openai-community/gpt2")
    assert calls[0] == ("openai-community/gpt2", ["config.json", "model.safetensors"])
    np.testing.assert_allclose(our_logits(m)[..., :V], hf_forward(sd, IDX), atol=2e-5)
    with pytest.raises(CheckpointError, match="nobody/nothing: could not fetch.*ConnectionError: no network"):
        GPT2.from_pretrained("nobody/nothing")


# ------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("case,where,needle", [
    ("shape", "model.safetensors", "tensor 'wte.weight' has shape (97, 32), config.json implies (97, 48)"),
    ("missing", "model.safetensors", "missing tensor 'h.1.mlp.c_fc.bias'"),
    ("nan", "model.safetensors", "NaN or Inf"),
    ("truncated", "model.safetensors", "truncated"),
    ("header", "model.safetensors", "corrupt or truncated safetensors file"),
    ("no_config", "config.json", "missing"),
    ("bad_json", "config.json", "not valid JSON"),
    ("activation", "config.json", "activation_function 'relu'"),
    ("untied", "model.safetensors", "lm_head.weight differs from wte.weight"),
    ("extra", "model.safetensors", "unexpected tensors ['h.2.ln_1.weight']"),
    ("no_weights", "", "no model.safetensors or pytorch_model.bin"),
])
def test_bad_hf_directories(tmp_path, case, where, needle):
    sd = hf_state(9, prefix="")
    cfg = dict(HF_CONFIG)
    if case == "shape":
        cfg.update(n_embd=48, n_head=3)
    elif case == "missing":
        del sd["h.1.mlp.c_fc.bias"]
    elif case == "nan":
        sd["h.1.ln_2.bias"][3] = np.nan
    elif case == "activation":
        cfg["activation_function"] = "relu"
    elif case == "untied":
        sd["lm_head.weight"] = sd["wte.weight"] + 1
    elif case == "extra":
        sd["h.2.ln_1.weight"] = np.ones(C, np.float32)
    d = write_hf_dir(tmp_path / "hf", sd, config=cfg)
    f = d / "model.safetensors"
    if case == "truncated":
        f.write_bytes(f.read_bytes()[:-1000])
    elif case == "header":
        raw = bytearray(f.read_bytes())
        raw[8:12] = b"\xff{[("
        f.write_bytes(bytes(raw))
    elif case == "no_config":
        (d / "config.json").unlink()
    elif case == "bad_json":
        (d / "config.json").write_text("{vocab_size: 3")
    elif case == "no_weights":
        f.unlink()
    with pytest.raises(CheckpointError) as e:
        GPT2.from_pretrained(d)
    assert str(d / where).rstrip("/") in str(e.value) and needle in str(e.value), str(e.value)


# ------------------------------------------------------------------------------------ CLIs
def test_generate_and_eval_accept_every_format(tmp_path, capsys):
    from gpt2core import evaluate, generate
    from gpt2core.data.shards import write_shard
    m = GPT2("tiny", seed=3)
    files = {
        "llmc_v3": m.save(tmp_path / "m3.bin"),
        "llmc_v5": m.save(tmp_path / "m5.bin", dtype="bfloat16"),
        "checkpoint": ck.save_checkpoint(tmp_path / "ckpts", 7, m),
        "hf": m.save_pretrained(tmp_path / "hf"),
    }
    texts = {k: generate.main(["Hello", "--model", str(p), "--max-new-tokens", "3", "--seed", "1"])
             for k, p in files.items()}
    assert texts["llmc_v3"] == texts["checkpoint"] == texts["hf"]  # the same fp32 weights
    assert texts["llmc_v5"][0].startswith("Hello")
    with pytest.raises(SystemExit, match=r"m3\.bin: file has .* bytes"):
        (tmp_path / "m3.bin").write_bytes((tmp_path / "m3.bin").read_bytes()[:5000])
        generate.main(["--model", str(tmp_path / "m3.bin")])

    data = tmp_path / "data"
    data.mkdir()
    write_shard(data / "x_val_000000.bin", np.random.default_rng(0).integers(0, 50257, 1000).astype(np.uint16))
    capsys.readouterr()
    for k in ("llmc_v5", "checkpoint", "hf"):
        assert evaluate.main(["val", "--checkpoint", str(files[k]), "--data-dir", str(data), "-B", "2", "-T", "16",
                              "--steps", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    vals = [ln for ln in lines if ln.startswith("val loss")]
    assert len(vals) == 3 and vals[1] == vals[2]


def test_save_pretrained_holds_the_modern_fields_gpt2s_format_can(tmp_path):
    """bias=False (zero biases), an untied head (tie_word_embeddings false + lm_head.weight) and relu2
    (activation_function "relu2") export and read back to the same logits; rotary positions, RMSNorm, QK-norm and
    the soft-cap are refused with the reason."""
    cfg = GPT2Config(block_size=NPOS, vocab_size=V, padded_vocab_size=128, n_layer=L, n_head=NH, n_embd=C,
                     bias=False, tie_embeddings=False, activation="relu2")
    src = GPT2(cfg, seed=5)
    out = src.save_pretrained(tmp_path / "out")
    hc = json.loads((out / "config.json").read_text())
    assert hc["activation_function"] == "relu2" and hc["tie_word_embeddings"] is False
    sd = pretrained.read_safetensors(out / "model.safetensors")
    np.testing.assert_array_equal(sd["lm_head.weight"], src.params["lm_head"][:V])
    assert not sd["transformer.h.1.mlp.c_fc.bias"].any() and not sd["transformer.ln_f.bias"].any()
    back = GPT2.from_pretrained(out)
    assert (back.config.activation, back.config.tie_embeddings) == ("relu2", False)
    np.testing.assert_array_equal(our_logits(back)[..., :V], our_logits(src)[..., :V])
    for field, value, why in (("position", "rope", "learned wpe"), ("norm", "rmsnorm", "gain-less RMSNorm"),
                              ("qk_norm", True, "neither q nor k"), ("logit_softcap", 30.0, "soft-cap")):
        m = GPT2(cfg.replace(**{field: value}), seed=0)
        with pytest.raises(ValueError, match=f"cannot represent {field}={value!r} .*{why}"):
            m.save_pretrained(tmp_path / field)
