"""The training loop: `Trainer` runs one TrainConfig, in one process or as a rank of a data-parallel run (the same
path either way). Its setup checks everything that can fail (the arguments against the model, the data, --init's
weights, the plan, the device) before the run folder is claimed, so a run that cannot start changes nothing on disk
(runfolder.check_claim, then runfolder.Claim.commit). The command line around it is gpt2core.training.train.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from pathlib import Path

import numpy as np

from .. import _C, chat, cli, progress
from ..planning import batchfit, memplan
from ..distributed import parallel as distributed
from . import runfolder, trackers
from ..config import RECIPES, TrainConfig
from ..data import hellaswag, sft, shakespeare
from ..data.loader import DataLoader
from ..data.shards import ShardError
from ..errors import ArgError, Error, Preempted, WriteError
from ..formats.llmc import fill_params
from ..model import GPT2
from .outliers import WINDOW, OutlierDetector
from ..formats.pretrained import read_weights
from .preemption import GracefulStop
from .runfolder import RunFolderError
from ..formats.runlock import RunLock, RunLockedError
from .schedule import lr_at, muon_momentum_at
from .evals import SFT_SAMPLE_PROMPT, Evaluations  # noqa: F401  (SFT_SAMPLE_PROMPT: tests)
from .resume import Checkpoints




class TrainingStopped(Preempted):
    """The run stopped early on SIGTERM/SIGINT, after writing a checkpoint (the message says which)."""


class RunFailed(Error):
    """The run stopped on a failure it cannot go on from (metrics not writable: disk full or file-size limit; a
    shard that shrank under it), after a checkpoint where that was possible (the message says which)."""


def schedule_lr(cfg: TrainConfig, step: int) -> float:
    """The --lr schedule's LR of optimizer step `step` (0-based): warm-up, then --schedule."""
    return lr_at(step, cfg.lr, cfg.warmup, cfg.steps, cfg.min_lr_frac * cfg.lr, cfg.schedule, cfg.cooldown_frac)


def step_kwargs(cfg: TrainConfig, step: int) -> dict:
    """GPT2.step's keywords for optimizer step `step` (0-based) of a run with cfg, lr included: AdamW's settings;
    with --optimizer muon AdamW's group LRs (--embedding-lr, --head-lr, --scalar-lr) and --muon-lr, each scaled by
    the schedule as --lr is (schedule_lr / --lr), and Muon's momentum warm-up."""
    lr = schedule_lr(cfg, step)
    kw = {**cfg.optimizer_kw(), **cfg.group_lrs(lr)}
    if cfg.optimizer == "muon":
        kw["muon_lr"] = cfg.muon_lr * (lr / cfg.lr)
        kw["muon_momentum"] = muon_momentum_at(step, cfg.muon_momentum, cfg.muon_momentum_warmup)
    return kw


