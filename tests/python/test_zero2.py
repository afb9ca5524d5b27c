"""ZeRO-2 (issue 37): the gradients sharded over the ranks, reduce-scattered bucket by bucket during backward.

One process (the model's side, csrc/model/gpt2.cpp set_grad_shard): a sharded model whose bucket hook keeps its own
part of each bucket holds exactly the full model's gradients of its range, bit for bit, over every recompute level,
both architectures, float32 and float64, with ignored targets and with none valid; with two micro-steps it holds
the float32 sum of the two micro-steps' gradients; it frees the full gradient buffer (the bytes the plan counts);
the full-buffer views and steps refuse with the reason.

Real ranks over Gloo (the same recorder and data as test_distributed.py):
- one micro-step per optimizer step: ZeRO-2 = ZeRO-1 bit for bit (weights, losses, grad norms, val losses), with 2
  ranks and with 3 (uneven shards that cut tensors mid-way, and buckets that straddle them);
- gradient accumulation: every micro-step's buckets are averaged over the ranks, and the shard is their sum in that
  order: bit for bit against that sum recomputed in numpy from each rank's per-micro-step gradients (two rank
  processes through the Python API), and equal to ZeRO-1 / one process to fp32 tolerance;
- checkpoints: the ZeRO-1 shard layout; kill -9 after a checkpoint + `--resume auto` is bit-identical; another
  number of ranks resumes it after `consolidate`.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from gpt2core import GPT2, GPT2Config, _C, memplan
from test_distributed import B, T, metrics, needs_gloo, run_training, start_ranks, wait_all
from test_distributed import data_dir, recorder, single  # noqa: F401  (fixtures)

TINY = GPT2Config(block_size=32, vocab_size=97, padded_vocab_size=128, n_layer=2, n_head=2, n_embd=64)
MODERN = GPT2Config.modern(2, 64, n_head=2, block_size=32, vocab_size=97, padded_vocab_size=128)


def own_part_hook(core, lo, hi):
    """The bucket hook of a one-rank 'reduction' on a core model (GPT2._m, or an emulated-CUDA model): fold its part
    of each bucket into its shard (what GradReduceScatterer does after the reduce-scatter). Returns the list of
    buckets' ranges it saw."""
    seen = []

    def hook(bucket, ranges):
        seen.append([tuple(r) for r in ranges])
        assert bucket.size == sum(r1 - r0 for r0, r1 in ranges)
        at = 0
        for r0, r1 in ranges:
            a, b = max(r0, lo), min(r1, hi)
            if a < b:
                core.accumulate_grad_shard(bucket[at + a - r0:at + b - r0], a)
            at += r1 - r0
    core.set_grad_bucket_hook(hook)
    return seen


def batch(seed, Bn, Tn, V, ignore=False):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, V, (Bn, Tn)).astype(np.int32)
    y = rng.integers(0, V, (Bn, Tn)).astype(np.int32)
    y[0, 1] = -1
    if ignore:
        y[:] = -1
    return x, y


@pytest.mark.parametrize("config,dtype", [(TINY, "float32"), (MODERN, "float32"), (TINY, "float64")],
                         ids=["gpt2", "modern", "gpt2-f64"])
