"""Fuzzing every file reader with hypothesis: whatever the bytes or the JSON, a reader returns or raises the
package's own error type (errors.FileFormatError: CheckpointError, ShardError, HellaSwagError) naming the file;
never another exception, never a crash. Each reader gets a valid file and mutations of it: bytes overwritten
(biased to the header), truncation, appended bytes; for JSON and structured formats, any JSON value put
anywhere in the document, or arrays of any dtype and shape. Bounded: MAX_EXAMPLES cases each (a few seconds
in CI). Run with `-s` to print the table of cases and clear errors per reader."""
import io
import json
import os
import random
import sys
import zipfile
from collections import defaultdict
from types import SimpleNamespace

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from gpt2core import GPT2, GPT2Config, _C, llmc, pretrained  # noqa: E402
from gpt2core import checkpoint as ck  # noqa: E402
from gpt2core.data import hellaswag, shards  # noqa: E402
from gpt2core.errors import FileFormatError  # noqa: E402

from test_faults import one_thread  # noqa: E402,F401 -- a module fixture

MAX_EXAMPLES = 100
FUZZ = settings(max_examples=MAX_EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
CFG = GPT2Config(block_size=8, vocab_size=50, padded_vocab_size=64, n_layer=1, n_head=2, n_embd=8)
TALLY = defaultdict(lambda: [0, 0])  # reader -> [cases, clear errors]


@pytest.fixture(scope="module", autouse=True)
def report(one_thread):
    yield
    print(f"\n{'reader':<36} cases  clear errors  crashes")
    for k, (cases, clear) in sorted(TALLY.items()):
        print(f"{k:<36} {cases:5d}  {clear:12d}  {0:7d}")


def attempt(reader: str, path, fn):
    """Run fn(); a FileFormatError must name `path`. Any other exception propagates: the test fails."""
    TALLY[reader][0] += 1
    try:
        fn()
    except FileFormatError as e:
        assert str(path) in str(e), f"{reader}: the error does not name {path}: {e}"
        TALLY[reader][1] += 1


@st.composite
def mutated(draw, data: bytes, header: int = 64):
    """`data` with a few bytes overwritten (mostly in its first `header` bytes), maybe truncated or extended."""
    b = bytearray(data)
    pos = st.one_of(st.integers(0, min(header, len(b)) - 1), st.integers(0, len(b) - 1))
    for p, v in draw(st.lists(st.tuples(pos, st.integers(0, 255)), max_size=6)):
        b[p] = v
    if draw(st.booleans()):
        b = b[:draw(st.integers(0, len(b)))]
    return bytes(b) + draw(st.binary(max_size=12))


JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=8),
                    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
                    max_leaves=6)


def paths(obj, prefix=()):
    """Every key path into a JSON document."""
    yield prefix
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        yield from paths(v, prefix + (k,))


@st.composite
def json_mutated(draw, doc):
    """`doc` (a parsed JSON document) with one value, anywhere in it, replaced by any JSON value, or a key
    deleted."""
    doc = json.loads(json.dumps(doc))
    where = draw(st.sampled_from(list(paths(doc))))
    if not where:
        return draw(JSON)
    parent = doc
    for k in where[:-1]:
        parent = parent[k]
    if isinstance(parent, dict) and draw(st.booleans()):
        del parent[where[-1]]
    else:
        parent[where[-1]] = draw(JSON)
    return doc


def random_model(seed=0):
    m = GPT2(CFG, seed=seed)
    x = np.random.default_rng(seed).integers(0, CFG.vocab_size, (1, 8)).astype(np.int32)
    m.zero_grad()
    m.forward(x, np.roll(x, -1, 1))
    m.backward()
    m.step(1e-3)
    return m


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """One valid file of every format, as bytes (and checkpoint directories)."""
    d = tmp_path_factory.mktemp("valid")
    m = random_model()
    out = SimpleNamespace(dir=d, model=m)
    out.v3 = m.save(d / "m3.bin").read_bytes()
    out.v5 = m.save(d / "m5.bin", dtype="bfloat16").read_bytes()
    out.shard = shards.write_shard(d / "x_val_000000.bin", np.arange(300) % 50).read_bytes()
    hf = m.save_pretrained(d / "hf")
    out.safetensors = (hf / "model.safetensors").read_bytes()
    out.hf_config = json.loads((hf / "config.json").read_text())
    items = [{"ctx": "A man is", "endings": ["sitting.", "running fast.", "a dog", "x"], "label": 2},
             {"ctx": "Then", "endings": ["one", "two", "three", "four"], "label": 0}]
    rendered = hellaswag.render(items)
    out.hellaswag_npz = hellaswag.save(rendered, d / "h.npz").read_bytes()
    out.hellaswag_arrays = {"version": np.int32(hellaswag.RENDER_VERSION), "tokens": rendered.tokens.astype(np.uint16),
                            "offsets": rendered.offsets, "ctx_lens": rendered.ctx_lens, "labels": rendered.labels}
    out.hellaswag_jsonl = "\n".join(json.dumps(i) for i in items)
    out.ckpt = ck.save_checkpoint(d / "ck", 1, m, {"train_loader": {"version": 1}})
    out.zero_ckpt = zero_checkpoint(d / "zero", m)
    return out