class Trainer(Checkpoints, Evaluations):
    """The training loop of a TrainConfig. self.model is the GPT2, or in a multi-process run a
    distributed.DataParallel over it, which has the same methods: the loop is one path either way."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        # join the process group first: a missing rank fails fast and by name
        self.dist, self.comm, self.device = distributed.setup(cfg.device, timeout=cfg.dist_timeout)
        cli.check_device_available(self.device)  # --device cuda:7 on a 1-GPU machine: one line, before any work
        self._check_process_flags()
        if cfg.threads:
            _C.set_num_threads(cli.threads(cfg.threads, "--threads"))
        self.config, self._init = self._model_config(cfg)
        self.grad_accum, self.total = self._batch_plan()
        self.out = Path(cfg.output_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.lock = self._lock()
        self.write_failure: WriteError | None = None  # the first failed metrics append (rank 0)
        self.trackers = trackers.Trackers()  # --log: opened in _setup, after the folder is claimed
        if cfg.warmup > cfg.steps:
            self.log(f"warning: --warmup {cfg.warmup} is longer than the run (--steps {cfg.steps}): the learning "
                     f"rate never reaches --lr {cfg.lr:g}")
        try:
            self._setup(cfg)
        except BaseException:
            self.close()
            raise

    def _check_process_flags(self) -> None:
        """Data-parallel switches in a run of one process would do nothing: --zero 1/2 is refused, the others
        warned about. ZeRO-2 with Muon is refused (Muon orthogonalises whole matrices of every rank's gradients);
        --offload optimizer needs a GPU and AdamW (with ZeRO each rank offloads its shard)."""
        cfg = self.cfg
        memplan.check_training_options(self.device.startswith("cuda"), cfg.zero, cfg.offload, cfg.optimizer)
        if self.comm is None:
            if cfg.zero:
                what = "the AdamW state" if cfg.zero == 1 else "the AdamW state and the gradients"
                raise ArgError(f"--zero {cfg.zero} shards {what} over the processes of a data-parallel run, and "
                               "this run is one process: start several (python -m gpt2core.launch --nproc-per-node "
                               "N, torchrun, srun, mpirun), or leave --zero out")
            if cfg.no_overlap_comm:
                self.log("warning: --no-overlap-comm does nothing in a run of one process (no gradients to average)")
            if cfg.dist_timeout != TrainConfig.dist_timeout:
                self.log("warning: --dist-timeout does nothing in a run of one process (no collectives to wait for)")

    def _check_weights_fit(self) -> None:
        """Weights, gradients and AdamW moments (16 bytes per parameter) within this machine's RAM (CPU), checked
        before they are allocated."""
        if self.device != "cpu":
            return
        need, have = 16 * self.config.num_parameters(), _physical_memory()
        if have and need > have:
            raise ArgError(f"--preset {self.cfg.preset} needs {_mem(need)} for its weights, gradients and AdamW state, "
                           f"more than this machine's {_mem(have)}: choose a smaller --preset")

    def _check_plan(self, model) -> None:
        """What the loaders and the machine can serve: --val-steps within the validation data, and a micro-batch
        whose memory fits in this machine's RAM (CPU)."""
        cfg = self.cfg
        if cfg.val_every and cfg.val_steps > self.val_loader.batches_per_epoch:
            raise ArgError(f"--val-steps {cfg.val_steps} is more than the {self.val_loader.batches_per_epoch} "
                           f"batches the validation data hold at -B {cfg.batch_size} -T {cfg.seq_len}: "
                           f"validation would repeat batches; use --val-steps <= {self.val_loader.batches_per_epoch}")
        if self.device == "cpu":
            need = model.memory_report(cfg.batch_size, cfg.seq_len)["total"]
            have = _physical_memory()
            if have and need > have:
                raise ArgError(f"-B {cfg.batch_size} -T {cfg.seq_len} needs {_mem(need)} of memory for preset "
                               f"{cfg.preset} (weights, gradients, optimizer, activations), more than this machine's "
                               f"{_mem(have)}: lower -B (and raise --total-batch-tokens for the same tokens per step)")

    def _setup(self, cfg: TrainConfig) -> None:
        self.metrics_path = self.out / "metrics.jsonl"
        self.ckpt_root = self.out / "checkpoints"
        # the folder is checked now (a refusal before any work) and taken only after every other check below: an
        # --overwrite that cannot start must leave the old run as it was (its model.bin may be this run's --init)
        self._claim = self._check_claim()
        self.run_record = self._claim.record if self._claim is not None else {}
        data_dir = None if cfg.sft else cfg.data_dir or self._shakespeare()
        model = self._make_model(cfg)
        cfg = self.cfg  # with the micro-batch chosen (--batch-size auto) or checked against the GPU's memory
        B, T, W, rank = cfg.batch_size, cfg.seq_len, self.dist.world_size, self.dist.rank
        V = self.config.vocab_size  # every shard's ids are checked against it when first opened
        if cfg.sft:
            self._sft_loaders(cfg)
            cfg = self.cfg  # --steps from --epochs
        else:
            self.train_loader = DataLoader(data_dir, "train", B, T, rank=rank, world_size=W,
                                           shuffle=not cfg.no_shuffle, seed=cfg.seed, vocab_size=V)
            self.val_loader = DataLoader(data_dir, "val", B, T, rank=rank, world_size=W, shuffle=False, vocab_size=V)
        self.outliers = {"loss": OutlierDetector(WINDOW), "grad_norm": OutlierDetector(WINDOW)}
        self.progress = self.dist.is_master and not cfg.no_progress
        self.hellaswag = (hellaswag.load(cfg.hellaswag_path, cfg.hellaswag_limit, progress=self.progress,
                                         flag="--hellaswag-path")
                          if cfg.hellaswag_every else None)
        self.core_tasks = self._core_tasks(cfg)
        self._check_plan(model)
        self.flops_per_token = self.config.flops_per_token(T)
        self.start_step = 0
        ck = self.resume(model, cfg.resume) if cfg.resume else None
        self.model = model
        if self.comm is not None:  # after resume: ZeRO-1 reads its shard of the checkpoint's AdamW state
            # None: on unless ZeRO-1; a captured backward cannot call back into Python to start collectives
            overlap = False if cfg.no_overlap_comm or cfg.cuda_graphs else None
            self.model = distributed.DataParallel(model, self.comm, zero=cfg.zero, resume_from=ck, overlap=overlap,
                                                  grad_accum=self.grad_accum)
        self._commit_claim()  # everything checked, --init's weights in the model: the folder is this run's now
        self._open_trackers(cfg)
        if self.dist.is_master and self.run_record.get("adopt"):  # a folder without run.json: it is this run's now
            run_id = (ck.state.get("run_id") if ck is not None else None) or runfolder.new_run_id()
            self.run_record = runfolder.write_manifest(self.out, run_id, cfg.to_dict(), self.config.to_dict(),
                                                       resumed_from=str(ck.path) if ck is not None else None)
        self._rewind_metrics(ck)

    def _model_config(self, cfg: TrainConfig):
        """(the model's config, (flat weights, source) of --init or None). --init: the file's shape and architecture;
        with --sft the vocab gains the chat tokens (gpt2core.chat.with_chat_vocab)."""
        if not cfg.init:
            c = cfg.model_config()
            return (chat.chat_config(c) if cfg.sft else c), None
        config, flat, source = read_weights(cfg.init)
        if cfg.sft:
            config, flat = chat.with_chat_vocab(config, flat, seed=cfg.seed)
        return config, (flat, source)

    def _sft_loaders(self, cfg: TrainConfig) -> None:
        """--sft: the conversation loaders (gpt2core.data.sft), --steps from --epochs, validation within the held-out
        rows (--val-steps at most their batches; none without held-out conversations)."""
        B, T, W, rank = cfg.batch_size, cfg.seq_len, self.dist.world_size, self.dist.rank
        train, val = sft.load(cfg.sft, T, cfg.sft_val_frac, cfg.seed)
        self.train_loader = sft.SFTLoader(train, "train", B, T, rank=rank, world_size=W, shuffle=not cfg.no_shuffle,
                                          seed=cfg.seed)
        self.val_loader = sft.SFTLoader(val, "val", B, T, rank=rank, world_size=W, shuffle=False) if val else None
        self.log(f"sft: train {self.train_loader.describe()}; "
                 + (f"val {self.val_loader.describe()}" if val else "no validation conversations"))
        changes = {}
        if cfg.epochs:
            changes["steps"] = math.ceil(cfg.epochs * self.train_loader.batches_per_epoch / self.grad_accum)
        if self.val_loader is None:
            changes["val_every"] = 0
        elif cfg.val_steps > self.val_loader.batches_per_epoch:
            changes["val_steps"] = self.val_loader.batches_per_epoch
        self.cfg = dataclasses.replace(cfg, **changes)

    def _lock(self) -> RunLock | None:
        """Rank 0 locks the output folder for the whole run (RunLockedError naming the holder, on every rank)."""
        lock = error = None
        if self.dist.is_master:
            try:
                lock = RunLock(self.out).acquire()
            except RunLockedError as e:
                error = e
        if self.over_ranks("sum", error is not None)[0]:
            raise error or RunLockedError(f"{self.out} is in use by another gpt2core run (see rank 0's message)")
        if lock is not None and lock.previous:
            self.log(lock.describe_previous())
        return lock

    def _check_claim(self) -> runfolder.Claim | None:
        """Rank 0 checks that the output folder can be this run's (runfolder.check_claim: a folder holding another
        run is refused unless --resume or --overwrite), writing nothing; a refusal reaches every rank. Returns rank
        0's Claim (None on the other ranks), committed by _commit_claim."""
        claim, error = None, None
        if self.dist.is_master:
            try:
                claim = runfolder.check_claim(self.out, self.cfg.to_dict(), self.config.to_dict(), self.cfg.resume,
                                              self.cfg.overwrite)
            except RunFolderError as e:
                error = e
        if self.over_ranks("sum", error is not None)[0]:
            raise error or RunFolderError(f"{self.out} holds another run (see rank 0's message)")
        return claim

    def _commit_claim(self) -> None:
        """Rank 0 takes the folder (--overwrite: removes the previous run; a fresh run writes run.json), once
        nothing can refuse the run any more; a failure reaches every rank."""
        error = None
        if self._claim is not None:
            try:
                self.run_record = self._claim.commit(log=self.log)
            except (Error, OSError) as e:
                error = e
        if self.over_ranks("sum", error is not None)[0]:
            raise error or RunFailed(f"rank 0 could not take {self.out} for this run (see its message)")

    def _open_trackers(self, cfg: TrainConfig) -> None:
        """--log: TensorBoard / W&B beside metrics.jsonl, on rank 0 (gpt2core.trackers; a failing one is a warning)."""
        if cfg.log and self.dist.is_master:
            self.trackers = trackers.open_trackers(cfg.log, self.out, project=cfg.wandb_project,
                                                   run_name=cfg.wandb_run_name or self.out.resolve().name,
                                                   mode=cfg.wandb_mode, warn=self.log)

    def close(self) -> None:
        """Release the output folder (also released by the kernel if the process dies) and close the trackers."""
        self.trackers.close()
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _rewind_metrics(self, ck) -> None:
        """metrics.jsonl as it was when the checkpoint resumed from was written (its copy), or empty for a run
        from step 0: the records of steps a stopped or killed run took after it would otherwise appear twice."""
        if self.dist.is_master:
            tmp = self.metrics_path.with_name(self.metrics_path.name + ".resume.tmp")
            old = ck.metrics_path.read_bytes() if ck is not None and ck.metrics_path else b""
            tmp.write_bytes(runfolder.whole_lines(old))  # never a torn last line to append to
            os.replace(tmp, self.metrics_path)

    def _batch_plan(self) -> tuple[int, int]:
        """(micro-steps per optimizer step, tokens per optimizer step), checked against the model."""
        cfg, W = self.cfg, self.dist.world_size
        B, T = cfg.batch_size, cfg.seq_len
        if T > self.config.block_size:
            bs = self.config.block_size
            if cfg.init:  # the shape is the file's: --preset and --block-size do not change it
                raise ArgError(f"-T {T} exceeds the block size {bs} of the --init model {cfg.init} (its shape comes "
                               f"from the file; --preset and --block-size do not change it): use -T {bs} or less")
            raise ArgError(f"-T {T} exceeds the block size {bs} of preset {cfg.preset} (raise it with --block-size "
                           f"{T}, or use -T {bs} or less)")
        if B == "auto":  # B is chosen in _setup (batchfit): the total batch does not depend on it
            total = cfg.tokens_per_step(self.config, batchfit.DEFAULT_BATCH * T * W)
            try:
                batchfit.sequences_per_step(total, T, W)
            except ValueError as e:
                raise ArgError(str(e)) from None
            return 0, total
        tokens_per_micro = B * T * W
        total = cfg.tokens_per_step(self.config, tokens_per_micro)
        if total % tokens_per_micro:
            raise ArgError(f"--total-batch-tokens {total} is not a multiple of B*T*world_size = {B}*{T}*{W} = "
                           f"{tokens_per_micro}")
        return total // tokens_per_micro, total

    def _make_model(self, cfg: TrainConfig):
        """The GPT2 of this run, and the micro-batch settled: --batch-size auto chosen (batchfit: on CUDA the
        largest that fits the GPU's free memory, measured; on the CPU the default), an explicit B on CUDA checked
        against that memory (ArgError naming the B that fits), before the first step. self.cfg then holds B."""
        self._check_weights_fit()
        cuda = self.device != "cpu"
        free_before = _C.cuda_mem_info(self._cuda_index())[0] if cuda else 0
        if cuda:  # the plan first: a run that cannot fit one sequence is refused before anything is allocated
            self._check_plan_fits(cfg, free_before)
        try:
            model = GPT2(self.config, device=self.device, seed=cfg.seed, precision=cfg.precision,
                         fp8_head=cfg.fp8_head, attention=cfg.attention, matmul_tuning=cfg.matmul_tuning,
                         deterministic=not cfg.no_deterministic, loss_scaling=cfg.loss_scaling_on,
                         loss_scale_init=cfg.loss_scale_init, loss_scale_interval=cfg.loss_scale_interval)
        except RuntimeError as e:
            if not cuda or "out of memory" not in str(e):
                raise
            raise ArgError(f"--preset {cfg.preset} does not fit {self.device}: its weights, gradients and optimizer "
                           f"state need more than the {batchfit.mib(free_before)} free ({e}); choose a smaller "
                           "--preset") from None
        if self._init is not None:  # --init: its weights (a resumed run then restores its checkpoint's)
            fill_params(model, *self._init)
            self._init = None
        model.recompute = cfg.recompute
        model.offload = cfg.offload == "optimizer"
        model.cuda_graphs = cfg.cuda_graphs
        T, W = cfg.seq_len, self.dist.world_size
        seqs = self.total // (T * W)
        B = cfg.batch_size
        if cuda:
            B, mem = batchfit.plan(model, B, T, W, self.total, self.config.vocab_size,
                                   lambda: _C.cuda_mem_info(self._cuda_index())[0], free_before, self.device,
                                   plan_options(cfg, W, 0, model.precision))
            if cfg.batch_size == "auto":
                # every rank the same B: the smallest any rank chose (each is a divisor of seqs, so it is one too)
                divs = batchfit.divisors_descending(seqs)
                counts = self.over_ranks("sum", *[float(d == B) for d in divs])
                B = min(d for d, c in zip(divs, counts) if c > 0)
                self.log(f"--batch-size auto: B={B} (needs {batchfit.mib(mem.need(B))} of the "
                         f"{batchfit.mib(free_before)} free on {self.device}; measured margin "
                         f"{batchfit.mib(mem.margin1)} + {batchfit.mib(mem.margin_per_seq)}/sequence)")
        elif B == "auto":
            B = batchfit.cpu_auto(seqs)
        if cfg.batch_size == "auto":
            self.cfg = dataclasses.replace(cfg, batch_size=B)
            self.grad_accum = seqs // B
        return model

    def _check_plan_fits(self, cfg: TrainConfig, free_before: int) -> None:
        """ArgError naming the smallest change that fits (memplan) when not even -B 1 fits the GPU's free memory."""
        o = plan_options(cfg, self.dist.world_size, 0)  # a lower bound: the library's workspace is measured later
        budget = memplan.budget_of(free_before, measured=True)
        if memplan.largest_batch(self.config, cfg.seq_len, o, budget, [1]) is None:
            p = memplan.plan(self.config, 1, cfg.seq_len, free_before, o, measured=True)
            p.config = f"--preset {cfg.preset}"
            raise ArgError(f"would run out of memory on {self.device} ({batchfit.mib(free_before)} free): "
                           + p.refusal())

    def _cuda_index(self) -> int:
        return int(self.device.partition(":")[2] or 0)

    def _shakespeare(self) -> Path:
        """The bundled tiny Shakespeare as shards in <output-dir>/data: one rank prepares them, the others wait."""
        if self.dist.is_master:
            shakespeare.ensure(self.out / "data")
        if self.comm is not None:
            self.comm.barrier()
        return shakespeare.ensure(self.out / "data")

    def log(self, msg: str) -> None:
        if self.dist.is_master:
            print(msg, flush=True)

    def write_metrics(self, rec: dict) -> None:
        """Append one record to metrics.jsonl, whole or not at all. A failed append (disk full, file-size limit)
        is kept in self.write_failure: the loop then stops after a checkpoint (run())."""
        if self.dist.is_master and self.write_failure is None:
            try:
                runfolder.append_line(self.metrics_path, json.dumps(rec))
            except WriteError as e:
                self.write_failure = e
                return
            self.trackers.log(rec)

    def _fail(self, error, steps_done: int) -> RunFailed:
        """The RunFailed for `error` after `steps_done` steps, with a checkpoint of them first when one is due
        (steps were taken since the start) and possible (the disk may be full)."""
        where = "no checkpoint (no step was taken since the start)"
        if steps_done > self.start_step:
            try:
                path = self.save_checkpoint(steps_done)
                where = f"checkpoint {path or self.ckpt_root} written; fix that, then continue with --resume auto"
            except (WriteError, OSError) as e:
                where = f"no checkpoint could be written either ({cli.describe_oserror(e)})"
        return RunFailed(f"{error}; the run stopped after step {steps_done} of {self.cfg.steps}: {where}")

    def over_ranks(self, op: str, *values: float) -> list[float]:
        """The values reduced over the ranks (op "sum" or "avg", one float32 allreduce); in one process, the
        values themselves."""
        if self.comm is None:
            return [float(v) for v in values]
        buf = np.array(values, dtype=np.float32)
        self.comm.allreduce(buf, op)
        return [float(v) for v in buf]

    def lr(self, step: int) -> float:
        return schedule_lr(self.cfg, step)

    def train_step(self, step: int) -> dict:
        """One optimizer step: grad_accum micro-steps (forward + backward, the loss summed on the device), then
        clip + AdamW. With data parallel the model averages the gradients over ranks on the way. The loss and
        grad norm are scored against the previous steps' (outliers); with --skip-outliers an outlier's update
        is skipped, which needs the norm before the update."""
        cfg, m = self.cfg, self.model
        t0 = time.perf_counter()
        lr = self.lr(step)
        m.zero_grad()
        for i in range(self.grad_accum):
            x, y = self.train_loader.next_batch()
            if self.comm is None and cfg.offload != "none" and i == self.grad_accum - 1:
                m.prefetch_grads()  # the last micro-step's gradients are final: to the host during its backward
            m.forward_backward(x, y, 1.0 / self.grad_accum)
        loss = m.take_loss()  # the mean over micro-steps (and ranks): the first wait for the device
        if not math.isfinite(loss):
            raise FloatingPointError(f"loss is {loss} at step {step}; weights were not updated (try a lower --lr)")
        z = {"loss_z": self.outliers["loss"].update(loss)}
        kw = step_kwargs(cfg, step)

        def score_norm(norm):  # with loss scaling a non-finite norm is an overflow (a skipped step), no outlier
            if math.isfinite(norm) or not m.loss_scaling:
                z["grad_norm_z"] = self.outliers["grad_norm"].update(norm)

        if cfg.skip_outliers:
            norm = m.grad_norm()
            score_norm(norm)
            skipped = any(v > cfg.outlier_z for v in z.values())  # NaN (window not yet full) compares False
            if not skipped:
                m.step(**kw)
        else:
            norm, skipped = m.step(**kw), False
            score_norm(norm)
        dt = time.perf_counter() - t0
        # the LR above is the loop step's whether or not the update is skipped (GradScaler's convention, GPT2.step)
        rec = {"step": step + 1, "loss": loss, "lr": lr, "grad_norm": norm if math.isfinite(norm) else None,
               "dt_ms": dt * 1e3, "tok_per_s": self.total / dt}
        if m.loss_scaling:  # the scale after this step's update (GradScaler.get_scale()), skips so far
            rec["loss_scale"], rec["skipped_steps"] = m.loss_scale, m.skipped_steps
        rec.update({k: v for k, v in z.items() if math.isfinite(v)})
        outliers = [f"{k[:-2].replace('_', ' ')} {rec[k[:-2]]:.4g} (z {v:.1f})" for k, v in z.items()
                    if v > cfg.outlier_z]
        if outliers:
            rec["skipped"] = skipped
            self.log(f"warning: step {step + 1} is an outlier over the previous {WINDOW} steps: "
                     + ", ".join(outliers) + ("; its update was skipped" if skipped else ""))
        return rec

    def evaluate(self, step: int, last: dict) -> None:
        """Validation loss and bits per byte, HellaSwag and CORE after `step` updates, each when due: every
        --val-every / --hellaswag-every / --core-every steps, and after the last update."""
        cfg, final = self.cfg, step == self.cfg.steps
        if cfg.val_every and (step % cfg.val_every == 0 or final):
            v = self.val_metrics()
            self.log(f"step {step:5d} | val loss {v['val_loss']:.4f} | val bpb {v['val_bpb']:.4f}")
            self.write_metrics({"step": step, **v})
            last.update(v)
        if cfg.hellaswag_every and (step % cfg.hellaswag_every == 0 or final):
            hs = self.hellaswag_eval()
            self.log(f"step {step:5d} | hellaswag acc {hs['acc']:.4f} acc_norm {hs['acc_norm']:.4f} "
                     f"({hs['n']} items)")
            self.write_metrics({"step": step, "hellaswag_acc": hs["acc"], "hellaswag_acc_norm": hs["acc_norm"]})
            last["hellaswag_acc"], last["hellaswag_acc_norm"] = hs["acc"], hs["acc_norm"]
        if cfg.core_every and (step % cfg.core_every == 0 or final):
            c = self.core_metrics()
            self.log(f"step {step:5d} | CORE {c['core']:.4f} ({len(c['core_tasks'])} tasks)")
            self.write_metrics({"step": step, **c})
            last["core"] = c["core"]

    def _stop_now(self, stop: GracefulStop) -> tuple[bool, bool]:
        """(whether any rank got SIGTERM/SIGINT, whether any rank failed to write its metrics): all ranks stop after
        the same step (one allreduce per step)."""
        if self.comm is None:
            return stop.requested, self.write_failure is not None
        signalled, failed = self.over_ranks("sum", stop.requested, self.write_failure is not None)
        return signalled > 0, failed > 0

    def run(self) -> dict:
        cfg, m = self.cfg, self.model
        shape = f"--init {cfg.init}" if cfg.init else f"preset {cfg.preset}"
        self.log(f"gpt2core {_C.build_info()['version']} | {shape}: {m.num_parameters:,} params | "
                 f"device {cfg.device} | threads {_C.get_num_threads()}")
        if self.config.non_gpt2_fields() or self.config.zero_init_proj:
            self.log("architecture: " + ", ".join(self.config.non_gpt2_fields()
                                                  + (["zero_init_proj=True"] if self.config.zero_init_proj else [])))
        self.log(f"batch: B={cfg.batch_size} T={cfg.seq_len} world={self.dist.world_size} "
                 f"grad_accum={self.grad_accum} -> {self.total:,} tokens/step | train tokens "
                 f"{self.train_loader.n_tokens:,} | val tokens {self.val_loader.n_tokens if self.val_loader else 0:,}")
        mem = m.memory_report(cfg.batch_size, cfg.seq_len)
        self.log("memory: " + " | ".join(f"{k} {v / 2**20:,.1f} MiB" for k, v in mem.items()) +
                 (" (GELU recomputed in backward)" if cfg.recompute == "gelu" else
                  " (each block recomputed in backward)" if cfg.recompute == "layer" else ""))
        if self.comm is not None:
            self.log(m.describe())
        # what gpt2core.plot needs to put runs on a tokens axis and to know a 124M run
        self.write_metrics({"run": {"preset": cfg.preset, "params": m.num_parameters, "tokens_per_step": self.total,
                                    "start_step": self.start_step, "steps": cfg.steps, "recipe": cfg.recipe,
                                    "recipe_values": RECIPES[cfg.recipe], "recipe_overridden": sorted(
                                        k for k, v in RECIPES[cfg.recipe].items() if getattr(cfg, k) != v),
                                    "config": cfg.to_dict(), "model": self.config.to_dict()}})
        last = {}
        t_run = time.perf_counter()
        with GracefulStop() as stop:
            for step in range(self.start_step, cfg.steps):
                self.evaluate(step, last)
                if cfg.sample_every and step > 0 and step % cfg.sample_every == 0:
                    self.log(f"step {step:5d} | {self._sample_line()}")
                pos = self.train_loader.state_dict() if self.comm is None else None
                try:
                    rec = self.train_step(step)
                except ShardError as e:  # a shard that shrank or changed under the run
                    if self.comm is not None:  # the other ranks wait in a collective: the launcher stops them
                        raise
                    self.train_loader.load_state_dict(pos)  # the checkpoint resumes at this step's first batch
                    raise self._fail(e, step) from e
                norm = "overflow, skipped" if rec["grad_norm"] is None else f"{rec['grad_norm']:.3f}"
                scale = f"scale {rec['loss_scale']:g} skips {rec['skipped_steps']} | " if "loss_scale" in rec else ""
                self.log(f"step {step + 1:5d}/{cfg.steps} | loss {rec['loss']:.4f} | lr {rec['lr']:.2e} | "
                         f"norm {norm} | {scale}{rec['dt_ms']:.0f} ms | {rec['tok_per_s']:,.0f} tok/s | "
                         f"{rec['tok_per_s'] * self.flops_per_token / 1e9:.1f} GFLOP/s | "
                         + progress.eta(time.perf_counter() - t_run, step + 1 - self.start_step, cfg.steps - step - 1))
                if self.comm is not None:  # rank 0's time in the step's gradient/parameter collectives (scaling)
                    rec["comm_ms"] = m.last_comm_ms
                self.write_metrics(rec)
                last.update(rec)
                stopping, failing = self._stop_now(stop)
                if failing:
                    raise self._fail(self.write_failure or "rank 0 could not write metrics.jsonl", step + 1)
                due = cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0
                if due or stopping or (cfg.checkpoint_every and step + 1 == cfg.steps):
                    path = self.save_checkpoint(step + 1)
                if stopping:
                    raise TrainingStopped(f"stopped by {stop.name or 'a signal on another rank'} after step "
                                          f"{step + 1} of {cfg.steps}; checkpoint {path or self.ckpt_root} written. "
                                          f"Continue with the same command and --resume auto")
        self.evaluate(cfg.steps, last)
        if self.write_failure is not None:
            raise RunFailed(f"{self.write_failure}; the run finished all {cfg.steps} steps but its last records are "
                            "missing from metrics.jsonl; model.bin was not written")
        if self.dist.is_master:
            path = m.save(self.out / "model.bin")
            self.log(f"saved {path}")
            self.log(self._sample_line())
        return last


def _mem(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"


def _physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None



def plan_options(cfg: TrainConfig, world_size: int, library_workspace: int = memplan.CUBLASLT_WORKSPACE,
                 precision: str | None = None) -> memplan.Options:
    """The memory plan's options of a TrainConfig: CUDA's default precision is bf16 (an sm_80+ GPU's). A run
    passes library_workspace=0 and its model's precision: the probe of batchfit measures the library's workspace."""
    cuda = cfg.device != "cpu"
    precision = precision or cfg.precision or ("bf16" if cuda else "fp32")
    return memplan.Options(device="cuda" if cuda else "cpu", precision=precision, world_size=world_size,
                           zero=cfg.zero, recompute=cfg.recompute, offload=cfg.offload,
                           attention="flash" if cfg.attention in (None, "auto") else cfg.attention,
                           library_workspace=library_workspace, optimizer=cfg.optimizer, fp8_head=cfg.fp8_head)
