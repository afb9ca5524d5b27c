"""gpt2core-train with the modern architecture's flags on the CPU: trains, checkpoints, resumes bit-exactly, samples,
scores HellaSwag, validates; its model.bin carries the full config (load_model gives the same logits); the llm.c
and Hugging Face exports refuse it naming the fields; data parallel (Gloo, ZeRO-1) over the modern layout.

The tiny preset (2 layers, C=64) with every architecture flag, B=2, T=32 on the bundled Shakespeare, one thread."""
from pathlib import Path

import numpy as np
import pytest

from gpt2core import GPT2, GPT2Config, _C, load_model
from gpt2core import checkpoint as ck
from gpt2core import train
from gpt2core.llmc import read_model_header
from test_resume import records
from test_resume import train_keeping_threads as run

FLAGS = ["--position", "rope", "--norm", "rmsnorm", "--qk-norm", "--activation", "relu2", "--no-bias", "--untied",
         "--zero-init-proj", "--logit-softcap", "15"]
STEPS = 12
HELLASWAG = Path(__file__).resolve().parents[1] / "data" / "hellaswag_val_120.jsonl"


@pytest.fixture(scope="module")
def shakespeare_dir(tmp_path_factory):
    from gpt2core.data import shakespeare
    d = tmp_path_factory.mktemp("shakespeare")
    shakespeare.prepare(d)
    return d


def argv(data, out, *extra):
    return ["--preset", "tiny", *FLAGS, "-B", "2", "-T", "32", "--val-every", "6", "--val-steps", "1", "--steps",
            str(STEPS), "--threads", "1", "--sample-tokens", "3", "--lr", "3e-3", "--warmup", "3", "--data-dir",
            str(data), "--output-dir", str(out), *extra]


def test_flags_build_the_modern_config():
    cfg = train.parse_args(["--preset", "tiny", *FLAGS]).model_config()
    assert cfg == GPT2Config(block_size=64, n_layer=2, n_head=2, n_embd=64, position="rope", norm="rmsnorm",
                             qk_norm=True, activation="relu2", bias=False, tie_embeddings=False, zero_init_proj=True,
                             logit_softcap=15.0)
    assert train.parse_args(["--preset", "m4"]).model_config() == GPT2Config.modern(4, 256, n_head=4, block_size=256)
    # a preset's field switched back off: --logit-softcap 0 is none, --rope-base sets the base
    c = train.parse_args(["--preset", "m2", "--logit-softcap", "0", "--rope-base", "500"]).model_config()
    assert c.logit_softcap is None and c.rope_base == 500.0
    with pytest.raises(SystemExit):
        train.parse_args(["--position", "alibi"])


