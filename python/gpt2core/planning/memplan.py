"""The memory plan: the bytes one GPU (or the CPU) holds to train a config, by part, for a micro-batch (B, T), a
precision, a number of ranks and the memory options, computed without allocating anything and without a GPU.

`memory(...)` is the one function that computes it; `plan(...)` (gpt2core.plan, `gpt2core-train --plan`) finds
with it the largest micro-batch that fits a memory budget and which option combinations fit, and `--batch-size
auto` (gpt2core.batchfit) chooses B with it. The parts (bytes per GPU; `host` is pinned host memory per rank):

  weights         the parameters the ops read: n x the storage type (4 fp32, 2 bf16 / fp16, 8 float64)
  master_weights  the fp32 master copy of a 16-bit model (n x 4), whole under ZeRO-1 and -2 (the all-gather after
                  the update moves them); offload: none (host), except with ZeRO the device buffer the ranks' new
                  master weights are gathered through (DataParallel.stage_values, at most a shard)
  gradients       fp32 gradients (n x 4); ZeRO-2: this rank's shard plus the three bucket buffers backward fills
                  (one layer's, the head's, the embeddings': GPT2Model::set_grad_shard)
  optimizer       AdamW's two fp32 moments (2 n x 4); ZeRO-1/2: this rank's shard; offload: none (host)
  activations     what forward keeps for backward and backward's scratch, from the model's own layout
                  (_C.activation_counts: the same function that lays the buffers out), logits aside
  logits          (B T, padded vocab) in the storage type: the largest single activation at small C
  workspace       the backend's scratch: the token ids and targets, the attention backward's scratch and the
                  column sums' partials (one buffer, the largest request), the matmul library's workspace
  host            offload: the fp32 master weights (whole, also under ZeRO), the AdamW moments, the gradients' host
                  copy and the new weights' staging (the storage type), the last three of the rank's shard under
                  ZeRO, per rank (GPT2Model::set_offload, CudaBackend::adamw_host)

Every option is implemented for training: recompute none / gelu / layer, ZeRO 0 / 1 / 2, and optimizer offload,
in one process or on every rank (with ZeRO each rank offloads its shard). The table's "planned" mark stays for
options a later plan may model before they train.

The numbers are checked against allocations: tests/python/test_memplan.py (CPU backend) and
tests/csrc/cuda/test_cuda_emu_memplan.py (the emulated CUDA device's allocation accounting) within 2%."""
from __future__ import annotations

import itertools
import math
import re
from dataclasses import asdict, dataclass, replace

from ..config import GPT2Config, get_preset
from ..errors import ArgError

PARTS = ("weights", "master_weights", "gradients", "optimizer", "activations", "logits", "workspace", "fp8")
RECOMPUTE = ("none", "gelu", "layer")
OFFLOAD = ("none", "optimizer")
SAFETY = 0.05                 # the share of a budget kept back (fragmentation, a later step's growth): as batchfit
CUBLASLT_WORKSPACE = 32 << 20  # csrc/cuda/seams_cublaslt.cu kWorkspaceBytes (the emulator's seams allocate none)
CUDA_CONTEXT = 512 << 20       # a card's memory the CUDA context and libraries take before the model (--gpu-memory
#                                names the card's size; a measured free figure already lacks it)
IMPLEMENTED = {"zero": (0, 1, 2), "offload": ("none", "optimizer")}
OPTIMIZERS = ("adamw", "muon")  # Muon's momentum sits in AdamW's first-moment slots: the same bytes as AdamW


def check_training_options(cuda: bool, zero: int, offload: str, optimizer: str) -> None:
    """What gpt2core-train refuses whatever the memory, with the message training gives (the plan and the
    trainer both call this, so --plan refuses what the run would): --offload optimizer off the GPU or with Muon,
    ZeRO-2 with Muon."""
    if offload != "none":
        if not cuda:
            raise ArgError("--offload optimizer needs --device cuda (on the CPU the optimizer is in host memory)")
        if optimizer == "muon":
            raise ArgError("--offload optimizer runs AdamW on the host: use --optimizer adamw with it")
    if zero == 2 and optimizer == "muon":
        raise ArgError("--zero 2 shards the gradients, and --optimizer muon orthogonalises whole matrices from "
                       "every rank's gradients: use --zero 1 with Muon (it shards the optimizer state), or "
                       "--optimizer adamw")