@pytest.mark.parametrize("recompute", ["none", "gelu", "layer"])
def test_a_sharded_model_holds_the_full_gradients_of_its_range(config, dtype, recompute):
    full = GPT2(config, device="cpu", dtype=dtype, seed=5)
    n = full.num_parameters
    # a range that starts inside wte and ends inside the last per-layer tensor: every bucket is cut
    lo, hi = config.padded_vocab_size * config.n_embd // 3, n - 5 * config.n_embd - 7
    sharded = GPT2(config, device="cpu", dtype=dtype, seed=5)
    sharded._m.set_grad_shard(lo, hi)
    assert sharded._m.grad_shard_range == (lo, hi) and sharded._m.grad_sharded
    seen = own_part_hook(sharded._m, lo, hi)
    for m in (full, sharded):
        m.recompute = recompute
    # one micro-step: the shard is the full model's gradients of [lo, hi), bit for bit
    x, y = batch(1, 2, 24, config.vocab_size)
    for m in (full, sharded):
        m.zero_grad()
        m.forward(x, y)
        m.backward(grad_scale=0.7)
    np.testing.assert_array_equal(sharded._m.grad_shard(), full.flat_grads()[lo:hi])
    # the buckets: the head's, each layer's from the last one down, the embeddings'; together every value once
    L = config.n_layer
    assert len(seen) == L + (2 if any(k in config.param_shapes() for k in ("lnfw", "lm_head")) else 1)
    covered = sorted(r for group in seen for r in group)
    assert covered[0][0] == 0 and covered[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))
    # two micro-steps: the shard is (g1 + g2) in float32, each g a micro-step's own gradients
    g = []
    for seed in (2, 3):
        full.zero_grad()
        full.forward(*batch(seed, 2, 24, config.vocab_size))
        full.backward()
        g.append(full.flat_grads()[lo:hi].copy())
    sharded.zero_grad()
    for seed in (2, 3):
        sharded.forward(*batch(seed, 2, 24, config.vocab_size))
        sharded.backward()
    np.testing.assert_array_equal(sharded._m.grad_shard(), g[0] + g[1])
    # a micro-step whose targets are all ignored adds nothing, and still hands over every bucket
    before, count = sharded._m.grad_shard().copy(), len(seen)
    sharded.forward(*batch(4, 2, 24, config.vocab_size, ignore=True))
    sharded.backward()
    np.testing.assert_array_equal(sharded._m.grad_shard(), before)
    assert len(seen) - count == len(seen[:count]) // 3


