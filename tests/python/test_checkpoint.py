"""llm.c model files (v3 fp32, v5 bf16) and training checkpoint directories: round trips, bf16 rounding,
and bad input (wrong magic/version, truncation, shape mismatch, NaN, corrupt or half-written checkpoints)."""
import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

from gpt2core import GPT2, GPT2Config, _C, llmc, load_model
from gpt2core import checkpoint as ck
from gpt2core.checkpoint import CheckpointError

CFG = GPT2Config(block_size=16, vocab_size=97, padded_vocab_size=128, n_layer=2, n_head=2, n_embd=32)


def random_model(seed=0, config=CFG):
    """A model whose every tensor is random (not the structured init), padded vocab rows zero."""
    m = GPT2(config, init=False)
    rng = np.random.default_rng(seed)
    for name in _C.param_names():
        p = m.params[name]
        p[...] = rng.standard_normal(p.shape).astype(np.float32) * (0.5 if name.startswith("ln") else 0.1)
    m.params["wte"][config.vocab_size:] = 0.0
    return m


def batch(seed=1, config=CFG, B=2):
    return np.random.default_rng(seed).integers(0, config.vocab_size, (B, config.block_size))


def logits(m, x):
    return m.forward(x, return_logits=True)[1]


# ------------------------------------------------------------------------------------ llm.c files
def test_v3_roundtrip_gives_identical_logits(tmp_path):
    m = random_model()
    x = batch()
    path = llmc.save_model(m, tmp_path / "m.bin")
    h = np.fromfile(path, dtype="<i4", count=256)
    assert list(h[:8]) == [20240326, 3, 16, 97, 2, 2, 32, 128]
    assert path.stat().st_size == 1024 + 4 * CFG.num_parameters()
    m2 = load_model(path)
    assert m2.config == CFG and llmc.read_model_header(path) == CFG
    for name in _C.param_names():
        np.testing.assert_array_equal(m2.params[name], m.params[name])
    np.testing.assert_array_equal(logits(m2, x), logits(m, x))


def bf16_reference(x):
    """Round fp32 to bf16 (as fp32), nearest with ties to even, from the definition: pick the nearer of
    the two bf16 neighbours in float64; on a tie the one whose last mantissa bit is 0."""
    x = np.asarray(x, dtype=np.float32).reshape(-1)
    out = np.empty_like(x)
    for i, v in enumerate(x):
        bits = struct.unpack("<I", struct.pack("<f", v))[0]
        lo = bits & 0xFFFF0000
        hi = lo + 0x10000
        f = lambda b: struct.unpack("<f", struct.pack("<I", b))[0]  # noqa: E731
        dlo, dhi = abs(float(v) - f(lo)), abs(f(hi) - float(v))
        if dlo < dhi or (dlo == dhi and not (lo >> 16) & 1):
            out[i] = f(lo)
        else:
            out[i] = f(hi)
    return out


def test_bf16_rounds_to_nearest_even():
    one = 1.0
    vals = np.array([one + 2**-8,               # halfway between 1 and 1+2^-7: tie -> 1 (even)
                     one + 3 * 2**-8,           # halfway between 1+2^-7 (odd) and 1+2^-6: tie -> up
                     one + 2**-8 + 2**-20,      # just above the halfway point -> up
                     -(one + 2**-8), -(one + 3 * 2**-8), 3.14159265, -0.1, 0.0, 1e-30],
                    dtype=np.float32)
    got = llmc.bf16_to_float32(llmc.float32_to_bf16(vals))
    np.testing.assert_array_equal(got[:5], np.array([1.0, 1 + 2**-6, 1 + 2**-7, -1.0, -(1 + 2**-6)], np.float32))
    np.testing.assert_array_equal(got, bf16_reference(vals))
    rnd = np.random.default_rng(0).standard_normal(2000).astype(np.float32)
    np.testing.assert_array_equal(llmc.bf16_to_float32(llmc.float32_to_bf16(rnd)), bf16_reference(rnd))
    assert np.isnan(llmc.bf16_to_float32(llmc.float32_to_bf16(np.array([np.nan], np.float32))))[0]


