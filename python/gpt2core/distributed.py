"""Data-parallel training: the launcher's environment, the process group, gradient averaging, ZeRO-1.

Environment (first match wins):

* torchrun / ``python -m gpt2core.launch``: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
  MASTER_ADDR, MASTER_PORT
* mpirun (Open MPI): OMPI_COMM_WORLD_RANK, _LOCAL_RANK, _SIZE, _LOCAL_SIZE (MASTER_ADDR from the
  environment, e.g. ``mpirun -x MASTER_ADDR=node0``; 127.0.0.1 when all ranks share one node)
* SLURM (srun): SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS, SLURM_NTASKS_PER_NODE; MASTER_ADDR defaults
  to the first host of SLURM_JOB_NODELIST

The process group meets at MASTER_ADDR:MASTER_PORT: rank 0 serves a small rendezvous store there (the C++
core, csrc/comm). torchrun's agent already serves its own store on MASTER_PORT
(TORCHELASTIC_USE_AGENT_STORE=True), so under torchrun we use MASTER_PORT + 1; GPT2CORE_STORE_PORT
overrides the port in every case. On the CPU the collectives run over Gloo (TCP); with device "cuda" over
NCCL, each process on GPU LOCAL_RANK (the CUDA backend's buffers are managed memory, so the same numpy
views reach NCCL as device pointers). Every collective is bounded by a timeout: a rank that died or hangs
makes the others raise DistError instead of waiting forever.

One optimizer step (``DataParallel.step``), after the last micro-step of gradient accumulation (the
micro-steps before it do not communicate):

* plain DDP: the gradients are averaged (mean over ranks), then the usual clip + AdamW on every rank
  (identical bits on every rank, so the replicas stay identical). With ``overlap`` (the default) the
  averaging overlaps the last micro-step's backward: ``DataParallel.backward(scale, last=True)`` runs it
  with the model's grad-ready hook, which hands each group of final gradients (lnf; then each layer, from
  the last one down; then the embeddings) to a background all-reduce (a worker thread over Gloo, a comm
  stream over NCCL; one collective per group), and ``step`` only waits for it (``finish``). Without
  overlap: one allreduce of the flat gradient buffer in ``step``;
* ZeRO-1 (``zero=1``): reduce-scatter (mean) of the gradients, the global grad norm from one allreduce
  of per-shard sums of squares, AdamW on this rank's shard only (its moments are the only optimizer state
  this rank holds: 2·N/world floats instead of 2·N), then an all-gather of the updated parameters.
  ZeRO-1 keeps its single reduce-scatter after backward (no overlap).

``last_comm_ms`` is the step's time spent waiting for gradient/parameter collectives: with overlap only the
wait in ``finish`` (the part of the all-reduce that backward did not hide).
"""
from __future__ import annotations

import math
import os
import re
import time
from dataclasses import dataclass

import numpy as np

