"""Data-parallel training on the CPU through Gloo, with real processes over loopback TCP.

* 2 ranks x micro-batch B give the same losses and weights as 1 process with micro-batch 2B and the same
  global batch (gradient accumulation 2 in both), with and without ZeRO-1; the two ranks read different
  rows and together exactly what the single process read.
* Overlapped gradient averaging (the default for plain data parallel): bit-identical to the single
  allreduce after backward (--no-overlap-comm); one collective per hook group, on the last micro-step
  only. The model's grad-ready hook tiles the gradients exactly once per enabled backward, from the last
  layer down. A rank killed mid-way through an overlapped backward fails the other one within the timeout.
* A rank killed (SIGKILL) or hung (SIGSTOP) makes the other one fail within the timeout; the launcher
  stops the remaining ranks when one fails; a rank that never arrives is named by the rendezvous.
* The collectives (uneven shards, 3 ranks) and AdamW over a flat range (ZeRO-1) against references.
* ZeRO-1 checkpoints: every rank saves its own optimizer shard (only its range), covered by the manifest;
  kill -9 after a checkpoint + `--resume auto` is bit-identical to the uninterrupted run; another world size is
  refused with a message naming the way out (`python -m gpt2core.checkpoint consolidate`), after which a single
  process resumes it (fp32 tolerance) and 2 ZeRO-1 ranks resume the full state exactly; a missing or corrupt
  shard makes the checkpoint rejected.
"""
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from gpt2core import _C
from gpt2core.config import get_preset
from gpt2core.distributed import DataParallel, from_env
from gpt2core.model import GPT2

needs_gloo = pytest.mark.skipif(not _C.build_info().get("gloo"), reason="gpt2core built without Gloo")

B, T, STEPS = 2, 16, 3
GLOBAL = 2 * B * T * 2  # 2 ranks x B x T x grad_accum 2  (= 1 process x 2B x T x grad_accum 2)
TRAIN_ARGS = ["--preset", "tiny", "-T", str(T), "--total-batch-tokens", str(GLOBAL), "--steps", str(STEPS),
              "--val-every", "2", "--val-steps", "2", "--sample-tokens", "2", "--warmup", "2", "--lr", "3e-3",
              "--threads", "1"]

# A rank script's lines (after `from gpt2core import train`): with KILL_AFTER_CHECKPOINT=N in its environment the
# rank dies (SIGKILL) right after saving the checkpoint of step N
KILL_HOOK = """
import os, signal
kill_after = int(os.environ.get("KILL_AFTER_CHECKPOINT", 0))
if kill_after:
    _save = train.Trainer.save_checkpoint
    def _save_then_die(self, step):
        _save(self, step)
        if step == kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
    train.Trainer.save_checkpoint = _save_then_die
"""

