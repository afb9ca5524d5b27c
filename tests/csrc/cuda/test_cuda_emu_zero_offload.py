"""ZeRO-1 and ZeRO-2 with optimizer offload (issue 37): each rank runs AdamW for its shard on the host, its moments in
pinned memory, and the ranks' new master weights are gathered through a device buffer (DataParallel._through_stage:
NCCL cannot reach pinned host memory).

Two ranks over Gloo (the emulated module's gpt2core._C.dist, built where libgloo-dev is installed), each with a
model on the emulated CUDA device, through the Python API (DataParallel): for each precision, three optimizer steps
of two micro-steps with clipping active (fp16 with dynamic loss scaling) under ZeRO-0, -1 and -2, with and without
offload (and plain data parallel, where every rank offloads the whole update). The weights, the losses, the grad norms, the rank's moments and the loss scale are the same bits with
offload as without; the staging buffer is made small (1,000 values), so every range crosses several chunks. What
each rank's device then holds against the plan: the master weights and the moments gone, the staging buffer
there (memplan.memory, the emulator's accounting)."""
import json
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from gpt2core import GPT2Config, memplan
from test_cuda_emu import BUILD, emu  # noqa: F401  (fixture)
from test_cuda_emu_memplan import data  # noqa: F401  (fixture)
from test_distributed import KILL_HOOK, start_ranks, wait_all

# gpt2core over the emulated core (argv[1]: its build folder), also in a build without a CUDA backend of its own
EMULATED = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[1])
    import gpt2core_cuda_emu
    sys.modules["gpt2core._C"] = gpt2core_cuda_emu
    import gpt2core._libs
    gpt2core._libs.driver_problem = lambda: ""
    import gpt2core._cuda
    gpt2core._cuda.load = lambda: []
    import gpt2core._plugins
    gpt2core._plugins.find = lambda: "emulated"
""")

RANK = EMULATED + textwrap.dedent("""
    import numpy as np
    from gpt2core import GPT2, GPT2Config, _C
    from gpt2core.distributed import DataParallel, setup

    out, precision = sys.argv[2], sys.argv[3]
    env, comm, _ = setup("cpu", timeout=300)  # Gloo between the processes; the models on the emulated device
    c = GPT2Config(block_size=16, vocab_size=97, padded_vocab_size=128, n_layer=2, n_head=2, n_embd=64)
    res = {}
    n = c.num_parameters()
    largest = max(hi - lo for lo, hi in (comm.shard(n, r) for r in range(comm.size)))
    # the staging buffer at 1,000 values (every range in many chunks), and on its boundaries with ZeRO-1: exactly
    # the largest shard (one chunk) and one value short of it (a last chunk of one value)
    runs = [(z, o, 1000) for z in (0, 1, 2) for o in (False, True)] + [(1, True, largest), (1, True, largest - 1)]
    for zero, offload, stage in runs:
        DataParallel.stage_values = stage
        free0 = _C.cuda_mem_info(0)[0]
        m = GPT2(c, device="cuda", seed=7 + env.rank, precision=precision, attention="flash",
                 loss_scale_init=1024.0)  # rank 1's seed differs: the first broadcast makes them equal
        m.offload = offload
        dp = DataParallel(m, comm, zero=zero, grad_accum=2)
        if offload:  # the ranks change the gradients after backward: no copy during it
            try:
                m.prefetch_grads()
                raise SystemExit("prefetch_grads under DataParallel was not refused")
            except RuntimeError as e:
                assert "DataParallel" in str(e), e
        rng = np.random.default_rng(100 + env.rank)
        losses, norms = [], []
        for step in range(3):
            dp.zero_grad()
            for micro in range(2):
                x = rng.integers(0, 97, (2, 16)).astype(np.int32)
                y = rng.integers(0, 97, (2, 16)).astype(np.int32)
                y[0, 3] = -1
                dp.forward_backward(x, y, grad_scale=0.5)
            losses.append(dp.take_loss())
            norms.append(dp.step(lr=1e-2, grad_clip=0.05))
        # ZeRO-2's offloaded shard goes to the host during each step's last backward
        assert m._m.grad_prefetches == (3 if offload and zero == 2 else 0), m._m.grad_prefetches
        key = f"z{zero}_{'off' if offload else 'dev'}" + ("" if stage == 1000 else f"_stage{stage - largest}")
        res[key + "_params"] = m.flat_params().copy()
        res[key + "_losses"] = np.array(losses)
        res[key + "_norms"] = np.array(norms)
        am, av = (dp.m, dp.v) if zero else (m._m.adam_m()["qkvw"], m._m.adam_v()["fcw"])
        res[key + "_m"] = np.array(am, copy=True)
        res[key + "_v"] = np.array(av, copy=True)
        res[key + "_scale"] = np.array([m.loss_scale])
        res[key + "_held"] = np.array([free0 - _C.cuda_mem_info(0)[0]])
        res[key + "_lo_hi"] = np.array([dp.lo, dp.hi])
        del dp, m, am, av
    np.savez(out + f"/rank{env.rank}.npz", **res)