DEFAULT_PORT = 29500
DEFAULT_TIMEOUT = 300.0  # seconds a collective may wait for the other ranks


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = DEFAULT_PORT
    store_port: int = DEFAULT_PORT  # where rank 0 serves the rendezvous store (see the module doc)
    source: str = "none"            # "torchrun", "mpirun", "slurm" or "none"

    @property
    def is_master(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


def _first_slurm_host(nodelist: str) -> str | None:
    """First host of a SLURM node list: 'gpu[03-05,07],cpu1' -> 'gpu03'."""
    m = re.match(r"\s*([^,\[]+)(?:\[([^\]]+)\])?", nodelist or "")
    if not m:
        return None
    prefix, ranges = m.group(1), m.group(2)
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def _slurm_tasks_per_node(env) -> int | None:
    v = env.get("SLURM_NTASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")  # '4' or '4(x2)' or '4,2'
    if not v:
        return None
    m = re.match(r"\s*(\d+)", v)
    return int(m.group(1)) if m else None


def from_env(environ=None) -> DistEnv:
    """The process's place in the job from torchrun, mpirun or SLURM variables (see the module doc)."""
    env = os.environ if environ is None else environ
    schemes = (("torchrun", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"),
               ("mpirun", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_SIZE",
                "OMPI_COMM_WORLD_LOCAL_SIZE"),
               ("slurm", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS", None))
    for source, r, lr, ws, lws in schemes:
        if ws not in env:
            continue
        try:
            rank, local_rank, world = int(env.get(r, 0)), int(env.get(lr, 0)), int(env[ws])
            if lws is not None and lws in env:
                local_world = int(env[lws])
            elif source == "slurm":
                local_world = _slurm_tasks_per_node(env) or world
            else:
                local_world = world
            port = int(env.get("MASTER_PORT", DEFAULT_PORT))
            if "GPT2CORE_STORE_PORT" in env:
                store_port = int(env["GPT2CORE_STORE_PORT"])
            elif env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
                store_port = port + 1
            else:
                store_port = port
        except ValueError as e:
            raise ValueError(f"bad distributed environment ({r}/{lr}/{ws}/MASTER_PORT): {e}") from None
        if world < 1:
            raise ValueError(f"{ws}={world} must be >= 1")
        if not (0 <= rank < world):
            raise ValueError(f"{r}={rank} is outside 0..{ws}-1 ({world})")
        addr = env.get("MASTER_ADDR")
        if not addr and source == "slurm":
            addr = _first_slurm_host(env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", ""))
        if not addr and world > 1 and local_world < world:
            raise ValueError(f"{world} ranks over several nodes ({source}) need MASTER_ADDR: the host of rank 0")
        return DistEnv(rank=rank, local_rank=local_rank, world_size=world, local_world_size=local_world,
                       master_addr=addr or "127.0.0.1", master_port=port, store_port=store_port, source=source)
    return DistEnv()


def init_process_group(env: DistEnv | None = None, timeout: float = DEFAULT_TIMEOUT, device: str = "cpu"):
    """Join the process group described by `env` (default: from_env()); returns a gpt2core._C.dist.Comm.

    Blocks until all ranks arrived (or raises DistError naming the missing ranks after `timeout` seconds).
    Every later collective is bounded by the same timeout."""
    from . import _C

    env = from_env() if env is None else env
    if device.startswith("cuda"):  # NCCL on GPU LOCAL_RANK (or the index in "cuda:N")
        if not _C.dist.have_nccl():
            raise RuntimeError(f"multi-process training on device {device!r} needs the NCCL communicator, which this "
                               "build of gpt2core does not include (it needs the CUDA backend and NCCL at build "
                               "time); use --device cpu for Gloo")
        index = int(device.split(":", 1)[1]) if ":" in device else env.local_rank
        return _C.dist.init_nccl(env.rank, env.world_size, env.master_addr, env.store_port, timeout=float(timeout),
                                 device=index)
    if device != "cpu":
        raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {device!r}")
    if not _C.dist.have_gloo():
        raise RuntimeError("this build of gpt2core has no Gloo, which CPU multi-process training needs: install "
                           "it (Debian/Ubuntu: apt-get install libgloo-dev) and reinstall gpt2core from source")
    return _C.dist.init_gloo(env.rank, env.world_size, env.master_addr, env.store_port, timeout=float(timeout),
                             iface=os.environ.get("GLOO_SOCKET_IFNAME", ""))


def _sum_squares(x: np.ndarray, chunk: int = 1 << 20) -> float:
    """sum(x**2) accumulated in float64, chunk by chunk (no full-size temporary)."""
    s = 0.0
    for i in range(0, x.size, chunk):
        c = x[i:i + chunk].astype(np.float64)
        s += float(np.dot(c, c))
    return s


class DataParallel:
    """Gradient averaging (and optionally ZeRO-1) for a GPT2 over a Comm. Every rank must call the same
    methods in the same order."""

    def __init__(self, model, comm, zero: int = 0, broadcast: bool = True, resume_from=None,
                 overlap: bool | None = None):
        """resume_from: the checkpoint.Checkpoint the model was restored from (weights and step count), from
        which ZeRO-1 reads this rank's range of the AdamW moments (its own shard file, or a slice of a full
        checkpoint's). Without it, a model with step_count > 0 is taken to hold the full restored moments.
        overlap: average the gradients during the last micro-step's backward (plain data parallel only;
        default: on for plain data parallel with a float32/bf16 model, off for ZeRO-1)."""
        if zero not in (0, 1):
            raise ValueError(f"zero must be 0 (plain data parallel) or 1 (ZeRO-1), got {zero!r}")
        if overlap and zero:
            raise ValueError("overlap=True needs zero=0: ZeRO-1 keeps its single reduce-scatter after backward")
        if overlap is None:
            overlap = not zero and getattr(model._m, "dtype", "float64") != "float64"
        self.model, self.comm, self.zero = model, comm, zero
        self.world = comm.size
        self.n = model.num_parameters
        if broadcast:  # the replicas start identical even if their seeds or checkpoints differ
            comm.broadcast(model._m.flat_params(), root=0)
        self.lo, self.hi = comm.shard(self.n) if zero else (0, self.n)
        self.last_comm_ms = 0.0  # wall time of the last step's gradient/parameter collectives
        self.reducer = None  # the overlapped gradient allreduce
        self._in_flight = False  # an overlapped backward ran since the last step()
        if overlap:
            from . import _C
            self.reducer = _C.dist.GradAllreducer(comm, model._m)
        self.m = self.v = None
        if zero:  # this rank's moments, in the backend's memory (device memory on GPUs)
            from . import _C
            S = self.hi - self.lo
            if isinstance(model._m, (_C.Model, _C.ModelBF16)):
                self.m, self.v = _C.dist.alloc_state(model._m, S), _C.dist.alloc_state(model._m, S)
            else:  # float64 test models (CPU)
                dtype = model.params["wte"].dtype
                self.m, self.v = np.zeros(S, dtype=dtype), np.zeros(S, dtype=dtype)
            if resume_from is not None:
                resume_from.load_optimizer_shard(comm.rank, self.world, self.lo, self.hi, self.m, self.v)
            elif model.step_count > 0:  # restored in full by the caller: take this rank's shard of the moments
                am, av = model._m.adam_m(), model._m.adam_v()
                self.m[:] = _flat(am, model)[self.lo:self.hi]
                self.v[:] = _flat(av, model)[self.lo:self.hi]

    # ------------------------------------------------------------------ reductions of scalars
    def mean(self, *values: float) -> list[float]:
        """The mean over ranks of each value (one allreduce)."""
        buf = np.array(values, dtype=np.float32)
        self.comm.allreduce(buf, "avg")
        return [float(v) for v in buf]

    # ------------------------------------------------------------------ backward and the optimizer step
    @property
    def overlap(self) -> bool:
        return self.reducer is not None

    def backward(self, grad_scale: float = 1.0, last: bool = True) -> None:
        """One micro-step's backward. last: the final micro-step of gradient accumulation before step():
        with overlap its gradients are averaged while it runs. Earlier micro-steps never communicate."""
        if self.reducer is not None and last:
            if self._in_flight:
                raise RuntimeError("DataParallel.backward(last=True) twice without step() in between")
            self._in_flight = True  # even if it fails part-way: step() must then wait for what was started
            self.reducer.backward(float(grad_scale))
        else:
            self.model.backward(grad_scale)

    def step(self, lr: float, weight_decay: float = 0.1, beta1: float = 0.9, beta2: float = 0.95,
             eps: float = 1e-8, grad_clip: float = 1.0) -> float:
        """Average the gradients over ranks and take one clipped AdamW step (see the module doc); returns
        the pre-clip global grad norm, the same on every rank."""
        m = self.model
        grads = m._m.flat_grads()
        t0 = time.perf_counter()
        if not self.zero:
            if self._in_flight:  # averaged during the last backward: wait for the rest of it
                self._in_flight = False
                self.reducer.finish()
            else:
                self.comm.allreduce(grads, "avg")
            self.last_comm_ms = (time.perf_counter() - t0) * 1e3
            return m.step(lr, weight_decay=weight_decay, beta1=beta1, beta2=beta2, eps=eps, grad_clip=grad_clip)
        self.comm.reduce_scatter(grads, "avg")
        from . import _C
        local = (_C.dist.grad_sum_squares(m._m, self.lo, self.hi) if isinstance(m._m, (_C.Model, _C.ModelBF16))
                 else _sum_squares(grads[self.lo:self.hi]))
        ss = np.array([local], dtype=np.float32)
        self.comm.allreduce(ss, "sum")
        comm_ms = (time.perf_counter() - t0) * 1e3
        norm = math.sqrt(float(ss[0]))
        if not math.isfinite(norm):
            raise FloatingPointError(f"gradient norm is {norm} at step {m.step_count + 1}; weights not updated")
        m.step_count += 1
        # clipped by the core's rule (csrc/model/optimizer.h) from the global sum of squares
        m._m.adamw_update_range(self.lo, self.hi, self.m, self.v, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                                weight_decay=weight_decay, step=m.step_count,
                                grad_clip=grad_clip if grad_clip and grad_clip > 0 else 0.0, sum_squares=float(ss[0]))
        t1 = time.perf_counter()
        self.comm.all_gather(m._m.flat_params())
        self.last_comm_ms = comm_ms + (time.perf_counter() - t1) * 1e3
        return norm

    # ------------------------------------------------------------------ reporting
    def memory_report(self) -> dict:
        """Bytes of AdamW state (m and v, fp32) per rank, with and without ZeRO-1."""
        full = 2 * 4 * self.n
        ours = 2 * 4 * (self.hi - self.lo) if self.zero else full
        return {"optimizer_bytes_per_rank": ours, "optimizer_bytes_unsharded": full, "saved_bytes": full - ours}

    def describe(self) -> str:
        if not self.zero:
            how = ("overlapped with the last micro-step's backward, one collective per layer" if self.overlap
                   else "in one allreduce after backward")
            return (f"data parallel over {self.world} ranks ({self.comm.backend}): gradients averaged once per "
                    f"optimizer step, {how}")
        r = self.memory_report()
        mb = 1 / 2**20
        return (f"ZeRO-1 over {self.world} ranks ({self.comm.backend}): this rank updates parameters "
                f"[{self.lo:,}, {self.hi:,}); AdamW state {r['optimizer_bytes_per_rank'] * mb:.1f} MiB per rank "
                f"instead of {r['optimizer_bytes_unsharded'] * mb:.1f} MiB (saves {r['saved_bytes'] * mb:.1f} MiB)")


def _flat(views: dict, model) -> np.ndarray:
    """The flat buffer behind a dict of per-tensor views (slices of one allocation, the first at offset 0)."""
    from . import _C

    first = views[_C.param_names()[0]].reshape(-1)
    return np.lib.stride_tricks.as_strided(first, shape=(model.num_parameters,), strides=(first.itemsize,))