@pytest.fixture(scope="module")
def straight(shakespeare_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("straight")
    last = run(argv(shakespeare_dir, out, "--hellaswag-every", str(STEPS), "--hellaswag-path", str(HELLASWAG),
                    "--hellaswag-limit", "4"))
    return out, last


@pytest.mark.filterwarnings("ignore:.*longer than the model.s context")
def test_modern_run_trains_validates_samples_and_scores_hellaswag(straight):
    out, last = straight
    recs = records(out)
    losses = [r["loss"] for r in recs if "loss" in r]
    assert len(losses) == STEPS and np.isfinite(losses).all()
    assert losses[-1] < losses[0] - 0.5  # it learns
    vals = [r for r in recs if "val_loss" in r]
    assert [r["step"] for r in vals] == [0, 6, 12] and np.isfinite([r["val_loss"] for r in vals]).all()
    hs = [r for r in recs if "hellaswag_acc" in r]
    assert [r["step"] for r in hs] == [0, 12] and all(0 <= r["hellaswag_acc_norm"] <= 1 for r in hs)
    # model.bin: gpt2core's extended llm.c file with the full config; load_model gives the same logits
    cfg = read_model_header(out / "model.bin")
    assert cfg == train.parse_args(["--preset", "tiny", *FLAGS]).model_config()
    assert np.frombuffer((out / "model.bin").read_bytes()[:8], "<i4")[1] == 1003
    m = load_model(out / "model.bin")
    assert m.config == cfg and list(m.params) == list(cfg.param_shapes())
    st = ck.load_checkpoint(sorted((out / "checkpoints").iterdir())[-1]) if (out / "checkpoints").exists() else None
    assert st is None or st.config == cfg


def test_resume_is_bit_identical(shakespeare_dir, straight, tmp_path, monkeypatch):
    ref, _ = straight
    out = tmp_path / "run"

    class Crash(Exception):
        pass

    orig = train.Trainer.write_metrics

    def crashing(self, rec):
        orig(self, rec)
        if rec.get("step") == 8:
            raise Crash()

    monkeypatch.setattr(train.Trainer, "write_metrics", crashing)
    with pytest.raises(Crash):
        run(argv(shakespeare_dir, out, "--checkpoint-every", "5"))
    monkeypatch.setattr(train.Trainer, "write_metrics", orig)
    c5 = ck.load_checkpoint(out / "checkpoints" / "step_000005")
    assert c5.config.position == "rope" and c5.state["optimizer"]["param_order"] == list(c5.config.param_shapes())
    run(argv(shakespeare_dir, out, "--checkpoint-every", "5", "--resume", "auto"))
    got = [(r["loss"], r["grad_norm"]) for r in records(out) if "loss" in r]
    want = [(r["loss"], r["grad_norm"]) for r in records(ref) if "loss" in r]
    assert got[-(STEPS - 5):] == want[-(STEPS - 5):]  # exact: bit-identical after the resume
    assert (out / "model.bin").read_bytes() == (ref / "model.bin").read_bytes()


def test_exports_refuse_naming_the_fields(tmp_path):
    m = GPT2(GPT2Config.modern(2, 64, n_head=2, block_size=32), seed=0)
    with pytest.raises(ValueError, match="llm.c.*position='rope'.*logit_softcap=15.0"):
        m.save(tmp_path / "x.bin", format="llmc")
    with pytest.raises(ValueError, match="Hugging Face GPT-2 format cannot represent position='rope', norm="):
        m.save_pretrained(tmp_path / "hf")
    assert not (tmp_path / "x.bin").exists() and not (tmp_path / "hf" / "model.safetensors").exists()
    # a single field is named alone
    g = GPT2(GPT2Config(block_size=32, n_layer=1, n_head=2, n_embd=32, activation="relu2"), seed=0)
    with pytest.raises(ValueError, match=r"this model has activation='relu2'; save"):
        g.save(tmp_path / "y.bin", format="llmc")
    # GPT-2 itself: llm.c's own version 3, whatever the format argument
    p = GPT2(GPT2Config(block_size=32, n_layer=1, n_head=2, n_embd=32), seed=0)
    a, b = p.save(tmp_path / "a.bin"), p.save(tmp_path / "b.bin", format="llmc")
    assert a.read_bytes() == b.read_bytes() and np.frombuffer(a.read_bytes()[:8], "<i4")[1] == 3


@pytest.mark.parametrize("dtype,version", [("float32", 1003), ("bfloat16", 1005)])
def test_modern_model_file_round_trip(tmp_path, dtype, version):
    cfg = GPT2Config.modern(2, 64, n_head=2, block_size=32, vocab_size=300, padded_vocab_size=384, rope_base=777.0,
                            logit_softcap=7.5, zero_init_proj=False)
    m = GPT2(cfg, seed=4)
    path = m.save(tmp_path / "m.bin", dtype=dtype)
    assert np.frombuffer(path.read_bytes()[:8], "<i4")[1] == version
    m2 = load_model(path)
    assert m2.config == cfg
    for k, v in m.params.items():
        want = v if dtype == "float32" else m2.params[k]  # bf16: rounded once, compared through a second save
        np.testing.assert_array_equal(m2.params[k], want)
    x = np.random.default_rng(0).integers(0, 300, (2, 9))
    if dtype == "float32":
        np.testing.assert_array_equal(m.forward(x, return_logits=True)[1], m2.forward(x, return_logits=True)[1])
    else:
        assert m2.save(tmp_path / "again.bin", dtype=dtype).read_bytes() == path.read_bytes()
    # a header with an unknown architecture code is refused naming the file
    raw = bytearray(path.read_bytes())
    raw[8 * 4:9 * 4] = np.array([7], "<i4").tobytes()
    (tmp_path / "bad.bin").write_bytes(bytes(raw))
    with pytest.raises(Exception, match="bad.bin.*unknown architecture"):
        load_model(tmp_path / "bad.bin")


def test_grad_ready_groups_tile_the_modern_layout():
    """The grad-ready hook's groups (what data parallel overlaps with backward) cover every gradient of the modern
    layout exactly once: no range for an absent tensor, lm_head with the final norm's group."""
    m = GPT2(GPT2Config.modern(3, 32, n_head=2, block_size=16, vocab_size=100, padded_vocab_size=128), seed=1,
             dtype="float64")
    groups = []
    m._m.set_grad_ready_hook(lambda ranges: groups.append([tuple(r) for r in ranges]))
    x = np.random.default_rng(0).integers(0, 100, (2, 8)).astype(np.int32)
    m.forward(x, x)
    m._m.backward(1.0, report_grads=True)
    m._m.set_grad_ready_hook(None)
    assert len(groups) == 3 + 2
    offsets = np.cumsum([0] + [v.size for v in m.params.values()])
    span = {k: (int(offsets[i]), int(offsets[i + 1])) for i, k in enumerate(m.params)}
    assert groups[0] == [span["lm_head"]]  # no lnfw/lnfb with RMSNorm
    assert groups[-1] == [span["wte"]]     # no wpe with rotary
    assert all(len(g) == 4 for g in groups[1:-1])  # qkvw, attprojw, fcw, fcprojw of each layer
    cover = np.zeros(m.num_parameters, np.int64)
    for g in groups:
        for lo, hi in g:
            assert lo < hi
            cover[lo:hi] += 1
    assert (cover == 1).all()


@pytest.mark.skipif(not _C.build_info().get("gloo"), reason="gpt2core built without Gloo")
def test_data_parallel_zero1_modern(tmp_path):
    """2 ranks with ZeRO-1 on the modern layout (sharded AdamW over a buffer with no wpe, no biases, an lm_head):
    both ranks' replicas bit-identical, equal to plain data parallel bit for bit (2 ranks: every sum is a + b),
    and to one process of the same global batch to fp32 summation-order tolerance (as test_distributed)."""
    from test_distributed import RECORDER, metrics, run_training
    from gpt2core.data import shakespeare
    data = shakespeare.ensure(tmp_path / "data")
    rec = tmp_path / "record_train.py"
    rec.write_text(RECORDER)
    single = run_training(tmp_path, "single", 1, rec, data, extra=FLAGS)
    zero1 = run_training(tmp_path, "zero1", 2, rec, data, extra=[*FLAGS, "--zero", "1"])
    zero0 = run_training(tmp_path, "zero0", 2, rec, data, extra=[*FLAGS, "--zero", "0"])
    p0, p1, p = (np.load(d / f"params{r}.npy") for d, r in ((zero1, 0), (zero1, 1), (single, 0)))
    assert p0.size == train.parse_args(["--preset", "tiny", *FLAGS]).model_config().num_parameters()
    np.testing.assert_array_equal(p0, p1)
    np.testing.assert_array_equal(np.load(zero0 / "params0.npy"), p0)
    # vs one process: the gradients are summed in another order (~1e-7 relative); AdamW's m / sqrt(v) turns that
    # into ~1e-6 on almost every weight, but into up to a few lr-sized steps on the rare weight whose gradient is
    # itself near that noise (measured: 2 of 6.5M beyond 2e-5, the largest 1.3e-4; 3 steps of lr 3e-3 bound it)
    d = np.abs(p0 - p)
    assert (d > 2e-5).mean() < 1e-5 and d.max() < 3 * 3e-3
    (l1, n1, v1), (l2, n2, v2) = metrics(single), metrics(zero1)
    np.testing.assert_allclose(l2, l1, rtol=1e-5)
    np.testing.assert_allclose(n2, n1, rtol=1e-4)
    assert read_model_header(zero1 / "model.bin").position == "rope"
