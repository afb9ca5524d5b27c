"""The lease's steps (issue 48): what a GPU lease measures, one function per step, in value order (STEPS).

Each step is a generator `step(budget, ctx)` that yields rows (dicts) as it measures them; the driver
(gpt2core.runtime.calibrate) runs each in a subprocess of its own (`python -m gpt2core.runtime.lease_steps NAME ROWS
CTX`), which writes every row to ROWS as one JSON line the moment it is made, so a step killed at its bound keeps
what it measured. A step that cannot run on the device at hand raises Skip(why). A step never reads another step's
rows. ctx.dry: the step at tiny shapes (a preset of 2 layers, T=32), which the CPU backend (--device cpu) and the
emulated device run in seconds, so that a lease never meets a crash a dry run could have found.

Where scripts/gpu_model.py models a figure (the d12 training step, KV-cache decoding; C=768 only, H100 and A100:
an H200 is the H100's compute with 1.4x the bandwidth), the step prints the model's figure beside the measured one.

The steps live by what they measure; each module imports only common, and this one gathers them:
    common     Ctx, Skip, the shapes, the checkout, command lines, the paper model, step timing, validation curves
    checks     is the build right here: doctor, gpu_tests, resume, bitwise, bgradb, vs_cpu
    learning   how far a recipe gets on the carried tokens: learn
    speed      how fast this device trains and evaluates: d12_step, recipe_profile, scale, eval, ladder, gemm
    serving    the server under streaming clients: serve
    parallel   data parallel over ranks: dp
    precision  fp16 and FP8 against bf16: fp16, fp8
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from .checks import (RESUME_KILL, step_bgradb, step_bitwise, step_doctor, step_gpu_tests,  # noqa: F401
                     step_resume, step_vs_cpu)
from .common import (DRY, REAL, ROOT, Ctx, Skip, checkout, gpt2core_cmd, gpu_model_key, need_gpu,  # noqa: F401
                     paper_model, peak_tflops, random_batch, random_token_config, shapes, time_steps, timing_row,
                     val_records)
from .learning import check_manifest, muon_share, reach, step_learn  # noqa: F401
from .parallel import DP_RANK, step_dp  # noqa: F401
from .precision import step_fp8, step_fp16  # noqa: F401
from .serving import step_serve  # noqa: F401
from .speed import step_d12_step, step_eval, step_gemm, step_ladder, step_recipe_profile, step_scale  # noqa: F401


@dataclass(frozen=True)
class Step:
    name: str
    what: str
    bound: float      # seconds on a real lease
    dry_bound: float  # seconds at tiny shapes (CPU or the emulated device)


# the value order: what a user asks first comes first (issue 48). The first four's bounds (the doctor, the GPU tests,
# learn sized to its bound, the d12 step) add up to 530 s: one 10-minute lease with a minute for the install
# (--budget 540); the next lease continues with scale
STEPS = [
    Step("doctor", "build, libraries, correctness on every device", 90, 120),
    Step("gpu_tests", "the GPU test suite against the CPU backend", 150, 120),
    Step("learn", "d12 T=1024: --recipe modern against gpt2 to gpt2's final val loss, tokens and seconds", 200, 300),
    Step("d12_step", "d12 B=64 T=1024 step time, cuDNN and flash attention, against the paper model", 90, 120),
    Step("recipe_profile", "d12 T=1024 --recipe gpt2 and modern step by op, time per token (issue 51)", 120, 120),
    Step("scale", "d24/d36/d48 bf16 at the largest batch per recompute level: tokens/s, MFU, phases", 420, 240),
    Step("serve", "gpt2core-serve at 1/8/32/64 streams against generate at the same batch", 240, 180),
    Step("dp", "2 ranks over Gloo (ZeRO 0/1/2, offload) bit for bit; NCCL's collectives on one rank", 240, 240),
    Step("fp16", "d12 fp16 with dynamic loss scaling, 50 steps against bf16", 120, 120),
    Step("fp8", "FP8 against bf16: d12/d24/d48 tokens/s at one batch, d24's loss on the carried tokens", 360, 240),
    Step("eval", "HellaSwag's 10,042 items (and a CORE bundle) on this device: items/s", 240, 120),
    Step("resume", "a run killed with SIGKILL after a checkpoint resumes bit-exactly", 180, 180),
    Step("bitwise", "two identical bf16 runs bit for bit", 120, 120),
    Step("bgradb", "was the bias-gradient GEMM epilogue accepted", 60, 120),
    Step("ladder", "the speed ladder at d12", 300, 120),
    Step("vs_cpu", "20 steps of d12 against the CPU reference", 120, 120),
    Step("gemm", "GEMM timings by shape", 120, 120),
]
FUNCS = {s.name: globals()[f"step_{s.name}"] for s in STEPS}
SKIPPED_EXIT = 3  # the exit status of a step that raised Skip


def run_step(name: str, rows_path: Path, budget: float, ctx: Ctx, funcs: dict | None = None) -> int:
    """One step in this process (funcs: the step functions by name, default FUNCS): each row appended to
    rows_path as one JSON line as soon as it is made."""
    with open(rows_path, "a") as f:
        def put(row):
            f.write(json.dumps(row, default=_jsonable) + "\n")
            f.flush()
        try:
            for row in (funcs or FUNCS)[name](budget, ctx):
                put(row)
        except Skip as e:
            put({"skipped": str(e)})
            return SKIPPED_EXIT
    return 0


def _jsonable(o):
    if isinstance(o, bytes):
        return o.hex()
    if isinstance(o, (np.integer, np.floating, np.bool_)):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    return str(o)


def ctx_to_json(ctx: Ctx) -> str:
    return json.dumps(asdict(ctx))


def main(argv: list[str], funcs: dict | None = None) -> int:
    """The step process: NAME ROWS BUDGET CTX_JSON (the driver's command line for it)."""
    name, rows, budget, ctx_json = argv[:4]
    return run_step(name, Path(rows), float(budget), Ctx(**json.loads(ctx_json)), funcs)
