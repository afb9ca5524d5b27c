"""Dynamic loss scaling (csrc/model/optimizer.h's LossScaler: PyTorch GradScaler's rule, run by the backend) on the
CPU backend, where it is optional (off by default) and its semantics are tested directly; the CUDA backend's kernels
are compared with these under the emulator (tests/csrc/cuda/test_cuda_graphs.py).

* An overflow forced at step k (one gradient element poisoned with inf through the Python API before the optimizer
  step) skips exactly that update: weights and AdamW moments bit-identical to before it, the scale halved, the skip
  counted, step_count (AdamW's bias correction) not advanced.
* Step counters follow GradScaler: a skipped step does not advance AdamW's step (bias correction), the loop's LR
  schedule does. Checked against a model without scaling that never saw the skipped batch: same bits.
* Growth after `interval` clean steps in a row, backoff on each overflow: the state after every step equals a
  plain-Python transcription of GradScaler's documented update rule.
* Scaling on vs off in fp32 with a power-of-two scale: multiplying by 2^k is exact in binary floating point (no
  rounding, absent overflow and underflow, which these small gradients are far from), every backward op is linear
  in the loss gradient, and the update divides 2^k out exactly; so the gradients are exactly 2^k times the
  unscaled ones and the weights, moments and norms are bit-identical, clipping active or not. A scale that is not a
  power of two rounds once per op: equal to fp32 rounding only.
* Checkpoints keep the scaler, training runs log it, and a resumed run's scale/clean/skip counters equal the
  uninterrupted run's (bit-identical records and weights); a model without scaling ignores a saved scaler.
* Bad arguments: ValueError naming them (GPT2 and TrainConfig).
"""
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

from gpt2core import _C, train
from gpt2core import checkpoint as ck
from gpt2core.config import GPT2Config, TrainConfig
from gpt2core.model import GPT2
from gpt2core.schedule import lr_at
from test_distributed import needs_gloo, start_ranks, wait_all  # the data-parallel tests' launch helpers
from test_resume import shakespeare_dir  # noqa: F401  (fixture: the bundled Shakespeare, prepared once)

CFG = GPT2Config(block_size=16, vocab_size=97, padded_vocab_size=128, n_layer=2, n_head=2, n_embd=32)
B, T = 2, 16


@pytest.fixture(autouse=True)
def one_thread():
    n = _C.get_num_threads()
    _C.set_num_threads(1)
    yield
    _C.set_num_threads(n)


def batches(k, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, CFG.vocab_size, (B, T)), rng.integers(0, CFG.vocab_size, (B, T))) for _ in range(k)]


def model(**kw):
    return GPT2(CFG, seed=1, **kw)


def state(m):
    """Copies of the weights and AdamW moments, flat."""
    mo, vo = m.opt_state()
    return [np.concatenate([d[k].ravel() for k in _C.param_names()]) for d in (m.params, mo, vo)]


def micro(m, x, y, poison=False):
    m.zero_grad()
    if poison:  # inf in one gradient element before backward accumulates into it: an overflow
        m.flat_grads()[123] = np.inf
    m.forward_backward(x, y)
    m.take_loss()


def reference_scaler(scale, interval, overflows):
    """GradScaler's update rule as documented (torch.amp.GradScaler.update), one (scale, clean, skipped) per step:
    an overflow multiplies the scale by backoff_factor 0.5 and resets the run of clean steps; growth_interval clean
    steps in a row multiply it by growth_factor 2 (unless that overflows fp32) and reset the run."""
    clean = skipped = 0
    out = []
    for inf in overflows:
        if inf:
            scale, clean, skipped = scale * 0.5, 0, skipped + 1
        else:
            clean += 1
            if clean == interval:
                scale = scale * 2 if np.isfinite(np.float32(scale * 2)) else scale
                clean = 0
        out.append((scale, clean, skipped))
    return out


def test_default_is_off_on_the_cpu_and_scale_one():
    m = model()
    assert not m.loss_scaling and m.loss_scale == 1.0 and m.loss_scaler_state() is None
    on = model(loss_scaling=True)
    assert on.loss_scaling and on.loss_scale == 2.0**16 and on.loss_scaler_state() == {"scale": 65536.0, "clean": 0,
                                                                                       "skipped": 0}