# Runs gpt2core.train's Trainer, recording the training batches it reads, then saves this rank's weights.
RECORDER = textwrap.dedent("""
    import os, signal, sys
    import numpy as np
    from gpt2core import train
    from gpt2core.data.loader import DataLoader
    seen, orig = [], DataLoader.next_batch
    def record(self):
        x, y = orig(self)
        if self.split == "train":
            seen.append(x.copy())
        return x, y
    DataLoader.next_batch = record
""") + KILL_HOOK + textwrap.dedent("""
    t = train.Trainer(train.parse_args(sys.argv[2:]))

    class Counting:  # records (collective, buffer size) of every call the data-parallel wrapper makes
        def __init__(self, comm):
            self.comm, self.calls = comm, []
        def __getattr__(self, name):
            f = getattr(self.comm, name)
            if not callable(f):
                return f
            def call(*a, **k):
                if a and hasattr(a[0], "size"):
                    self.calls.append([name, int(a[0].size)])
                return f(*a, **k)
            return call
    if t.comm is not None:  # t.model is the DataParallel
        t.model.comm = Counting(t.model.comm)
    t.run()
    if t.comm is not None:
        import json
        json.dump(t.model.comm.calls, open(f"{sys.argv[1]}/calls{t.dist.rank}.json", "w"))
        json.dump(t.model.reducer.stats() if t.model.reducer else None,
                  open(f"{sys.argv[1]}/reducer{t.dist.rank}.json", "w"))
    np.save(f"{sys.argv[1]}/params{t.dist.rank}.npy", t.model.flat_params())
    np.save(f"{sys.argv[1]}/batches{t.dist.rank}.npy", np.stack(seen))
""")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank, world, port):
    env = dict(os.environ, OMP_NUM_THREADS="1", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
               LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    return env


def start_ranks(world, cmd, tmp_path, name, port=None, env=None):
    port = port or free_port()
    procs = []
    for r in range(world):
        out = open(tmp_path / f"{name}.rank{r}.log", "w")
        procs.append(subprocess.Popen(cmd, env=dict(rank_env(r, world, port), **(env or {})), stdout=out,
                                      stderr=subprocess.STDOUT))
    return procs


def wait_all(procs, timeout):
    deadline = time.monotonic() + timeout
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    return codes


def metrics(out_dir):
    recs = [json.loads(line) for line in open(out_dir / "metrics.jsonl")]
    return ([r["loss"] for r in recs if "loss" in r], [r["grad_norm"] for r in recs if "grad_norm" in r],
            [r["val_loss"] for r in recs if "val_loss" in r])


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    from gpt2core.data import shakespeare
    return shakespeare.ensure(tmp_path_factory.mktemp("shakespeare"))


@pytest.fixture(scope="module")
def recorder(tmp_path_factory):
    p = tmp_path_factory.mktemp("rec") / "record_train.py"
    p.write_text(RECORDER)
    return p


def run_training(tmp_path, name, world, recorder, data_dir, extra=(), micro=None, env=None, expect=0):
    out = tmp_path / name
    out.mkdir(exist_ok=True)
    micro = micro or (2 * B if world == 1 else B)
    cmd = [sys.executable, str(recorder), str(out), *TRAIN_ARGS, "-B", str(micro), "--data-dir", str(data_dir),
           "--output-dir", str(out), *extra]
    if world == 1:
        env = dict(os.environ, OMP_NUM_THREADS="1")
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
            env.pop(k, None)
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == expect, r.stdout + r.stderr
    else:
        codes = wait_all(start_ranks(world, cmd, tmp_path, name, env=env), timeout=120)
        logs = "".join((tmp_path / f"{name}.rank{r}.log").read_text() for r in range(world))
        assert codes == [expect] * world, logs
    return out


@pytest.fixture(scope="module")
def single(tmp_path_factory, recorder, data_dir):
    return run_training(tmp_path_factory.mktemp("single"), "single", 1, recorder, data_dir)


@pytest.fixture(scope="module")
def zero_run(tmp_path_factory, recorder, data_dir):
    """2 ranks, ZeRO-1, STEPS steps, checkpoints after steps 2 and 3 (the tests below must not modify them)."""
    if not _C.build_info().get("gloo"):
        pytest.skip("gpt2core built without Gloo")
    tmp = tmp_path_factory.mktemp("zero")
    return run_training(tmp, "ddp_zero1", 2, recorder, data_dir, extra=["--zero", "1", "--checkpoint-every", "2"])


@pytest.fixture(scope="module")
def ddp_no_overlap(tmp_path_factory, recorder, data_dir):
    return run_training(tmp_path_factory.mktemp("nooverlap"), "ddp_no_overlap", 2, recorder, data_dir,
                        extra=["--no-overlap-comm"])


@needs_gloo
@pytest.mark.parametrize("zero", [0, 1])
def test_two_ranks_match_one_process(tmp_path, single, recorder, data_dir, zero, request):
    if zero:
        ddp = request.getfixturevalue("zero_run")
        tmp_path = ddp.parent  # where its logs are
    else:
        ddp = run_training(tmp_path, "ddp_zero0", 2, recorder, data_dir, extra=["--zero", "0"])
    cfg = get_preset("tiny")

    # data: each rank read different rows; side by side they are what the single process read
    b0, b1, b1p = (np.load(ddp / "batches0.npy"), np.load(ddp / "batches1.npy"), np.load(single / "batches0.npy"))
    assert b0.shape == (STEPS * 2, B, T) and b1p.shape == (STEPS * 2, 2 * B, T)
    assert not np.array_equal(b0, b1)
    np.testing.assert_array_equal(np.concatenate([b0, b1], axis=1), b1p)

    # gradients cross the wire once per optimizer step, not once per micro-step (grad_accum is 2): ZeRO-1 in
    # one reduce-scatter after backward; plain data parallel (overlap on by default) in one collective per
    # grad-ready group (lnf, each layer, the embeddings) of the last micro-step's backward, every value once
    n = np.load(single / "params0.npy").size
    full = [c for c in json.load(open(ddp / "calls0.json")) if c[1] == n and c[0] in ("allreduce", "reduce_scatter")]
    for r in range(2):
        stats = json.load(open(ddp / f"reducer{r}.json"))
        if zero:
            assert stats is None
        else:
            assert stats == {"finishes": STEPS, "groups": STEPS * (cfg.n_layer + 2), "values": STEPS * n,
                             "ranges": STEPS * (12 * cfg.n_layer + 4)}
    assert full == ([["reduce_scatter", n]] * STEPS if zero else [])

    # losses (mean over ranks), grad norms and val losses as logged by rank 0: fp32 accumulation-order noise
    loss1, norm1, val1 = metrics(single)
    loss2, norm2, val2 = metrics(ddp)
    assert len(loss2) == STEPS and len(val2) == 3  # steps 0 and 2 (--val-every 2), and after the last update
    assert all("comm_ms" in json.loads(line) for line in open(ddp / "metrics.jsonl") if "grad_norm" in line)
    np.testing.assert_allclose(loss2, loss1, rtol=1e-5)
    np.testing.assert_allclose(norm2, norm1, rtol=1e-4)
    np.testing.assert_allclose(val2, val1, rtol=1e-5)

    # weights: both ranks hold bit-identical replicas, equal to the single process's to fp32 tolerance
    # (gradients summed in another order, ~1e-7 relative, moved by AdamW's normalised update of lr=3e-3)
    p0, p1, p = np.load(ddp / "params0.npy"), np.load(ddp / "params1.npy"), np.load(single / "params0.npy")
    np.testing.assert_array_equal(p0, p1)
    np.testing.assert_allclose(p0, p, rtol=0, atol=2e-5)
    assert (ddp / "model.bin").exists()  # only rank 0 writes (same output dir for both ranks)
    if not zero:
        # overlapped == one allreduce after backward, bit for bit: with 2 ranks each value's sum is a + b
        # whatever the bucketing, and both paths then scale by 1/2 the same way
        nov = request.getfixturevalue("ddp_no_overlap")
        assert json.load(open(nov / "reducer0.json")) is None
        assert [c for c in json.load(open(nov / "calls0.json")) if c[1] == n] == [["allreduce", n]] * STEPS
        np.testing.assert_array_equal(np.load(nov / "params0.npy"), p0)
        assert metrics(nov) == (loss2, norm2, val2)

    log0 = (tmp_path / f"ddp_zero{zero}.rank0.log").read_text()
    log1 = (tmp_path / f"ddp_zero{zero}.rank1.log").read_text()
    assert "step     3/3" in log0 and log1.strip() == ""  # only rank 0 prints
    assert ("overlapped with the last micro-step's backward" in log0) == (not zero)
    if zero:
        assert "ZeRO-1 over 2 ranks" in log0 and "saves" in log0


@needs_gloo
def test_three_ranks_zero1_uneven_shards(tmp_path, recorder, data_dir):
    """3 ranks: the ZeRO-1 shards (ceil(N/3) values) are uneven and cut tensors mid-way."""
    extra = ["--total-batch-tokens", str(3 * T * 2), "--val-every", "0"]
    one = run_training(tmp_path, "one", 1, recorder, data_dir, extra=extra, micro=3)
    three = run_training(tmp_path, "three", 3, recorder, data_dir, extra=extra + ["--zero", "1"], micro=1)
    np.testing.assert_allclose(metrics(three)[0], metrics(one)[0], rtol=1e-5)
    p = [np.load(three / f"params{r}.npy") for r in range(3)]
    np.testing.assert_array_equal(p[0], p[1])
    np.testing.assert_array_equal(p[0], p[2])
    np.testing.assert_allclose(p[0], np.load(one / "params0.npy"), rtol=0, atol=2e-5)


def _wait_for(path, text, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text():
            return
        time.sleep(0.1)
    raise AssertionError(f"{text!r} did not appear in {path}: {path.read_text() if path.exists() else ''}")


@needs_gloo
@pytest.mark.parametrize("how", ["kill", "hang"])
def test_dead_or_hung_rank_fails_the_run(tmp_path, data_dir, how):
    timeout = 3.0
    cmd = [sys.executable, "-m", "gpt2core.train", *TRAIN_ARGS[:2], "-B", str(B), "-T", str(T), "--steps", "1000",
           "--val-every", "0", "--data-dir", str(data_dir), "--output-dir", str(tmp_path), "--threads", "1",
           "--dist-timeout", str(timeout)]
    procs = start_ranks(2, cmd, tmp_path, how)
    try:
        _wait_for(tmp_path / f"{how}.rank0.log", "step     2/1000", timeout=60)
        t0 = time.monotonic()
        os.kill(procs[1].pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        code = procs[0].wait(timeout=timeout + 15)
        took = time.monotonic() - t0
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert code != 0
    log = (tmp_path / f"{how}.rank0.log").read_text()
    assert "DistError" in log and "rank 0 of 2" in log, log
    if how == "hang":
        assert "Timed out" in log and took >= timeout * 0.9
    assert took < timeout + 15


def test_launcher_stops_the_other_ranks(tmp_path):
    script = tmp_path / "job.py"
    script.write_text("import os, sys, time\n"  # one write per line: the ranks share the launcher's stdout
                      "e = os.environ\n"
                      "sys.stdout.write(f\"rank {e['RANK']} of {e['WORLD_SIZE']} {e['LOCAL_WORLD_SIZE']} "
                      "{e['MASTER_ADDR']} {e['MASTER_PORT']}\\n\")\n"
                      "sys.stdout.flush()\n"
                      "if os.environ['RANK'] == '1':\n    time.sleep(0.5); sys.exit(7)\n"
                      "time.sleep(60)\n")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "gpt2core.launch", "--nproc-per-node", "3", "--master-port", "auto",
                        "--kill-timeout", "2", str(script)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 7, r.stdout + r.stderr
    assert time.monotonic() - t0 < 15
    assert "rank 1" in r.stderr and "exited with code 7" in r.stderr
    lines = sorted(line for line in r.stdout.splitlines() if line.startswith("rank"))
    assert [line.split()[1:5] for line in lines] == [[str(i), "of", "3", "3"] for i in range(3)]

    ok = subprocess.run([sys.executable, "-m", "gpt2core.launch", "--nproc-per-node", "2", "--master-port", "auto",
                         "-m", "json.tool", "--help"], capture_output=True, text=True, timeout=30)
    assert ok.returncode == 0, ok.stderr


@needs_gloo
def test_rendezvous_names_the_missing_rank():
    t0 = time.monotonic()
    with pytest.raises(_C.dist.DistError, match=r"rank 1 of 2 never joined"):
        _C.dist.init_gloo(0, 2, "127.0.0.1", free_port(), timeout=1.0)
    assert time.monotonic() - t0 < 5
    with pytest.raises(_C.dist.DistError, match="could not reach the rendezvous store"):
        _C.dist.init_gloo(1, 2, "127.0.0.1", free_port(), timeout=0.5)


COLLECTIVES = textwrap.dedent("""
    import sys
    import numpy as np
    from gpt2core import _C, distributed
    c = distributed.init_process_group(timeout=20)
    r, w = c.rank, c.size
    for n in (1, 2, 7, 1000, 100_003):
        base = np.arange(n, dtype=np.float32)
        a = base * (r + 1)
        c.allreduce(a, "sum")
        np.testing.assert_array_equal(a, base * (w * (w + 1) // 2))
        a = base * (r + 1)
        c.allreduce(a, "avg")
        np.testing.assert_allclose(a, base * (w + 1) / 2, rtol=1e-6)
        lo, hi = c.shard(n)
        assert (lo, hi) == (min(r * -(-n // w), n), min((r + 1) * -(-n // w), n))
        a = base * (r + 1)
        c.reduce_scatter(a, "sum")
        np.testing.assert_array_equal(a[lo:hi], (base * (w * (w + 1) // 2))[lo:hi])
        g = np.full(n, -1.0, np.float32)
        g[lo:hi] = base[lo:hi]
        c.all_gather(g)
        np.testing.assert_array_equal(g, base)
        b = np.full(n, float(r), np.float32)
        c.broadcast(b, root=w - 1)
        assert (b == w - 1).all()
    c.barrier()
    print("ok", r, flush=True)
""")


@needs_gloo
def test_collectives_three_ranks_uneven_shards(tmp_path):
    script = tmp_path / "coll.py"
    script.write_text(COLLECTIVES)
    procs = start_ranks(3, [sys.executable, str(script)], tmp_path, "coll")
    codes = wait_all(procs, timeout=60)
    logs = "".join((tmp_path / f"coll.rank{r}.log").read_text() for r in range(3))
    assert codes == [0, 0, 0], logs


@needs_gloo
def test_single_rank_group_and_bad_buffers():
    c = _C.dist.init_gloo(0, 1, "127.0.0.1", free_port(), timeout=5)
    a = np.arange(5, dtype=np.float32)
    c.allreduce(a, "avg"), c.reduce_scatter(a), c.all_gather(a), c.broadcast(a), c.barrier()
    np.testing.assert_array_equal(a, np.arange(5))
    assert (c.rank, c.size, c.backend, c.shard(5)) == (0, 1, "gloo", (0, 5))
    with pytest.raises(TypeError, match="float32"):
        c.allreduce(np.zeros(3))
    with pytest.raises(ValueError, match="contiguous"):
        c.allreduce(np.zeros(6, np.float32)[::2])
    with pytest.raises(ValueError, match="op must be"):
        c.allreduce(a, "max")
    with pytest.raises(_C.dist.DistError, match="root"):
        c.broadcast(a, root=1)


@pytest.fixture
def one_thread():
    """In-process model tests on one OpenMP thread: on a loaded 2-core machine two threads spin-wait ~10x longer."""
    n = _C.get_num_threads()
    _C.set_num_threads(1)
    yield
    _C.set_num_threads(n)


def test_grad_ready_hook_tiles_the_gradients_once_per_enabled_backward(one_thread):
    """The model's grad-ready hook (float64 CPU model): called only by backward(report_grads=True); its ranges
    cover [0, num_parameters) exactly once, in the order the gradients become final: lnfw, lnfb; each layer's
    12 slices from the last layer down; wte, wpe. Also with every target ignored (nothing to compute)."""
    m = GPT2(get_preset("tiny").replace(n_layer=3), seed=1, dtype="float64")
    L, n = m.config.n_layer, m.num_parameters
    offsets = np.cumsum([0] + [v.size for v in m.params.values()])  # llm.c order: wte, wpe, ln1w, ..., lnfb
    span = {name: (int(offsets[i]), int(offsets[i + 1])) for i, name in enumerate(m.params)}
    per_layer = ["ln1w", "ln1b", "qkvw", "qkvb", "attprojw", "attprojb", "ln2w", "ln2b", "fcw", "fcb", "fcprojw",
                 "fcprojb"]

    def layer(name, l):
        lo, hi = span[name]
        k = (hi - lo) // L
        return (lo + l * k, lo + (l + 1) * k)

    expected = ([[span["lnfw"], span["lnfb"]]] + [[layer(t, l) for t in per_layer] for l in reversed(range(L))]
                + [[span["wte"], span["wpe"]]])
    groups = []
    m._m.set_grad_ready_hook(lambda ranges: groups.append([tuple(r) for r in ranges]))
    rng = np.random.default_rng(0)
    x = rng.integers(0, 1000, (2, 8)).astype(np.int32)
    ignored = np.full_like(x, -1)
    for report, y in ((False, x), (True, x), (False, x), (True, ignored), (True, x)):
        before = len(groups)
        m.forward(x, y)
        m._m.backward(0.5, report_grads=report)
        got = groups[before:]
        if not report:
            assert got == []  # not enabled: no calls (the non-final micro-steps of gradient accumulation)
            continue
        assert got == expected
        cover = np.zeros(n, np.int64)
        for g in got:
            for lo, hi in g:
                cover[lo:hi] += 1
        assert (cover == 1).all()
    m._m.set_grad_ready_hook(None)
    m.forward(x, x)
    m._m.backward(1.0, report_grads=True)
    assert len(groups) == 3 * (L + 2)

    def failing(ranges):
        raise KeyError("from the hook")
    m._m.set_grad_ready_hook(failing)  # an exception in the hook propagates out of backward
    m.forward(x, x)
    with pytest.raises(KeyError, match="from the hook"):
        m._m.backward(1.0, report_grads=True)
    with pytest.raises(TypeError, match="callable"):
        m._m.set_grad_ready_hook(3)


@needs_gloo
def test_overlapped_allreduce_in_a_one_rank_group(one_thread):
    """GradAllreducer over a 1-rank Gloo group: gradients as plain backward gives them, hook groups counted;
    DataParallel picks overlap for plain data parallel only."""
    c = _C.dist.init_gloo(0, 1, "127.0.0.1", free_port(), timeout=5)
    a, b = GPT2("tiny", seed=2), GPT2("tiny", seed=2)
    dp = DataParallel(a, c, grad_accum=2)
    assert dp.overlap and "overlapped" in dp.describe()
    x = np.random.default_rng(1).integers(0, 1000, (2, 8)).astype(np.int32)
    for _ in range(2):  # the second micro-step's backward averages over the (one-rank) group
        dp.forward(x, x), b.forward(x, x)
        dp.backward(0.5)
        b.backward(0.5)
    assert dp.reducer.stats() == {"finishes": 0, "groups": a.config.n_layer + 2, "ranges": 12 * a.config.n_layer + 4,
                                  "values": a.num_parameters}
    with pytest.raises(RuntimeError, match="more than grad_accum=2 micro-steps"):
        dp.backward(0.5)
    np.testing.assert_array_equal(a.flat_grads(), b.flat_grads())
    dp.step(lr=1e-3), b.step(lr=1e-3)
    assert dp.reducer.stats()["finishes"] == 1
    np.testing.assert_array_equal(a.flat_params(), b.flat_params())
    with pytest.raises(_C.dist.DistError, match="already has a live one"):
        DataParallel(b, c, broadcast=False)
    with pytest.raises(ValueError, match="ZeRO-1 keeps its single reduce-scatter"):
        DataParallel(b, c, zero=1, overlap=True)
    assert not DataParallel(b, c, zero=1).overlap and not DataParallel(b, c, overlap=False).overlap
    with pytest.raises(TypeError, match="float32 gradients"):
        _C.dist.GradAllreducer(c, GPT2("tiny", dtype="float64")._m)


# Two ranks in an overlapped step; rank 1 stops itself (SIGKILL or SIGSTOP) part-way through its backward,
# after 2 grad-ready groups, while rank 0's background allreduce waits for it.
MIDWAY = textwrap.dedent("""
    import os, signal, sys
    import numpy as np
    from gpt2core import _C, distributed
    from gpt2core.distributed import DataParallel
    from gpt2core.model import GPT2
    c = distributed.init_process_group(timeout=float(sys.argv[2]))
    m = GPT2("tiny", seed=0)
    dp = DataParallel(m, c)
    x = np.arange(32, dtype=np.int32).reshape(2, 16)
    m.forward(x, x)
    if c.rank == 1:
        seen = []
        def hook(ranges):
            seen.append(ranges)
            if len(seen) == 2:
                os.kill(os.getpid(), getattr(signal, sys.argv[1]))
        m._m.set_grad_ready_hook(hook)
        m._m.backward(1.0, report_grads=True)
    else:
        dp.backward(1.0)  # grad_accum=1: this micro-step averages as it goes
        print("backward done", flush=True)
        dp.step(lr=1e-3)
    print("no error", flush=True)
""")


@needs_gloo
@pytest.mark.parametrize("sig", ["SIGKILL", "SIGSTOP"])
def test_rank_dies_during_overlapped_backward(tmp_path, sig):
    timeout = 2.0
    script = tmp_path / "midway.py"
    script.write_text(MIDWAY)
    procs = start_ranks(2, [sys.executable, str(script), sig, str(timeout)], tmp_path, "midway")
    try:
        t0 = time.monotonic()
        code = procs[0].wait(timeout=60)
        took = time.monotonic() - t0
    finally:
        for p in procs:
            p.kill()
            p.wait()
    log = (tmp_path / "midway.rank0.log").read_text()
    assert code != 0 and "no error" not in log, log
    assert "DistError" in log and "overlapped gradient allreduce" in log and "rank 0 of 2" in log, log
    if sig == "SIGSTOP":  # a hung peer: the background allreduce gives up after the timeout
        assert "Timed out" in log and took >= timeout * 0.9, log
    assert took < timeout + 20


def test_adamw_update_range_matches_full_step():
    """ZeRO-1's C++ entry: AdamW over [lo, hi) pieces (cutting tensors mid-way) equals the full update."""
    full, part = GPT2("tiny", seed=3), GPT2("tiny", seed=3)
    n = full.num_parameters
    cuts = [0, 1234, n // 2 + 17, n - 5, n]
    ms = [np.zeros(b - a, np.float32) for a, b in zip(cuts, cuts[1:])]
    vs = [np.zeros(b - a, np.float32) for a, b in zip(cuts, cuts[1:])]
    rng = np.random.default_rng(0)
    for step in (1, 2, 3):
        g = rng.standard_normal(n).astype(np.float32)
        full._m.flat_grads()[:] = g
        part._m.flat_grads()[:] = g
        full._m.adamw_update(lr=1e-2, weight_decay=0.1, step=step, grad_scale=0.5)
        for (a, b), m, v in zip(zip(cuts, cuts[1:]), ms, vs):
            part._m.adamw_update_range(a, b, m, v, lr=1e-2, weight_decay=0.1, step=step, grad_scale=0.5)
        np.testing.assert_array_equal(part._m.flat_params(), full._m.flat_params())
    fm = full._m.adam_m()
    np.testing.assert_array_equal(np.concatenate(ms)[:fm["wte"].size], fm["wte"].ravel())
    with pytest.raises(ValueError, match="hi - lo"):
        part._m.adamw_update_range(0, 10, np.zeros(9, np.float32), np.zeros(10, np.float32), lr=1e-3, step=1)
    with pytest.raises(ValueError, match="lo <= hi"):
        part._m.adamw_update_range(5, n + 1, np.zeros(n - 4, np.float32), np.zeros(n - 4, np.float32), lr=1e-3, step=1)


def test_memory_report_of_zero1():
    class FakeComm:  # a 4-rank group seen from rank 3, for the arithmetic only
        size, rank, backend = 4, 3, "gloo"

        def shard(self, n):
            s = -(-n // 4)
            return min(3 * s, n), n

        def broadcast(self, buf, root=0):
            pass

    m = GPT2("tiny", seed=0)
    dp = DataParallel(m, FakeComm(), zero=1)
    rep = dp.optimizer_memory()
    n = m.num_parameters
    assert rep["optimizer_bytes_unsharded"] == 8 * n
    assert rep["optimizer_bytes_per_rank"] == 8 * (n - 3 * -(-n // 4)) == 8 * dp.m.size
    assert "saves" in dp.describe()


def test_from_env_launchers():
    assert from_env({}).world_size == 1 and not from_env({}).is_distributed
    tr = from_env({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "2",
                   "MASTER_ADDR": "node0", "MASTER_PORT": "1234", "TORCHELASTIC_USE_AGENT_STORE": "True"})
    assert (tr.rank, tr.local_rank, tr.world_size, tr.local_world_size, tr.master_addr, tr.master_port,
            tr.store_port, tr.source) == (3, 1, 8, 2, "node0", 1234, 1235, "torchrun")
    assert from_env({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "9", "GPT2CORE_STORE_PORT": "77"}).store_port == 77
    sl = from_env({"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8", "SLURM_NTASKS_PER_NODE": "4",
                   "SLURM_JOB_NODELIST": "gpu[07-08,11]"})
    assert (sl.rank, sl.local_rank, sl.world_size, sl.local_world_size, sl.master_addr) == (5, 1, 8, 4, "gpu07")
    mp = from_env({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
                   "OMPI_COMM_WORLD_LOCAL_SIZE": "2"})
    assert (mp.rank, mp.world_size, mp.master_addr, mp.master_port, mp.source) == (1, 2, "127.0.0.1", 29500, "mpirun")
    with pytest.raises(ValueError, match="outside"):
        from_env({"RANK": "2", "WORLD_SIZE": "2"})
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        from_env({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"})


def test_nccl_entry_point_fails_cleanly_without_a_gpu():
    if hasattr(_C, "cuda_status") and _C.cuda_status() == "":
        pytest.skip("a GPU is present")
    assert _C.dist.have_nccl() == (_C.build_info()["nccl"] and "cuda" in _C.build_info()["backends"])
    with pytest.raises(_C.dist.DistError, match="NCCL|CUDA"):
        _C.dist.init_nccl(0, 1, "127.0.0.1", free_port(), timeout=2.0, device=0)


# ------------------------------------------------------------------------------------ ZeRO-1 checkpoints
def _shard_ranges(n, world):
    s = -(-n // world)
    return [(min(r * s, n), min((r + 1) * s, n)) for r in range(world)]


@needs_gloo
def test_zero1_checkpoint_holds_one_shard_per_rank(zero_run, tmp_path):
    from gpt2core import checkpoint as ck
    n = np.load(zero_run / "params0.npy").size
    c = ck.load_checkpoint(zero_run / "checkpoints" / "step_000002")
    files = sorted(c.manifest["files"])
    assert files == ["metrics.jsonl", "model.bin", "optim_shard_r0_of_2.npz", "optim_shard_r1_of_2.npz",
                     "state.json"]  # no full adam_m.npy / adam_v.npy anywhere
    assert c.manifest["version"] == 2 and c.manifest["zero"] == {"stage": 1, "world_size": 2}
    ranges = _shard_ranges(n, 2)
    assert [(s["lo"], s["hi"]) for s in c.zero["shards"]] == ranges and c.zero["world_size"] == 2
    for r, (lo, hi) in enumerate(ranges):
        with np.load(c.path / f"optim_shard_r{r}_of_2.npz") as z:  # only this rank's range of the moments
            assert (int(z["lo"]), int(z["hi"]), int(z["num_parameters"]), int(z["step_count"])) == (lo, hi, n, 2)
            assert z["m"].shape == z["v"].shape == (hi - lo,) and z["m"].dtype == np.float32
            assert (z["v"] > 0).any()
    with pytest.raises(ck.CheckpointError, match="with world size 2 .* world size 1 .*consolidate"):
        c.restore(GPT2("tiny"))  # a full restore needs the merged state

    # a corrupt or missing shard makes the checkpoint rejected; --resume auto's choice falls back
    root = tmp_path / "checkpoints"
    shutil.copytree(zero_run / "checkpoints", root)
    shard = root / "step_000003" / "optim_shard_r1_of_2.npz"
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    shard.write_bytes(bytes(raw))
    with pytest.raises(ck.CheckpointError, match=r"step_000003/optim_shard_r1_of_2\.npz: sha256 does not match"):
        ck.load_checkpoint(root / "step_000003")
    skipped = []
    assert ck.latest_checkpoint(root, log=skipped.append).step == 2 and "sha256" in skipped[0]
    (root / "step_000002" / "optim_shard_r0_of_2.npz").unlink()
    with pytest.raises(ck.CheckpointError, match=r"optim_shard_r0_of_2\.npz: missing"):
        ck.load_checkpoint(root / "step_000002")
    assert ck.latest_checkpoint(root, log=skipped.append) is None
    m = json.loads((root / "step_000002" / "manifest.json").read_text())
    del m["files"]["optim_shard_r0_of_2.npz"]  # a manifest that forgot a shard
    (root / "step_000002" / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ck.CheckpointError, match="does not list optim_shard_r0_of_2.npz .*rank 0"):
        ck.load_checkpoint(root / "step_000002")


@needs_gloo
def test_zero1_kill_9_then_resume_auto_is_bit_identical(zero_run, tmp_path, recorder, data_dir):
    """Both ranks SIGKILLed right after the checkpoint of step 2; 2 ranks resume it: the same bits."""
    extra = ["--zero", "1", "--checkpoint-every", "2"]
    out = run_training(tmp_path, "run", 2, recorder, data_dir, extra=extra, env={"KILL_AFTER_CHECKPOINT": "2"},
                       expect=-signal.SIGKILL)
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_000002"]
    assert not (out / "model.bin").exists()
    run_training(tmp_path, "run", 2, recorder, data_dir, extra=extra + ["--resume", "auto", "--keep-last", "1"])
    assert f"resumed from {out / 'checkpoints' / 'step_000002'} at step 2" in (tmp_path / "run.rank0.log").read_text()
    p0 = np.load(zero_run / "params0.npy")
    np.testing.assert_array_equal(np.load(out / "params0.npy"), p0)
    np.testing.assert_array_equal(np.load(out / "params1.npy"), p0)
    assert metrics(out) == metrics(zero_run)  # losses, grad norms, val losses: exact
    assert (out / "model.bin").read_bytes() == (zero_run / "model.bin").read_bytes()
    # --keep-last 1 pruned step 2 once step 3 was complete, shards and all
    from gpt2core import checkpoint as ck
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_000003"]
    assert ck.load_checkpoint(out / "checkpoints" / "step_000003").zero["world_size"] == 2


@needs_gloo
def test_zero1_other_world_size_needs_consolidate(zero_run, tmp_path, recorder, data_dir):
    ck_dir = tmp_path / "step_000002"
    shutil.copytree(zero_run / "checkpoints" / "step_000002", ck_dir)

    # 1 process and 3 ZeRO-1 ranks are refused, with the saved and current world sizes and the way out
    want = (f"{ck_dir}: this checkpoint was written by a ZeRO-1 run with world size 2 .* this run has world size "
            "{w} .*python -m gpt2core.checkpoint consolidate " + str(ck_dir))
    one = subprocess.run([sys.executable, "-m", "gpt2core.train", *TRAIN_ARGS, "-B", str(2 * B), "--data-dir",
                          str(data_dir), "--output-dir", str(tmp_path / "one"), "--resume", str(ck_dir)],
                         capture_output=True, text=True, timeout=60)
    assert one.returncode != 0 and re.search(want.format(w=1), one.stderr), one.stderr
    run_training(tmp_path, "three", 3, recorder, data_dir, micro=1, expect=1,
                 extra=["--zero", "1", "--total-batch-tokens", str(3 * T * 2), "--resume", str(ck_dir)])
    for r in range(3):
        assert re.search(want.format(w=3), (tmp_path / f"three.rank{r}.log").read_text())

    # consolidate: the shards merged into full adam_m / adam_v, exactly
    shards = []
    for r in range(2):
        with np.load(ck_dir / f"optim_shard_r{r}_of_2.npz") as z:
            shards.append((z["m"].copy(), z["v"].copy()))
    r = subprocess.run([sys.executable, "-m", "gpt2core.checkpoint", "consolidate", str(ck_dir)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    from gpt2core import checkpoint as ck
    c = ck.load_checkpoint(ck_dir)
    assert c.zero is None and c.manifest["version"] == 1
    assert sorted(c.manifest["files"]) == ["adam_m.npy", "adam_v.npy", "metrics.jsonl", "model.bin", "state.json"]
    assert not list(ck_dir.glob("optim_shard_*")) and c.state["consolidated_from"]["zero"]["world_size"] == 2
    np.testing.assert_array_equal(np.load(ck_dir / "adam_m.npy"), np.concatenate([m for m, _ in shards]))
    np.testing.assert_array_equal(np.load(ck_dir / "adam_v.npy"), np.concatenate([v for _, v in shards]))

    # one process resumes it: the 2-rank continuation to fp32 tolerance (gradients summed in another order,
    # as in test_two_ranks_match_one_process)
    p0 = np.load(zero_run / "params0.npy")
    res1 = run_training(tmp_path, "resume1", 1, recorder, data_dir, extra=["--resume", str(ck_dir)])
    np.testing.assert_allclose(np.load(res1 / "params0.npy"), p0, rtol=0, atol=2e-5)
    np.testing.assert_allclose(metrics(res1)[0], metrics(zero_run)[0], rtol=1e-5)
    # 2 ZeRO-1 ranks resume the full state (each slices its range): exactly the uninterrupted run
    res2 = run_training(tmp_path, "resume2", 2, recorder, data_dir, extra=["--zero", "1", "--resume", str(ck_dir)])
    np.testing.assert_array_equal(np.load(res2 / "params0.npy"), p0)
    assert metrics(res2)[0] == metrics(zero_run)[0]
