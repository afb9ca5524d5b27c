"""Exact resume on the CPU backend: 20 steps straight == 10 steps + crash/kill -9 + resume + 10 steps, bit for
bit (losses, metrics.jsonl, final weights), and `--resume auto` skipping corrupt or half-written checkpoints;
a ZeRO-1 rank's slice of a full checkpoint's optimizer state.

The tiny preset (2 layers, C=64) with B=2, T=32 on the bundled Shakespeare, one thread, no validation."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpt2core import _C
from gpt2core import checkpoint as ck
from gpt2core import train

STEPS = 20


@pytest.fixture(scope="session")
def shakespeare_dir(tmp_path_factory):
    from gpt2core.data import shakespeare
    d = tmp_path_factory.mktemp("shakespeare")
    shakespeare.prepare(d)
    return d


def argv(data, out, *extra):
    return ["--preset", "tiny", "-B", "2", "-T", "32", "--val-every", "0", "--steps", str(STEPS), "--threads", "1",
            "--sample-tokens", "2", "--lr", "3e-3", "--warmup", "3", "--data-dir", str(data), "--output-dir", str(out),
            *extra]


@pytest.fixture(autouse=True)
def _restore_threads():
    n = _C.get_num_threads()
    yield
    _C.set_num_threads(n)


def train_keeping_threads(args):
    """train.main(args) for a fixture wider than a test, which _restore_threads does not wrap: --threads changes
    the process-wide OpenMP thread count."""
    n = _C.get_num_threads()
    try:
        return train.main(args)
    finally:
        _C.set_num_threads(n)


def records(out):
    """The per-step and evaluation records (not the {"run": ...} record each start or resume writes)."""
    recs = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if "step" in r]


def losses(out):
    recs = records(out)
    assert [r["step"] for r in recs] == list(range(1, len(recs) + 1)), "metrics.jsonl: steps missing or repeated"
    return [(r["loss"], r["lr"], r["grad_norm"]) for r in recs]


@pytest.fixture(scope="session")
def straight(shakespeare_dir, tmp_path_factory):
    """The reference: 20 steps without interruption."""
    out = tmp_path_factory.mktemp("straight")
    train_keeping_threads(argv(shakespeare_dir, out))
    return out


def assert_same_run(out, ref):
    got, want = losses(out), losses(ref)
    assert len(got) == len(want) == STEPS
    assert got == want  # exact float equality: bit-identical
    assert (Path(out) / "model.bin").read_bytes() == (Path(ref) / "model.bin").read_bytes()


class Crash(Exception):
    pass


def test_resume_after_crash_is_bit_identical(shakespeare_dir, straight, tmp_path, monkeypatch):
    out = tmp_path / "run"
    orig = train.Trainer.write_metrics

    def crashing(self, rec):
        orig(self, rec)
        if rec.get("step") == 13:  # between the checkpoints of steps 10 and 15
            raise Crash()

    monkeypatch.setattr(train.Trainer, "write_metrics", crashing)
    with pytest.raises(Crash):
        train.main(argv(shakespeare_dir, out, "--checkpoint-every", "5", "--keep-last", "3"))
    monkeypatch.setattr(train.Trainer, "write_metrics", orig)
    assert [s for s, _ in ck.list_checkpoints(out / "checkpoints")] == [10, 5]
    assert len(records(out)) == 13 and not (out / "model.bin").exists()

    train.main(argv(shakespeare_dir, out, "--checkpoint-every", "5", "--keep-last", "3", "--resume", "auto"))
    assert_same_run(out, straight)  # metrics.jsonl lost the records of steps 11-13 of the crashed run
    assert [s for s, _ in ck.list_checkpoints(out / "checkpoints")] == [20, 15, 10]  # --keep-last 3
    st = ck.load_checkpoint(out / "checkpoints" / "step_000015").state
    assert st["step"] == 15 and st["optimizer"]["step_count"] == 15 and st["train_loader"]["step"] == 15
    assert st["args"]["seed"] == 1337 and st["model_config"]["n_layer"] == 2

    # --- corrupt / half-written checkpoints: rejected with a message; auto takes the previous one
    root = out / "checkpoints"
    v = root / "step_000020" / "adam_v.npy"
    raw = bytearray(v.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    v.write_bytes(bytes(raw))
    with pytest.raises(SystemExit, match=r"step_000020/adam_v\.npy: sha256 does not match"):
        train.main(argv(shakespeare_dir, out, "--resume", str(root / "step_000020")))
    (root / "step_000015" / "manifest.json").unlink()  # as if the save of step 15 had died
    auto = tmp_path / "auto"
    res = subprocess.run([sys.executable, "-m", "gpt2core.train",
                          *argv(shakespeare_dir, auto, "--resume", str(root))],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "skipping checkpoint" in res.stdout and "sha256" in res.stdout and "incomplete" in res.stdout
    assert f"resumed from {root / 'step_000010'} at step 10" in res.stdout
    assert_same_run(auto, straight)


def _wait_for(pred, proc, what, timeout=240):
    t0 = time.time()
    while not pred():
        if proc.poll() is not None:
            raise AssertionError(f"training exited ({proc.returncode}) before {what}:\n{proc.stderr.read()}")
        if time.time() - t0 > timeout:
            proc.kill()
            raise AssertionError(f"timeout waiting for {what}")
        time.sleep(0.05)


# runs gpt2core-train, but blocks forever at a chosen point, so that the test kills it there with SIGKILL
_HANG = """
import sys, time
from gpt2core import train
from gpt2core.formats import manifest
where = sys.argv.pop(1)
if where == 'after-step-13':
    orig = train.Trainer.write_metrics
    def wm(self, rec):
        orig(self, rec)
        if rec.get('step') == 13:
            time.sleep(1000)
    train.Trainer.write_metrics = wm