def test_the_sharded_model_frees_what_the_plan_says_and_refuses_full_buffer_calls():
    for config in (TINY, MODERN, GPT2Config(block_size=64, vocab_size=1000, padded_vocab_size=1024, n_layer=6,
                                             n_head=4, n_embd=128)):
        m = GPT2(config, device="cpu")
        n = m.num_parameters
        before = m._m.backend_bytes_in_use
        lo, hi = n // 4, n // 2
        m._m.set_grad_shard(lo, hi)
        assert m._m.grad_bucket_values == memplan.grad_bucket_values(config)
        assert before - m._m.backend_bytes_in_use == 4 * (n - (hi - lo) - memplan.grad_bucket_values(config))
        # the plan's ZeRO-2 gradient bytes: rank 0's shard (the largest) plus the buckets
        p = memplan.memory(config, 1, 16, memplan.Options(device="cpu", precision="fp32", world_size=4, zero=2))
        assert p["gradients"] == 4 * (-(-n // 4) + memplan.grad_bucket_values(config))
    x, y = batch(0, 1, 16, 97)
    m = GPT2(TINY, device="cpu")
    m.shard_grads(10, 20)
    with pytest.raises(ValueError, match=r"sharded \(ZeRO-2\): this model holds flat \[10, 20\] only"):
        m.grads["wte"]  # the wrapper's views of the freed full buffer are gone
    for call in (m.flat_grads, lambda: m.params and m._m.grads()):
        with pytest.raises(ValueError, match=r"sharded \(ZeRO-2\): this model holds flat \[10, 20\) only"):
            call()
    m.forward(x, y)
    with pytest.raises(RuntimeError, match="backward runs through the reducer"):
        m.backward()
    with pytest.raises(RuntimeError, match="sharded"):
        m._m.grad_norm()
    with pytest.raises(ValueError, match="not in the shard"):
        m._m.accumulate_grad_shard(np.ones(5, np.float32), 18)
    with pytest.raises(ValueError, match="need 0 <= lo <= hi"):
        m._m.set_grad_shard(5, 4)
    m.shard_grads(0, m.num_parameters)  # back to one full buffer
    assert not m._m.grad_sharded and m.grads["wte"].shape == (TINY.padded_vocab_size, TINY.n_embd)
    m.forward(x, y)
    m.backward()
    assert m.flat_grads().shape == (m.num_parameters,)


# ----------------------------------------------------------------------------------------- real ranks (Gloo)
ONE_MICRO = ["--total-batch-tokens", str(2 * B * T)]  # 2 ranks x B x T: one micro-step per optimizer step


@needs_gloo
def test_zero2_is_zero1_bit_for_bit_with_one_micro_step(tmp_path, recorder, data_dir):
    z1 = run_training(tmp_path, "z1", 2, recorder, data_dir, extra=["--zero", "1", *ONE_MICRO])
    z2 = run_training(tmp_path, "z2", 2, recorder, data_dir, extra=["--zero", "2", *ONE_MICRO])
    p = np.load(z1 / "params0.npy")
    for r in range(2):
        np.testing.assert_array_equal(np.load(z2 / f"params{r}.npy"), p)
    assert metrics(z2) == metrics(z1)
    log = (tmp_path / "z2.rank0.log").read_text()
    assert "ZeRO-2 over 2 ranks" in log and "reduce-scattered bucket by bucket" in log
    # no full-buffer gradient collective: the buckets went through the C++ reduce-scatterer
    n = p.size
    assert not [c for c in json.load(open(z2 / "calls0.json")) if c[1] == n and c[0] != "all_gather"]
    # 3 ranks: uneven shards, buckets straddling the shard boundaries
    extra = ["--total-batch-tokens", str(3 * T), "--val-every", "0"]
    t1 = run_training(tmp_path, "t1", 3, recorder, data_dir, micro=1, extra=["--zero", "1", *extra])
    t2 = run_training(tmp_path, "t2", 3, recorder, data_dir, micro=1, extra=["--zero", "2", *extra])
    for r in range(3):
        np.testing.assert_array_equal(np.load(t2 / f"params{r}.npy"), np.load(t1 / "params0.npy"))
    assert metrics(t2) == metrics(t1)


@needs_gloo
def test_zero2_with_accumulation_matches_zero1_to_fp32(tmp_path, single, recorder, data_dir):
    z2 = run_training(tmp_path, "z2acc", 2, recorder, data_dir, extra=["--zero", "2"])  # grad_accum 2
    loss1, norm1, val1 = metrics(single)
    loss2, norm2, val2 = metrics(z2)
    np.testing.assert_allclose(loss2, loss1, rtol=1e-5)
    np.testing.assert_allclose(norm2, norm1, rtol=1e-4)
    np.testing.assert_allclose(val2, val1, rtol=1e-5)
    p0 = np.load(z2 / "params0.npy")
    np.testing.assert_array_equal(np.load(z2 / "params1.npy"), p0)
    np.testing.assert_allclose(p0, np.load(single / "params0.npy"), rtol=0, atol=2e-5)


# Each rank: a ZeRO-2 DataParallel over two micro-steps of its own batches, then its gradient shard; and, from a
# plain model with the same weights, each micro-step's own full gradients on this rank's batches.
SHARD_SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np
    from gpt2core import GPT2, GPT2Config
    from gpt2core.distributed import DataParallel, setup
    env, comm, _ = setup("cpu", timeout=60)
    c = GPT2Config(block_size=32, vocab_size=97, padded_vocab_size=128, n_layer=3, n_head=2, n_embd=48)
    rng = np.random.default_rng(100 + env.rank)
    xs = [rng.integers(0, 97, (2, 32)).astype(np.int32) for _ in range(2)]
    plain = GPT2(c, device="cpu", seed=7)
    own = []
    for x in xs:
        plain.zero_grad()
        plain.forward(x, x)
        plain.backward(grad_scale=0.5)
        own.append(plain.flat_grads().copy())
    dp = DataParallel(GPT2(c, device="cpu", seed=7), comm, zero=2, grad_accum=2)
    dp.zero_grad()
    for x in xs:
        dp.forward_backward(x, x, grad_scale=0.5)
    shard = dp.model._m.grad_shard().copy()
    dp.step(lr=1e-3)  # the shard's moments exist after the first step: what the rank holds, against the plan
    np.savez(sys.argv[1] + f"/rank{env.rank}.npz", shard=shard, lo=dp.lo, hi=dp.hi,
             used=dp.model._m.backend_bytes_in_use,
             own=np.stack(own), stats=np.array([dp.scatterer.stats()[k] for k in ("backwards", "buckets", "values")]),
             seconds=dp.scatterer.stats()["seconds"])
""")


@needs_gloo
def test_zero2_accumulates_the_micro_steps_averages_bit_for_bit(tmp_path):
    script = tmp_path / "shard.py"
    script.write_text(SHARD_SCRIPT)
    procs = start_ranks(2, [sys.executable, str(script), str(tmp_path)], tmp_path, "shard")
    assert wait_all(procs, 120) == [0, 0], "".join((tmp_path / f"shard.rank{r}.log").read_text() for r in range(2))
    z = [np.load(tmp_path / f"rank{r}.npz") for r in range(2)]
    half = np.float32(0.5)  # Gloo's mean: the sum times 1/world
    avg = [(z[0]["own"][k] + z[1]["own"][k]) * half for k in range(2)]
    want = avg[0] + avg[1]  # the first micro-step's average copied in, the second's added
    for r in range(2):
        lo, hi = int(z[r]["lo"]), int(z[r]["hi"])
        np.testing.assert_array_equal(z[r]["shard"], want[lo:hi])
        # the other order (ZeRO-0/1: the mean of the sums) is the same number to fp32 rounding, not the same bits
        np.testing.assert_allclose(z[r]["shard"], ((z[0]["own"].sum(0) + z[1]["own"].sum(0)) * half)[lo:hi],
                                   rtol=1e-5, atol=1e-7)
        backwards, buckets, values = z[r]["stats"]
        n = want.size
        assert (backwards, buckets, values) == (2, 2 * (3 + 2), 2 * n) and z[r]["seconds"] > 0
    # what a rank's backend holds after the step, against the plan's total for ZeRO-2 over 2 ranks (within 2%)
    c = GPT2Config(block_size=32, vocab_size=97, padded_vocab_size=128, n_layer=3, n_head=2, n_embd=48)
    planned = memplan.total(memplan.memory(c, 2, 32, memplan.Options(device="cpu", precision="fp32", world_size=2,
                                                                     zero=2)))
    used = int(z[0]["used"])
    assert abs(planned - used) <= 0.02 * used, (planned, used)


@needs_gloo
def test_zero2_kill_9_resume_and_another_world_size(tmp_path, recorder, data_dir):
    extra = ["--zero", "2", "--checkpoint-every", "2"]
    whole = run_training(tmp_path, "whole", 2, recorder, data_dir, extra=extra)
    out = run_training(tmp_path, "run", 2, recorder, data_dir, extra=extra, env={"KILL_AFTER_CHECKPOINT": "2"},
                       expect=-signal.SIGKILL)
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_000002"]
    from gpt2core import checkpoint as ck
    c = ck.load_checkpoint(out / "checkpoints" / "step_000002")
    assert c.zero["world_size"] == 2  # the ZeRO-1 shard layout: one optimizer shard per rank
    run_training(tmp_path, "run", 2, recorder, data_dir, extra=extra + ["--resume", "auto"])
    np.testing.assert_array_equal(np.load(out / "params0.npy"), np.load(whole / "params0.npy"))
    assert metrics(out) == metrics(whole)
    # ZeRO-1 ranks resume a ZeRO-2 checkpoint as it is (the same shard layout): the last step to fp32 tolerance
    z1 = run_training(tmp_path, "z1", 2, recorder, data_dir, extra=["--zero", "1", "--resume",
                                                                    str(whole / "checkpoints" / "step_000002")])
    np.testing.assert_allclose(np.load(z1 / "params0.npy"), np.load(whole / "params0.npy"), rtol=0, atol=2e-5)
    # 4 ZeRO-2 ranks (micro-batch 1: the same global batch) resume it once consolidated: the 2-rank run's
    # continuation to fp32 tolerance (gradients summed in another order)
    ck_dir = tmp_path / "step_000002"
    shutil.copytree(whole / "checkpoints" / "step_000002", ck_dir)
    r = subprocess.run([sys.executable, "-m", "gpt2core.checkpoint", "consolidate", str(ck_dir)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    four = run_training(tmp_path, "four", 4, recorder, data_dir, micro=1, extra=["--zero", "2", "--resume",
                                                                                 str(ck_dir)])
    assert f"resumed from {ck_dir} at step 2" in (tmp_path / "four.rank0.log").read_text()
    p = [np.load(four / f"params{r}.npy") for r in range(4)]
    for r in range(1, 4):
        np.testing.assert_array_equal(p[r], p[0])
    np.testing.assert_allclose(p[0], np.load(whole / "params0.npy"), rtol=0, atol=2e-5)
    np.testing.assert_allclose(metrics(four)[0], metrics(whole)[0], rtol=1e-5)  # steps 1-2 carried over


def test_zero2_refusals(tmp_path, data_dir):
    base = [sys.executable, "-m", "gpt2core.train", "--preset", "tiny", "-T", "16", "--steps", "1", "--data-dir",
            str(data_dir), "--output-dir", str(tmp_path / "o")]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    r = subprocess.run(base + ["--zero", "2"], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2 and "--zero 2 shards the AdamW state and the gradients over the processes" in r.stderr
    r = subprocess.run(base + ["--zero", "2", "--optimizer", "muon"], capture_output=True, text=True, timeout=60,
                       env=env)
    assert r.returncode == 2 and "use --zero 1 with Muon" in r.stderr
    from gpt2core.distributed import DataParallel
    with pytest.raises(ValueError, match=r"zero must be 0 .* 1 .* or 2"):
        DataParallel(GPT2(TINY), None, zero=3)  # checked before the communicator is touched


@needs_gloo
def test_reducer_and_collective_refuse_bad_input_in_a_one_rank_group():
    """In a group of one: reduce_scatter_v is the identity and checks its counts; the reducer refuses a model whose
    gradients are not this rank's shard, or a float64 one; a CPU model refuses offload."""
    from test_distributed import free_port
    c = _C.dist.init_gloo(0, 1, "127.0.0.1", free_port(), timeout=5)
    a = np.arange(5, dtype=np.float32)
    c.reduce_scatter_v(a, [5], "avg")
    np.testing.assert_array_equal(a, np.arange(5))
    with pytest.raises(ValueError, match=r"one count per rank \(1\) summing to len\(buf\) \(5\)"):
        c.reduce_scatter_v(a, [4], "avg")
    with pytest.raises(ValueError, match="one count per rank"):
        c.reduce_scatter_v(a, [2, 3], "avg")
    m = GPT2(TINY, device="cpu", seed=2)
    with pytest.raises(ValueError, match="set_grad_shard first"):
        _C.dist.GradReduceScatterer(c, m._m)
    m.shard_grads(0, m.num_parameters - 1)  # one rank's shard is everything: refused as not its ZeRO shard
    with pytest.raises(ValueError, match=r"this rank's ZeRO shard \[0, \d+\)"):
        _C.dist.GradReduceScatterer(c, m._m)
    with pytest.raises(TypeError, match="Model, ModelBF16 or ModelF16"):
        _C.dist.GradReduceScatterer(c, GPT2(TINY, device="cpu", dtype="float64")._m)
    with pytest.raises(ValueError, match="offload is for a GPU"):
        m.offload = True
