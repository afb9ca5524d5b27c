"""Model and training configuration, with the GPT-2 presets."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

from . import cli
from .errors import ArgError

# the largest model shapes the core takes (its int32 index arithmetic and a sane memory footprint)
MAX_BLOCK_SIZE = 1 << 20
MAX_VOCAB = 1 << 24
MAX_DIM = 1 << 16


# The architecture fields' values, default (GPT-2) first.
ARCH_CHOICES = {"position": ("learned", "rope"), "norm": ("layernorm", "rmsnorm"), "activation": ("gelu", "relu2")}


# --log's values (the trackers themselves: gpt2core.training.trackers)
KINDS = ("tensorboard", "wandb")


def parse_kinds(value) -> list[str]:
    """'tensorboard', 'wandb', 'tensorboard,wandb' (or a list of them) -> the list; ArgError naming --log else."""
    if value is None or value == "":
        return []
    names = value.split(",") if isinstance(value, str) else list(value)
    names = [n.strip() for n in names if n.strip()]
    bad = [n for n in names if n not in KINDS]
    if bad:
        raise ArgError(f"--log: {', '.join(bad)} is not a tracker; use tensorboard, wandb, or both comma-separated")
    return list(dict.fromkeys(names))


class LogKinds(cli.Check):
    """--log's values: tensorboard, wandb, or both comma-separated."""
    what = "tensorboard, wandb or tensorboard,wandb"

    def valid(self, value) -> str | None:
        try:
            return None if parse_kinds(value) else "no tracker named"
        except ArgError as e:
            return str(e).removeprefix("--log: ")