def test_v5_bf16_export_import(tmp_path):
    m = random_model()
    x = batch()
    p5 = llmc.save_model(m, tmp_path / "m5.bin", dtype="bfloat16")
    assert np.fromfile(p5, dtype="<i4", count=2)[1] == 5
    assert p5.stat().st_size == 1024 + 2 * CFG.num_parameters()
    m5 = load_model(p5)
    # the imported weights are exactly the RNE-rounded fp32 weights...
    rounded = random_model()
    for name in _C.param_names():
        r = rounded.params[name]
        r[...] = bf16_reference(r).reshape(r.shape)
        np.testing.assert_array_equal(m5.params[name], r)
    np.testing.assert_array_equal(logits(m5, x), logits(rounded, x))
    # ... so a second export gives the same bytes, and its import the same logits
    p5b = llmc.save_model(m5, tmp_path / "m5b.bin", dtype="bf16")
    assert p5b.read_bytes() == p5.read_bytes()
    np.testing.assert_array_equal(logits(load_model(p5b), x), logits(m5, x))
    # bf16 keeps ~3 significant digits: logits move, but only a little
    assert np.abs(logits(m5, x) - logits(m, x)).max() < 0.1


def test_padded_rows_and_unpadded_vocab(tmp_path):
    cfg = CFG.replace(padded_vocab_size=97)  # no padding at all
    m = random_model(3, cfg)
    m2 = load_model(llmc.save_model(m, tmp_path / "u.bin"))
    assert m2.config.padded_vocab_size == 97
    np.testing.assert_array_equal(logits(m2, batch(config=cfg)), logits(m, batch(config=cfg)))


def _write(path, header, body):
    with open(path, "wb") as f:
        f.write(np.asarray(header, dtype="<i4").tobytes())
        f.write(body)
    return path


@pytest.fixture()
def good_file(tmp_path):
    return llmc.save_model(random_model(), tmp_path / "good.bin")


