"""Runs where people look: every metrics.jsonl record also goes to TensorBoard and / or Weights & Biases.

    gpt2core-train ... --log tensorboard                  # event files in <output-dir>/tensorboard
    tensorboard --logdir <output-dir>/tensorboard
    gpt2core-train ... --log wandb --wandb-project gpt2 --wandb-run-name d12-lr6e-4     # offline by default:
    wandb sync <output-dir>/wandb/offline-run-*           # upload later (or --wandb-mode online to stream)
    gpt2core-train ... --log tensorboard,wandb            # both

metrics.jsonl stays the source of truth: a tracker gets each record after it was written there. A tracker that
cannot be imported, started or written to prints one warning and is switched off; the run goes on (only rank 0
writes, as for metrics.jsonl). What is logged: every number of a record under its key, "train/<key>" for the per-step
records (loss, lr, grad_norm, tok_per_s, dt_ms, ...) and "eval/<key>" for the evaluations (val_loss, val_bpb,
hellaswag_acc, hellaswag_acc_norm, core, and each task's centered score as eval/core_tasks/<label>), at the record's
step; the run record ({"run": {...}}) is W&B's config.

Libraries: TensorBoard through the `tensorboard` package's own numpy-only writer (tensorboard.summary.Writer): no
TensorFlow or PyTorch, and the package that shows the runs (and reads the files back) is the one that writes them;
W&B through `wandb` (offline mode needs no account).
"""
from __future__ import annotations

import math
import warnings
from pathlib import Path

from ..config import KINDS, LogKinds, parse_kinds  # noqa: F401  (--log's values: checked with the config)

EVAL_PREFIXES = ("val_", "hellaswag_", "core")  # keys of the evaluation records


def tag(key: str) -> str:
    return ("eval/" if key.startswith(EVAL_PREFIXES) else "train/") + key


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def scalars(rec: dict) -> dict[str, float]:
    """The finite numbers of a metrics record other than its step, by tag; a dict of numbers (CORE's per-task
    scores, "core_tasks") gives one tag per member, <key>/<member>."""
    out = {}
    for k, v in rec.items():
        if k != "step" and _number(v):
            out[tag(k)] = float(v)
        elif isinstance(v, dict):
            out.update({f"{tag(k)}/{m}": float(x) for m, x in v.items() if _number(x)})
    return out


class _Tracker:
    name = "tracker"

    def __init__(self, warn):
        self.warn = warn
        self.alive = True

    def _guard(self, what: str, fn, *args):
        if not self.alive:
            return
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - a tracker never stops the run
            self.alive = False
            self.warn(f"warning: {self.name} {what} failed ({type(e).__name__}: {e}); it is off for the rest of the "
                      "run (metrics.jsonl has everything)")

    def log(self, rec: dict) -> None:
        if "run" in rec and isinstance(rec["run"], dict):
            self._guard("config", self._config, rec["run"])
        elif "step" in rec:
            values = scalars(rec)
            if values:
                self._guard("write", self._write, int(rec["step"]), values)

    def close(self) -> None:
        self._guard("close", self._close)
        self.alive = False

    def _config(self, run: dict) -> None:
        pass


class TensorBoard(_Tracker):
    name = "TensorBoard"

    def __init__(self, logdir, warn):
        super().__init__(warn)
        from tensorboard.summary import Writer
        self.logdir = Path(logdir)
        self.writer = Writer(str(self.logdir))

    def _write(self, step: int, values: dict) -> None:
        for k, v in values.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def _close(self) -> None:
        self.writer.close()


class WandB(_Tracker):
    name = "W&B"

    def __init__(self, run_dir, project: str, run_name: str | None, mode: str, warn):
        super().__init__(warn)
        import wandb
        self.run = wandb.init(project=project, name=run_name, dir=str(run_dir), mode=mode)

    def _config(self, run: dict) -> None:
        self.run.config.update(run, allow_val_change=True)

    def _write(self, step: int, values: dict) -> None:
        self.run.log(values, step=step)

    def _close(self) -> None:
        self.run.finish()


class Trackers:
    """The trackers of a run: log(record) to each, close() at the end; none of them raises."""

    def __init__(self, trackers=()):
        self.trackers = list(trackers)

    def log(self, rec: dict) -> None:
        for t in self.trackers:
            t.log(rec)

    def close(self) -> None:
        for t in self.trackers:
            t.close()
        self.trackers = []


def open_trackers(kinds, run_dir, project: str = "gpt2core", run_name: str | None = None, mode: str = "offline",
                  warn=None) -> Trackers:
    """Trackers for `kinds` (parse_kinds' names) writing into run_dir: TensorBoard's event files in
    run_dir/tensorboard, W&B's run folder in run_dir/wandb. One that fails to import or start is one warning."""
    warn = warn or (lambda msg: warnings.warn(msg, stacklevel=3))
    out = []
    for kind in parse_kinds(kinds):
        try:
            if kind == "tensorboard":
                out.append(TensorBoard(Path(run_dir) / "tensorboard", warn))
            else:
                out.append(WandB(run_dir, project, run_name, mode, warn))
        except Exception as e:  # noqa: BLE001 - ImportError, a wandb that cannot start: the run goes on
            hint = {"tensorboard": "pip install tensorboard", "wandb": "pip install wandb"}[kind]
            warn(f"warning: --log {kind}: not logging there ({type(e).__name__}: {e}); {hint} "
                 "(metrics.jsonl has everything)")
    return Trackers(out)


__all__ = ["KINDS", "LogKinds", "parse_kinds", "scalars", "open_trackers", "Trackers", "TensorBoard", "WandB"]