def test_overflow_skips_exactly_that_update_and_follows_gradscalers_step_convention():
    """Step 3 of 6 overflows: nothing is written, the scale halves, the skip is counted and step_count stays. The run
    then matches, bit for bit, a model without scaling that never saw step 3's batch and was given the loop's LR of
    each step: the next update's bias correction is that of the 3rd APPLIED update (GradScaler skips
    optimizer.step(), so Adam's step count does not advance), its LR the loop's (the scheduler still steps)."""
    data = batches(6)
    lrs = [lr_at(s, 3e-3, 2, 6, 3e-4, "cosine") for s in range(6)]
    scaled, plain = model(loss_scaling=True), model()
    for s, (x, y) in enumerate(data):
        if s == 2:
            micro(scaled, x, y, poison=True)
            before = state(scaled)
            norm = scaled.step(lrs[s], grad_clip=1.0)
            assert np.isinf(norm)
            for a, b in zip(state(scaled), before):
                assert np.array_equal(a, b)  # weights, m and v untouched
            assert scaled.loss_scale == 2.0**15 and scaled.skipped_steps == 1 and scaled.step_count == 2
            assert scaled._m.loss_scaler["clean"] == 0
            # the bf16 copy's rounding seed is the last APPLIED step's, as step_count, so a resumed run (which sets
            # it from the restored step_count) rebuilds the same bits
            assert scaled._m.param_round_seed == scaled.step_count == 2
            continue
        micro(scaled, x, y)
        micro(plain, x, y)
        n1, n2 = scaled.step(lrs[s], grad_clip=1.0), plain.step(lrs[s], grad_clip=1.0)
        assert n1 == n2  # the reported norm is the unscaled one
        for a, b in zip(state(scaled), state(plain)):
            assert np.array_equal(a, b)
    assert scaled.step_count == plain.step_count == 5
    # without loss scaling an inf gradient is an error (nothing written either)
    micro(plain, *data[0], poison=True)
    before = state(plain)
    with pytest.raises(FloatingPointError, match="gradient norm is inf at step 6"):
        plain.step(1e-3)
    for a, b in zip(state(plain), before):
        assert np.array_equal(a, b)


def test_growth_and_backoff_follow_gradscaler():
    """interval 3, overflows at steps 2, 7, 8: after each step (scale, clean, skipped) is GradScaler's."""
    overflows = [False, True, False, False, False, False, True, True, False, False, False, False, False]
    m = model(loss_scaling=True, loss_scale_interval=3)
    got = []
    for (x, y), inf in zip(batches(len(overflows), 2), overflows):
        micro(m, x, y, poison=inf)
        norm = m.step(1e-3)
        assert math.isfinite(norm) != inf
        s = m._m.loss_scaler
        got.append((s["scale"], s["clean"], s["skipped"]))
    assert got == reference_scaler(2.0**16, 3, overflows)
    assert m.step_count == overflows.count(False)


def test_growth_stops_below_fp32_overflow():
    m = model(loss_scaling=True, loss_scale_init=2.0**127, loss_scale_interval=1)
    for x, y in batches(2, 3):
        micro(m, x, y)
        assert math.isfinite(m.step(1e-3))
    assert m.loss_scale == 2.0**127 and m.skipped_steps == 0  # 2^128 is inf in fp32: not taken


