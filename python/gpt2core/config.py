"""Model and training configuration, with the GPT-2 presets."""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace


@dataclass(frozen=True)
class GPT2Config:
    block_size: int = 1024          # max sequence length T (wpe rows)
    vocab_size: int = 50257         # real tokens
    padded_vocab_size: int = 50304  # rounded up to a multiple of 128 for fast GEMMs; never predicted
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768

    def __post_init__(self):
        for name in ("block_size", "vocab_size", "padded_vocab_size", "n_layer", "n_head", "n_embd"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"GPT2Config.{name} must be a positive int, got {v!r}")
        if self.padded_vocab_size < self.vocab_size:
            raise ValueError(f"padded_vocab_size ({self.padded_vocab_size}) must be >= vocab_size ({self.vocab_size})")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")

    @property
    def head_size(self) -> int:
        return self.n_embd // self.n_head

    def num_parameters(self) -> int:
        """Parameter count including the padded vocab rows (124,475,904 for d12)."""
        L, C, Vp, T = self.n_layer, self.n_embd, self.padded_vocab_size, self.block_size
        per_layer = 2 * C + 3 * C * C + 3 * C + C * C + C + 2 * C + 4 * C * C + 4 * C + 4 * C * C + C
        return Vp * C + T * C + L * per_layer + 2 * C

    def flops_per_token(self, T: int | None = None) -> int:
        """Training FLOPs per token: 6*N (matmuls, forward + backward) + 6*L*C*T (attention), with N the
        parameter count less the position embedding (PaLM appendix B / nanoGPT's estimate)."""
        T = T or self.block_size
        n = self.num_parameters() - self.block_size * self.n_embd
        return 6 * n + 6 * self.n_layer * self.n_embd * T

    def to_dict(self) -> dict:
        return asdict(self)

    def replace(self, **kw) -> "GPT2Config":
        return replace(self, **kw)


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
}


def get_preset(name: str) -> GPT2Config:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}") from None