def zero_checkpoint(root, m):
    """A ZeRO-1 checkpoint of one rank (a communicator of one: every collective is the identity)."""
    comm = SimpleNamespace(rank=0, size=1, broadcast=lambda *a, **k: None, allreduce=lambda *a, **k: None)
    mm, vv = m.opt_state()
    names = list(_C.param_names())
    dp = SimpleNamespace(comm=comm, zero=1, lo=0, hi=m.num_parameters,
                         m=np.concatenate([mm[k].ravel() for k in names]), v=np.concatenate([vv[k].ravel() for k in names]))
    return ck.save_checkpoint(root, 1, m, {}, zero=dp)


# ------------------------------------------------------------------------------------ byte-level readers
@FUZZ
@given(data=st.data())
def test_llmc_model_files(files, data):
    p = files.dir / "fuzz.bin"
    for version, name in ((files.v3, "llm.c v3 model.bin"), (files.v5, "llm.c v5 model.bin")):
        p.write_bytes(data.draw(mutated(version, header=32)))
        attempt(name, p, lambda: llmc.read_model(p))


@FUZZ
@given(data=st.data())
def test_token_shards(files, data):
    p = files.dir / "fuzz_val_000000.bin"
    p.write_bytes(data.draw(mutated(files.shard, header=12)))

    def read():
        tokens = shards.load_tokens(p, vocab_size=50)
        int(tokens.sum())
    attempt("token shard", p, read)


@FUZZ
@given(data=st.data())
def test_safetensors_bytes(files, data):
    p = files.dir / "fuzz.safetensors"
    p.write_bytes(data.draw(mutated(files.safetensors, header=256)))
    attempt("safetensors (bytes)", p, lambda: pretrained.read_safetensors(p))


def _safetensors_with_header(header: dict, body: bytes) -> bytes:
    hb = json.dumps(header).encode()
    return len(hb).to_bytes(8, "little") + hb + body


@FUZZ
@given(data=st.data())
def test_safetensors_headers(files, data):
    """Hand-edited headers: negative shapes, wrong types, offsets outside the file, unknown dtypes..."""
    n = int.from_bytes(files.safetensors[:8], "little")
    header = json.loads(files.safetensors[8:8 + n])
    d = files.dir / "hf_fuzz"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(files.hf_config))
    p = d / "model.safetensors"
    p.write_bytes(_safetensors_with_header(data.draw(json_mutated(header)), files.safetensors[8 + n:]))
    attempt("safetensors (header)", p, lambda: pretrained.read_hf(d))


@FUZZ
@given(data=st.data())
def test_hf_config_json(files, data):
    d = files.dir / "hf_cfg_fuzz"
    d.mkdir(exist_ok=True)
    (d / "model.safetensors").write_bytes(files.safetensors)
    (d / "config.json").write_text(json.dumps(data.draw(json_mutated(files.hf_config))))
    attempt("HF config.json", d, lambda: pretrained.read_hf(d))


@pytest.fixture(scope="module")
def torch_bin(files, tmp_path_factory):
    """A pytorch_model.bin in torch's zip format, written without torch (tests/python/test_interop.py's writer)."""
    from test_interop import write_torch_zip
    sd = pretrained.params_to_state_dict(files.model)
    p = tmp_path_factory.mktemp("torch") / "pytorch_model.bin"
    with pytest.MonkeyPatch.context() as mp:
        write_torch_zip(p, {k: (v, None, False) for k, v in sd.items()}, mp)
    with zipfile.ZipFile(p) as z:
        members = {n: z.read(n) for n in z.namelist()}
    return p.read_bytes(), members