@dataclass(frozen=True)
class GPT2Config:
    """A model's shape and architecture. The defaults are GPT-2 (2019): learned positions, LayerNorm with gain and
    bias, tanh-GELU, biases in every linear layer, the lm_head tied to wte, N(0, 0.02) init. The architecture fields
    switch on the parts the speedrun era replaced them with (`GPT2Config.modern` sets them all):

    position        "learned" (wpe) | "rope": no wpe; rotary embeddings on q and k, rotate-half layout, `rope_base`
    rope_base       rotary base (10000, as RoFormer / Llama)
    norm            "layernorm" | "rmsnorm": RMSNorm without gain, every block norm and the final norm
    qk_norm         RMSNorm of q and k per head before attention (after rotary)
    activation      "gelu" (tanh form) | "relu2": relu(x)^2
    bias            biases in every linear layer (and in the LayerNorms)
    tie_embeddings  False: a separate lm_head (padded_vocab_size, n_embd)
    zero_init_proj  the attention and MLP output projections (and an untied lm_head) start at zero
    logit_softcap   None | cap: logits = cap * tanh(logits / cap) before the cross-entropy (and in generation)
    """
    block_size: int = 1024          # max sequence length T (wpe rows)
    vocab_size: int = 50257         # real tokens
    padded_vocab_size: int = 50304  # rounded up to a multiple of 128 for fast GEMMs; never predicted
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    position: str = "learned"
    rope_base: float = 10000.0
    norm: str = "layernorm"
    qk_norm: bool = False
    activation: str = "gelu"
    bias: bool = True
    tie_embeddings: bool = True
    zero_init_proj: bool = False
    logit_softcap: float | None = None

    def __post_init__(self):
        """ArgError (a ValueError) naming the field unless every size is a positive int in the core's range and
        every architecture field one of its values."""
        for name, hi in (("block_size", MAX_BLOCK_SIZE), ("vocab_size", MAX_VOCAB), ("padded_vocab_size", MAX_VOCAB),
                         ("n_layer", MAX_DIM), ("n_head", MAX_DIM), ("n_embd", MAX_DIM)):
            cli.Int(1, hi, f"a positive int <= {hi:,}").check(getattr(self, name), f"GPT2Config.{name}")
        if self.padded_vocab_size < self.vocab_size:
            raise ArgError(f"padded_vocab_size ({self.padded_vocab_size}) must be >= vocab_size ({self.vocab_size})")
        if self.n_embd % self.n_head:
            raise ArgError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        for name, choices in ARCH_CHOICES.items():
            if getattr(self, name) not in choices:
                raise ArgError(f"GPT2Config.{name} must be one of {', '.join(map(repr, choices))}, "
                                 f"got {getattr(self, name)!r}")
        for name in ("qk_norm", "bias", "tie_embeddings", "zero_init_proj"):
            if not isinstance(getattr(self, name), bool):
                raise ArgError(f"GPT2Config.{name} must be True or False, got {getattr(self, name)!r}")
        rb = self.rope_base
        if isinstance(rb, bool) or not isinstance(rb, (int, float)) or not (math.isfinite(rb) and rb > 1):
            raise ArgError(f"GPT2Config.rope_base must be a finite number > 1, got {rb!r}")
        cap = self.logit_softcap
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float))
                                or not (math.isfinite(cap) and cap > 0)):
            raise ArgError(f"GPT2Config.logit_softcap must be None (no cap) or a finite number > 0, got {cap!r}")
        if self.position == "rope" and self.head_size % 2:
            raise ArgError(f"position='rope' needs an even head size (n_embd / n_head), got {self.head_size}")

    @classmethod
    def modern(cls, n_layer: int = 12, n_embd: int = 768, n_head: int | None = None, **kw) -> "GPT2Config":
        """The speedrun-era architecture on GPT-2's shape (the combination modded-nanogpt's records and nanochat
        train; any field can be overridden by keyword):

        - position="rope": rotary embeddings (Su et al. 2021, RoFormer; Llama), modded-nanogpt's first record
          (rotary + a higher LR: 5.0B tokens to GPT-2's 3.28 val loss instead of ~9B)
        - norm="rmsnorm" without gain (Zhang & Sennrich 2019; modded-nanogpt's and nanochat's `norm(x) =
          F.rms_norm(x, (x.size(-1),))`)
        - qk_norm=True (Dehghani et al. 2023; Wortsman et al. 2023), activation="relu2" (So et al. 2021,
          Primer), zero_init_proj=True (modded-nanogpt zero-initialises the output projections): together
          modded-nanogpt's 2.67B-token record
        - tie_embeddings=False: modded-nanogpt's untied head record (2.40B tokens)
        - logit_softcap=15.0 (Gemma 2's soft-capping; nanochat caps at 15, modded-nanogpt 30 then 15)
        - bias=False (PaLM, Llama, nanoGPT's bias=False option; none of the above has biases)
        - n_head: head size 128 where n_embd allows (modded-nanogpt's 6 heads at 768, nanochat's head_dim 128),
          else 64
        """
        if n_head is None:
            n_head = n_embd // 128 if n_embd % 128 == 0 else max(1, n_embd // 64)
        base = dict(n_layer=n_layer, n_embd=n_embd, n_head=n_head, position="rope", norm="rmsnorm", qk_norm=True,
                    activation="relu2", bias=False, tie_embeddings=False, zero_init_proj=True, logit_softcap=15.0)
        base.update(kw)
        return cls(**base)

    @property
    def head_size(self) -> int:
        return self.n_embd // self.n_head

    @property
    def is_gpt2(self) -> bool:
        """Every architecture field at GPT-2's value (zero_init_proj, an init choice, aside): what the llm.c and
        Hugging Face GPT-2 formats can hold."""
        return not self.non_gpt2_fields()

    def non_gpt2_fields(self) -> list[str]:
        """The architecture fields (name=value) where this config is not GPT-2 (zero_init_proj aside: it only
        changes the init)."""
        d = GPT2Config()
        return [f"{n}={getattr(self, n)!r}" for n in ARCH_FIELDS
                if n != "zero_init_proj" and getattr(self, n) != getattr(d, n)
                and not (n == "rope_base" and self.position == "learned")]

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """The tensors this config has, by name, in layout order (llm.c's for GPT-2; lm_head last when untied)."""
        L, C, Vp, T = self.n_layer, self.n_embd, self.padded_vocab_size, self.block_size
        ln, b = self.norm == "layernorm", self.bias
        s = {"wte": (Vp, C), "wpe": (T, C) if self.position == "learned" else None,
             "ln1w": (L, C) if ln else None, "ln1b": (L, C) if ln and b else None, "qkvw": (L, 3 * C, C),
             "qkvb": (L, 3 * C) if b else None, "attprojw": (L, C, C), "attprojb": (L, C) if b else None,
             "ln2w": (L, C) if ln else None, "ln2b": (L, C) if ln and b else None, "fcw": (L, 4 * C, C),
             "fcb": (L, 4 * C) if b else None, "fcprojw": (L, C, 4 * C), "fcprojb": (L, C) if b else None,
             "lnfw": (C,) if ln else None, "lnfb": (C,) if ln and b else None,
             "lm_head": (Vp, C) if not self.tie_embeddings else None}
        return {k: v for k, v in s.items() if v is not None}

    def num_parameters(self) -> int:
        """Parameter count including the padded vocab rows (124,475,904 for d12), of the tensors this config has
        (rotary adds none; RMSNorm has no gain; an untied head adds padded_vocab_size * n_embd)."""
        return sum(math.prod(s) for s in self.param_shapes().values())

    def newton_schulz_flops(self, steps: int = 5) -> int:
        """FLOPs of Muon's Newton-Schulz over every Muon matrix of one optimizer step (csrc/model/config.h
        muon_matrices: q, k, v and the attention projection (C, C), the MLP's (4C, C) and (C, 4C) per layer): per
        iteration on the k x w wide form (k <= w) 2 k^2 w (X X^T) + 2 k^3 (A A) + 2 k^2 w (B X)."""
        C, L = self.n_embd, self.n_layer
        per = lambda k, w: 4 * k * k * w + 2 * k ** 3  # noqa: E731
        return steps * L * (4 * per(C, C) + 2 * per(C, 4 * C))

    def flops_per_token(self, T: int | None = None) -> int:
        """Training FLOPs per token: 6*N (matmuls, forward + backward) + 6*L*C*T (attention), with N the
        parameter count less the embeddings that are lookups, not matmuls: wpe, and wte when the lm_head is untied
        (tied, wte is the lm_head's matmul) (PaLM appendix B / nanoGPT's estimate). Elementwise work (norms,
        rotary, activations, soft-cap) is not counted, as GELU is not."""
        T = T or self.block_size
        n = self.num_parameters()
        if self.position == "learned":
            n -= self.block_size * self.n_embd
        if not self.tie_embeddings:
            n -= self.padded_vocab_size * self.n_embd
        return 6 * n + 6 * self.n_layer * self.n_embd * T

    def to_dict(self) -> dict:
        return asdict(self)

    def replace(self, **kw) -> "GPT2Config":
        return replace(self, **kw)


# the architecture fields (everything after the shape), in declaration order
ARCH_FIELDS = ("position", "rope_base", "norm", "qk_norm", "activation", "bias", "tie_embeddings", "zero_init_proj",
               "logit_softcap")


PRESETS: dict[str, GPT2Config] = {
    # the GPT-2 family (OpenAI's sizes): 124M, 350M, 774M, 1558M
    "d12": GPT2Config(n_layer=12, n_head=12, n_embd=768),
    "d24": GPT2Config(n_layer=24, n_head=16, n_embd=1024),
    "d36": GPT2Config(n_layer=36, n_head=20, n_embd=1280),
    "d48": GPT2Config(n_layer=48, n_head=25, n_embd=1600),
    # small presets that train on a laptop CPU
    "s4": GPT2Config(block_size=256, n_layer=4, n_head=4, n_embd=256),
    "s2": GPT2Config(block_size=128, n_layer=2, n_head=2, n_embd=128),
    "tiny": GPT2Config(block_size=64, vocab_size=50257, padded_vocab_size=50304, n_layer=2, n_head=2, n_embd=64),
    # the modern architecture (GPT2Config.modern: rotary, RMSNorm, QK-norm, ReLU^2, no biases, untied head,
    # zero-initialised projections, soft-capped logits) on the d12 shape, and small ones for a laptop CPU
    "m12": GPT2Config.modern(12, 768),
    "m4": GPT2Config.modern(4, 256, n_head=4, block_size=256),
    "m2": GPT2Config.modern(2, 128, n_head=2, block_size=128),
}



