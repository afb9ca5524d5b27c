"""Data-parallel training: the launcher's environment, the process group, gradient averaging, ZeRO-1 and -2,
optimizer offload on every rank.

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

``DataParallel`` has GPT2's face (forward_backward, take_loss, step, and the rest passed through to the
model), so the training loop is the same with or without it. Of the ``grad_accum`` micro-steps of an
optimizer step, only the last one communicates; ``take_loss`` returns the loss averaged over ranks. In
``step``:

* plain DDP: the gradients are averaged (mean over ranks), then the usual clip + AdamW on every rank
  (identical bits on every rank, so the replicas stay identical). With ``overlap`` (the default) the
  averaging overlaps the last micro-step's backward: that micro-step runs the model's backward with its
  grad-ready hook, which hands each group of final gradients (lnf; then each layer, from the last one
  down; then the embeddings) to a background all-reduce (a worker thread over Gloo, a comm stream over
  NCCL; one collective per group), and ``take_loss`` or ``step`` waits for it (``finish``). Without
  overlap: one allreduce of the flat gradient buffer in ``step``;
* ZeRO-1 (``zero=1``): reduce-scatter (mean) of the gradients, the global grad norm from one allreduce
  of per-shard sums of squares, AdamW on this rank's shard only (its moments are the only optimizer state
  this rank holds: 2·N/world floats instead of 2·N), then an all-gather of the updated parameters.
  ZeRO-1 keeps its single reduce-scatter after backward (no overlap).
* ZeRO-2 (``zero=2``): as ZeRO-1, and the gradients are sharded too. The model keeps only this rank's shard of them
  (GPT2.shard_grads) plus three bucket buffers, and every micro-step (forward_backward, or backward) runs with the
  bucket hook of a ``_C.dist.GradReduceScatterer``: each bucket (the head's, each layer's from the last one down,
  the embeddings') is averaged over the ranks by one reduce-scatter into its owners' shards as soon as it is final,
  and folded into the shard (csrc/model/grad_shard.h). So every micro-step communicates (as DeepSpeed's ZeRO-2), and
  with gradient accumulation the shard sums the micro-steps' averages, where ZeRO-0/1 average the micro-steps' sum:
  bit-identical to ZeRO-1 with one micro-step per optimizer step, equal to fp32 rounding with several. AdamW only
  (Muon orthogonalises whole matrices from every rank's gradients: use zero=0 or 1).
* Optimizer offload (``model.offload = True`` before wrapping; any zero): the rank's update runs on its host
  (plain DDP: the whole model's, as in one process; ZeRO: its shard's, ``adamw_range``, with the shard's moments in
  pinned memory). A 16-bit model's fp32 master weights are then in pinned host memory, where NCCL cannot reach, so
  the first broadcast and ZeRO's all-gather of them go through one device buffer (``stage_values``, 64 MiB), a
  broadcast per chunk from each range's owner: the same bits as without offload.

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

from .. import _C
from ..config import TrainConfig
from ..planning.memplan import STAGE_VALUES
from ..model import check_group_lrs, check_muon_args, check_step_args

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


def setup(device: str = "cpu", timeout: float = DEFAULT_TIMEOUT):
    """(DistEnv, process group or None, device) of this process: its place in the job (from_env), the process
    group it joined (None when it runs alone), and its device: under a multi-process launcher "cuda" is
    "cuda:LOCAL_RANK", one GPU per process."""
    env = from_env()
    if env.world_size == 1:
        return env, None, device
    if device == "cuda":
        device = f"cuda:{env.local_rank}"
    return env, init_process_group(env, timeout=timeout, device=device), device


class DataParallel:
    """A GPT2 trained on every rank of a Comm: the same methods as GPT2, with the gradients averaged over ranks
    (and optionally ZeRO-1). Every rank must call the same methods in the same order. Attributes it does not
    define (forward, generate, params, config, save, ...) are the model's."""

    def __init__(self, model, comm, zero: int = 0, broadcast: bool = True, resume_from=None,
                 overlap: bool | None = None, grad_accum: int = 1):
        """resume_from: the checkpoint.Checkpoint the model was restored from (weights and step count), from
        which ZeRO-1 reads this rank's range of the AdamW moments (its own shard file, or a slice of a full
        checkpoint's). Without it, a model with step_count > 0 is taken to hold the full restored moments.
        overlap: average the gradients during the last micro-step's backward (plain data parallel only;
        default: on for plain data parallel with a float32/bf16 model, off for ZeRO-1).
        grad_accum: micro-steps (forward_backward or backward calls) per optimizer step; the last one overlaps."""
        if zero not in (0, 1, 2):
            raise ValueError(f"zero must be 0 (plain data parallel), 1 (ZeRO-1) or 2 (ZeRO-2), got {zero!r}")
        if overlap and zero:
            raise ValueError("overlap=True needs zero=0: ZeRO-1 keeps its single reduce-scatter after backward, "
                             "ZeRO-2 reduce-scatters bucket by bucket in every backward")
        if grad_accum < 1:
            raise ValueError(f"grad_accum must be >= 1, got {grad_accum!r}")
        if overlap is None:
            overlap = not zero and model.params["wte"].dtype != np.float64
        self.model, self.comm, self.zero, self.grad_accum = model, comm, zero, grad_accum
        model._data_parallel = True  # GPT2.prefetch_grads refuses: the ranks change the gradients after backward
        self.world = comm.size
        if hasattr(comm, "use_stream_of") and hasattr(model, "_m"):  # NCCL: collectives wait for the model's stream
            comm.use_stream_of(model._m)
        self.n = model.num_parameters
        self._stage = None        # _through_stage's device buffer
        if broadcast:  # the replicas start identical even if their seeds or checkpoints differ
            self._broadcast_params()
            if not zero:
                self._stage = None  # only ZeRO gathers again
        self.lo, self.hi = comm.shard(self.n) if zero else (0, self.n)
        self.last_comm_ms = 0.0  # wall time of the last step's gradient/parameter collectives
        self.reducer = model.grad_allreducer(comm) if overlap else None  # the overlapped gradient allreduce
        self._micro = 0           # micro-steps since the last step()
        self._in_flight = False   # an overlapped backward ran and finish() has not been called
        self._averaged = False    # this step's gradients are averaged (by the overlapped backward)
        self._host_loss = 0.0     # the overlapped micro-step's grad_scale * loss (it is read back on the host)
        self._comm_ms = 0.0
        self._norm = None         # this step's global grad norm, once grad_norm() computed it
        self.m = self.v = None
        self.scatterer = None
        if zero == 2:  # this rank's shard of the gradients only, reduce-scattered into bucket by bucket
            model.shard_grads(self.lo, self.hi)
            self.scatterer = _C.dist.GradReduceScatterer(comm, model._m)
        if zero:  # this rank's moments, in the backend's memory (device memory on GPUs)
            S = self.hi - self.lo
            self.m, self.v = model.alloc_optimizer_state(S), model.alloc_optimizer_state(S)
            if resume_from is not None:
                resume_from.load_optimizer_shard(comm.rank, self.world, self.lo, self.hi, self.m, self.v)
            elif model.step_count > 0:  # restored in full by the caller: take this rank's shard of the moments
                am, av = model.opt_state()
                self.m[:] = _flat(am, model)[self.lo:self.hi]
                self.v[:] = _flat(av, model)[self.lo:self.hi]

    def __getattr__(self, name):  # only called for names DataParallel does not define
        if name == "model":
            raise AttributeError(name)
        return getattr(self.model, name)

    # ------------------------------------------------------------------ reductions of scalars
    def mean(self, *values: float) -> list[float]:
        """The mean over ranks of each value (one allreduce)."""
        buf = np.array(values, dtype=np.float32)
        self.comm.allreduce(buf, "avg")
        return [float(v) for v in buf]

    # ------------------------------------------------------------------ micro-steps
    @property
    def overlap(self) -> bool:
        return self.reducer is not None

    def _overlaps(self) -> bool:
        """Count a micro-step; True if it is the one whose backward averages the gradients (the grad_accum-th)."""
        if self._in_flight or self._averaged:
            raise RuntimeError(f"more than grad_accum={self.grad_accum} micro-steps before step(): the gradients "
                               "were already averaged over ranks")
        self._micro += 1
        return self.reducer is not None and self._micro == self.grad_accum

    def _overlapped_backward(self, grad_scale: float) -> None:
        self._in_flight = True  # even if it fails part-way: finish() must then wait for what was started
        self.reducer.backward(float(grad_scale))
        self.model._has_grads = True  # the reducer ran the model's backward

    def forward_backward(self, idx, targets, grad_scale: float = 1.0) -> None:
        """GPT2.forward_backward; the last micro-step of the optimizer step averages the gradients over ranks
        during its backward (with overlap), its loss then read back on the host. ZeRO-2: every micro-step
        reduce-scatters its gradients bucket by bucket (its loss added to the device-side sum)."""
        if self.scatterer is not None:  # the fused micro-step, its buckets reduce-scattered as they are final
            self._micro += 1
            self._scattered(lambda: self.model.forward_backward(idx, targets, grad_scale))
            return
        if self._overlaps():
            self._host_loss += grad_scale * self.model.forward(idx, targets)
            self._overlapped_backward(grad_scale)
        else:
            self.model.forward_backward(idx, targets, grad_scale)

    def _scattered(self, micro_step) -> None:
        """ZeRO-2: micro_step (the model's forward_backward or backward) with the bucket hook installed. The optimizer
        step's last one, offloaded: each part of the shard goes to the host as soon as it is folded in."""
        if self._micro == self.grad_accum and self.model.offload:
            self.model._m.prefetch_grads()
        before = self.scatterer.stats()["seconds"]
        self.scatterer.run(micro_step)
        self._comm_ms += (self.scatterer.stats()["seconds"] - before) * 1e3  # its buckets' collectives only

    def backward(self, grad_scale: float = 1.0) -> None:
        """GPT2.backward (after forward); as in forward_backward, the last micro-step averages as it goes."""
        if self.scatterer is not None:
            self._micro += 1
            self._scattered(lambda: self.model.backward(grad_scale))
            return
        if self._overlaps():
            self._overlapped_backward(grad_scale)
        else:
            self.model.backward(grad_scale)

    def _finish(self) -> None:
        """Wait for the overlapped gradient averaging, if one is in flight."""
        if self._in_flight:
            self._in_flight = False
            t0 = time.perf_counter()
            self.reducer.finish()
            self._comm_ms += (time.perf_counter() - t0) * 1e3
            self._averaged = True

    def take_loss(self) -> float:
        """GPT2.take_loss averaged over ranks (one allreduce, once the overlapped averaging has finished)."""
        self._finish()
        loss = self.model.take_loss() + self._host_loss
        self._host_loss = 0.0
        return self.mean(loss)[0]

    def zero_grad(self) -> None:
        self._finish()
        self._micro, self._averaged, self._norm = 0, False, None
        self.model.zero_grad()

    # ------------------------------------------------------------------ the optimizer step
    def step(self, lr: float, weight_decay: float = TrainConfig.weight_decay, beta1: float = TrainConfig.beta1,
             beta2: float = TrainConfig.beta2, eps: float = TrainConfig.eps,
             grad_clip: float = TrainConfig.grad_clip, optimizer: str = "adamw",
             muon_lr: float = TrainConfig.muon_lr, muon_momentum: float = TrainConfig.muon_momentum,
             muon_weight_decay: float = TrainConfig.muon_weight_decay,
             muon_ns_steps: int = TrainConfig.muon_ns_steps, *, embedding_lr: float | None = None,
             head_lr: float | None = None, muon_ns_dtype: str = TrainConfig.muon_ns_dtype) -> float:
        """Average the gradients over ranks and take one clipped AdamW step (see the module doc); returns
        the pre-clip global grad norm, the same on every rank. optimizer="muon" as GPT2.step: each rank
        orthogonalises its share of the matrices (muon_share) and the results are all-gathered, as modded-nanogpt
        distributes Muon; with ZeRO-1 each rank keeps the momentum of its shard only (its m slots)."""
        check_step_args(lr, weight_decay, beta1, beta2, eps, grad_clip)
        if optimizer not in ("adamw", "muon"):
            raise ValueError(f"optimizer must be 'adamw' or 'muon', got {optimizer!r}")
        check_group_lrs(optimizer, embedding_lr, head_lr)
        if optimizer == "muon":
            check_muon_args(muon_lr, muon_momentum, muon_weight_decay, muon_ns_steps)
            if self.zero == 2:
                raise ValueError("optimizer='muon' needs every rank's gradients of a whole matrix to orthogonalise "
                                 "it: use zero=0 or zero=1 with Muon (ZeRO-2 shards the gradients)")
            return self._muon_step(lr, weight_decay, beta1, beta2, eps, grad_clip, muon_lr, muon_momentum,
                                   muon_weight_decay, muon_ns_steps, dict(embedding_lr=embedding_lr, head_lr=head_lr),
                                   muon_ns_dtype)
        m = self.model
        norm = self.grad_norm() if self.zero else None  # ZeRO-1: reduce-scatter + one allreduce of sum(g**2)
        self._finish()
        averaged, comm_ms = self._averaged, self._comm_ms
        self._micro, self._averaged, self._comm_ms, self._norm = 0, False, 0.0, None
        t0 = time.perf_counter()
        if not self.zero:
            if not averaged:
                self.comm.allreduce(m.flat_grads(), "avg")
            self.last_comm_ms = comm_ms + (time.perf_counter() - t0) * 1e3
            return m.step(lr, weight_decay=weight_decay, beta1=beta1, beta2=beta2, eps=eps, grad_clip=grad_clip)
        if not math.isfinite(norm) and not m.loss_scaling:
            raise FloatingPointError(f"gradient norm is {norm} at step {m.step_count + 1}; weights not updated")
        # clipped by the core's rule (csrc/model/optimizer.h) by the global norm, from the sum of squares over ranks;
        # with loss scaling an overflow (that sum not finite, the same value on every rank) skips the update and
        # backs the scale off on every rank alike (GradScaler's convention: step_count counts applied updates)
        m.adamw_range(self.lo, self.hi, self.m, self.v, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                      weight_decay=weight_decay, step=m.step_count + 1,
                      grad_clip=grad_clip if grad_clip and grad_clip > 0 else 0.0, sum_squares=self._sumsq)
        if not math.isfinite(norm):
            self.last_comm_ms = comm_ms
            return norm  # nothing written on any rank: nothing to all-gather
        m.step_count += 1
        t1 = time.perf_counter()
        self._gather_params()
        self.last_comm_ms = comm_ms + (time.perf_counter() - t1) * 1e3
        return norm

    # Values of the staging buffer through which an offloaded 16-bit model's master weights are gathered (64 MiB)
    stage_values = STAGE_VALUES

    def _gather_params(self) -> None:
        """ZeRO: every rank's updated range of the master weights (flat_params()) to every rank, in place by one
        all_gather (reading flat_params() marks the ops' 16-bit copy stale: it is rebuilt from the whole master with
        this step's rounding seed before the next forward), or through the staging buffer (_staged) when a 16-bit
        model's optimizer is offloaded."""
        if not self._staged():
            self.comm.all_gather(self.model.flat_params())
            return
        self._through_stage([(r, *self.comm.shard(self.n, r)) for r in range(self.world)])

    def _broadcast_params(self) -> None:
        """Rank 0's weights to every rank (the replicas start identical)."""
        if not self._staged():
            self.comm.broadcast(self.model.flat_params(), root=0)
            return
        self._through_stage([(0, 0, self.n)])

    def _staged(self) -> bool:
        """An offloaded 16-bit model keeps its master weights in pinned host memory, where NCCL cannot reach: its
        collectives on them go through a device buffer."""
        m = self.model
        return bool(getattr(m, "offload", False)) and m.precision in ("bf16", "fp16")

    def _through_stage(self, pieces) -> None:
        """For each (root, lo, hi): the master weights [lo, hi) from rank root to every rank, in chunks through one
        device buffer of at most stage_values, a broadcast each. A receiving rank writes each chunk into its host
        master and casts it into its 16-bit weights on the device with the rounding a full rebuild would use (the
        core's offload_chunk_in): the same bits as the all-gather without offload, and no second pass over PCIe to
        rebuild them from the host. The root's own range is already both (its update wrote them)."""
        core = self.model._m
        largest = max(hi - lo for lo, hi in (self.comm.shard(self.n, r) for r in range(self.world)))
        size = max(1, min(self.stage_values, largest))  # the plan's: at most the largest ZeRO shard
        if self._stage is None or self._stage.size < size:
            self._stage = None  # the old buffer first: at most one in backend memory
            self._stage = _C.dist.alloc_state(core, size, pinned=False)
        stage, me = self._stage, self.comm.rank
        for root, lo, hi in pieces:
            for a in range(lo, hi, stage.size):
                chunk = stage[:min(hi, a + stage.size) - a]
                if root == me:
                    core.offload_chunk_out(a, chunk)
                self.comm.broadcast(chunk, root=root)
                if root != me:
                    core.offload_chunk_in(a, chunk)

    # ------------------------------------------------------------------ Muon over ranks
    def muon_share(self, rank: int | None = None) -> tuple[int, int]:
        """[lo, hi) of the Muon matrices (GPT2.muon_matrix_list) rank orthogonalises: contiguous runs balanced by
        their number of values (matrix k goes to the rank whose 1/world of the total its first value falls in)."""
        rank = self.comm.rank if rank is None else rank
        return _muon_shares(self.model.muon_matrix_list(), self.world)[rank]

    def _gather_muon(self) -> None:
        """Every rank's orthogonalised and applied matrices to every rank: each packs its share into one chunk of
        an all_gather buffer (chunks padded to the largest share), then copies the others' into its weights."""
        mats = self.model.muon_matrix_list()
        shares = _muon_shares(mats, self.world)
        sizes = [sum(r * c for _, r, c, _, _ in mats[lo:hi]) for lo, hi in shares]
        S = max(sizes)
        if S == 0:
            return
        buf = np.zeros(self.world * S, dtype=np.float32)
        flat = self.model.flat_params()  # marks the ops' copy stale: rebuilt with this step's seed
        lo, hi = shares[self.comm.rank]
        at = self.comm.rank * S
        for off, r, c, _, _ in mats[lo:hi]:
            buf[at:at + r * c] = flat[off:off + r * c]
            at += r * c
        self.comm.all_gather(buf)
        for rank, (lo, hi) in enumerate(shares):
            if rank == self.comm.rank:
                continue
            at = rank * S
            for off, r, c, _, _ in mats[lo:hi]:
                flat[off:off + r * c] = buf[at:at + r * c]
                at += r * c

    def _muon_step(self, lr, weight_decay, beta1, beta2, eps, grad_clip, muon_lr, muon_momentum, muon_weight_decay,
                   muon_ns_steps, group_lrs: dict, muon_ns_dtype: str = TrainConfig.muon_ns_dtype) -> float:
        m = self.model
        norm = self.grad_norm() if self.zero else None
        self._finish()
        averaged, comm_ms = self._averaged, self._comm_ms
        self._micro, self._averaged, self._comm_ms, self._norm = 0, False, 0.0, None
        t0 = time.perf_counter()
        share = self.muon_share()
        if not self.zero:
            if not averaged:
                self.comm.allreduce(m.flat_grads(), "avg")
            comm_ms += (time.perf_counter() - t0) * 1e3
            norm = m.step(lr, weight_decay=weight_decay, beta1=beta1, beta2=beta2, eps=eps, grad_clip=grad_clip,
                          optimizer="muon", muon_lr=muon_lr, muon_momentum=muon_momentum,
                          muon_weight_decay=muon_weight_decay, muon_ns_steps=muon_ns_steps, muon_matrices=share,
                          muon_ns_dtype=muon_ns_dtype, **group_lrs)
            if math.isfinite(norm):
                t1 = time.perf_counter()
                self._gather_muon()
                comm_ms += (time.perf_counter() - t1) * 1e3
            self.last_comm_ms = comm_ms
            return norm
        if not math.isfinite(norm) and not m.loss_scaling:
            raise FloatingPointError(f"gradient norm is {norm} at step {m.step_count + 1}; weights not updated")
        clip = grad_clip if grad_clip and grad_clip > 0 else 0.0
        step = m.step_count + 1
        # AdamW and the momentum on this rank's shard; every rank's update (over its gradients) to every rank;
        # this rank's matrices orthogonalised and applied; those to every rank; then the flat shards
        m._m.muon_update_range(self.lo, self.hi, self.m, self.v, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                               weight_decay=weight_decay, step=step, grad_clip=clip, sum_squares=self._sumsq,
                               muon_lr=muon_lr, muon_momentum=muon_momentum, muon_weight_decay=muon_weight_decay,
                               ns_steps=muon_ns_steps, nesterov=True, **group_lrs)
        t1 = time.perf_counter()
        if math.isfinite(norm):
            self.comm.all_gather(m.flat_grads())
        comm_ms += (time.perf_counter() - t1) * 1e3
        m._m.muon_update_matrices(step=step, sum_squares=self._sumsq, muon_weight_decay=muon_weight_decay,
                                  ns_steps=muon_ns_steps, mat_lo=share[0], mat_hi=share[1], ns_dtype=muon_ns_dtype)
        if not math.isfinite(norm):
            self.last_comm_ms = comm_ms
            return norm
        m.step_count += 1
        t1 = time.perf_counter()
        self._gather_muon()
        self.comm.all_gather(m.flat_params())
        self.last_comm_ms = comm_ms + (time.perf_counter() - t1) * 1e3
        return norm

    def grad_norm(self) -> float:
        """The global norm of the gradients averaged over ranks, before step() (which then reuses the
        averaging): plain data parallel averages them in full, ZeRO-1 reduce-scatters them and sums the
        squares of each rank's range (ZeRO-2: of the shard its backward reduced into)."""
        self._finish()
        if self._norm is None:
            t0 = time.perf_counter()
            if not self.zero:
                if not self._averaged:
                    self.comm.allreduce(self.model.flat_grads(), "avg")
                    self._averaged = True
                self._comm_ms += (time.perf_counter() - t0) * 1e3
                self._norm = self.model.grad_norm()
            else:
                if self.zero == 1:  # ZeRO-2's shard was reduce-scattered bucket by bucket during backward
                    self.comm.reduce_scatter(self.model.flat_grads(), "avg")
                ss = np.array([self.model.grad_sum_squares(self.lo, self.hi)], dtype=np.float32)
                self.comm.allreduce(ss, "sum")
                self._comm_ms += (time.perf_counter() - t0) * 1e3
                self._sumsq = float(ss[0])  # step() hands it to the core's clip rule (scaled, as the gradients)
                self._norm = math.sqrt(self._sumsq / self.model.loss_scale ** 2)
        return self._norm

    # ------------------------------------------------------------------ reporting
    def optimizer_memory(self) -> dict:
        """Bytes of AdamW state (m and v, fp32) per rank, with and without ZeRO-1/2; and of the gradients (ZeRO-2:
        the shard plus the bucket buffers)."""
        full = 2 * 4 * self.n
        ours = 2 * 4 * (self.hi - self.lo) if self.zero else full
        grads = 4 * (self.hi - self.lo + self.model._m.grad_bucket_values) if self.zero == 2 else 4 * self.n
        return {"optimizer_bytes_per_rank": ours, "optimizer_bytes_unsharded": full, "saved_bytes": full - ours,
                "gradient_bytes_per_rank": grads, "gradient_bytes_unsharded": 4 * self.n}

    def describe(self) -> str:
        if not self.zero:
            how = ("overlapped with the last micro-step's backward, one collective per layer" if self.overlap
                   else "in one allreduce after backward")
            return (f"data parallel over {self.world} ranks ({self.comm.backend}): gradients averaged once per "
                    f"optimizer step, {how}")
        r = self.optimizer_memory()
        mb = 1 / 2**20
        text = (f"ZeRO-{self.zero} over {self.world} ranks ({self.comm.backend}): this rank updates parameters "
                f"[{self.lo:,}, {self.hi:,}); AdamW state {r['optimizer_bytes_per_rank'] * mb:.1f} MiB per rank "
                f"instead of {r['optimizer_bytes_unsharded'] * mb:.1f} MiB (saves {r['saved_bytes'] * mb:.1f} MiB)")
        if self.zero == 2:
            text += (f"; gradients {r['gradient_bytes_per_rank'] * mb:.1f} MiB per rank (shard + buckets) instead "
                     f"of {r['gradient_bytes_unsharded'] * mb:.1f} MiB, reduce-scattered bucket by bucket in every "
                     "backward")
        return text


def _muon_shares(mats, world: int) -> list[tuple[int, int]]:
    """Contiguous [lo, hi) runs of the Muon matrices, one per rank, balanced by values: matrix k belongs to the
    rank r with r * total <= world * (values before k) < (r + 1) * total (ranks may get none when there are
    fewer matrices than ranks)."""
    total = sum(r * c for _, r, c, _, _ in mats)
    owner, before = [], 0
    for _, r, c, _, _ in mats:
        owner.append(min(world - 1, world * before // max(total, 1)))
        before += r * c
    return [(next((k for k, o in enumerate(owner) if o >= rank), len(mats)),
             next((k for k, o in enumerate(owner) if o > rank), len(mats))) for rank in range(world)]


def _flat(views: dict, model) -> np.ndarray:
    """The flat buffer behind a dict of per-tensor views (slices of one allocation, the first at offset 0)."""
    first = views[_C.param_names()[0]].reshape(-1)
    return np.lib.stride_tricks.as_strided(first, shape=(model.num_parameters,), strides=(first.itemsize,))