@FUZZ
@given(data=st.data())
def test_torch_bin(files, torch_bin, data, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # the restricted unpickler, as without torch
    raw, members = torch_bin
    p = files.dir / "pytorch_model.bin"
    if data.draw(st.booleans()):  # the zip itself
        p.write_bytes(data.draw(mutated(raw, header=128)))
    else:  # a valid zip holding a mutated pickle or storage
        name = data.draw(st.sampled_from(sorted(members)))
        with zipfile.ZipFile(p, "w") as z:
            for k, v in members.items():
                z.writestr(k, data.draw(mutated(v, header=len(v))) if k == name else v)
    attempt("torch pytorch_model.bin", p, lambda: pretrained.read_torch_bin(p))


@FUZZ
@given(data=st.data())
def test_hellaswag_npz(files, data):
    p = files.dir / "fuzz.npz"
    if data.draw(st.booleans()):
        p.write_bytes(data.draw(mutated(files.hellaswag_npz, header=128)))
    else:  # a well-formed .npz whose arrays have any dtype, shape and values
        arrays = dict(files.hellaswag_arrays)
        for k in data.draw(st.lists(st.sampled_from(sorted(arrays)), min_size=1, max_size=3, unique=True)):
            if data.draw(st.integers(0, 5)) == 0:
                del arrays[k]
                continue
            dtype = data.draw(st.sampled_from(["<i4", "<i8", "<u2", "<f4", "|b1", "<U3", ">i4"]))
            shape = data.draw(st.lists(st.integers(0, 9), max_size=2))
            vals = data.draw(st.lists(st.integers(-3, 70000), min_size=int(np.prod(shape)),
                                      max_size=int(np.prod(shape))))
            arrays[k] = np.array(vals, dtype=np.int64).reshape(shape).astype(dtype)
        buf = io.BytesIO()
        np.savez(buf, **arrays)
        p.write_bytes(buf.getvalue())

    def read():
        r = hellaswag.load_rendered(p)
        for i in range(len(r)):  # what scoring does with it
            r.item(i)
    attempt("HellaSwag .npz", p, read)


@FUZZ
@given(text=st.text(max_size=300), cut=st.integers(0, 400))
def test_hellaswag_jsonl_and_text(files, text, cut):
    for suffix, valid in ((".jsonl", files.hellaswag_jsonl), (".txt", "ctx\nA\nB\nC\nD\n1\n")):
        p = files.dir / f"fuzz{suffix}"
        p.write_text(valid[:cut] + text)
        attempt(f"HellaSwag {suffix}", p, lambda: hellaswag.load_items(p))


# ------------------------------------------------------------------------------------ checkpoints
def _copy(src, dst):
    import shutil
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    return dst


def _rehash(d, name):
    manifest = json.loads((d / "manifest.json").read_text())
    manifest["files"][name] = {"bytes": (d / name).stat().st_size, "sha256": ck.sha256_file(d / name)}
    (d / "manifest.json").write_text(json.dumps(manifest))


def _resume(d, zero: bool):
    c = ck.load_checkpoint(d)
    m = GPT2(CFG, init=False)
    c.restore(m, optimizer=not zero)
    if zero:
        n = m.num_parameters
        c.load_optimizer_shard(0, 1, 0, n, np.empty(n, np.float32), np.empty(n, np.float32))


@FUZZ
@given(data=st.data())
def test_checkpoints(files, data):
    """manifest.json and state.json: any JSON anywhere; model.bin, adam_*.npy, ZeRO-1 shards: any bytes
    (with the manifest's hash made to match, so the reader meets them)."""
    zero = data.draw(st.booleans())
    d = _copy(files.zero_ckpt if zero else files.ckpt, files.dir / "ck_fuzz")
    names = sorted(os.listdir(d))
    name = data.draw(st.sampled_from(names))
    if name.endswith(".json"):
        (d / name).write_text(json.dumps(data.draw(json_mutated(json.loads((d / name).read_text())))))
    else:
        (d / name).write_bytes(data.draw(mutated((d / name).read_bytes(), header=160)))
    if name != "manifest.json" and data.draw(st.booleans()):
        _rehash(d, name)
    attempt(f"checkpoint {'ZeRO-1 ' if zero else ''}{name.split('_r0')[0]}", d, lambda: _resume(d, zero))


def test_random_bytes_everywhere(files):
    """Every reader also meets files of pure noise, empty files, and directories where files belong."""
    rng = random.Random(0)
    readers = {"llm.c": llmc.read_model, "shard": lambda p: shards.load_tokens(p, 50),
               "safetensors": pretrained.read_safetensors, "hellaswag npz": hellaswag.load_rendered,
               "torch bin": pretrained.read_torch_bin, "checkpoint": ck.load_checkpoint,
               "any (read_weights)": pretrained.read_weights}
    for i, blob in enumerate([b"", b"\0" * 1024, bytes(rng.randrange(256) for _ in range(3000)), b"PK\x03\x04"]):
        p = files.dir / f"noise{i}"
        p.write_bytes(blob)
        for name, read in readers.items():
            attempt(f"noise: {name}", p, lambda: read(p))
    for name, read in readers.items():
        attempt(f"noise: {name}", files.dir, lambda: read(files.dir / "empty_dir_here"))