""")


@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp32"])
def test_zero_with_offload_is_bit_identical_to_zero_on_the_device(emu, tmp_path, precision):  # noqa: F811
    if not hasattr(emu, "dist") or not emu.dist.have_gloo():
        pytest.skip("the emulated module was built without Gloo (apt-get install libgloo-dev)")
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    procs = start_ranks(2, [sys.executable, str(script), str(BUILD), str(tmp_path), precision], tmp_path, "z")
    logs = lambda: "".join((tmp_path / f"z.rank{r}.log").read_text() for r in range(2))  # noqa: E731
    try:
        codes = wait_all(procs, 600)
    except subprocess.TimeoutExpired:
        pytest.fail("ranks timed out:\n" + logs())
    assert codes == [0, 0], logs()
    z = [dict(np.load(tmp_path / f"rank{r}.npz")) for r in range(2)]
    for r in range(2):
        for zero in (0, 1, 2):
            dev, off = f"z{zero}_dev", f"z{zero}_off"
            for part in ("params", "losses", "norms", "m", "v", "scale"):
                assert np.array_equal(z[r][dev + "_" + part], z[r][off + "_" + part]), (precision, r, zero, part)
            assert np.all(z[r][dev + "_norms"] > 0.05)  # clipping was active
            assert np.array_equal(z[r][dev + "_params"], z[0][dev + "_params"])  # the ranks agree
        for edge in ("_stage0", "_stage-1"):  # the staging buffer at the largest shard, and one value short of it
            for part in ("params", "losses", "norms", "m", "v"):
                assert np.array_equal(z[r]["z1_dev_" + part], z[r]["z1_off" + edge + "_" + part]), (edge, part)
    # the device memory a rank's offloaded run holds less than its run on the device: the master weights (16-bit)
    # and the rank's moments, less the staging buffer (its 1,000 values) -- as the plan says
    c = GPT2Config(block_size=16, vocab_size=97, padded_vocab_size=128, n_layer=2, n_head=2, n_embd=64)
    n = c.num_parameters()
    for zero in (1, 2):
        lo, hi = z[0][f"z{zero}_dev_lo_hi"]
        saved = int(z[0][f"z{zero}_dev_held"][0] - z[0][f"z{zero}_off_held"][0])
        half = precision != "fp32"
        assert saved == (4 * n if half else 0) + 8 * (hi - lo) - (4 * 1000 if half else 0), (zero, saved)
        o = {f: memplan.Options(device="cuda", precision=precision, world_size=2, zero=zero, offload=f,
                                library_workspace=0) for f in ("none", "optimizer")}
        plan = {f: memplan.memory(c, 2, 16, o[f]) for f in o}
        stage = 4 * min(memplan.STAGE_VALUES, hi - lo) if half else 0
        assert memplan.total(plan["none"]) - memplan.total(plan["optimizer"]) == \
            (4 * n if half else 0) + 8 * -(-n // 2) - stage


# gpt2core-train's ranks over the emulated core: Gloo between the processes (the emulated module has no NCCL), every
# rank's model on the one emulated device
TRAIN = EMULATED + textwrap.dedent("""
    from gpt2core import train
    from gpt2core.distributed import parallel as distributed  # the module whose setup the trainer calls
    _setup = distributed.setup
    distributed.setup = lambda device="cpu", timeout=60.0: (*_setup("cpu", timeout)[:2], device)