def get_preset(name: str) -> GPT2Config:
    try:
        return PRESETS[name]
    except KeyError:
        raise ArgError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}") from None


# Training recipes (--recipe): the values a recipe sets; any flag given explicitly overrides them. "gpt2" is the
# 2019 recipe as gpt2core trains it by default (the TrainConfig defaults, AdamW + cosine), unchanged. "modern" is
# the modded-nanogpt / nanochat line (docs/training/recipes.md, "The modern recipe"): the architecture of issue 26
# (rotary positions, RMSNorm, QK-norm, ReLU^2, no biases, untied head, zero-initialised projections, logit soft-cap:
# GPT2Config fields, see MODERN_ARCH, set through their own train flags) trained with Muon for the hidden matrices and
# AdamW for the rest, warmup-stable-decay.
MODERN_ARCH = {"position": "rope", "norm": "rmsnorm", "qk_norm": True, "activation": "relu2", "bias": False,
               "tie_embeddings": False, "zero_init_proj": True, "logit_softcap": 15.0}


def arch_flags(arch: dict) -> dict:
    """GPT2Config architecture fields (name: value) as the TrainConfig fields that set them (bias=False is
    no_bias=True, tie_embeddings=False is untied=True; the others keep their names)."""
    rename = {"bias": ("no_bias", lambda v: not v), "tie_embeddings": ("untied", lambda v: not v)}
    return {rename[k][0] if k in rename else k: rename[k][1](v) if k in rename else v for k, v in arch.items()}


RECIPES: dict[str, dict] = {
    "gpt2": {},
    # AdamW's group LRs, Muon's LR and the warm-up: swept on linux-doc-6.12 at s4 (docs/training/recipes.md, "AdamW's
    # learning rates by group"; issue 35): the embedding's LR well above the head's, as in modded-nanogpt and nanochat
    "modern": {**arch_flags(MODERN_ARCH), "optimizer": "muon", "muon_lr": 0.01, "muon_momentum": 0.95,
               "muon_momentum_warmup": 300, "muon_weight_decay": 0.0, "muon_ns_dtype": "bfloat16",
               "newton_schulz_share": 0.2, "lr": 6e-3, "embedding_lr": 0.1,
               "head_lr": 6e-3, "beta1": 0.8, "beta2": 0.95, "weight_decay": 0.0, "schedule": "wsd",
               "cooldown_frac": 0.4, "warmup": 5, "min_lr_frac": 0.0},
}
# the switches a recipe turns on, which a command line can turn off again (--no-qk-norm, --bias, --no-untied, ...)
RECIPE_SWITCHES = sorted({k for r in RECIPES.values() for k, v in r.items() if isinstance(v, bool)})


# Supervised fine-tuning's own defaults (--sft): a tenth of pre-training's LR, no warmup, a linear decay to zero over
# the run (wsd with the whole run as its cool-down, as nanochat's SFT decays), no weight decay (nanochat's SFT), three
# passes over the conversations. Any flag given explicitly overrides them; --steps given replaces --epochs.
SFT_DEFAULTS = {"lr": 1e-4, "warmup": 0, "schedule": "wsd", "cooldown_frac": 1.0, "min_lr_frac": 0.0,
                "weight_decay": 0.0, "epochs": 3}


def negated_flag(name: str) -> str:
    """The switch that turns a recipe's bool field off: --no-<name>, or --<rest> for a no_<rest> field."""
    return "--" + (name[3:] if name.startswith("no_") else "no_" + name).replace("_", "-")


def recipe_help() -> str:
    """Every value of every recipe, for --help."""
    def show(name):
        vals = RECIPES[name]
        if not vals:
            return f"{name}: the defaults shown below (AdamW, cosine, GPT-2's architecture)"
        return f"{name}: " + ", ".join(f"{k}={v}" for k, v in vals.items())
    return "; ".join(show(n) for n in RECIPES)