@pytest.mark.parametrize("clip", [0.0, 0.05])
def test_power_of_two_scale_is_bit_identical_to_no_scaling(clip):
    """5 steps, clipping off or active, the scale growing after every 2nd: gradients exactly 2^16, 2^16, 2^17,
    2^17, 2^18 x the unscaled ones; norms (the reported one unscaled by the scale its gradients carry, also at a
    step after which the scale grows), weights, moments equal."""
    on, off = model(loss_scaling=True, loss_scale_interval=2), model()
    for s, (x, y) in enumerate(batches(5, 4)):
        micro(on, x, y)
        micro(off, x, y)
        assert np.array_equal(on.flat_grads(), off.flat_grads() * np.float32(2.0 ** (16 + s // 2)))
        assert on.grad_norm() == off.grad_norm()
        assert on.step(2e-3, grad_clip=clip) == off.step(2e-3, grad_clip=clip)
        for a, b in zip(state(on), state(off)):
            assert np.array_equal(a, b)
    assert on.loss_scale == 2.0**18  # no overflow: grown twice


def test_scale_not_a_power_of_two_matches_within_fp32_rounding():
    """Scale 1000: each scaled op rounds differently from the unscaled one (relative 2^-24 per op), so the
    gradients agree normwise to the fp32 tolerance of the op tests (1e-5 of the largest value: summation-order
    rounding over these short sums). AdamW's step m / (sqrt(v) + eps) normalises each coordinate, so a coordinate
    whose gradient is a sum that nearly cancels passes its large relative error (up to ~2e-3 here, against 1e-7
    for the typical one) straight into its update: each of the 3 steps moves a weight by at most lr, so the
    weights agree within 3 * lr * 2e-3 (while they moved by up to 3 * lr)."""
    on, off = model(loss_scaling=True, loss_scale_init=1000.0), model()
    for x, y in batches(3, 5):
        micro(on, x, y)
        micro(off, x, y)
        want = off.flat_grads() * 1000
        assert np.max(np.abs(on.flat_grads() - want)) <= 1e-5 * np.max(np.abs(want))
        n_on, n_off = on.step(2e-3), off.step(2e-3)
        assert abs(n_on - n_off) <= 1e-5 * n_off
    np.testing.assert_allclose(on.flat_params(), off.flat_params(), rtol=0, atol=3 * 2e-3 * 2e-3)
    assert not np.array_equal(on.flat_params(), off.flat_params())  # not exact: the scale is not a power of two


def test_checkpoint_keeps_the_scaler_and_a_model_without_scaling_ignores_it(tmp_path):
    m = model(loss_scaling=True, loss_scale_interval=4)
    for s, (x, y) in enumerate(batches(6, 6)):
        micro(m, x, y, poison=s == 1)
        m.step(1e-3)
    want = {"scale": 2.0**16, "clean": 0, "skipped": 1}  # 2^16 -> 2^15 (skip) -> 2^16 after 4 clean steps
    assert m.loss_scaler_state() == want
    path = ck.save_checkpoint(tmp_path, 6, m)
    c = ck.load_checkpoint(path)
    assert c.state["optimizer"]["loss_scaler"] == want and c.state["optimizer"]["step_count"] == 5
    again = model(loss_scaling=True, loss_scale_interval=4)
    c.restore(again)
    assert again.loss_scaler_state() == want and again.step_count == 5
    fp32 = model()  # e.g. an fp16 run continued in fp32 on the CPU: no scaler, the saved one is ignored
    c.restore(fp32)
    assert not fp32.loss_scaling and fp32.loss_scale == 1.0 and fp32.step_count == 5
    for a, b in zip(state(again), state(fp32)):
        assert np.array_equal(a, b)
    plain_ck = ck.load_checkpoint(ck.save_checkpoint(tmp_path / "plain", 5, fp32))
    assert plain_ck.state["optimizer"]["loss_scaler"] is None
    fresh = model(loss_scaling=True, loss_scale_init=2.0**10)  # a checkpoint without a scaler: starts at init
    plain_ck.restore(fresh)
    assert fresh.loss_scaler_state() == {"scale": 1024.0, "clean": 0, "skipped": 0}
    # a malformed scaler in state.json is refused by name
    st = json.loads((path / "state.json").read_text())
    st["optimizer"]["loss_scaler"]["scale"] = -1.0
    (path / "state.json").write_text(json.dumps(st))
    man = json.loads((path / "manifest.json").read_text())
    man["files"]["state.json"]["bytes"] = (path / "state.json").stat().st_size  # checked; its sha256 is not below
    (path / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(ck.CheckpointError, match="loss_scaler"):
        ck.load_checkpoint(path, verify=False)


def test_bad_arguments_are_named():
    for kw, name in [({"loss_scaling": "yes"}, "loss_scaling"), ({"loss_scale_init": 0.0}, "loss_scale_init"),
                     ({"loss_scale_init": math.inf}, "loss_scale_init"), ({"loss_scale_interval": 0}, "loss_scale_interval"),
                     ({"loss_scale_interval": 2.5}, "loss_scale_interval")]:
        with pytest.raises(ValueError, match=name):
            model(**kw)
    for kw, flag in [({"loss_scaling": "maybe"}, "--loss-scaling"), ({"loss_scale_init": -2.0}, "--loss-scale-init"),
                     ({"loss_scale_init": 1e39}, "--loss-scale-init"), ({"loss_scale_interval": 0}, "--loss-scale-interval")]:
        with pytest.raises(ValueError, match=flag):
            TrainConfig(**kw)
    assert TrainConfig(loss_scaling="on").loss_scaling_on is True and TrainConfig().loss_scaling_on is None
    with pytest.raises(SystemExit):
        train.parse_args(["--loss-scaling", "sometimes"])


# ----------------------------------------------------------------------------------------- the training loop
STEPS = 12
POISON = {4, 9}  # loop steps (1-based) whose gradients overflow


def argv(data, out, *extra):
    return ["--preset", "tiny", "-B", "2", "-T", "16", "--val-every", "0", "--steps", str(STEPS), "--threads", "1",
            "--sample-tokens", "2", "--lr", "3e-3", "--warmup", "3", "--data-dir", str(data), "--output-dir", str(out),
            "--loss-scaling", "on", "--loss-scale-interval", "3", *extra]


@pytest.fixture
def poisoned(monkeypatch):
    """Overflow the gradients of loop steps POISON: GPT2.step poisons one element first. The loop step is
    step_count + skipped_steps + 1 (both restored on resume)."""
    orig = GPT2.step

    def step(self, *a, **kw):
        if self.step_count + self.skipped_steps + 1 in POISON:
            self.flat_grads()[7] = np.inf
        return orig(self, *a, **kw)

    monkeypatch.setattr(GPT2, "step", step)


def records(out):
    return [r for r in map(json.loads, (Path(out) / "metrics.jsonl").read_text().splitlines()) if "step" in r]


class Crash(Exception):
    pass


def test_training_logs_scaler_and_resume_restores_it_exactly(shakespeare_dir, tmp_path, poisoned, monkeypatch, capsys):
    straight = tmp_path / "straight"
    train.main(argv(shakespeare_dir, straight))
    recs = records(straight)
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
    assert [r["skipped_steps"] for r in recs] == [sum(p <= s for p in POISON) for s in range(1, STEPS + 1)]
    want = reference_scaler(2.0**16, 3, [s in POISON for s in range(1, STEPS + 1)])
    assert [r["loss_scale"] for r in recs] == [w[0] for w in want]
    for r in recs:  # the LR is the loop step's, skipped or not; a skipped step has no norm
        assert r["lr"] == lr_at(r["step"] - 1, 3e-3, 3, STEPS, 0.1 * 3e-3, "cosine")  # --min-lr-frac 0.1
        assert (r["grad_norm"] is None) == (r["step"] in POISON)
    out = capsys.readouterr().out
    assert "norm overflow, skipped | scale 65536 skips 1 |" in out and "| scale 131072 skips 0 |" in out

    run = tmp_path / "run"
    orig = train.Trainer.write_metrics

    def crashing(self, rec):
        orig(self, rec)
        if rec.get("step") == 7:
            raise Crash()

    monkeypatch.setattr(train.Trainer, "write_metrics", crashing)
    with pytest.raises(Crash):
        train.main(argv(shakespeare_dir, run, "--checkpoint-every", "5"))
    monkeypatch.setattr(train.Trainer, "write_metrics", orig)
    saved = ck.load_checkpoint(run / "checkpoints" / "step_000005").state["optimizer"]
    # steps 1-3 clean (2^16 -> 2^17 at step 3), step 4 overflows (2^16), step 5 clean: clean 1 of 3
    assert saved["loss_scaler"] == {"scale": 65536.0, "clean": 1, "skipped": 1} and saved["step_count"] == 4
    train.main(argv(shakespeare_dir, run, "--checkpoint-every", "5", "--resume", "auto"))
    def untimed(rs):
        return [{k: v for k, v in r.items() if k not in ("dt_ms", "tok_per_s")} for r in rs]

    assert untimed(records(run)) == untimed(recs)  # losses, norms, LRs, scales, skips: exact
    assert (run / "model.bin").read_bytes() == (straight / "model.bin").read_bytes()
    end = ck.load_checkpoint(run / "checkpoints" / f"step_{STEPS:06d}").state["optimizer"]
    assert end["step_count"] == STEPS - len(POISON) and end["loss_scaler"]["skipped"] == len(POISON)


def test_training_without_scaling_logs_no_scale(shakespeare_dir, tmp_path):
    out = tmp_path / "off"
    train.main(argv(shakespeare_dir, out, "--steps", "2", "--loss-scaling", "auto"))
    assert all("loss_scale" not in r and "skipped_steps" not in r for r in records(out))


# ----------------------------------------------------------------------------------------- data parallel
# Each rank: 5 steps of loss-scaled training over Gloo; at step OVERFLOW_AT only rank 0's gradients overflow (an inf
# put into its gradient buffer before backward accumulates into it, so it reaches the averaging the way a real
# overflow does). Saves per step (norm finite?, scale, clean, skipped, step_count) and the weights before and
# after each step.
RANK_SCRIPT = """
import json, sys
import numpy as np
from gpt2core import _C
from gpt2core.config import GPT2Config
from gpt2core.distributed import DataParallel, init_process_group
from gpt2core.model import GPT2
_C.set_num_threads(1)
zero, overlap, out = int(sys.argv[1]), sys.argv[2] == "1", sys.argv[3]
comm = init_process_group(timeout=60)
cfg = GPT2Config(block_size=16, vocab_size=97, padded_vocab_size=128, n_layer=1, n_head=2, n_embd=32)
m = GPT2(cfg, seed=comm.rank, loss_scaling=True, loss_scale_interval=2)  # different seeds: broadcast from rank 0
dp = DataParallel(m, comm, zero=zero, overlap=overlap if not zero else None)
rng = np.random.default_rng(10 + comm.rank)  # each rank its own rows
log, weights = [], []
for step in range(5):
    dp.zero_grad()
    if step == OVERFLOW_AT and comm.rank == 0:
        m.flat_grads()[5] = np.inf
    dp.forward_backward(rng.integers(0, 97, (2, 16)), rng.integers(0, 97, (2, 16)))
    dp.take_loss()
    weights.append(m.flat_params().copy())
    norm = dp.step(1e-3)
    s = m._m.loss_scaler
    log.append([bool(np.isfinite(norm)), s["scale"], s["clean"], s["skipped"], m.step_count])
weights.append(m.flat_params().copy())
np.save(out + f".rank{comm.rank}.npy", np.stack(weights))
json.dump(log, open(out + f".rank{comm.rank}.json", "w"))
"""
OVERFLOW_AT = 2


@needs_gloo
@pytest.mark.parametrize("zero,overlap", [(0, 1), (0, 0), (1, 0)], ids=["ddp-overlap", "ddp", "zero1"])
def test_data_parallel_ranks_take_the_same_skip_decision(tmp_path, zero, overlap):
    """Overflow on rank 0 only: both ranks skip that step (their decision comes from the averaged gradients, or
    ZeRO-1's all-reduced sum of squares, never from a rank's own), both halve the scale, and the weights stay
    identical across ranks and unchanged by the skipped step."""
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT.replace("OVERFLOW_AT", str(OVERFLOW_AT)))
    out = str(tmp_path / "run")
    procs = start_ranks(2, [sys.executable, str(script), str(zero), str(overlap), out], tmp_path, "ls")
    codes = wait_all(procs, timeout=120)
    assert codes == [0, 0], "".join((tmp_path / f"ls.rank{r}.log").read_text() for r in range(2))
    logs = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(2)]
    w = [np.load(f"{out}.rank{r}.npy") for r in range(2)]
    assert logs[0] == logs[1]
    want = reference_scaler(2.0**16, 2, [s == OVERFLOW_AT for s in range(5)])
    assert [(s, c, k) for _, s, c, k, _ in logs[0]] == want
    assert [ok for ok, *_ in logs[0]] == [s != OVERFLOW_AT for s in range(5)]
    assert [n for *_, n in logs[0]] == [1, 2, 2, 3, 4]  # step_count: applied updates only
    assert np.array_equal(w[0], w[1])  # identical replicas, every step
    assert np.array_equal(w[0][OVERFLOW_AT], w[0][OVERFLOW_AT + 1])  # the skipped step wrote nothing
    assert not np.array_equal(w[0][OVERFLOW_AT + 1], w[0][OVERFLOW_AT + 2])