@pytest.mark.parametrize("case,needle", [
    ("magic", "bad magic"), ("version", "unsupported model file version 4"), ("short_header", "truncated header"),
    ("truncated", "truncated or corrupt"), ("truncated_v5", "truncated or corrupt"), ("too_long", "corrupt"),
    ("nan", "NaN"), ("inf", "NaN or Inf"), ("bad_shape", "invalid model"), ("directory", "directory"),
])
def test_bad_model_files_name_the_file_and_problem(tmp_path, good_file, case, needle):
    raw = good_file.read_bytes()
    header = np.frombuffer(raw[:1024], dtype="<i4").copy()
    body = raw[1024:]
    path = tmp_path / f"{case}.bin"
    if case == "magic":
        header[0] = 12345
        _write(path, header, body)
    elif case == "version":
        header[1] = 4
        _write(path, header, body)
    elif case == "short_header":
        path.write_bytes(raw[:500])
    elif case == "truncated":
        path.write_bytes(raw[:-4])
    elif case == "truncated_v5":
        raw5 = llmc.save_model(random_model(), tmp_path / "v5.bin", dtype="bf16").read_bytes()
        path.write_bytes(raw5[:len(raw5) // 2])
    elif case == "too_long":
        path.write_bytes(raw + b"\0" * 8)
    elif case in ("nan", "inf"):
        flat = np.frombuffer(body, dtype="<f4").copy()
        flat[-3] = np.nan if case == "nan" else np.inf  # in lnfb
        _write(path, header, flat.tobytes())
    elif case == "bad_shape":
        header[5] = 5  # n_head 5 does not divide n_embd 32
        _write(path, header, body)
    elif case == "directory":
        path.mkdir()  # a directory with neither manifest nor config.json
    with pytest.raises(CheckpointError) as e:
        load_model(path)
    assert str(path) in str(e.value) and needle in str(e.value), str(e.value)
    if case == "nan":
        assert "lnfb" in str(e.value)


def test_missing_file(tmp_path):
    with pytest.raises(CheckpointError, match="no such file"):
        load_model(tmp_path / "nope.bin")


def test_save_model_is_atomic(tmp_path):
    m = random_model()
    path = llmc.save_model(m, tmp_path / "m.bin")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.bin"]
    with pytest.raises(ValueError, match="dtype"):
        llmc.save_model(m, path, dtype="float16")


# ------------------------------------------------------------------------------------ checkpoint dirs
def trained_model(steps=3, seed=0):
    """A model with non-trivial AdamW state after a few steps."""
    m = random_model(seed)
    x = batch(5)
    y = np.roll(x, -1, axis=1)
    for _ in range(steps):
        m.zero_grad()
        m.forward(x, y)
        m.backward()
        m.step(1e-3)
    return m


def test_checkpoint_roundtrip_restores_everything(tmp_path):
    m = trained_model()
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1, "loss": 4.5}\n')
    d = ck.save_checkpoint(tmp_path / "ckpts", 3, m, {"train_loader": {"epoch": 0}, "args": {"lr": 1e-3}},
                           metrics_path=metrics)
    assert d.name == "step_000003"
    assert sorted(p.name for p in d.iterdir()) == ["adam_m.npy", "adam_v.npy", "manifest.json", "metrics.jsonl",
                                                   "model.bin", "state.json"]
    man = json.loads((d / "manifest.json").read_text())
    assert man["step"] == 3 and set(man["files"]) == {"adam_m.npy", "adam_v.npy", "metrics.jsonl", "model.bin",
                                                      "state.json"}
    c = ck.load_checkpoint(d)
    assert c.step == 3 and c.config == CFG and c.state["args"]["lr"] == 1e-3
    assert (d / "metrics.jsonl").read_text() == metrics.read_text()
    fresh = GPT2(CFG, seed=9)
    c.restore(fresh)
    assert fresh.step_count == m.step_count == 3
    m1, v1 = m.opt_state()
    m2, v2 = fresh.opt_state()
    for name in _C.param_names():
        np.testing.assert_array_equal(fresh.params[name], m.params[name])
        np.testing.assert_array_equal(m2[name], m1[name])
        np.testing.assert_array_equal(v2[name], v1[name])
    assert np.abs(v2["qkvw"]).max() > 0  # the state really was non-trivial
    x = batch(6)
    # load_model on a checkpoint directory gives the weights
    np.testing.assert_array_equal(logits(load_model(d), x), logits(m, x))
    # one more identical step on both gives identical weights (the optimizer state is complete)
    for mm in (m, fresh):
        mm.zero_grad()
        mm.forward(x, np.roll(x, -1, 1))
        mm.backward()
        mm.step(1e-3)
    np.testing.assert_array_equal(fresh.params["fcw"], m.params["fcw"])


def test_restore_rejects_shape_mismatch(tmp_path):
    d = ck.save_checkpoint(tmp_path, 1, trained_model(1))
    other = GPT2(CFG.replace(n_embd=16), seed=0)
    with pytest.raises(CheckpointError, match="n_embd=32.*n_embd=16"):
        ck.load_checkpoint(d).restore(other)


def _dead_pid():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_incomplete_and_corrupt_checkpoints(tmp_path):
    root = tmp_path / "ckpts"
    m = trained_model(1)
    for step in (10, 20, 30, 40):
        ck.save_checkpoint(root, step, m, {"k": step})
    # a crash mid-save leaves a hidden temporary directory: never listed, removed by prune
    stale = root / f".step_000050.tmp-{_dead_pid()}"
    stale.mkdir()
    (stale / "model.bin").write_bytes(b"partial")
    assert [s for s, _ in ck.list_checkpoints(root)] == [40, 30, 20, 10]
    assert ck.latest_checkpoint(root).step == 40

    # 40: a flipped byte in the optimizer state
    f = root / "step_000040" / "adam_v.npy"
    raw = bytearray(f.read_bytes())
    raw[-5] ^= 0x01
    f.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError) as e:
        ck.load_checkpoint(root / "step_000040")
    assert str(f) in str(e.value) and "sha256" in str(e.value)
    # 30: half-written (no manifest)
    (root / "step_000030" / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="incomplete checkpoint: no manifest.json"):
        ck.load_checkpoint(root / "step_000030")
    msgs = []
    c = ck.latest_checkpoint(root, log=msgs.append)
    assert c.step == 20 and c.state["k"] == 20
    assert len(msgs) == 2 and "step_000040" in msgs[0] and "step_000030" in msgs[1]
    # 20: truncated weights; manifest garbage in 10 -> nothing left
    w = root / "step_000020" / "model.bin"
    w.write_bytes(w.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="truncated"):
        ck.load_checkpoint(root / "step_000020")
    (root / "step_000010" / "manifest.json").write_text('{"format": "gpt2core-checkp')
    with pytest.raises(CheckpointError, match="corrupt manifest"):
        ck.load_checkpoint(root / "step_000010")
    with pytest.warns(UserWarning, match="skipping checkpoint"):
        assert ck.latest_checkpoint(root) is None
    with pytest.raises(CheckpointError, match="not a checkpoint directory"):
        ck.load_checkpoint(root / "step_000099")

    removed = ck.prune_checkpoints(root, keep_last=2)
    assert stale in removed and not stale.exists()
    assert [s for s, _ in ck.list_checkpoints(root)] == [40, 30]