def _opt(default, help: str, group: str, check: cli.Check | None = None, **argparse_kw):
    """A TrainConfig field: its default, what the command line needs (train.build_parser), and its checker (a
    gpt2core.cli.Check: the flag's type and TrainConfig's validation; a field without one may have an entry in
    _CHECKS below)."""
    meta = {"help": help, "group": group, **argparse_kw}
    if check is not None:
        meta["check"] = check
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class TrainConfig:
    """Every training setting and its default, once. `gpt2core-train`'s flags are these fields (--name-with-dashes;
    bools are switches); `GPT2.step` and `DataParallel.step` take their AdamW defaults from here.

    LR experiments are one flag: --lr scales the whole schedule (warmup peak, cosine, and the floor, which is
    --min-lr-frac of it), so "3x the max LR" is `--lr 1.8e-3` against a 6e-4 recipe."""
    # model
    recipe: str = _opt("gpt2", "training recipe: sets the values listed here unless given as flags. "
                       + recipe_help(), "model", choices=sorted(RECIPES))
    preset: str = _opt("s4", "model shape", "model", choices=sorted(PRESETS))
    block_size: int | None = _opt(None, "context length the model is built for (the wpe rows); above the preset's "
                                        "trains a longer context, e.g. 2048 as GPT-3 did (default: the preset's)",
                                  "model")
    padded_vocab_size: int | None = _opt(None, "override the padded vocab (50257 disables padding)", "model")
    device: str = _opt("cpu", "cpu, cuda or cuda:N", "model")
    precision: str | None = _opt(None, "fp32; tf32 (CUDA: TF32 tensor-core matmuls); bf16 (CUDA: bf16 activations "
                                       "and weights copy, fp32 master weights and optimizer state); fp16 (CUDA: "
                                       "the same in half precision, sm_70+). Default: bf16 on sm_80+ GPUs, fp16 on "
                                       "sm_70 / sm_75, else fp32; fp8 (sm_89 / sm_90: bf16 with the blocks' Linear layers "
                                       "multiplied in FP8, per-tensor scales from each tensor's amax)", "model",
                                 choices=["fp32", "tf32", "bf16", "fp16", "fp8"])
    fp8_head: bool = _opt(False, "--precision fp8: multiply the head (the logits) in FP8 too", "model")
    attention: str | None = _opt(None, "CUDA attention: auto (default: cuDNN's fused attention for bf16 when it "
                                       "passes a self-check at start, else flash), flash (gpt2core's kernel), cudnn, "
                                       "or the materialised 'naive' rung", "model",
                                 choices=["auto", "flash", "cudnn", "naive"])
    matmul_tuning: bool = _opt(False, "CUDA: time cuBLASLt's candidate algorithms once per matmul shape and keep "
                                      "the fastest (a resumed run may then round differently from an "
                                      "uninterrupted one; off: cuBLASLt's heuristic's first, bit-exact resume)",
                               "model")
    no_deterministic: bool = _opt(False, "CUDA: let cuDNN's attention backward accumulate with atomics (maybe "
                                         "faster; two identical runs, or a resumed one, then round differently). "
                                         "Default: deterministic, bit-exact resume", "model")
    loss_scaling: str = _opt("auto", "dynamic loss scaling (PyTorch GradScaler's rule, on the device): auto (on for "
                                     "fp16 only), on, off. An overflow skips the step and halves the scale",
                             "model", choices=["auto", "on", "off"])
    loss_scale_init: float = _opt(65536.0, "initial loss scale (2**16, as GradScaler)", "model")
    loss_scale_interval: int = _opt(2000, "steps in a row without overflow after which the loss scale doubles",
                                    "model")
    # the architecture (GPT2Config's fields, applied on top of the preset; see GPT2Config.modern and the m* presets)
    position: str | None = _opt(None, "positions: learned (wpe, GPT-2) or rope (rotary on q and k, no wpe) "
                                      "(default: the preset's)", "model", choices=["learned", "rope"])
    rope_base: float | None = _opt(None, "rotary base (default: the preset's, 10000)", "model")
    norm: str | None = _opt(None, "layernorm (GPT-2) or rmsnorm (no gain) for every norm (default: the preset's)",
                            "model", choices=["layernorm", "rmsnorm"])
    qk_norm: bool = _opt(False, "RMSNorm of q and k per head before attention", "model")
    activation: str | None = _opt(None, "MLP activation: gelu (tanh, GPT-2) or relu2 (relu(x)^2) (default: the "
                                        "preset's)", "model", choices=["gelu", "relu2"])
    no_bias: bool = _opt(False, "no biases in the linear layers and LayerNorms", "model")
    untied: bool = _opt(False, "a separate lm_head instead of one tied to wte", "model")
    zero_init_proj: bool = _opt(False, "start the attention and MLP output projections (and an untied lm_head) at "
                                       "zero", "model")
    logit_softcap: float | None = _opt(None, "soft-cap the logits: cap * tanh(logits / cap) (default: the preset's; "
                                             "0: none)", "model")
    recompute: str = _opt("none", "what backward recomputes instead of keeping from forward: none; gelu (the MLP "
                                  "activation's output: one buffer instead of one per layer); layer (only each "
                                  "block's input is kept and backward runs the block's forward again, one block at a "
                                  "time: about a third more compute for most of the activations' memory). The "
                                  "gradients are bit for bit the same. See --plan", "model",
                          choices=["none", "gelu", "layer"])
    recompute_gelu: bool = _opt(False, "the same as --recompute gelu", "model")
    offload: str = _opt("none", "optimizer: keep the fp32 master weights and AdamW moments in pinned host memory "
                                "and run AdamW on the host (CUDA, one process, AdamW; the same bits as on the GPU)",
                        "model",
                        choices=["none", "optimizer"])
    cuda_graphs: bool = _opt(False, "CUDA: capture each micro-step's forward and backward, and the optimizer step, "
                                    "in CUDA graphs and replay them (one launch instead of hundreds); with data "
                                    "parallel, gradients are then averaged after backward", "model")
    # data
    data_dir: str | None = _opt(None, "directory of token shards (*_train_*.bin, *_val_*.bin); default: the bundled "
                                      "tiny Shakespeare, prepared in <output-dir>/data", "data")
    batch_size: int | str = _opt("auto", "micro-batch size per process, or auto: on CUDA the largest that fits the "
                                         "GPU's free memory (measured at start), the total batch kept through "
                                         "gradient accumulation; on the CPU 8. An explicit B that does not fit the "
                                         "GPU is refused before the first step, naming the B that would",
                                 "data", flags=["-B", "--batch-size"], metavar="B|auto")
    seq_len: int = _opt(128, "sequence length (<= the block size)", "data", flags=["-T", "--seq-len"])
    total_batch_tokens: int | None = _opt(None, "tokens per optimizer step; gradient accumulation makes up the "
                                                "difference (default: B*T*world; with -B auto 8*T*world)", "data")
    no_shuffle: bool = _opt(False, "read shards and windows sequentially", "data")
    # supervised fine-tuning on conversations (gpt2core.data.sft, gpt2core.chat)
    sft: str | None = _opt(None, "fine-tune on conversations: a .jsonl file of {\"messages\": [{\"role\", "
                                 "\"content\"}, ...]} lines, or a folder of them, rendered in the chat format "
                                 "(gpt2core.chat), packed into rows of -T, the loss on the assistant's tokens only. "
                                 "Its defaults, unless given as flags: "
                                 + ", ".join(f"{k}={v}" for k, v in SFT_DEFAULTS.items()),
                           "supervised fine-tuning", metavar="CONVERSATIONS")
    init: str | None = _opt(None, "start from this model's weights (an llm.c model file such as out/model.bin, a "
                                  "training checkpoint or a Hugging Face GPT-2): its shape replaces --preset and the "
                                  "architecture flags; with --sft its vocab gains the chat tokens", "supervised "
                                  "fine-tuning", metavar="MODEL")
    epochs: int | None = _opt(None, "--sft: passes over the training conversations; sets --steps (default with "
                                    "--sft: 3, unless --steps is given)", "supervised fine-tuning")
    sft_val_frac: float = _opt(0.05, "--sft: the fraction of conversations held out for the validation loss "
                                     "(seeded; 0: none)", "supervised fine-tuning")
    # optimization: AdamW (decoupled weight decay on 2-D weights only) with warmup + cosine LR
    steps: int = _opt(120, "optimizer steps", "optimization")
    lr: float = _opt(1e-3, "max learning rate (the whole schedule scales with it)", "optimization")
    min_lr_frac: float = _opt(0.1, "min LR as a fraction of --lr (cosine)", "optimization")
    warmup: int = _opt(10, "linear warmup steps", "optimization")
    schedule: str = _opt("cosine", "LR after warmup: cosine to the floor, constant, or wsd (warmup-stable-decay: "
                                   "constant, then a linear cool-down to the floor over the last --cooldown-frac "
                                   "of the steps)", "optimization", choices=["cosine", "constant", "wsd"])
    cooldown_frac: float = _opt(0.4, "wsd: the fraction of the steps the LR cools down over (modded-nanogpt: 0.4)",
                                "optimization")
    weight_decay: float = _opt(0.1, "AdamW weight decay (2-D weights only)", "optimization")
    grad_clip: float = _opt(1.0, "global grad-norm clip (0 disables)", "optimization")
    beta1: float = _opt(0.9, "AdamW beta1", "optimization")
    beta2: float = _opt(0.95, "AdamW beta2", "optimization")
    eps: float = _opt(1e-8, "AdamW epsilon", "optimization")
    optimizer: str = _opt("adamw", "adamw: AdamW for every tensor; muon: Muon (momentum orthogonalised by "
                                   "Newton-Schulz) for the hidden matrices (attention q, k, v, projection, MLP), "
                                   "AdamW (--lr, --weight-decay) for embeddings, head, gains and biases",
                          "optimization", choices=["adamw", "muon"])
    muon_lr: float = _opt(0.02, "Muon's max learning rate (the --schedule scales it as it scales --lr)",
                          "optimization")
    muon_momentum: float = _opt(0.95, "Muon's momentum (Nesterov)", "optimization")
    muon_momentum_warmup: int = _opt(300, "steps over which Muon's momentum rises linearly from 0.85 to "
                                          "--muon-momentum (modded-nanogpt's warm-up; 0: none)", "optimization")
    muon_weight_decay: float = _opt(0.0, "Muon's decoupled weight decay (lr * wd per step)", "optimization")
    muon_ns_steps: int = _opt(5, "Newton-Schulz iterations per Muon step", "optimization")
    newton_schulz_share: float | None = _opt(
        None, "--optimizer muon without --total-batch-tokens: accumulate micro-batches (B*T*world each) until "
              "Newton-Schulz's FLOPs are at most this share of the optimizer step's forward + backward FLOPs, so that "
              "Muon's fixed cost per step is amortised over enough tokens (TrainConfig.tokens_per_step); unset: one "
              "micro-batch per step", "optimization")
    muon_ns_dtype: str = _opt("float32", "Newton-Schulz's products: float32 (the model's type), or bfloat16 (inputs "
                                         "rounded to bf16, fp32 sums: AVX512-BF16 on CPUs that have it; the CUDA "
                                         "backend's always are bf16)", "optimization",
                              choices=["float32", "bfloat16"])
    # AdamW's LR groups under --optimizer muon (csrc/model/config.h param_lr_group), each following the --schedule
    # as --lr does; modded-nanogpt and nanochat give the embedding a much higher LR than the head
    # (docs/training/recipes.md, "The modern recipe")
    embedding_lr: float | None = _opt(None, "--optimizer muon: AdamW's max LR for the embeddings (wte, wpe; a tied "
                                            "head is wte) (default: --lr)", "optimization")
    head_lr: float | None = _opt(None, "--optimizer muon: AdamW's max LR for the untied lm_head (default: --lr)",
                                 "optimization")
    scalar_lr: float | None = _opt(None, "--optimizer muon: AdamW's max LR for the rest: norm gains and biases "
                                         "(default: --lr)", "optimization")
    outlier_z: float = _opt(5.0, "a step whose loss or grad norm is more than this many standard deviations above "
                                 "the previous 128 steps' is an outlier: warned about and logged in metrics.jsonl",
                            "optimization")
    skip_outliers: bool = _opt(False, "skip the update of an outlier step (see --outlier-z), as llm.c can",
                               "optimization")
    # evaluation and output
    val_every: int = _opt(40, "validation loss every N steps (0: never)", "evaluation and output")
    val_steps: int = _opt(8, "batches per validation", "evaluation and output")
    hellaswag_every: int = _opt(0, "HellaSwag accuracy every N steps and at the end (0: never)",
                                "evaluation and output")
    hellaswag_path: str | None = _opt(None, "HellaSwag val set: rendered .npz, rowanz .jsonl or 6-line .txt "
                                            "(default: download)", "evaluation and output")
    hellaswag_limit: int | None = _opt(None, "score only the first N HellaSwag items", "evaluation and output")
    core_every: int = _opt(0, "CORE (DCLM's score, gpt2core.core_eval) every N steps and at the end (0: never; needs "
                              "--core-bundle)", "evaluation and output", check=cli.Int(0, what="an integer >= 0 "
                                                                                         "(0: never)"))
    core_bundle: str | None = _opt(None, "the CORE eval bundle: its folder or zip (core.yaml, eval_meta_data.csv, "
                                         "eval_data/)", "evaluation and output",
                                   check=cli.Optional(cli.existing_path), metavar="PATH")
    core_max_per_task: int | None = _opt(500, "CORE during training scores the first N items of each task (none: "
                                              "all; nanochat uses 500)", "evaluation and output",
                                         check=cli.Optional(cli.Int(1)))
    no_progress: bool = _opt(False, "no progress bars for HellaSwag (they show only on a terminal, on rank 0, on "
                                    "stderr)", "evaluation and output")
    sample_every: int = _opt(0, "print a text sample every M steps (0: only at the end)", "evaluation and output")
    sample_tokens: int = _opt(48, "tokens per text sample", "evaluation and output")
    sample_prompt: str = _opt("\n", "text the samples continue", "evaluation and output")
    output_dir: str = _opt("out", "metrics.jsonl and model.bin go here", "evaluation and output")
    log: str | None = _opt(None, "also send every metrics.jsonl record to tensorboard (event files in "
                                 "<output-dir>/tensorboard), wandb, or both (tensorboard,wandb); a tracker that fails "
                                 "is one warning (gpt2core.trackers)", "evaluation and output",
                           check=cli.Optional(LogKinds()), metavar="TRACKERS")
    wandb_project: str = _opt("gpt2core", "W&B project (--log wandb)", "evaluation and output")
    wandb_run_name: str | None = _opt(None, "W&B run name (default: the output folder's name)",
                                      "evaluation and output")
    wandb_mode: str = _opt("offline", "W&B mode: offline (no account needed; upload later with wandb sync "
                                      "<output-dir>/wandb/offline-run-*) or online", "evaluation and output",
                           check=cli.Choice("offline", "online"), choices=["offline", "online"])
    seed: int = _opt(1337, "weights init, data order and sampling", "evaluation and output")
    threads: int | None = _opt(None, "CPU threads (default: all cores)", "evaluation and output")
    # data parallel
    zero: int = _opt(0, "1: ZeRO-1, each rank keeps and updates only its shard of the AdamW state; 2: ZeRO-2, "
                        "the gradients sharded too (reduce-scattered bucket by bucket in every backward; AdamW "
                        "only)",
                     "data parallel (under torchrun, python -m gpt2core.launch, srun or mpirun)", choices=[0, 1, 2])
    no_overlap_comm: bool = _opt(False, "average gradients in one allreduce after backward instead of overlapping "
                                        "it with the last micro-step's backward (for measurements; ZeRO-1 never "
                                        "overlaps)", "data parallel (under torchrun, python -m gpt2core.launch, srun "
                                                     "or mpirun)")
    dist_timeout: float = _opt(300.0, "seconds a collective waits for the other ranks before the run fails (a dead "
                                      "or hung rank)", "data parallel (under torchrun, python -m gpt2core.launch, "
                                                       "srun or mpirun)")
    # checkpoints
    checkpoint_every: int = _opt(0, "write <output-dir>/checkpoints/step_NNNNNN every N steps and at the end "
                                    "(0: never)", "checkpoints")
    keep_last: int = _opt(0, "keep only the newest K checkpoints (0: all)", "checkpoints")
    resume: str | None = _opt(None, "continue from a checkpoint directory, or 'auto': the newest complete "
                                    "checkpoint in <output-dir>/checkpoints (a fresh start if there is none)",
                              "checkpoints", metavar="DIR|auto")
    overwrite: bool = _opt(False, "start over in an --output-dir that holds another run: delete its model.bin, "
                                  "metrics.jsonl and checkpoints first (without it such a folder is refused)",
                           "checkpoints")

    # the settings that change the trajectory: a resumed run that changes them no longer matches an uninterrupted one
    TRAJECTORY = ("recipe", "preset", "block_size", "padded_vocab_size", "position", "rope_base", "norm", "qk_norm",
                  "activation", "no_bias", "untied", "zero_init_proj", "logit_softcap", "batch_size", "seq_len",
                  "total_batch_tokens",
                  "no_shuffle", "steps", "lr", "min_lr_frac", "warmup", "schedule", "weight_decay", "grad_clip",
                  "beta1", "beta2", "eps", "seed", "loss_scaling", "loss_scale_init", "loss_scale_interval",
                  "cooldown_frac", "optimizer", "muon_lr", "muon_momentum", "muon_momentum_warmup",
                  "muon_weight_decay", "muon_ns_steps", "muon_ns_dtype", "embedding_lr", "head_lr", "scalar_lr", "sft", "init",
                  "epochs", "sft_val_frac")

    def __post_init__(self):
        """Every argument in its range: ArgError (a ValueError) naming the flag (gpt2core-train prints it as a
        one-line error and exits 2)."""
        cli.check_fields(self, checks=_CHECKS)
        if self.sft and self.data_dir:
            raise ArgError(f"--sft {self.sft} trains on conversations and --data-dir {self.data_dir} on token "
                           "shards: give one of them")
        if self.epochs is not None and not self.sft:
            raise ArgError("--epochs counts passes over --sft conversations: give --sft, or --steps for shards")
        if self.overwrite and self.resume:
            raise ArgError(f"--overwrite starts over and --resume {self.resume} continues: give one of them")
        if self.val_every and not self.val_steps:
            raise ArgError("--val-steps must be >= 1 when --val-every is set")
        if self.recipe not in RECIPES:
            raise ArgError(f"--recipe must be one of {', '.join(RECIPES)}, got {self.recipe!r}")
        if self.optimizer not in ("adamw", "muon"):
            raise ArgError(f"--optimizer must be adamw or muon, got {self.optimizer!r}")
        self._check_group_lrs()
        if self.schedule not in ("cosine", "constant", "wsd"):
            raise ArgError(f"--schedule must be cosine, constant or wsd, got {self.schedule!r}")
        if self.loss_scaling not in ("auto", "on", "off"):
            raise ArgError(f"--loss-scaling must be auto, on or off, got {self.loss_scaling!r}")
        if self.recompute_gelu:  # the old switch is the gelu level
            if self.recompute not in ("none", "gelu"):
                raise ArgError(f"--recompute-gelu and --recompute {self.recompute} disagree: give one of them")
            object.__setattr__(self, "recompute", "gelu")
        object.__setattr__(self, "recompute_gelu", self.recompute == "gelu")
        if self.device == "cpu" and self.offload != "none":
            raise ArgError("--offload optimizer needs --device cuda (on the CPU the optimizer is in host memory)")
        if self.fp8_head and self.precision != "fp8":
            raise ArgError(f"--fp8-head needs --precision fp8, got --precision {self.precision}")
        if self.precision == "fp8" and self.device == "cpu":
            raise ArgError("--precision fp8 needs an NVIDIA GPU with FP8 tensor cores, sm_89 (RTX 40xx, L4, L40) or "
                           "sm_90 (H100, H200); --device cpu has none")
        if self.precision == "fp8" and self.batch_size != "auto" and (self.batch_size * self.seq_len) % 16:
            raise ArgError(f"--precision fp8: -B * -T = {self.batch_size * self.seq_len} must be a multiple of 16 "
                           "(cuBLASLt's FP8 matmuls take inner dimensions in multiples of 16)")
        if self.device == "cpu" and self.precision not in (None, "fp32"):
            raise ArgError(f"--precision {self.precision} needs --device cuda (the CPU backend computes in fp32)")
        if self.device == "cpu" and self.attention in ("flash", "cudnn"):
            raise ArgError(f"--attention {self.attention} needs --device cuda (the CPU backend materialises "
                           "attention)")
        for flag in ("matmul_tuning", "cuda_graphs"):  # switches that would do nothing on the CPU
            if self.device == "cpu" and getattr(self, flag):
                raise ArgError(f"--{flag.replace('_', '-')} needs --device cuda (it does nothing on the CPU)")
        try:
            self.model_config()
        except ArgError as e:  # --padded-vocab-size below the vocab, --block-size beyond the core's range
            flags = [f"--{k.replace('_', '-')} {getattr(self, k)}" for k in ("block_size", "padded_vocab_size")
                     if getattr(self, k) is not None]
            raise ArgError(f"{' '.join(flags)} with --preset {self.preset}: {e}") from None

    GROUP_LRS = ("embedding_lr", "head_lr", "scalar_lr")

    def _check_group_lrs(self) -> None:
        """The AdamW group LRs are Muon's optimizer's: refused with --optimizer adamw unless a recipe set them
        (--recipe modern --optimizer adamw: every tensor then takes --lr)."""
        if self.optimizer == "muon":
            return
        given = [k for k in self.GROUP_LRS if getattr(self, k) is not None
                 and getattr(self, k) != RECIPES[self.recipe].get(k)]
        if given:
            raise ArgError(f"--{given[0].replace('_', '-')} is an AdamW group LR of --optimizer muon; with "
                           f"--optimizer {self.optimizer} every tensor takes --lr")

    def group_lrs(self, lr: float) -> dict:
        """The step's AdamW LRs by group, given the schedule's LR of the step (lr; each group's max LR is scaled by
        lr / --lr): with --optimizer muon step()'s lr (the rest: --scalar-lr), embedding_lr and head_lr, each lr
        itself where its flag is unset; with AdamW alone, {"lr": lr}."""
        if self.optimizer != "muon":
            return {"lr": lr}
        at = lambda v: lr if v is None else v * (lr / self.lr)  # noqa: E731
        return {"lr": at(self.scalar_lr), "embedding_lr": at(self.embedding_lr), "head_lr": at(self.head_lr)}

    @property
    def loss_scaling_on(self) -> bool | None:
        """--loss-scaling as GPT2's loss_scaling argument: None (auto: on for fp16 only), True or False."""
        return {"auto": None, "on": True, "off": False}[self.loss_scaling]

    def model_config(self) -> GPT2Config:
        """The preset, with --block-size, --padded-vocab-size and the architecture flags applied."""
        c = get_preset(self.preset)
        if self.block_size:
            c = c.replace(block_size=self.block_size)
        if self.padded_vocab_size:
            c = c.replace(padded_vocab_size=self.padded_vocab_size)
        arch = {k: getattr(self, k) for k in ("position", "rope_base", "norm", "activation") if getattr(self, k)}
        if self.qk_norm:
            arch["qk_norm"] = True
        if self.no_bias:
            arch["bias"] = False
        if self.untied:
            arch["tie_embeddings"] = False
        if self.zero_init_proj:
            arch["zero_init_proj"] = True
        if self.logit_softcap is not None:
            arch["logit_softcap"] = self.logit_softcap or None  # 0: none
        return c.replace(**arch) if arch else c

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_recipe(cls, recipe: str = "gpt2", **explicit) -> "TrainConfig":
        """The recipe's values, then with sft given SFT_DEFAULTS (--steps given: no --epochs), overridden by the
        explicit ones."""
        if recipe not in RECIPES:
            raise ArgError(f"--recipe must be one of {', '.join(RECIPES)}, got {recipe!r}")
        sft = dict(SFT_DEFAULTS) if explicit.get("sft") else {}
        if "steps" in explicit:
            sft.pop("epochs", None)
        return cls(**{**RECIPES[recipe], **sft, **explicit, "recipe": recipe})

    def tokens_per_step(self, model: "GPT2Config", tokens_per_micro: int) -> int:
        """Tokens per optimizer step: --total-batch-tokens; else, with --optimizer muon and --newton-schulz-share,
        the fewest micro-batches of tokens_per_micro whose forward + backward FLOPs are at least Newton-Schulz's
        FLOPs / the share (GPT2Config.newton_schulz_flops, flops_per_token); else one micro-batch."""
        if self.total_batch_tokens:
            return self.total_batch_tokens
        if self.optimizer != "muon" or not self.newton_schulz_share:
            return tokens_per_micro
        need = model.newton_schulz_flops(self.muon_ns_steps) / (self.newton_schulz_share *
                                                                 model.flops_per_token(self.seq_len))
        return max(1, math.ceil(need / tokens_per_micro)) * tokens_per_micro

    def optimizer_kw(self) -> dict:
        """The keywords of GPT2.step / DataParallel.step besides lr (and muon_lr, muon_momentum, which follow the
        schedules: Trainer.train_step)."""
        kw = dict(weight_decay=self.weight_decay, beta1=self.beta1, beta2=self.beta2, eps=self.eps,
                  grad_clip=self.grad_clip)
        if self.optimizer == "muon":
            kw.update(optimizer="muon", muon_weight_decay=self.muon_weight_decay, muon_ns_steps=self.muon_ns_steps,
                      muon_ns_dtype=self.muon_ns_dtype)
        return kw