def _trainable(cuda: bool, zero: int, offload: str, optimizer: str) -> bool:
    try:
        check_training_options(cuda, zero, offload, optimizer)
    except ArgError:
        return False
    return True
STAGE_VALUES = 1 << 24  # distributed.DataParallel.stage_values
_STORAGE = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 2, "float64": 8}  # fp8: bf16 storage
# csrc/cuda/reduce.cuh (column sums' partials) and csrc/cuda/attention_tc.cuh (the 16-bit flash backward's dS)
_COL_TILE, _COL_BLOCKS, _COL_MIN_ROWS, _TC_ROWS = 32, 1024, 32, 64


@dataclass(frozen=True)
class Options:
    """What a run's memory depends on besides the config and (B, T)."""
    device: str = "cuda"          # "cuda" or "cpu"
    precision: str = "bf16"       # fp32, tf32, bf16, fp16, fp8 (CUDA); fp32 or float64 (CPU)
    world_size: int = 1
    zero: int = 0                 # 0, 1 or 2
    recompute: str = "none"       # none, gelu, layer
    offload: str = "none"         # none, optimizer
    attention: str = "flash"      # CUDA: flash, cudnn or naive ("auto" plans as flash)
    library_workspace: int = CUBLASLT_WORKSPACE  # the matmul library's workspace (CUDA); 0 under the emulator
    optimizer: str = "adamw"      # adamw, muon (the same bytes; Muon refuses ZeRO-2 and offload)
    fp8_head: bool = False        # precision fp8: the head multiplied in FP8 too (its copy and scratch)

    def __post_init__(self):
        if self.device not in ("cuda", "cpu"):
            raise ArgError(f"device must be 'cuda' or 'cpu', got {self.device!r}")
        allowed = ("fp32", "float64") if self.device == "cpu" else ("fp32", "tf32", "bf16", "fp16", "fp8")
        if self.precision not in allowed:
            raise ArgError(f"--precision {self.precision} is not one of {', '.join(allowed)} on {self.device}")
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ArgError(f"--world-size must be an integer >= 1, got {self.world_size!r}")
        if self.zero not in (0, 1, 2):
            raise ArgError(f"--zero must be 0, 1 or 2, got {self.zero!r}")
        if self.zero and self.world_size == 1:
            raise ArgError(f"--zero {self.zero} shards over the ranks of a data-parallel run: it needs --world-size "
                           ">= 2")
        if self.recompute not in RECOMPUTE:
            raise ArgError(f"--recompute must be one of {', '.join(RECOMPUTE)}, got {self.recompute!r}")
        if self.offload not in OFFLOAD:
            raise ArgError(f"--offload must be one of {', '.join(OFFLOAD)}, got {self.offload!r}")
        if self.fp8_head and self.precision != "fp8":
            raise ArgError(f"--fp8-head needs --precision fp8, got --precision {self.precision}")
        if self.optimizer not in OPTIMIZERS:
            raise ArgError(f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        check_training_options(self.device == "cuda", self.zero, self.offload, self.optimizer)
        if self.attention not in ("auto", "flash", "cudnn", "naive"):
            raise ArgError(f"--attention must be auto, flash, cudnn or naive, got {self.attention!r}")

    @property
    def implemented(self) -> bool:
        """Whether gpt2core-train can train with these options today (the rest are planned)."""
        return self.zero in IMPLEMENTED["zero"] and self.offload in IMPLEMENTED["offload"]

    def flags(self) -> str:
        """The options as gpt2core-train flags (the non-default ones)."""
        out = []
        if self.recompute != "none":
            out.append(f"--recompute {self.recompute}")
        if self.zero:
            out.append(f"--zero {self.zero}")
        if self.offload != "none":
            out.append(f"--offload {self.offload}")
        if self.fp8_head:
            out.append("--fp8-head")
        return " ".join(out) or "(no options)"


def sequences_per_step(total_tokens: int, T: int, world: int) -> int:
    """Sequences of length T per optimizer step and process; total_tokens must be a multiple of T * world."""
    per = T * world
    if total_tokens % per:
        raise ValueError(f"--total-batch-tokens {total_tokens} is not a multiple of T*world_size = {T}*{world} = "
                         f"{per}")
    return total_tokens // per


def divisors_descending(n: int) -> list[int]:
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]), reverse=True)