@pytest.mark.parametrize("where", ["wpe", "adam_m", "adam_v"])
def test_non_finite_state_is_never_written(tmp_path, where):
    good = ck.save_checkpoint(tmp_path, 1, trained_model(1))
    m = trained_model(1)
    m_state, v_state = m.opt_state()
    {"wpe": m.params["wpe"], "adam_m": m_state["fcw"], "adam_v": v_state["fcw"]}[where].reshape(-1)[3] = np.inf
    tensor = "wpe" if where == "wpe" else f"{where}\\[fcw\\]"
    with pytest.raises(ck.NonFiniteError, match=rf"step_000002: refusing .*1 NaN/Inf values in tensor {tensor}"):
        ck.save_checkpoint(tmp_path, 2, m)
    assert sorted(os.listdir(tmp_path)) == ["step_000001"]  # nothing half-written, the previous one intact
    ck.load_checkpoint(good)
    if where == "wpe":
        with pytest.raises(ValueError, match=r"m\.bin: refusing to write non-finite weights .*tensor wpe"):
            m.save(tmp_path / "m.bin")
        assert not (tmp_path / "m.bin").exists()


@pytest.mark.parametrize("name,offset", [("model.bin", 1024 + 4 * 17), ("adam_m.npy", 128 + 4 * 5),
                                         ("adam_v.npy", 128 + 4 * 999)])
def test_resume_auto_skips_a_checkpoint_holding_nan(tmp_path, name, offset):
    """A checkpoint that holds NaN by other means (written by an older version, edited; its manifest made to
    match) is skipped by latest_checkpoint, with a message naming the file, like a corrupt one."""
    ck.save_checkpoint(tmp_path, 1, trained_model(1))
    d = ck.save_checkpoint(tmp_path, 2, trained_model(2))
    f = d / name
    raw = bytearray(f.read_bytes())
    raw[offset:offset + 4] = struct.pack("<f", float("nan"))
    f.write_bytes(bytes(raw))
    manifest = json.loads((d / "manifest.json").read_text())
    manifest["files"][name]["sha256"] = ck.sha256_file(f)
    (d / "manifest.json").write_text(json.dumps(manifest))
    msgs = []
    assert ck.latest_checkpoint(tmp_path, log=msgs.append).step == 1
    assert len(msgs) == 1 and f"{f}: " in msgs[0] and "NaN or Inf" in msgs[0], msgs
    with pytest.raises(CheckpointError, match="NaN or Inf"):
        ck.load_checkpoint(d)


def test_saving_the_same_step_again_replaces_it(tmp_path):
    m = trained_model(1)
    d = ck.save_checkpoint(tmp_path, 5, m, {"v": 1})
    ck.save_checkpoint(tmp_path, 5, m, {"v": 2})
    assert ck.load_checkpoint(d).state["v"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000005"]
    assert os.listdir(d)  # nothing half-deleted