""") + KILL_HOOK + """
sys.exit(train.console(sys.argv[2:]))
"""


def test_train_zero2_with_offload_is_the_same_run_and_resumes_bit_exactly(emu, tmp_path, data):  # noqa: F811
    """gpt2core-train on two ranks (bf16, tiny preset, gradient accumulation 2, clipping at the default 1.0):
    --zero 2 --offload optimizer gives --zero 2's losses and model.bin; killed (SIGKILL, both ranks) right after the
    checkpoint of step 2 and resumed (--resume auto: each rank's optimizer shard back into pinned memory), the same
    model.bin too. That checkpoint, consolidated, resumes in one process with offload (micro-batch 4: the same
    global batch), the 2-rank run's continuation to fp32 rounding (the gradients summed in another order)."""
    if not hasattr(emu, "dist") or not emu.dist.have_gloo():
        pytest.skip("the emulated module was built without Gloo (apt-get install libgloo-dev)")
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    common = [sys.executable, str(script), str(BUILD), "--device", "cuda", "--data-dir", str(data), "--preset",
              "tiny", "--precision", "bf16", "-T", "32", "--total-batch-tokens", "256", "--val-every", "0",
              "--sample-tokens", "0", "--threads", "1", "--attention", "flash", "--checkpoint-every", "2"]
    base = common + ["-B", "2", "--zero", "2"]

    def train(name, *extra, world=2, cmd=base, expect=0, env=None):
        procs = start_ranks(world, cmd + ["--output-dir", str(tmp_path / name), *extra], tmp_path, name, env=env)
        codes = wait_all(procs, 900)
        log = "".join((tmp_path / f"{name}.rank{r}.log").read_text() for r in range(world))
        assert codes == [expect] * world, log[-6000:]
        return tmp_path / name, log

    loss = lambda d: [json.loads(x)["loss"] for x in open(d / "metrics.jsonl") if '"loss"' in x]  # noqa: E731
    weights = lambda d: np.fromfile(d / "model.bin", dtype=np.float32)[256:]  # noqa: E731  (past the header)
    plain, _ = train("plain", "--steps", "3")
    off, log = train("off", "--steps", "3", "--offload", "optimizer")
    assert len(loss(plain)) == 3 and loss(off) == loss(plain)
    assert (off / "model.bin").read_bytes() == (plain / "model.bin").read_bytes()
    run, _ = train("run", "--steps", "3", "--offload", "optimizer", expect=-9, env={"KILL_AFTER_CHECKPOINT": "2"})
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_000002"]
    _, log = train("run", "--steps", "3", "--offload", "optimizer", "--resume", "auto")
    assert "resumed from" in log
    assert (run / "model.bin").read_bytes() == (plain / "model.bin").read_bytes()
    assert loss(run) == loss(plain)
    ck_dir = tmp_path / "step_000002"
    shutil.copytree(off / "checkpoints" / "step_000002", ck_dir)
    r = subprocess.run([sys.executable, "-m", "gpt2core.checkpoint", "consolidate", str(ck_dir)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    one, log = train("one", "--steps", "3", "--offload", "optimizer", "--resume", str(ck_dir), world=1,
                     cmd=common + ["-B", "4"])
    assert f"resumed from {ck_dir} at step 2" in log
    np.testing.assert_allclose(weights(one), weights(plain), rtol=0, atol=2e-5)
    np.testing.assert_allclose(loss(one), loss(plain), rtol=1e-5)