def _config(config) -> GPT2Config:
    return get_preset(config) if isinstance(config, str) else config


def _column_chunks(N: int, C: int) -> int:  # csrc/cuda/reduce.cuh column_chunks
    return min(-(-N // _COL_MIN_ROWS), -(-_COL_BLOCKS // -(-C // (_COL_TILE * 8))))


def attention_state(c: GPT2Config, B: int, T: int, o: Options) -> int:
    """Values of the attention state per layer: the probabilities (B, NH, T, T) on the CPU and the naive CUDA rung,
    the logsumexp per query row (B, NH, T) for flash and cuDNN (Backend::attention_state_size)."""
    full = o.device == "cpu" or o.attention == "naive"
    return B * c.n_head * T * (T if full else 1)


def _workspace(c: GPT2Config, B: int, T: int, o: Options) -> int:
    N, C, NH = B * T, c.n_embd, c.n_head
    fixed = 2 * N * 4 + 8  # token ids and targets (int32), the valid-target count and the loss accumulator
    if o.device == "cpu":
        return fixed
    # one float scratch, grown to the largest request: column sums (layernorm dw/db, bias gradients), attention
    floats = [2 * _column_chunks(N, C) * C] if c.norm == "layernorm" else []
    if c.bias:
        floats += [_column_chunks(N, oc) * oc for oc in (3 * C, C, 4 * C)]
    sixteen = o.precision in ("bf16", "fp16", "fp8")
    if o.attention == "naive":
        floats.append(B * NH * T * T)
    elif o.attention != "cudnn" and sixteen and c.head_size in (64, 128):  # the tensor-core flash backward
        tiles = -(-T // _TC_ROWS)
        floats.append((B * NH * T + 3) // 4 * 4 + B * NH * tiles * (tiles + 1) // 2 * _TC_ROWS * _TC_ROWS // 2)
    elif o.attention != "cudnn":
        floats.append(B * NH * T)
    fixed += 256 * 8 + 64  # the global norm's partials (kNormBlocks doubles) and the step state
    if c.position == "rope":  # the rotary table: cos, sin per position and frequency, for at least 1024 positions,
        rows = 1024           # doubled until T fits (backend_cuda.cu rope_table)
        while rows < T:
            rows *= 2
        fixed += rows * c.head_size * 4
    return fixed + 4 * max(floats, default=0) + o.library_workspace


def memory(config: GPT2Config | str, B: int, T: int, options: Options = Options()) -> dict:
    """Bytes per GPU by part (PARTS) and 'host' (pinned host memory per rank), for training `config` at micro-batch
    (B, T) with `options`. Pure: allocates nothing, needs no GPU."""
    from .. import _C

    c, o = _config(config), options
    if B < 1 or T < 1:
        raise ArgError(f"-B and -T must be >= 1, got B={B} T={T}")
    if T > c.block_size:
        raise ArgError(f"-T {T} exceeds the block size {c.block_size}")
    n, W = c.num_parameters(), o.world_size
    st = 8 if o.precision == "float64" else _STORAGE[o.precision]
    sm = 8 if o.precision == "float64" else 4  # gradients, moments, statistics: fp32 (float64 in a float64 model)
    shard = -(-n // W)
    master = n * 4 if st == 2 else 0
    moments = 2 * n * sm
    grads = n * sm
    host = 0
    if o.zero >= 1:
        moments = 2 * shard * sm
    if o.zero >= 2:  # the fp32 master weights stay whole, as under ZeRO-1 (the all-gather moves them)
        grads = (shard + grad_bucket_values(c)) * sm
    if o.offload == "optimizer":
        own = shard if o.zero else n
        # master weights (whole), two moments, the gradients' host copy, and the new weights' staging on their way back
        host = n * 4 + own * 4 * 2 + own * 4 + own * st
        moments = 0
        # with ZeRO, a 16-bit model's ranks gather the new master weights through one device buffer
        master = 4 * min(STAGE_VALUES, shard) if (o.zero and st == 2) else 0
    a = _C.activation_counts(c.block_size, c.vocab_size, c.padded_vocab_size, c.n_layer, c.n_head, c.n_embd, B, T,
                             attention_state(c, B, T, o), o.recompute, position=c.position, norm=c.norm,
                             qk_norm=c.qk_norm, activation=c.activation, bias=c.bias,
                             tie_embeddings=c.tie_embeddings)
    return {"weights": n * st, "master_weights": master, "gradients": grads, "optimizer": moments,
            "activations": a["t"] * st + a["m"] * sm, "logits": a["logits"] * st,
            "workspace": _workspace(c, B, T, o),
            "fp8": fp8_bytes(c, B * T, o.fp8_head) if o.precision == "fp8" else 0, "host": host}


def fp8_bytes(c: GPT2Config, N: int, head: bool) -> int:
    """precision fp8's bytes beyond bf16's (GPT2Model::fp8_bytes): each FP8 weight's e4m3 copy and its transpose
    (the block's qkv, projection, MLP up and down: 12 C^2 a layer; the head's Vp x C with fp8_head), two floats of
    scale state per weight and two more, and one Linear's scratch at a time: its input quantised (with its
    transpose) and its output gradient (with its transpose), N = B * T rows of at most 4C (or Vp with the head)."""
    C, L, Vp = c.n_embd, c.n_layer, c.padded_vocab_size
    weights = 12 * C * C * L + (Vp * C if head else 0)
    metas = (4 * L + (1 if head else 0) + 2) * 2 * 4
    return 2 * weights + metas + 2 * N * 4 * C + 2 * N * max(4 * C, Vp if head else 0)


def grad_bucket_values(c: GPT2Config) -> int:
    """ZeRO-2's bucket buffers (GPT2Model::set_grad_shard): one layer's slice of every per-layer tensor, the head's
    (lnfw, lnfb, an untied lm_head) and the embeddings' (wte, wpe)."""
    shapes = c.param_shapes()
    size = {k: math.prod(v) for k, v in shapes.items()}
    head = sum(size.get(k, 0) for k in ("lnfw", "lnfb", "lm_head"))
    emb = sum(size.get(k, 0) for k in ("wte", "wpe"))
    layer = (sum(size.values()) - head - emb) // max(1, c.n_layer)
    return layer + head + emb


def total(parts: dict) -> int:
    """Bytes per GPU: the sum of PARTS (host memory aside)."""
    return sum(parts[k] for k in PARTS)


def budget_of(gpu_memory: int, measured: bool, device: str = "cuda") -> int:
    """The bytes a plan may fill: SAFETY kept back, and the CUDA context when gpu_memory is a card's size rather
    than the free memory measured with a context in place."""
    reserve = 0 if measured or device != "cuda" else CUDA_CONTEXT
    return int((gpu_memory - reserve) * (1.0 - SAFETY))


def largest_batch(config, T: int, options: Options, budget: int, candidates=None) -> int | None:
    """The largest B (of `candidates`, descending, when given; else any B >= 1) whose memory fits `budget`."""
    need = lambda B: total(memory(config, B, T, options))  # noqa: E731
    if candidates is not None:
        return next((B for B in candidates if need(B) <= budget), None)
    if need(1) > budget:
        return None
    lo, hi = 1, 2
    while need(hi) <= budget and hi < 1 << 20:
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # need(lo) fits, need(hi) does not (or hi is the cap)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if need(mid) <= budget else (lo, mid)
    return lo


def combinations(options: Options):
    """Every option combination for options' device, precision and ranks, cheapest step first (Options)."""
    zeros = (0, 1, 2) if options.world_size > 1 else (0,)
    offloads = OFFLOAD if options.device == "cuda" else ("none",)
    combos = [replace(options, recompute=r, zero=z, offload=f)
              for f, r, z in itertools.product(offloads, RECOMPUTE, zeros)
              if _trainable(options.device == "cuda", z, f, options.optimizer)]
    return sorted(combos, key=lambda x: step_cost_rank(x))


def step_cost_rank(o: Options) -> tuple:
    """Orders combinations by what they cost in step time: offload (PCIe traffic) > layer recompute (one more
    forward) > gelu recompute (one elementwise pass); ZeRO stages add no traffic over data parallel's (a
    reduce-scatter and an all-gather move what an all-reduce moves) but ZeRO-2 overlaps less."""
    return (o.offload != "none", RECOMPUTE.index(o.recompute), o.zero)


# ------------------------------------------------------------------------------------------- step-time costs
PCIE_GBS = 25.0  # PCIe 4.0 x16, one direction, as measured by bandwidthTest on pinned memory (~25 of 32 GB/s)
# The host's memory bandwidth for offload's AdamW (a streaming pass, bound by memory, not by the cores): this
# project's CPU machine moved 34 GB/s copying and 45 GB/s scaling in place with numpy (2026-11-28, 400 MB arrays).
HOST_GBS = 30.0


def step_costs(config, B: int, T: int, options: Options) -> dict:
    """What an option costs in step time, modelled (not measured): layer recompute runs each block's forward again
    (its FLOPs as a share of the step's 6N + 6LCT per token, so ~1/3 of the block matmuls); offload moves the
    gradients to the host and the new 16-bit weights back over PCIe each optimizer step (bytes and ms at
    PCIE_GBS, to be set against the step's compute time), and its AdamW on the host streams every parameter's
    state through host memory (CudaBackend::adamw_host: the gradient copy written, then gradient, master and two
    moments read, those three written and the new weight written to staging, which the upload reads: 32 + 2 x the
    storage type's bytes a parameter; ms at HOST_GBS)."""
    c = _config(config)
    n = c.num_parameters()
    emb = c.padded_vocab_size * c.n_embd
    per_token = c.flops_per_token(T)
    block_fwd = 2 * (n - emb - (c.block_size * c.n_embd if c.position == "learned" else 0)) + 2 * c.n_layer * c.n_embd * T
    out = {"flops_per_token": per_token}
    if options.recompute == "layer":
        out["recompute_extra_flops_share"] = block_fwd / per_token
    if options.offload == "optimizer":
        own = -(-n // options.world_size) if options.zero else n
        st = 4 if options.precision in ("fp32", "tf32") else 2
        moved = own * 4 + own * st  # fp32 gradients down, the updated storage-type weights up
        if options.zero and st == 2:  # the other ranks' new master weights to the host (DataParallel._through_stage;
            moved += (n - own) * 4       # the 16-bit copy is cast on the device from the staging buffer)
        elif options.zero:  # fp32: the all-gathered weights re-read into the host copy the update starts from
            moved += n * 4
        out["offload_pcie_bytes"] = moved
        out["offload_pcie_ms"] = moved / (PCIE_GBS * 1e9) * 1e3
        out["offload_host_bytes"] = own * (32 + 2 * st)
        out["offload_host_ms"] = out["offload_host_bytes"] / (HOST_GBS * 1e9) * 1e3
    return out


# ------------------------------------------------------------------------------------------- the plan
@dataclass
class Plan:
    config: str
    B: int | None
    T: int
    options: Options
    gpu_memory: int
    budget: int
    per_gpu_bytes: dict
    host_bytes: int
    fits: bool
    max_batch_size: int | None
    table: list          # [(Options, max_batch_size or None)], cheapest first
    suggestion: str | None  # the smallest change that fits, when this does not
    costs: dict

    def to_json(self) -> dict:
        return {"fits": self.fits, "max_batch_size": self.max_batch_size, "per_gpu_bytes": self.per_gpu_bytes,
                "host_bytes": self.host_bytes, "total_per_gpu_bytes": total(self.per_gpu_bytes),
                "gpu_memory": self.gpu_memory, "budget": self.budget, "config": self.config, "B": self.B,
                "T": self.T, "options": asdict(self.options), "implemented": self.options.implemented,
                "suggestion": self.suggestion, "step_costs": self.costs,
                "table": [{**asdict(o), "flags": o.flags(), "max_batch_size": b, "implemented": o.implemented}
                          for o, b in self.table]}

    def report(self) -> str:
        """The plan as text (what `gpt2core-train --plan` prints)."""
        o = self.options
        lines = [f"memory plan: {self.config}, {o.precision}, B={self.B or self.max_batch_size} T={self.T}, "
                 f"{o.world_size} rank(s), {o.flags()}, on {o.device} with {gib(self.gpu_memory)} "
                 f"({gib(self.budget)} usable: {int(SAFETY * 100)}% kept back"
                 + (", the CUDA context taken off)" if self.budget < self.gpu_memory * (1 - SAFETY) - 1 else ")")]
        for k in PARTS:
            if k != "fp8" or self.per_gpu_bytes[k]:  # the fp8 line only for precision fp8
                lines.append(f"  {k:<15}{gib(self.per_gpu_bytes[k]):>12}")
        lines.append(f"  {'total per GPU' if o.device == 'cuda' else 'total':<15}{gib(total(self.per_gpu_bytes)):>12}")
        if self.host_bytes:
            lines.append(f"  {'host (pinned)':<15}{gib(self.host_bytes):>12} per rank")
        for k, v in self.costs.items():
            if k == "recompute_extra_flops_share":
                lines.append(f"  cost: --recompute layer runs each block's forward again: +{v:.0%} of the step's "
                             "FLOPs")
            elif k == "offload_pcie_ms":
                lines.append(f"  cost: --offload optimizer moves {self.costs['offload_pcie_bytes'] / 1e9:.2f} GB "
                             f"over PCIe per optimizer step: {v:.0f} ms at {PCIE_GBS:g} GB/s (PCIe 4.0 x16; in "
                             "one process and with --zero 2 the gradients' copies overlap the last backward)")
            elif k == "offload_host_ms":
                lines.append(f"  cost: its AdamW on the host streams {self.costs['offload_host_bytes'] / 1e9:.1f} GB "
                             f"through host memory per optimizer step: {v:.0f} ms at {HOST_GBS:g} GB/s (not "
                             "overlapped with the GPU yet)")
        lines.append("  option combinations (largest B that fits; cheapest step first):")
        for x, b in self.table:
            note = "" if x.implemented else "  (planned: not implemented yet)"
            lines.append(f"    {x.flags():<48} {('B <= ' + str(b)) if b else 'does not fit'}{note}")
        if self.fits:
            lines.append(f"fits: largest micro-batch B={self.max_batch_size}")
        else:
            lines.append(self.refusal())
        if not o.implemented:
            lines.append("note: " + o.flags() + " is planned (issue 37), not yet trainable by gpt2core-train")
        return "\n".join(lines)

    def refusal(self) -> str:
        what = f"-B {self.B}" if self.B else "-B 1"
        return (f"does not fit: {self.config} {what} -T {self.T} {self.options.flags()} needs "
                f"{gib(total(self.per_gpu_bytes))} per GPU of {gib(self.budget)} usable; "
                + (f"smallest change that fits: {self.suggestion}" if self.suggestion else
                   "no option combination fits: lower -T, use a smaller --preset or more GPUs"))


def plan(config: GPT2Config | str = "d12", B: int | None = None, T: int = 1024, gpu_memory: int | str | None = None,
         options: Options | None = None, measured: bool = False, total_batch_tokens: int | None = None,
         **option_kw) -> Plan:
    """The memory plan (see the module's docstring) of `config` at micro-batch B (None: the largest that fits) and
    T with the options (an Options, or its fields as keywords: precision='bf16', world_size=2, zero=2,
    recompute='layer', offload='optimizer', device='cuda', ...) within gpu_memory (bytes or '24GiB'; measured: it
    is the free memory read from the device, so no CUDA context is taken off). With total_batch_tokens, B is
    chosen among the divisors of the sequences per step and rank (as --batch-size auto)."""
    o = options or Options(**option_kw)
    if options is not None and option_kw:
        o = replace(options, **option_kw)
    c = _config(config)
    name = config if isinstance(config, str) else f"L={c.n_layer} C={c.n_embd}"
    if gpu_memory is None:
        raise ArgError("gpu_memory is needed: the bytes of one GPU (e.g. '24GiB'), or its free memory")
    mem = parse_bytes(gpu_memory) if isinstance(gpu_memory, str) else int(gpu_memory)
    budget = budget_of(mem, measured, o.device)
    cands = None
    if total_batch_tokens is not None:
        cands = divisors_descending(sequences_per_step(total_batch_tokens, T, o.world_size))
    best = largest_batch(c, T, o, budget, cands)
    shown = B or best or 1
    parts = memory(c, shown, T, o)
    host = parts.pop("host")
    fits = total(parts) <= budget if B else best is not None
    table = [(x, largest_batch(c, T, x, budget, cands)) for x in combinations(o)]
    suggestion = None
    if not fits:
        suggestion = _smallest_change(c, B, T, o, budget, table, cands)
    return Plan(name, B, T, o, mem, budget, parts, host, fits, best, table, suggestion, step_costs(c, shown, T, o))


def _smallest_change(c, B, T, o, budget, table, cands) -> str | None:
    """The cheapest change that fits: a smaller B with the same options, else the cheapest option combination
    (at B, or at the largest B it allows), else more ranks with ZeRO-2 (up to 8)."""
    best = largest_batch(c, T, o, budget, cands)
    if B and best:
        return f"-B {best}"
    # what training runs today first; a planned option (ZeRO-2, offload) only when nothing else fits, and said so
    table = sorted(table, key=lambda xb: not xb[0].implemented)

    def planned(x) -> str:
        return "" if x.implemented else " (planned: not implemented yet)"

    for x, b in table:
        if b and (not B or b >= B):
            return x.flags() + ("" if B else f" (B <= {b})") + planned(x)
    for x, b in table:
        if b:
            return f"{x.flags()} -B {b}" + planned(x)
    for w in (2, 4, 8):
        if w <= o.world_size:
            continue
        for x in sorted(combinations(replace(o, world_size=w)), key=lambda x: not x.implemented):
            b = largest_batch(c, T, x, budget, None)
            if b:
                return f"--world-size {w} {x.flags()} (B <= {b})" + planned(x)
    return None


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
          "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str, flag: str = "--gpu-memory") -> int:
    """'24GiB', '10 GB', '512MiB', '80e9' -> bytes (GB = 10^9, GiB = 2^30)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*", str(text).lower())
    if str(text).strip().startswith("-"):
        raise ArgError(f"{flag} must be a positive size such as 24GiB, 10GB or 512MiB, got {text!r}")
    if not m or m.group(2) not in _UNITS:
        raise ArgError(f"{flag} must be a size such as 24GiB, 10GB or 512MiB, got {text!r}")
    n = float(m.group(1)) * _UNITS[m.group(2)]
    if not math.isfinite(n) or n < 1:
        raise ArgError(f"{flag} must be a positive size, got {text!r}")
    return int(n)


def gib(n: int) -> str:
    return f"{n / 2**30:,.2f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"