def modern_config(c: GPT2Config) -> GPT2Config:
    """c (its shape kept) with the modern architecture's fields (MODERN_ARCH, what --recipe modern sets)."""
    return c.replace(**MODERN_ARCH)


_I, _F = cli.Int, cli.Float
# TrainConfig's checkers by field (a field may instead name its own: _opt(..., check=...)); the optimizer's
# hyper-parameters must also be representable in float32, the core's arithmetic
_CHECKS = {
    "preset": cli.Choice(*PRESETS), "device": cli.device,
    "block_size": _I(1, MAX_BLOCK_SIZE), "padded_vocab_size": _I(1, MAX_VOCAB),
    "batch_size": cli.AutoOr(_I(1, 1 << 24)), "seq_len": _I(1, MAX_BLOCK_SIZE), "total_batch_tokens": _I(1, 1 << 40),
    "steps": _I(1, 1 << 40), "lr": _F(0, lo_open=True, float32=True, what="a finite number > 0"),
    "min_lr_frac": _F(0, 1, what="a fraction in [0, 1]"), "warmup": _I(0),
    "weight_decay": _F(0, float32=True, what="a finite number >= 0"),
    "grad_clip": _F(0, float32=True, what="a finite number >= 0 (0 disables clipping)"),
    "beta1": _F(0, 1, hi_open=True, float32=True, what="a number in [0, 1)"),
    "beta2": _F(0, 1, hi_open=True, float32=True, what="a number in [0, 1)"),
    "eps": _F(0, lo_open=True, float32=True, what="a finite number > 0"),
    "outlier_z": _F(0, lo_open=True, what="a finite number > 0"),
    "val_every": _I(0, what="an integer >= 0 (0: never)"), "val_steps": _I(0), "hellaswag_every":
    _I(0, what="an integer >= 0 (0: never)"), "hellaswag_limit": _I(1),
    "sample_every": _I(0, what="an integer >= 0 (0: only at the end)"), "sample_tokens": _I(0),
    "seed": _I(0, 2**63 - 1, "an integer >= 0"), "threads": _I(1, 1 << 16),
    "dist_timeout": _F(0, 1e9, lo_open=True, what="a finite number of seconds > 0"),
    "loss_scale_init": _F(0, lo_open=True, float32=True, what="a finite number > 0 that fits in float32 (e.g. 65536)"),
    "loss_scale_interval": _I(1, 2**31 - 1, "an integer >= 1"),
    "recompute": cli.Choice("none", "gelu", "layer"), "offload": cli.Choice("none", "optimizer"),
    "checkpoint_every": _I(0, what="an integer >= 0 (0: never)"), "keep_last": _I(0, what="an integer >= 0 (0: all)"),
    "data_dir": cli.Optional(cli.existing_dir), "output_dir": cli.output_dir,
    "sft": cli.Optional(cli.existing_path),
    "epochs": _I(1, 1 << 20), "sft_val_frac": _F(0, 0.5, hi_open=True, what="a fraction in [0, 0.5)"),
    "hellaswag_path": cli.Optional(cli.existing_file),
    "recipe": cli.Choice(*RECIPES), "optimizer": cli.Choice("adamw", "muon"),
    "schedule": cli.Choice("cosine", "constant", "wsd"), "cooldown_frac": _F(0, 1, what="a fraction in [0, 1]"),
    "muon_lr": _F(0, float32=True, what="a finite number >= 0"),
    "muon_momentum": _F(0, 1, hi_open=True, float32=True, what="a number in [0, 1)"),
    "muon_momentum_warmup": _I(0), "muon_weight_decay": _F(0, float32=True, what="a finite number >= 0"),
    "muon_ns_steps": _I(0, 100), "muon_ns_dtype": cli.Choice("float32", "bfloat16"),
    "newton_schulz_share": cli.Optional(_F(0, 1, lo_open=True, what="a share in (0, 1]")),
    **{k: cli.Optional(_F(0, float32=True, what="a finite number >= 0")) for k in ("embedding_lr", "head_lr",
                                                                                   "scalar_lr")},
    "position": cli.Choice("learned", "rope"), "norm": cli.Choice("layernorm", "rmsnorm"),
    "activation": cli.Choice("gelu", "relu2"), "rope_base": _F(1, lo_open=True, float32=True, what="a finite number > 1"),
    "logit_softcap": _F(0, float32=True, what="a finite number >= 0 (0: none)"),
}
