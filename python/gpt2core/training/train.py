"""Train GPT-2: `python -m gpt2core.train` (console script `gpt2core-train`).

With no arguments it trains the small preset "s4" (4 layers, 4 heads, C=256) on the bundled tiny
Shakespeare on the CPU for a few minutes; the loss falls from ln(50257) = 10.8 to about 6 and a text
sample is printed. The 124M reproduction is

    gpt2core-train --preset d12 --data-dir data/edu_fineweb10B --device cuda -B 64 -T 1024 \\
        --total-batch-tokens 524288 --steps 19073 --lr 6e-4 --warmup 715 --val-every 250

Each step prints step, loss, lr, grad norm, ms, tokens/s, elapsed time and ETA; metrics go to
<out>/metrics.jsonl (`gpt2core-plot <out>` draws them). With dynamic loss scaling (--loss-scaling; on for fp16) each
step also prints and records the loss scale after its update and the steps skipped so far for an overflow
(`loss_scale`, `skipped_steps`); a skipped step's grad_norm is null. Every flag and its default is a field of
config.TrainConfig. --block-size trains a longer context than the preset's (GPT-3 used 2048); --lr scales the whole
LR schedule, so "2-3x the max LR" experiments are that one flag.

This module is the command line (its arguments, --plan, main and the console script); the loop is
gpt2core.training.trainer (Trainer), whose names are also found here.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import typing

from .. import _C, cli
from ..planning import memplan
from ..distributed import parallel as distributed
from ..config import _CHECKS, RECIPE_SWITCHES, RECIPES, SFT_DEFAULTS, TrainConfig, negated_flag
from ..errors import ArgError
from . import trainer as _trainer
from .preemption import EXIT_PREEMPTED
# the loop's public names, where callers of gpt2core.train (and gpt2core.training.train) have always found them
from .trainer import RunFailed, Trainer, TrainingStopped, plan_options, schedule_lr, step_kwargs


def build_parser() -> argparse.ArgumentParser:
    """One flag per TrainConfig field, in the field's group: --name-with-dashes (or the field's own flags), its
    type and default; bools are switches."""
    ap = cli.ArgumentParser(prog="gpt2core-train", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    groups: dict[str, argparse._ArgumentGroup] = {}
    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        kw = dict(f.metadata)
        help, group = kw.pop("help"), kw.pop("group")
        check = cli.field_check(f, _CHECKS)
        kw.pop("check", None)
        flags = kw.pop("flags", ["--" + f.name.replace("_", "-")])
        g = groups.get(group) or groups.setdefault(group, ap.add_argument_group(group))
        if hints[f.name] is bool:
            g.add_argument(*flags, dest=f.name, action="store_true", help=help)
            if f.name in RECIPE_SWITCHES:  # a recipe turns it on: the command line can turn it off again
                g.add_argument(negated_flag(f.name), dest=f.name, action="store_false",
                               help=f"the opposite of {flags[0]}, for a --recipe that sets it")
            continue
        kind = next(t for t in typing.get_args(hints[f.name]) or (hints[f.name],) if t is not type(None))
        if f.default is not None:
            help += " (default: %(default)r)" if kind is str else " (default: %(default)s)"
        # the checker parses the text; TrainConfig checks the range, naming the flag
        g.add_argument(*flags, dest=f.name, type=check.parser() if check else kind, default=f.default, help=help,
                       **kw)
    g = ap.add_argument_group("memory plan (gpt2core.memplan: allocates nothing, needs no GPU)")
    g.add_argument("--plan", action="store_true",
                   help="print the bytes per GPU by part for this command's preset, precision, B, T, ranks and "
                        "memory options, the largest micro-batch that fits --gpu-memory and which option "
                        "combinations fit, then exit: 0 when it fits, 2 (one line naming the smallest change that "
                        "fits) when it does not")
    g.add_argument("--json", action="store_true", help="--plan: print the plan as one JSON object")
    g.add_argument("--gpu-memory", metavar="SIZE", default=None,
                   help="--plan: one GPU's memory, e.g. 24GiB, 10GiB, 80GB (default: the GPU's free memory)")
    g.add_argument("--world-size", metavar="N", type=cli.Int(1, 1 << 16, "an integer >= 1"), default=None,
                   help="--plan: ranks (default: the launcher's environment, else 1)")
    return ap


PLAN_FLAGS = ("plan", "json", "gpu_memory", "world_size")


def parse_args(argv=None) -> TrainConfig:
    """The TrainConfig of a command line; a value out of range is a one-line error naming the flag (exit 2)."""
    return parse_command(argv)[0]


def parse_command(argv=None) -> tuple[TrainConfig, dict]:
    """The TrainConfig of a command line and its --plan flags (PLAN_FLAGS)."""
    ap = build_parser()
    values = vars(ap.parse_args(argv))
    values.pop("debug", None)  # cli.entry's switch
    planned = {k: values.pop(k) for k in PLAN_FLAGS}
    if not planned["plan"] and (planned["json"] or planned["gpu_memory"] or planned["world_size"]):
        ap.exit(2, f"{ap.prog}: error: --json, --gpu-memory and --world-size go with --plan\n")
    # --recipe sets its values unless a flag gave them: the flags given are those a parser without defaults sees
    bare = build_parser()
    for a in bare._actions:
        a.default = argparse.SUPPRESS
    explicit = vars(bare.parse_args(argv))
    try:
        recipe = values.pop("recipe")
        sets = RECIPES.get(recipe, {})
        if values.get("sft"):  # its defaults, and --steps only when given (else --epochs sets it)
            sets = {**sets, **SFT_DEFAULTS, "steps": None}
        cfg = TrainConfig.from_recipe(recipe, **{k: v for k, v in values.items() if k in explicit or k not in sets})
        return cfg, planned
    except ValueError as e:
        ap.exit(2, f"{ap.prog}: error: {e}\n")


def run_plan(cfg: TrainConfig, flags: dict) -> dict:
    """--plan: the memory plan of this command (memplan.plan), printed as text or JSON. Exit 0 when it fits, 2
    with one line naming the smallest change that fits when it does not (JSON: the object, then exit 2)."""
    world = flags["world_size"] or distributed.from_env().world_size
    measured = False
    gpu_memory = flags["gpu_memory"]
    if gpu_memory is None:
        if cfg.device == "cpu":
            gpu_memory = _trainer._physical_memory()
        elif _C.cuda_status():
            raise ArgError(f"--plan needs --gpu-memory (e.g. 24GiB) without a usable GPU ({_C.cuda_status()})")
        else:
            gpu_memory = _C.cuda_mem_info(int(cfg.device.partition(":")[2] or 0))[0]
            measured = True
    else:
        gpu_memory = memplan.parse_bytes(gpu_memory)
    B = None if cfg.batch_size == "auto" else cfg.batch_size
    p = memplan.plan(cfg.model_config(), B, cfg.seq_len, gpu_memory, plan_options(cfg, world), measured=measured,
                     total_batch_tokens=cfg.total_batch_tokens if B is None else None)
    p.config = cfg.preset
    if flags["json"]:
        print(json.dumps(p.to_json()), flush=True)
        if not p.fits:
            raise SystemExit(2)
    elif not p.fits:
        raise ArgError(p.refusal())
    else:
        print(p.report(), flush=True)
    return p.to_json()


def main(argv=None) -> dict:
    """gpt2core-train. Exits with a one-line message on a file, disk, lock or divergence problem (status 1),
    and with EXIT_PREEMPTED (75) after a checkpoint when stopped by SIGTERM/SIGINT."""
    cfg, flags = parse_command(argv)
    if flags["plan"]:
        try:
            return run_plan(cfg, flags)
        except BaseException as e:
            cli.reraise_as_exit("gpt2core-train", e)
            raise
    try:
        with Trainer(cfg) as trainer:
            return trainer.run()
    except TrainingStopped as e:
        print(f"gpt2core-train: {e} (exit code {EXIT_PREEMPTED})", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_PREEMPTED) from None
    except BaseException as e:
        cli.reraise_as_exit("gpt2core-train", e)
        raise


# the console script `gpt2core-train`: exit status 0 after a successful run (main() returns the last step's metrics
# to Python callers), 1/2/75 with one line otherwise (gpt2core.cli.entry)
console = cli.entry("gpt2core-train", main)


__all__ = ["build_parser", "parse_args", "parse_command", "run_plan", "main", "console", "PLAN_FLAGS", "Trainer",
           "TrainingStopped", "RunFailed", "plan_options", "schedule_lr", "step_kwargs"]

if __name__ == "__main__":
    sys.exit(console())
