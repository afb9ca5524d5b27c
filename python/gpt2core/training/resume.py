"""The Trainer's checkpoints: saving one after a step (rank 0 writes it; with ZeRO every rank its optimizer shard),
pruning to --keep-last, and resuming (--resume auto | DIR) with every check that the checkpoint belongs to this run
and this model. A mixin of Trainer (trainer.py)."""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from ..config import TrainConfig
from ..model import GPT2
from ..formats.checkpoint import (CheckpointError, checkpoint_dir, latest_checkpoint, list_checkpoints,
                                  load_checkpoint, prune_checkpoints, remove_stale_temporaries, save_checkpoint)
from . import runfolder
from .runfolder import RunFolderError


class Checkpoints:
    """Trainer's checkpoint and resume methods (they use its cfg, model, loaders, run folder and ranks)."""

    @property
    def zero1(self) -> bool:
        """ZeRO-1: each rank holds and checkpoints only its shard of the AdamW state."""
        return self.comm is not None and bool(self.cfg.zero)

    def _newest(self, root: Path):
        """The newest complete checkpoint under root, or None. In a multi-process run rank 0 chooses and
        broadcasts its step, so that every rank resumes the same one."""
        ck = latest_checkpoint(root, log=self.log) if self.dist.is_master else None
        if self.comm is None:
            return ck
        step = np.array([ck.step if ck is not None else -1], dtype=np.float32)  # exact below 2**24 steps
        self.comm.broadcast(step, root=0)
        if step[0] < 0:
            return None
        return ck if ck is not None else load_checkpoint(checkpoint_dir(root, int(step[0])))

    def resume(self, model: GPT2, where: str):
        """Restore weights, AdamW state and step count into `model`, and the loader position and metrics, from a
        checkpoint; returns it (None when 'auto' found none). With ZeRO-1 the AdamW moments are left to
        DataParallel(resume_from=...), which reads only this rank's range."""
        if where == "auto":
            if self.dist.is_master:  # under the lock no other run writes here: what a killed save left is stale
                for d in remove_stale_temporaries(self.ckpt_root, locked=True):
                    self.log(f"removed {d}, left by an interrupted checkpoint")
            ck = self._newest(self.ckpt_root)
            if ck is None:
                self.log(f"resume auto: no complete checkpoint in {self.ckpt_root}; starting from step 0")
                return None
        else:
            d = Path(where)
            if d.is_dir() and not (d / "manifest.json").exists() and list_checkpoints(d):
                ck = self._newest(d)  # a checkpoints/ folder: its newest complete one
                if ck is None:
                    raise CheckpointError(f"{d}: no complete checkpoint in this directory")
            else:
                ck = load_checkpoint(d)
        run_id = self.run_record.get("run_id")
        if run_id and ck.state.get("run_id") not in (None, run_id):
            raise RunFolderError(f"{ck.path} belongs to run {ck.state['run_id']}, but {self.out} holds run {run_id} "
                                 f"({runfolder.RUN_FILE}): resume that run's own checkpoints, or start over with "
                                 "--overwrite, or in another --output-dir")
        if ck.config != self.config:
            raise CheckpointError(f"{ck.path}: checkpoint model {ck.config} does not match this run's {self.config} "
                                  "(use the same --preset, --block-size and --padded-vocab-size)")
        saved, now = ck.state.get("args", {}), self.cfg.to_dict()
        changed = [f"--{k.replace('_', '-')} {saved[k]!r} -> {now[k]!r}"
                   for k in TrainConfig.TRAJECTORY if k in saved and saved[k] != now[k]]
        if changed:
            self.log("warning: resuming with changed arguments, the run will not match an uninterrupted one: "
                     + ", ".join(changed))
        if ck.zero is not None and (not self.zero1 or ck.zero["world_size"] != self.dist.world_size):
            raise ck.layout_error(self.dist.world_size, self.zero1)
        ck.restore(model, optimizer=not self.zero1)
        try:
            self.train_loader.load_state_dict(ck.state["train_loader"])
            for k, d in ck.state.get("outliers", {}).items():
                self.outliers[k].load_state_dict(d)
        except (KeyError, ValueError, TypeError) as e:
            raise CheckpointError(f"{ck.path}: cannot restore the data loader position or outlier windows: "
                                  f"{e}") from e
        self.start_step = ck.step
        self.log(f"resumed from {ck.path} at step {ck.step}")
        return ck

    def save_checkpoint(self, step: int) -> Path | None:
        """Checkpoint after `step` optimizer steps (rank 0 writes it; with ZeRO-1 every rank also writes its
        optimizer shard, a collective), then prune to --keep-last (rank 0, once every shard is on disk)."""
        if not (self.zero1 or self.dist.is_master):
            return None
        cfg = self.cfg
        t0 = time.perf_counter()
        state = {
            "train_loader": self.train_loader.state_dict(),
            "args": cfg.to_dict(),
            "run_id": self.run_record.get("run_id"),
            "lr_next": self.lr(step),
            "outliers": {k: d.state_dict() for k, d in self.outliers.items()},
            "grad_accum": self.grad_accum,
            "world_size": self.dist.world_size,
            # the data order is a function of (seed, loader position); sampling is seeded per call
            "rng": {"data": "train_loader position + seed", "sampling": f"seed {cfg.seed} per call"},
        }
        path = save_checkpoint(self.ckpt_root, step, self.model, state, metrics_path=self.metrics_path,
                               zero=self.model if self.zero1 else None)
        if not self.dist.is_master:
            return path
        removed = prune_checkpoints(self.ckpt_root, cfg.keep_last)  # also removes temporary dirs left by a crash
        self.log(f"checkpoint {path} ({time.perf_counter() - t0:.1f} s)"
                 + (f"; removed {len(removed)} old" if removed else ""))
        return path
