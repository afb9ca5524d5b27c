"""gpt2core-train under what clusters and users do to it, for real: SIGTERM / SIGINT at a random step (finish
the step, checkpoint, exit 75; resume bit-identical to an uninterrupted run), a second signal (exit at once;
resume still exact), two runs on one output folder, out-of-range flags (one-line errors naming the flag),
loss outliers (warned, logged, skipped with --skip-outliers), the validation loss of the final model.

The tiny preset with B=2, T=32 on the bundled Shakespeare, one thread, 16 steps."""
import json
import random
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from gpt2core import GPT2, GPT2Config, _C, train
from gpt2core import checkpoint as ck
from gpt2core.preemption import EXIT_PREEMPTED
from gpt2core.training import trainer

from test_resume import _restore_threads, records, train_keeping_threads  # noqa: F401 -- _restore_threads is an autouse fixture

STEPS = 16


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from gpt2core.data import shakespeare
    return shakespeare.ensure(tmp_path_factory.mktemp("shakespeare"))


def argv(data, out, *extra):
    return ["--preset", "tiny", "-B", "2", "-T", "32", "--val-every", "5", "--val-steps", "2", "--steps", str(STEPS),
            "--threads", "1", "--sample-tokens", "2", "--lr", "3e-3", "--warmup", "3", "--data-dir", str(data),
            "--output-dir", str(out), *extra]


def trajectory(out):
    """metrics.jsonl without the timings: every train record once, in order, and the validation losses."""
    recs = records(out)
    train_steps = [r["step"] for r in recs if "loss" in r]
    assert train_steps == list(range(1, len(train_steps) + 1)), f"steps missing or repeated: {train_steps}"
    return [{k: v for k, v in r.items() if k not in ("dt_ms", "tok_per_s")} for r in recs]


@pytest.fixture(scope="module")
def straight(data, tmp_path_factory):
    out = tmp_path_factory.mktemp("straight")
    train_keeping_threads(argv(data, out))
    return out


def test_final_model_gets_a_validation_loss(straight):
    vals = [r["step"] for r in records(straight) if "val_loss" in r]
    assert vals == [0, 5, 10, 15, STEPS]  # every 5 steps, and after the last update (not before it)