else:  # inside the save of step 15: every file written but the manifest
    orig = manifest.write_json
    def wj(path, obj):
        if path.name == 'manifest.json' and obj.get('step') == 15:
            time.sleep(1000)
        orig(path, obj)
    manifest.write_json = wj
train.main(sys.argv[1:])
"""


@pytest.mark.parametrize("where", ["after-step-13", "mid-checkpoint-15"])
def test_kill_9_then_resume_auto(shakespeare_dir, straight, tmp_path, where):
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", _HANG, where,
                             *argv(shakespeare_dir, out, "--checkpoint-every", "5")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        if where == "after-step-13":
            _wait_for(lambda: (out / "metrics.jsonl").exists() and len(records(out)) >= 13, proc, "step 13")
        else:
            _wait_for(lambda: any(p.name.startswith(".step_000015.tmp-") and (p / "state.json").exists()
                                  and (p / "metrics.jsonl").exists() for p in (out / "checkpoints").glob(".*")),
                      proc, "the half-written checkpoint 15")
            time.sleep(0.3)  # it is blocked before the manifest
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    root = out / "checkpoints"
    assert [s for s, _ in ck.list_checkpoints(root)] == [10, 5]
    if where == "mid-checkpoint-15":
        assert [p.name for p in root.iterdir() if p.name.startswith(".step_000015.tmp-")]
        assert len(records(out)) == 15

    res = subprocess.run([sys.executable, "-m", "gpt2core.train",
                          *argv(shakespeare_dir, out, "--checkpoint-every", "5", "--resume", "auto")],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert f"resumed from {root / 'step_000010'} at step 10" in res.stdout
    assert_same_run(out, straight)
    assert [s for s, _ in ck.list_checkpoints(root)] == [20, 15, 10, 5]
    assert not [p for p in root.iterdir() if p.name.startswith(".")]  # the stale temporary dir was cleaned up


def test_resume_auto_without_checkpoints_starts_fresh_and_mismatch_is_an_error(shakespeare_dir, straight, tmp_path):
    out = tmp_path / "run"
    train.main(argv(shakespeare_dir, out, "--resume", "auto", "--checkpoint-every", str(STEPS)))
    assert_same_run(out, straight)
    d = out / "checkpoints" / f"step_{STEPS:06d}"
    with pytest.raises(SystemExit, match=r"step_000020: checkpoint model .* does not match"):
        train.main(argv(shakespeare_dir, tmp_path / "other", "--resume", str(d), "--padded-vocab-size", "50432"))
    with pytest.raises(SystemExit, match="not a checkpoint directory"):
        train.main(argv(shakespeare_dir, tmp_path / "other", "--resume", str(tmp_path / "missing")))


def test_full_checkpoint_slices_for_zero1_and_is_not_consolidated(tmp_path):
    """What a ZeRO-1 rank reads from a full (non-ZeRO) checkpoint: exactly its range of adam_m / adam_v.
    (The sharded format itself needs several ranks: tests/python/test_distributed.py.)"""
    import numpy as np

    from gpt2core.model import GPT2
    m = GPT2("tiny", seed=1)
    x = np.random.default_rng(0).integers(0, 50257, (2, 8)).astype(np.int32)
    m.forward(x, np.roll(x, -1, 1))
    m.backward()
    m.step(lr=1e-3)
    d = ck.save_checkpoint(tmp_path / "checkpoints", 1, m)
    c = ck.load_checkpoint(d)
    assert c.zero is None and c.manifest["version"] == 1
    full_m, full_v = (np.load(d / f) for f in ("adam_m.npy", "adam_v.npy"))
    lo, hi = 1000, m.num_parameters - 7
    got_m, got_v = np.zeros(hi - lo, np.float32), np.zeros(hi - lo, np.float32)
    c.load_optimizer_shard(1, 2, lo, hi, got_m, got_v)  # any world size, any range
    np.testing.assert_array_equal(got_m, full_m[lo:hi])
    np.testing.assert_array_equal(got_v, full_v[lo:hi])
    with pytest.raises(SystemExit, match="not a ZeRO-1 checkpoint"):  # already the full state
        ck.main(["consolidate", str(d)])
    fresh = GPT2("tiny", seed=2)
    c.restore(fresh, optimizer=False)  # weights and step count only
    assert fresh.step_count == 1
    np.testing.assert_array_equal(fresh.flat_params(), m.flat_params())
