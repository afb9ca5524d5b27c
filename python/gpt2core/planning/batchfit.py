"""`--batch-size auto`: the largest micro-batch B that fits the GPU's free memory, the total batch (tokens per
optimizer step) kept through gradient accumulation; and the refusal of an explicit B that will not fit, before the
first step, naming the B that would.

The memory a micro-batch of B sequences needs is modelled as

    need(B) = total(memplan.memory(config, B, T, options)) + margin(B),   margin(B) = m1 + (B - 1) * m_seq

where the memory plan (gpt2core.memplan, the one function that computes it: `--plan` prints the same) counts what
the run holds (weights, their fp32 master copy, gradients, AdamW moments, activations, logits, the backend's
workspace) and the margin is what it does not (library handles, the allocator's rounding), MEASURED on the device:
the device memory in use after one micro-step at B = 1 and at B = 2 (cudaMemGetInfo, before and after), minus the
plan's figures for the same B; m1 is the first difference and m_seq its growth per sequence (never below 0). B fits when need(B) <= (1 - SAFETY) * the memory that was free before
the model was made: SAFETY keeps a share back for what a later step may add (fragmentation, another process's
growth).

The candidates are the divisors of the sequences per step and process (total tokens / (T * processes)), so that
B * grad_accum is exactly the total batch: without --total-batch-tokens the total batch is DEFAULT_BATCH * T *
processes (the micro-batch the CPU uses), so `auto` changes the micro-batch, never what an optimizer step sees.
On the CPU `auto` is DEFAULT_BATCH (or the largest divisor of the sequences per step below it): there is no device
memory to fit, and the machine's RAM is checked separately (Trainer._check_plan)."""
from __future__ import annotations

from dataclasses import dataclass

from .memplan import divisors_descending, sequences_per_step  # noqa: F401  (train.py uses them from here)

DEFAULT_BATCH = 8   # the micro-batch `auto` means on the CPU, and the total batch's sequences without a total given
SAFETY = 0.05       # the share of the free memory kept back


@dataclass(frozen=True)
class MemoryModel:
    """need(B) = report(B) + margin(B): bytes of device memory a run at micro-batch B holds."""
    fixed: int       # memory_report's B-independent part (weights, gradients, optimizer state)
    act_per_seq: int  # memory_report's activations per sequence
    act_fixed: int   # memory_report's activations at B = 0 (extrapolated; usually 0)
    margin1: int     # measured: in use at B = 1 beyond memory_report(1, T)
    margin_per_seq: int  # measured: the margin's growth per sequence (>= 0)

    def report(self, B: int) -> int:
        return self.fixed + self.act_fixed + self.act_per_seq * B

    def need(self, B: int) -> int:
        return self.report(B) + self.margin1 + (B - 1) * self.margin_per_seq


def from_measurements(report1: int, report2: int, fixed: int, used1: int, used2: int) -> MemoryModel:
    """The model from memory_report's totals at B = 1 and 2 (report1, report2; fixed: its B-independent part) and
    the device memory measured in use after a micro-step at B = 1 and at B = 2 (used1, used2)."""
    per_seq = report2 - report1
    m1 = used1 - report1
    m2 = used2 - report2
    return MemoryModel(fixed=fixed, act_per_seq=per_seq, act_fixed=report1 - per_seq - fixed,
                       margin1=max(0, m1), margin_per_seq=max(0, m2 - max(0, m1)))


def largest_fitting(seqs: int, budget: int, need) -> int | None:
    """The largest divisor B of seqs with need(B) <= budget (need grows with B), or None."""
    for B in divisors_descending(seqs):
        if need(B) <= budget:
            return B
    return None


def budget_of(free_before: int, safety: float = SAFETY) -> int:
    return int(free_before * (1.0 - safety))


def cpu_auto(seqs: int) -> int:
    """`auto` on the CPU: DEFAULT_BATCH, or the largest divisor of the sequences per step below it."""
    return next(B for B in divisors_descending(seqs) if B <= DEFAULT_BATCH)


def measure(model, T: int, vocab_size: int, free_now, free_before: int) -> tuple[int, int]:
    """Device memory the model holds (bytes: free_before minus free_now(), the device's free memory) after one
    micro-step at B = 1 and at B = 2 on random tokens: call it right after the model is made, with free_before read
    before that. The gradients are zeroed and the loss sum taken afterwards, so the run starts as if the probe had
    not been (the weights and the optimizer state are not touched)."""
    import numpy as np

    rng = np.random.default_rng(0)
    used = []
    for B in (1, 2):
        x = rng.integers(0, vocab_size, (B, T), dtype=np.int32)
        try:
            model.forward_backward(x, x, 1.0)
            model.take_loss()  # waits for the device
        except RuntimeError as e:
            if "out of memory" not in str(e):
                raise
            used.append(None)  # B = 1 (or 2) does not fit at all
            break
        used.append(free_before - free_now())
    model.zero_grad()
    return used[0], (used[1] if len(used) > 1 else None)


def plan(model, B, T: int, world: int, total_tokens: int, vocab_size: int, free_now, free_before: int,
         where: str = "cuda", options=None) -> tuple[int, MemoryModel]:
    """B for a CUDA run: `auto` (B == "auto") the largest divisor of the sequences per step that fits, an explicit
    B checked. Raises ArgError when nothing fits, or the explicit B does not (naming the B that would). options:
    the run's memplan.Options (default: those of the model's precision, one rank)."""
    from . import memplan
    from ..errors import ArgError

    if options is None:
        options = memplan.Options(device="cuda", precision=model.precision, world_size=world)
    seqs = sequences_per_step(total_tokens, T, world)
    report1 = memplan.memory(model.config, 1, T, options)
    report1.pop("host")
    fixed = sum(report1[k] for k in ("weights", "master_weights", "gradients", "optimizer"))
    used1, used2 = measure(model, T, vocab_size, free_now, free_before)
    r1 = memplan.total(report1)
    r2 = memplan.total(memplan.memory(model.config, 2, T, options))
    have = f"{mib(free_before)} free on {where} before the model, {int(SAFETY * 100)}% kept back"
    if used1 is None:  # one sequence ran out of memory
        raise ArgError(f"no micro-batch fits: -B 1 -T {T} ran out of memory ({have}); lower -T or --preset, or use "
                       "--recompute layer (gpt2core-train --plan shows what fits)")
    budget = budget_of(free_before)
    mem = from_measurements(r1, r2, fixed, used1, used2 if used2 is not None else budget + 1)
    fit = largest_fitting(seqs, budget, mem.need)
    if fit is None:
        raise ArgError(f"no micro-batch fits: -B 1 -T {T} needs {mib(mem.need(1))} ({have}); lower -T or "
                       "--preset, or use --recompute layer (gpt2core-train --plan shows what fits)")
    if B == "auto":
        return fit, mem
    if mem.need(B) > budget:
        accum = seqs // fit
        raise ArgError(f"-B {B} -T {T} needs {mib(mem.need(B))} of GPU memory ({have}): -B {fit} fits "
                       f"(or -B auto), with {accum} micro-steps per optimizer step for the same {total_tokens:,} "
                       "tokens per step")
    return B, mem


def mib(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB"
