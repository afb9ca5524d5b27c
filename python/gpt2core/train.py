"""Train GPT-2: `python -m gpt2core.train` (console script `gpt2core-train`).

With no arguments it trains the small preset "s4" (4 layers, 4 heads, C=256) on the bundled tiny
Shakespeare on the CPU for a few minutes; the loss falls from ln(50257) = 10.8 to about 6 and a text
sample is printed. The 124M reproduction is

    gpt2core-train --preset d12 --data-dir data/edu_fineweb10B --device cuda -B 64 -T 1024 \
        --total-batch-tokens 524288 --steps 19073 --lr 6e-4 --warmup 715 --val-every 250

Each step prints step, loss, lr, grad norm, ms and tokens/s; metrics go to <out>/metrics.jsonl.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import numpy as np

from . import _C, tokenizer
from .checkpoint import (CheckpointError, checkpoint_dir, latest_checkpoint, list_checkpoints, load_checkpoint,
                         prune_checkpoints, save_checkpoint)
from .config import PRESETS, get_preset
from .data.loader import DataLoader
from .distributed import from_env
from .model import GPT2
from .schedule import lr_at


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="gpt2core-train", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_argument_group("model")
    g.add_argument("--preset", default="s4", choices=sorted(PRESETS), help="model shape (default: s4)")
    g.add_argument("--padded-vocab-size", type=int, default=None, help="override the padded vocab (50257 disables padding)")
    g.add_argument("--device", default="cpu", help="cpu or cuda")
    g.add_argument("--precision", choices=["fp32", "tf32", "bf16"], default=None,
                   help="fp32; tf32 (CUDA: TF32 tensor-core matmuls); bf16 (CUDA: bf16 activations and weights "
                        "copy, fp32 master weights and optimizer state). Default: bf16 on sm_80+ GPUs, else fp32")
    g.add_argument("--attention", choices=["auto", "flash", "cudnn", "naive"], default=None,
                   help="CUDA attention: auto (default: cuDNN's fused attention for bf16 when it passes a self-check at "
                        "start, else flash), flash (gpt2core's kernel), cudnn, or the materialised 'naive' rung")
    g.add_argument("--recompute-gelu", action="store_true",
                   help="recompute GELU outputs in backward instead of storing one per layer (less memory)")
    g.add_argument("--cuda-graphs", action="store_true",
                   help="CUDA: capture each micro-step's forward and backward, and the optimizer step, in CUDA "
                        "graphs and replay them (one launch instead of hundreds); with data parallel, gradients are "
                        "then averaged after backward")
    g = ap.add_argument_group("data")
    g.add_argument("--data-dir", default=None,
                   help="directory of token shards (*_train_*.bin, *_val_*.bin); default: the bundled tiny "
                        "Shakespeare, prepared in <output-dir>/data")
    g.add_argument("-B", "--batch-size", type=int, default=8, help="micro-batch size per process")
    g.add_argument("-T", "--seq-len", type=int, default=128, help="sequence length (<= the preset's block size)")
    g.add_argument("--total-batch-tokens", type=int, default=None,
                   help="tokens per optimizer step; gradient accumulation makes up the difference (default: B*T*world)")
    g.add_argument("--no-shuffle", action="store_true", help="read shards and windows sequentially")
    g = ap.add_argument_group("optimization")
    g.add_argument("--steps", type=int, default=120, help="optimizer steps")
    g.add_argument("--lr", type=float, default=1e-3, help="max learning rate")
    g.add_argument("--min-lr-frac", type=float, default=0.1, help="min LR as a fraction of --lr (cosine)")
    g.add_argument("--warmup", type=int, default=10, help="linear warmup steps")
    g.add_argument("--schedule", choices=["cosine", "constant"], default="cosine")
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--grad-clip", type=float, default=1.0, help="global grad-norm clip (0 disables)")
    g.add_argument("--beta1", type=float, default=0.9)
    g.add_argument("--beta2", type=float, default=0.95)
    g = ap.add_argument_group("evaluation and output")
    g.add_argument("--val-every", type=int, default=40, help="validation loss every N steps (0: never)")
    g.add_argument("--val-steps", type=int, default=8, help="batches per validation")
    g.add_argument("--hellaswag-every", type=int, default=0,
                   help="HellaSwag accuracy every N steps and at the end (0: never)")
    g.add_argument("--hellaswag-path", default=None,
                   help="HellaSwag val set: rendered .npz, rowanz .jsonl or 6-line .txt (default: download)")
    g.add_argument("--hellaswag-limit", type=int, default=None, help="score only the first N HellaSwag items")
    g.add_argument("--sample-every", type=int, default=0, help="print a text sample every M steps (0: only at the end)")
    g.add_argument("--sample-tokens", type=int, default=48)
    g.add_argument("--sample-prompt", default="\n")
    g.add_argument("--output-dir", default="out", help="metrics.jsonl and model.bin go here")
    g.add_argument("--seed", type=int, default=1337)
    g.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    g = ap.add_argument_group("data parallel (under torchrun, python -m gpt2core.launch, srun or mpirun)")
    g.add_argument("--zero", type=int, choices=[0, 1], default=0,
                   help="1: ZeRO-1, each rank keeps and updates only its shard of the AdamW state")
    g.add_argument("--no-overlap-comm", action="store_true",
                   help="average gradients in one allreduce after backward instead of overlapping it with the last "
                        "micro-step's backward (for measurements; ZeRO-1 never overlaps)")
    g.add_argument("--dist-timeout", type=float, default=300.0,
                   help="seconds a collective waits for the other ranks before the run fails (a dead or hung rank)")
    g = ap.add_argument_group("checkpoints")
    g.add_argument("--checkpoint-every", type=int, default=0,
                   help="write <output-dir>/checkpoints/step_NNNNNN every N steps and at the end (0: never)")
    g.add_argument("--keep-last", type=int, default=0, help="keep only the newest K checkpoints (0: all)")
    g.add_argument("--resume", default=None, metavar="DIR|auto",
                   help="continue from a checkpoint directory, or 'auto': the newest complete checkpoint in "
                        "<output-dir>/checkpoints (a fresh start if there is none)")
    return ap


# arguments that change the trajectory: a resumed run that changes them is no longer exact
_RESUME_ARGS = ("preset", "padded_vocab_size", "batch_size", "seq_len", "total_batch_tokens", "no_shuffle",
                "steps", "lr", "min_lr_frac", "warmup", "schedule", "weight_decay", "grad_clip", "beta1", "beta2",
                "seed")


class Trainer:
    def __init__(self, args):
        self.args = args
        self.dist = from_env()
        self.comm = self.ddp = None
        # each process of a multi-GPU run drives GPU LOCAL_RANK
        self.device = (f"cuda:{self.dist.local_rank}" if self.dist.world_size > 1 and args.device == "cuda"
                       else args.device)
        if self.dist.world_size > 1:  # join the process group first: a missing rank fails fast and by name
            from .distributed import init_process_group
            self.comm = init_process_group(self.dist, timeout=getattr(args, "dist_timeout", 300.0),
                                           device=self.device)
        if args.threads:
            _C.set_num_threads(args.threads)
        config = get_preset(args.preset)
        if args.padded_vocab_size:
            config = config.replace(padded_vocab_size=args.padded_vocab_size)
        B, T, W = args.batch_size, args.seq_len, self.dist.world_size
        if B <= 0 or T <= 0:
            raise SystemExit(f"gpt2core-train: -B and -T must be positive (got B={B}, T={T})")
        if T > config.block_size:
            raise SystemExit(f"gpt2core-train: -T {T} exceeds the block size {config.block_size} of preset {args.preset}")
        tokens_per_micro = B * T * W
        total = args.total_batch_tokens or tokens_per_micro
        if total % tokens_per_micro:
            raise SystemExit(f"gpt2core-train: --total-batch-tokens {total} is not a multiple of B*T*world_size = "
                             f"{B}*{T}*{W} = {tokens_per_micro}")
        self.grad_accum = total // tokens_per_micro
        self.total = total
        self.out = Path(args.output_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        data_dir = args.data_dir
        if data_dir is None:
            from .data import shakespeare
            if self.dist.is_master:  # one rank prepares the shards, the others wait for it
                shakespeare.ensure(self.out / "data")
            if self.comm is not None:
                self.comm.barrier()
            data_dir = shakespeare.ensure(self.out / "data")
        self.train_loader = DataLoader(data_dir, "train", B, T, rank=self.dist.rank, world_size=W,
                                       shuffle=not args.no_shuffle, seed=args.seed)
        self.val_loader = DataLoader(data_dir, "val", B, T, rank=self.dist.rank, world_size=W, shuffle=False)
        self.hellaswag = None
        if getattr(args, "hellaswag_every", 0):
            from .data import hellaswag
            self.hellaswag = hellaswag.load(args.hellaswag_path, args.hellaswag_limit)
        self.model = GPT2(config, device=self.device, seed=args.seed, precision=getattr(args, "precision", None),
                          attention=getattr(args, "attention", None))
        self.model.recompute_gelu = getattr(args, "recompute_gelu", False)
        graphs = getattr(args, "cuda_graphs", False)
        if graphs and self.device == "cpu":
            raise SystemExit("gpt2core-train: --cuda-graphs needs --device cuda")
        self.model.cuda_graphs = graphs
        self.config = config
        self.metrics_path = self.out / "metrics.jsonl"
        self.flops_per_token = config.flops_per_token(T)
        self.ckpt_root = self.out / "checkpoints"
        self.start_step = 0
        ck = self.resume(args.resume) if getattr(args, "resume", None) else None
        if self.comm is not None:  # after resume: ZeRO-1 reads its shard of the checkpoint's AdamW state
            from .distributed import DataParallel
            zero = getattr(args, "zero", 0)
            # None: on unless ZeRO-1; a captured backward cannot call back into Python to start collectives
            overlap = False if getattr(args, "no_overlap_comm", False) or graphs else None
            self.ddp = DataParallel(self.model, self.comm, zero=zero, resume_from=ck, overlap=overlap)

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

    def resume(self, where: str):
        """Restore weights, AdamW state, step, loader position and metrics from a checkpoint; returns it (None
        when 'auto' found none). With ZeRO-1 the AdamW moments are left to DataParallel(resume_from=...),
        which reads only this rank's range."""
        if where == "auto":
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
        if ck.config != self.config:
            raise CheckpointError(f"{ck.path}: checkpoint model {ck.config} does not match this run's {self.config} "
                                  "(use the same --preset and --padded-vocab-size)")
        saved = ck.state.get("args", {})
        changed = [f"--{k.replace('_', '-')} {saved.get(k)!r} -> {getattr(self.args, k, None)!r}"
                   for k in _RESUME_ARGS if k in saved and saved[k] != getattr(self.args, k, None)]
        if changed:
            self.log("warning: resuming with changed arguments, the run will not match an uninterrupted one: "
                     + ", ".join(changed))
        zero = self.comm is not None and bool(getattr(self.args, "zero", 0))
        if ck.zero is not None and (not zero or ck.zero["world_size"] != self.dist.world_size):
            raise ck.layout_error(self.dist.world_size, zero)
        ck.restore(self.model, optimizer=not zero)
        try:
            self.train_loader.load_state_dict(ck.state["train_loader"])
        except (KeyError, ValueError) as e:
            raise CheckpointError(f"{ck.path}: cannot restore the data loader position: {e}") from e
        self.start_step = ck.step
        if self.dist.is_master:
            tmp = self.metrics_path.with_name(self.metrics_path.name + ".resume.tmp")
            if ck.metrics_path is not None:
                tmp.write_bytes(ck.metrics_path.read_bytes())
            else:
                tmp.write_bytes(b"")
            os.replace(tmp, self.metrics_path)  # drop records of steps after the checkpoint
        self.log(f"resumed from {ck.path} at step {ck.step}")
        return ck

    def save_checkpoint(self, step: int) -> Path | None:
        """Checkpoint after `step` optimizer steps (rank 0 writes it; with ZeRO-1 every rank also writes its
        optimizer shard, a collective), then prune to --keep-last (rank 0, once every shard is on disk)."""
        zero = self.ddp is not None and self.ddp.zero
        if not (zero or self.dist.is_master):
            return None
        a = self.args
        t0 = time.perf_counter()
        state = {
            "train_loader": self.train_loader.state_dict(),
            "args": {k: v for k, v in vars(a).items() if isinstance(v, (str, int, float, bool, type(None)))},
            "lr_next": lr_at(step, a.lr, a.warmup, a.steps, a.min_lr_frac * a.lr, a.schedule),
            "grad_accum": self.grad_accum,
            "world_size": self.dist.world_size,
            # the data order is a function of (seed, loader position); sampling is seeded per call
            "rng": {"data": "train_loader position + seed", "sampling": f"seed {a.seed} per call"},
        }
        path = save_checkpoint(self.ckpt_root, step, self.model, state, metrics_path=self.metrics_path,
                               zero=self.ddp if zero else None)
        if not self.dist.is_master:
            return path
        keep = getattr(a, "keep_last", 0)
        removed = prune_checkpoints(self.ckpt_root, keep)  # also removes temporary dirs left by a crash
        self.log(f"checkpoint {path} ({time.perf_counter() - t0:.1f} s)"
                 + (f"; removed {len(removed)} old" if removed else ""))
        return path

    def log(self, msg: str) -> None:
        if self.dist.is_master:
            print(msg, flush=True)

    def write_metrics(self, rec: dict) -> None:
        if self.dist.is_master:
            with open(self.metrics_path, "a") as f:
                f.write(json.dumps(rec) + "\n")

    def val_loss(self) -> float:
        self.val_loader.reset()
        losses = []
        for _ in range(self.args.val_steps):
            x, y = self.val_loader.next_batch()
            losses.append(self.model.forward(x, y))
        vl = float(np.mean(losses))
        return self.ddp.mean(vl)[0] if self.ddp else vl  # each rank read its own rows: combine them

    def hellaswag_eval(self) -> dict:
        """HellaSwag accuracy: each rank scores items i % world_size == rank, counts summed over ranks."""
        from .evaluate import score_hellaswag
        a = self.args
        # batches of about one training micro-batch's tokens: activations the size training already uses
        row_len = min(self.config.block_size, self.hellaswag.max_row_len())
        per = max(1, (a.batch_size * a.seq_len) // (4 * row_len))
        r = score_hellaswag(self.model, self.hellaswag, items_per_batch=per, rank=self.dist.rank,
                            world_size=self.dist.world_size)
        counts = np.array([r["n"], r["correct"], r["correct_norm"]], dtype=np.float64)
        if self.comm is not None:
            counts = counts.astype(np.float32)  # exact for counts below 2**24
            self.comm.allreduce(counts, "sum")
        n, c, cn = (int(round(float(v))) for v in counts)
        return {"n": n, "acc": c / n, "acc_norm": cn / n}

    def sample(self) -> str:
        prompt = tokenizer.encode(self.args.sample_prompt) or [tokenizer.EOT]
        out = self.model.generate(np.array([prompt]), self.args.sample_tokens, top_k=50, seed=self.args.seed)
        return tokenizer.decode(out[0, len(prompt):])

    def run(self) -> dict:
        a, m = self.args, self.model
        self.log(f"gpt2core {_C.build_info()['version']} | preset {a.preset}: {m.num_parameters:,} params | "
                 f"device {a.device} | threads {_C.get_num_threads()}")
        self.log(f"batch: B={a.batch_size} T={a.seq_len} world={self.dist.world_size} grad_accum={self.grad_accum} "
                 f"-> {self.total:,} tokens/step | train tokens {self.train_loader.n_tokens:,} | "
                 f"val tokens {self.val_loader.n_tokens:,}")
        mem = m.memory_report(a.batch_size, a.seq_len)
        self.log("memory: " + " | ".join(f"{k} {v / 2**20:,.1f} MiB" for k, v in mem.items()) +
                 (" (GELU recomputed in backward)" if m.recompute_gelu else ""))
        if self.ddp:
            self.log(self.ddp.describe())
        last = {}
        every = getattr(a, "checkpoint_every", 0)
        for step in range(self.start_step, a.steps):
            last_step = step == a.steps - 1
            if a.val_every and (step % a.val_every == 0 or last_step):
                vl = self.val_loss()
                self.log(f"step {step:5d} | val loss {vl:.4f}")
                self.write_metrics({"step": step, "val_loss": vl})
                last["val_loss"] = vl
            if getattr(a, "hellaswag_every", 0) and (step % a.hellaswag_every == 0 or last_step):
                hs = self.hellaswag_eval()
                self.log(f"step {step:5d} | hellaswag acc {hs['acc']:.4f} acc_norm {hs['acc_norm']:.4f} "
                         f"({hs['n']} items)")
                self.write_metrics({"step": step, "hellaswag_acc": hs["acc"], "hellaswag_acc_norm": hs["acc_norm"]})
                last["hellaswag_acc"], last["hellaswag_acc_norm"] = hs["acc"], hs["acc_norm"]
            if a.sample_every and step > 0 and step % a.sample_every == 0:
                self.log(f"step {step:5d} | sample: {self.sample()!r}")
            t0 = time.perf_counter()
            lr = lr_at(step, a.lr, a.warmup, a.steps, a.min_lr_frac * a.lr, a.schedule)
            m.zero_grad()
            loss = 0.0
            for i in range(self.grad_accum):
                x, y = self.train_loader.next_batch()
                if self.ddp and self.ddp.overlap and i == self.grad_accum - 1:
                    # the last micro-step's backward averages the gradients over ranks as it goes
                    loss += m.forward(x, y) / self.grad_accum
                    self.ddp.backward(1.0 / self.grad_accum, last=True)
                else:  # the loss stays on the device: no wait for the GPU between micro-steps
                    m.forward_backward(x, y, 1.0 / self.grad_accum)
            loss += m.take_loss()
            if not math.isfinite(loss):
                raise FloatingPointError(f"loss is {loss} at step {step}; weights were not updated "
                                         "(try a lower --lr)")
            # data parallel: the one gradient exchange of the step (or the wait for it), after the last micro-step
            norm = (self.ddp.step if self.ddp else m.step)(lr, weight_decay=a.weight_decay, beta1=a.beta1,
                                                           beta2=a.beta2, grad_clip=a.grad_clip)
            if self.ddp:
                loss = self.ddp.mean(loss)[0]
            dt = time.perf_counter() - t0
            tps = self.total / dt
            gflops = tps * self.flops_per_token / 1e9
            self.log(f"step {step + 1:5d}/{a.steps} | loss {loss:.4f} | lr {lr:.2e} | norm {norm:.3f} | "
                     f"{dt * 1e3:.0f} ms | {tps:,.0f} tok/s | {gflops:.1f} GFLOP/s")
            rec = {"step": step + 1, "loss": loss, "lr": lr, "grad_norm": norm, "dt_ms": dt * 1e3, "tok_per_s": tps}
            if self.ddp:  # rank 0's time in the step's gradient/parameter collectives (scaling analysis)
                rec["comm_ms"] = self.ddp.last_comm_ms
            self.write_metrics(rec)
            last.update(rec)
            if every and ((step + 1) % every == 0 or last_step):
                self.save_checkpoint(step + 1)
        if self.dist.is_master:
            path = m.save(self.out / "model.bin")
            self.log(f"saved {path}")
            self.log(f"sample: {self.sample()!r}")
        return last


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    try:
        return Trainer(args).run()
    except CheckpointError as e:
        raise SystemExit(f"gpt2core-train: {e}") from e


if __name__ == "__main__":
    main()
