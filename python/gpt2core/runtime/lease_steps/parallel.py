"""The dp step: data parallel over two ranks (Gloo) at every ZeRO stage and with optimizer offload, bit for bit
against one process; NCCL's collectives on one rank."""
from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from .common import Ctx, Skip, random_batch, random_token_config, shapes


DP_RANK = """
import json, os, sys
import numpy as np
from gpt2core import GPT2, GPT2Config
from gpt2core.distributed import DataParallel, setup
out, device, config, B, T, zero, offload, world = sys.argv[1:9]
B, T, zero, offload, world = int(B), int(T), int(zero), offload == "1", int(world)
rank = 0
comm = None
if world > 1:
    env, comm, _ = setup("cpu", timeout=120)  # Gloo between the ranks (NCCL refuses two ranks on one GPU)
    rank = env.rank
cfg = GPT2Config(**json.loads(config))
m = GPT2(cfg, device=device, seed=7)
if offload:
    m.offload = True
model = DataParallel(m, comm, zero=zero, grad_accum=1 if world > 1 else 2) if comm is not None else m
rng = np.random.default_rng(100)
losses = []
for step in range(3):
    model.zero_grad()
    xs = [rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32) for _ in range(2)]
    if world > 1:
        model.forward_backward(xs[rank], xs[rank], grad_scale=1.0)
    else:
        for x in xs:
            m.forward_backward(x, x, grad_scale=0.5)
    losses.append(float(model.take_loss()))
    model.step(lr=1e-3, grad_clip=1.0)
np.save(out + f".rank{rank}.npy", m.flat_params())
if rank == 0:
    json.dump(losses, open(out + ".json", "w"))
"""


def step_dp(budget: float, ctx: Ctx):
    """Two ranks over Gloo (on one GPU: NCCL refuses two ranks on one device) at ZeRO 0, 1, 2 and with optimizer
    offload, against one process with two micro-steps, against ZeRO 0 and (offload) against the same stage without
    it: the same weights bit for bit, or how far apart (the CPU's tests find ZeRO and one process equal to fp32
    rounding: the gradients are summed in another order; offload = no offload bit for bit). Then NCCL with one
    rank and every collective the trainer calls (allreduce, reduce_scatter, all_gather, broadcast, barrier, and a
    DataParallel step at ZeRO 0/1/2) run once on real streams."""
    from gpt2core import _C
    from gpt2core.distributed.launch import free_port
    if not _C.dist.have_gloo():
        raise Skip("this build has no Gloo")
    s = shapes(ctx)
    work = Path(ctx.work)
    script = work / "dp_rank.py"
    script.write_text(DP_RANK)
    common = [ctx.device, json.dumps(asdict(random_token_config(ctx))), s["dp_B"], s["dp_T"]]

    def run(name, zero, offload, world):
        out = str(work / name)
        port = free_port()
        procs = []
        for r in range(world):
            env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
            procs.append(subprocess.Popen([*ctx.python, str(script), out, *map(str, common), str(zero),
                                           "1" if offload else "0", str(world)], env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
        logs = [p.communicate(timeout=max(30, budget / 3))[0] for p in procs]
        if any(p.returncode != 0 for p in procs):
            raise RuntimeError(f"dp run {name} failed: {logs[0][-1500:]} {logs[-1][-1500:]}")
        return [np.load(out + f".rank{r}.npy") for r in range(world)], json.load(open(out + ".json"))

    (ref,), ref_losses = run("one", 0, False, 1)
    yield {"run": "one process, two micro-steps", "losses": ref_losses}
    offloads = (False, True) if ctx.device == "cuda" else (False,)
    zero0 = None
    for zero in (0, 1, 2):
        on_device = None
        for off in offloads:
            (p, p1), losses = run(f"z{zero}{'_off' if off else ''}", zero, off, 2)
            zero0 = p if zero0 is None else zero0
            row = {"run": f"2 ranks over Gloo, ZeRO {zero}" + (", offload" if off else ""), "losses": losses,
                   "replicas_bit_identical": bool(np.array_equal(p, p1)),
                   "same_bits_as_zero0": bool(np.array_equal(p, zero0)),
                   "same_bits_as_one_process": bool(np.array_equal(p, ref)),
                   "max_abs_diff_to_one_process": float(np.max(np.abs(p - ref)))}
            if off:  # the optimizer on the host: the same bits as this ZeRO stage on the device
                row["same_bits_as_without_offload"] = bool(np.array_equal(p, on_device))
            on_device = p
            yield row
    if ctx.device != "cuda" or not _C.dist.have_nccl():
        yield {"nccl": "skipped: " + ("--device cpu" if ctx.device != "cuda" else "this build has no NCCL")}
        return
    yield {"nccl": _nccl_one_rank(s, random_token_config(ctx))}


def _nccl_one_rank(s: dict, cfg) -> dict:
    from gpt2core import GPT2, _C
    from gpt2core.distributed import DataParallel
    from gpt2core.distributed.launch import free_port
    t0 = time.perf_counter()
    comm = _C.dist.init_nccl(0, 1, "127.0.0.1", free_port(), timeout=60.0, device=0)
    m = GPT2(cfg, device="cuda", seed=0)
    comm.use_stream_of(m._m)
    g = m.flat_grads()
    done = {}
    g[...] = 1.0
    comm.allreduce(g, "sum")
    done["allreduce"] = bool(np.all(g == 1.0))
    comm.reduce_scatter(g, "sum")
    comm.all_gather(g)
    done["reduce_scatter+all_gather"] = bool(np.all(g == 1.0))
    comm.broadcast(g, 0)
    comm.barrier()
    done["broadcast+barrier"] = True
    x = random_batch(cfg.vocab_size, 2, s["dp_T"])
    for zero in (0, 1, 2):
        mz = GPT2(cfg, device="cuda", seed=0)
        dp = DataParallel(mz, comm, zero=zero)
        dp.zero_grad()
        dp.forward_backward(x, x)
        loss = dp.take_loss()
        dp.step(lr=1e-4)
        done[f"DataParallel zero={zero}"] = bool(np.isfinite(loss))
        del dp, mz
    return {"collectives": done, "seconds": round(time.perf_counter() - t0, 2)}