def start(data, out, *extra):
    return subprocess.Popen([sys.executable, "-m", "gpt2core.train", *argv(data, out, *extra)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_step(proc, k):
    for line in proc.stdout:
        if line.startswith(f"step {k:5d}/"):
            return
    raise AssertionError(f"training ended ({proc.wait()}) before step {k}: {proc.stderr.read()}")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_stops_after_the_step_with_a_checkpoint_and_resume_is_bit_identical(data, straight, tmp_path, sig):
    k = random.randint(1, 8)
    out = tmp_path / "run"
    proc = start(data, out)
    wait_for_step(proc, k)
    proc.send_signal(sig)
    rest, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED, (k, err)
    stopped = int(err.split("after step ")[1].split(" ")[0])
    assert k <= stopped < STEPS, (k, err)
    assert f"received {sig.name}: finishing this step" in err and "Traceback" not in err
    assert (f"gpt2core-train: stopped by {sig.name} after step {stopped} of {STEPS}; checkpoint "
            f"{out / 'checkpoints' / f'step_{stopped:06d}'} written. Continue with the same command and --resume auto "
            f"(exit code {EXIT_PREEMPTED})") in err, err
    assert [s for s, _ in ck.list_checkpoints(out / "checkpoints")] == [stopped]
    assert not (out / "model.bin").exists()
    train.main(argv(data, out, "--resume", "auto"))
    assert trajectory(out) == trajectory(straight)
    assert (out / "model.bin").read_bytes() == (straight / "model.bin").read_bytes()


def test_second_signal_exits_at_once_and_resume_auto_still_matches(data, straight, tmp_path):
    out = tmp_path / "run"
    proc = start(data, out, "--checkpoint-every", "4")
    wait_for_step(proc, 5)
    proc.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    while "received SIGTERM" not in (line := proc.stderr.readline()):
        assert line, "no message for the first signal"
    proc.send_signal(signal.SIGINT)  # the second: the default action, no checkpoint
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGINT and time.monotonic() - t0 < 30
    done = [s for s, _ in ck.list_checkpoints(out / "checkpoints")]
    assert done and done[-1] == 4  # the stop's own checkpoint may or may not have been started
    train.main(argv(data, out, "--checkpoint-every", "4", "--resume", "auto"))
    assert trajectory(out) == trajectory(straight)
    assert (out / "model.bin").read_bytes() == (straight / "model.bin").read_bytes()


def test_restart_without_checkpoint_rewrites_metrics(data, straight, tmp_path):
    """A run killed before its first checkpoint, restarted: metrics.jsonl holds each step once."""
    out = tmp_path / "run"
    proc = start(data, out)
    wait_for_step(proc, 3)
    proc.kill()
    proc.wait()
    assert len(records(out)) >= 3
    train.main(argv(data, out, "--resume", "auto"))
    assert trajectory(out) == trajectory(straight)


def test_two_runs_on_one_folder(data, tmp_path):
    out = tmp_path / "run"
    first = start(data, out)
    try:
        wait_for_step(first, 1)
        second = subprocess.run([sys.executable, "-m", "gpt2core.train", *argv(data, out)], capture_output=True,
                                text=True, timeout=120)
        assert second.returncode == 1
        assert second.stderr.strip().splitlines()[-1] == (
            f"gpt2core-train: {out} is in use by another gpt2core run (pid {first.pid} on host {socket.gethostname()}"
            f", started {json.loads((out / 'gpt2core.lock').read_text())['started']}: "
            f"{json.loads((out / 'gpt2core.lock').read_text())['argv']}); wait for it to finish, stop it, or choose "
            "another output folder"), second.stderr
        first.communicate(timeout=120)
        assert first.returncode == 0
    finally:
        first.kill()
    trajectory(out)  # the first run's metrics: every step once, nothing of the second's
    assert (out / "gpt2core.lock").read_text() == ""  # released on exit


@pytest.mark.parametrize("flag,value,needle", [
    ("--steps", "-5", "--steps must be a positive integer, got -5"),
    ("--val-every", "-1", "--val-every must be an integer >= 0 (0: never), got -1"),
    ("--checkpoint-every", "-2", "--checkpoint-every must be an integer >= 0 (0: never), got -2"),
    ("--keep-last", "-1", "--keep-last must be an integer >= 0 (0: all), got -1"),
    ("--grad-clip", "-1", "--grad-clip must be a finite number >= 0 (0 disables clipping), got -1.0"),
    ("--beta1", "1.5", "--beta1 must be a number in [0, 1), got 1.5"),
    ("--beta2", "nan", "--beta2 must be a number in [0, 1), got nan"),
    ("--min-lr-frac", "5", "--min-lr-frac must be a fraction in [0, 1], got 5.0"),
    ("--threads", "0", "--threads must be a positive integer, got 0"),
    ("--lr", "inf", "--lr must be a finite number > 0, got inf"),
    ("--lr", "0", "--lr must be a finite number > 0, got 0.0"),
    ("--weight-decay", "nan", "--weight-decay must be a finite number >= 0, got nan"),
    ("--eps", "0", "--eps must be a finite number > 0, got 0.0"),
    ("--warmup", "-3", "--warmup must be an integer >= 0, got -3"),
    ("-B", "0", "--batch-size must be auto or a positive integer, got 0"),
    ("--seed", "-1", "--seed must be an integer >= 0, got -1"),
    ("--dist-timeout", "inf", "--dist-timeout must be a finite number of seconds > 0, got inf"),
    ("--outlier-z", "-1", "--outlier-z must be a finite number > 0, got -1.0"),
    ("--precision", "fp16", "--precision fp16 needs --device cuda (the CPU backend computes in fp32)"),
    ("--attention", "flash", "--attention flash needs --device cuda (the CPU backend materialises attention)"),
])
def test_cli_numbers_are_validated_with_one_line_errors(capsys, flag, value, needle):
    with pytest.raises(SystemExit) as e:
        train.parse_args([flag, value])
    assert e.value.code == 2
    assert capsys.readouterr().err == f"gpt2core-train: error: {needle}\n"


def test_warmup_longer_than_the_run_is_warned_about(data, tmp_path, capsys):
    train.main(argv(data, tmp_path, "--steps", "2", "--val-every", "0"))
    assert "warning: --warmup 3 is longer than the run (--steps 2): the learning rate never reaches --lr 0.003" \
        in capsys.readouterr().out


@pytest.mark.parametrize("skip", [False, True])
def test_loss_outliers_are_warned_logged_and_skipped(data, tmp_path, monkeypatch, capsys, skip):
    """At a tiny LR the loss stays at its initial level, batch after batch; at step 9 a batch whose targets are
    the model's least likely tokens makes it jump: an outlier against the window of 6 steps before it."""
    monkeypatch.setattr(trainer, "WINDOW", 6)
    cfg = train.parse_args(argv(data, tmp_path, "--steps", "10", "--val-every", "0", "--outlier-z", "3", "--lr", "1e-6",
                                *(["--skip-outliers"] if skip else [])))
    with train.Trainer(cfg) as t:
        orig = t.train_loader.next_batch

        def batches():
            x, y = orig()
            if t.train_loader.step == 9:
                _, logits = t.model.forward(x, return_logits=True)
                return x, np.argmin(logits[..., :50257], axis=-1).astype(np.int32)
            return x, y
        t.train_loader.next_batch = batches
        weights, real_step = {}, t.train_step

        def step(i):  # train_step(8) takes step 9
            if i == 8:
                weights["before"] = t.model.params["fcw"].copy()
            rec = real_step(i)
            if i == 8:
                weights["after"] = t.model.params["fcw"].copy()
            return rec
        t.train_step = step
        t.run()
        recs = records(tmp_path)
        flagged = [r for r in recs if "skipped" in r]  # (at init the grad norms are so regular that one is too)
        r9 = recs[8]
        assert r9 in flagged and r9["loss_z"] > 3 and r9["skipped"] is skip, json.dumps(flagged)
        assert all(r["skipped"] is skip for r in flagged)
        assert "warning: step 9 is an outlier over the previous 6 steps: loss 11.5" in capsys.readouterr().out
        assert t.model.step_count == 10 - (len(flagged) if skip else 0)
        assert np.array_equal(weights["before"], weights["after"]) is skip  # skipped: step 9 left no trace


@pytest.mark.skipif(not _C.build_info().get("gloo"), reason="gpt2core built without Gloo")
@pytest.mark.parametrize("zero", ["0", "1"])
def test_data_parallel_ranks_agree_on_the_stop_step(data, tmp_path, zero):
    """SIGTERM reaches rank 1 only: both ranks stop after the same step (an allreduce of the flag), the checkpoint
    of that step is complete, both exit 75; resuming it with two ranks finishes the run. With --zero 1 and
    --skip-outliers, DataParallel.grad_norm (the norm before the update) is exercised too."""
    from test_distributed import start_ranks, wait_all
    out = tmp_path / "dp"
    cmd = [sys.executable, "-m", "gpt2core.train", *argv(data, out, "--zero", zero, "--skip-outliers", "-B", "1",
                                                              "--val-every", "0")]
    procs = start_ranks(2, cmd, tmp_path, "dp")
    log0 = tmp_path / "dp.rank0.log"
    deadline = time.monotonic() + 120
    while "step     2/" not in (log0.read_text() if log0.exists() else ""):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), log0.read_text()
        time.sleep(0.05)
    procs[1].send_signal(signal.SIGTERM)
    codes = wait_all(procs, timeout=120)
    logs = [(tmp_path / f"dp.rank{r}.log").read_text() for r in range(2)]
    assert codes == [EXIT_PREEMPTED] * 2, logs
    stopped = {int(log.split("after step ")[1].split(" ")[0]) for log in logs}
    assert len(stopped) == 1, logs  # the same step on both ranks
    (step,) = stopped
    assert "stopped by a signal on another rank" in logs[0] and "stopped by SIGTERM" in logs[1]
    assert ck.load_checkpoint(ck.checkpoint_dir(out / "checkpoints", step)).step == step
    assert len(records(out)) == step
    codes = wait_all(start_ranks(2, cmd + ["--resume", "auto"], tmp_path, "dp2"), timeout=120)
    assert codes == [0, 0], (tmp_path / "dp2.rank0.log").read_text()
    assert len(trajectory(out)) == STEPS


class OneRank:
    """A communicator of one rank: every collective is the identity (DataParallel's bookkeeping, in-process)."""
    rank, size = 0, 1

    def shard(self, n):
        return 0, n

    def __getattr__(self, name):  # broadcast, allreduce, reduce_scatter, all_gather, barrier
        return lambda *a, **k: None


@pytest.mark.parametrize("zero", [0, 1])
def test_data_parallel_grad_norm_before_step_is_reused_by_it(zero):
    """--skip-outliers asks DataParallel for the norm before the update; step() must then neither average the
    gradients again nor change the result: the same weights as a plain step, bit for bit."""
    from gpt2core.distributed import DataParallel
    x = np.random.default_rng(0).integers(0, 97, (2, 16)).astype(np.int32)
    weights = []
    for ask_first in (False, True):
        m = GPT2(GPT2Config(block_size=16, vocab_size=97, padded_vocab_size=128, n_layer=1, n_head=2, n_embd=16),
                 seed=3)
        dp = DataParallel(m, OneRank(), zero=zero, overlap=False)
        for _ in range(3):
            dp.zero_grad()
            dp.forward_backward(x, np.roll(x, -1, 1))
            dp.take_loss()
            norm = dp.grad_norm() if ask_first else None
            got = dp.step(1e-2)
            assert norm is None or norm == pytest.approx(got, rel=1e-6)
        weights.append(m.flat_params().copy())
    np.testing.assert_array_equal(weights[0], weights[1])
