"""The Trainer's evaluations during a run: validation loss and bits per byte, HellaSwag, CORE (each rank scores its
share, the counts summed over ranks) and the text samples. A mixin of Trainer (trainer.py)."""
from __future__ import annotations

import numpy as np

from .. import chat, tokenizer
from ..config import TrainConfig
from ..errors import ArgError
from ..evaluation import core_eval
from ..evaluation.evaluate import bits_per_byte, evaluate_val, score_hellaswag

SFT_SAMPLE_PROMPT = "Hello!"  # the user message of an --sft run's samples when --sample-prompt is blank (its default)


class Evaluations:
    """Trainer's evaluation and sampling methods (they use its cfg, model, loaders and over_ranks)."""

    def val_metrics(self) -> dict:
        """{"val_loss", "val_bpb"} of --val-steps fixed validation batches (each rank reads its own rows; the loss
        averaged over ranks, bits per byte from the nats and bytes summed over ranks)."""
        v = evaluate_val(self.model, self.val_loader, self.cfg.val_steps)
        loss, nats, nbytes = self.over_ranks("sum", v["val_loss"], v["val_nats"], v["val_bytes"])
        return {"val_loss": loss / self.dist.world_size, "val_bpb": bits_per_byte(nats, nbytes)}

    def hellaswag_eval(self) -> dict:
        """HellaSwag accuracy: each rank scores items i % world_size == rank, counts summed over ranks."""
        cfg = self.cfg
        # batches of about one training micro-batch's tokens: activations the size training already uses
        row_len = min(self.config.block_size, self.hellaswag.max_row_len())
        per = max(1, (cfg.batch_size * cfg.seq_len) // (4 * row_len))
        r = score_hellaswag(self.model, self.hellaswag, items_per_batch=per, rank=self.dist.rank,
                            world_size=self.dist.world_size, progress=self.progress)
        counts = self.over_ranks("sum", r["n"], r["correct"], r["correct_norm"])  # float32: exact below 2**24
        n, c, cn = (int(round(v)) for v in counts)
        return {"n": n, "acc": c / n, "acc_norm": cn / n}

    @staticmethod
    def _core_tasks(cfg: TrainConfig):
        """--core-every: the bundle's tasks, read once before training (a bad bundle fails the run at its start)."""
        if not cfg.core_every:
            return None
        if not cfg.core_bundle:
            raise ArgError("--core-every needs --core-bundle: the eval bundle's folder or zip (nanochat's is "
                           f"{core_eval.BUNDLE_URL})")
        return core_eval.load_bundle(cfg.core_bundle)

    def core_metrics(self) -> dict:
        """{"core", "core_tasks": {label: centered}}: each rank scores items i % world_size == rank of the first
        --core-max-per-task items of every task, in forwards of one training micro-batch's tokens."""
        cfg = self.cfg
        r = core_eval.evaluate_core(self.model, self.core_tasks, max_per_task=cfg.core_max_per_task,
                                    batch_tokens=cfg.batch_size * cfg.seq_len, rank=self.dist.rank,
                                    world_size=self.dist.world_size, comm=self.comm, progress=self.progress)
        return {"core": r["core"], "core_tasks": {k: v["centered"] for k, v in r["tasks"].items()}}

    def sample(self) -> str:
        """A text sample of at most --sample-tokens tokens (top-k 50, --seed): the continuation of --sample-prompt;
        after --sft the reply in the chat format to --sample-prompt as a user message (SFT_SAMPLE_PROMPT in place of
        a blank one), up to <|assistant_end|>, as gpt2core-chat would answer it."""
        cfg = self.cfg
        if cfg.sft:
            try:
                return chat.generate_reply(self.model, [{"role": "user", "content": self.sample_prompt()}],
                                           cfg.sample_tokens, top_k=50, seed=cfg.seed)
            except ArgError:  # the prompt fills the context: no room for a reply
                return ""
        prompt = tokenizer.encode(cfg.sample_prompt) or [tokenizer.EOT]
        out = self.model.generate(np.array([prompt]), cfg.sample_tokens, top_k=50, seed=cfg.seed)
        return tokenizer.decode(out[0, len(prompt):])

    def sample_prompt(self) -> str:
        """The text sample() starts from: --sample-prompt, or after --sft SFT_SAMPLE_PROMPT for a blank one."""
        p = self.cfg.sample_prompt
        return p if not self.cfg.sft or p.strip() else SFT_SAMPLE_PROMPT

    def _sample_line(self) -> str:
        what = f"sample (reply to {self.sample_prompt()!r})" if self.cfg.sft else "sample"
        return f"{what}: {self.sample()!r}"
