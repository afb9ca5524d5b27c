"""GPT-2 BPE tokenizer through tiktoken, working offline.

The vocabulary files (encoder.json, vocab.bpe) ship inside the package (gpt2core/assets/, copied from
OpenAI's GPT-2 release; see assets/SOURCES.md). They are byte-identical to the files tiktoken downloads
for its "gpt2" encoding, so offline and online users get exactly the same token ids.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path

import numpy as np

ASSETS = Path(__file__).resolve().parent / "assets"
EOT = 50256          # <|endoftext|>
VOCAB_SIZE = 50257
# The chat format's special tokens (nanochat's names, and a system pair), in GPT-2's padded vocabulary rows:
# 50257..50303 exist in every gpt2core model (padded_vocab_size 50304) and the BPE never produces them, so they
# change no weight shape. encode() never makes them from text; decode() shows their names. gpt2core.chat renders
# conversations with them.
CHAT_TOKENS = {"<|user_start|>": 50257, "<|user_end|>": 50258, "<|assistant_start|>": 50259,
               "<|assistant_end|>": 50260, "<|system_start|>": 50261, "<|system_end|>": 50262}
CHAT_VOCAB_SIZE = max(CHAT_TOKENS.values()) + 1  # the vocab_size a model needs to read and write them
ASSISTANT_END = CHAT_TOKENS["<|assistant_end|>"]
# the ids that end a generated sequence (where the model's vocabulary has them): end of text, end of the
# assistant's turn
END_IDS = (EOT, ASSISTANT_END)
# OpenAI's r50k/gpt2 pre-tokenization pattern (tiktoken_ext/openai_public.py)
_PAT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""


@functools.lru_cache(maxsize=1)
def get_encoding():
    """The GPT-2 `tiktoken.Encoding`, built from the vocabulary files shipped in the package."""
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks

    # tiktoken >= 0.12 reads plain paths; keep it from copying them into its cache directory.
    old = os.environ.get("TIKTOKEN_CACHE_DIR")
    os.environ["TIKTOKEN_CACHE_DIR"] = ""
    try:
        ranks = data_gym_to_mergeable_bpe_ranks(
            vocab_bpe_file=str(ASSETS / "vocab.bpe"), encoder_json_file=str(ASSETS / "encoder.json"))
    finally:
        if old is None:
            del os.environ["TIKTOKEN_CACHE_DIR"]
        else:
            os.environ["TIKTOKEN_CACHE_DIR"] = old
    return tiktoken.Encoding(name="gpt2", pat_str=_PAT, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": EOT, **CHAT_TOKENS})


def encode(text: str, allow_special: bool = False) -> list[int]:
    """Token ids of `text`. With allow_special, the literal "<|endoftext|>" becomes token 50256. The chat tokens
    (CHAT_TOKENS) are never made from text: "<|user_start|>" in a message is the BPE of that string."""
    enc = get_encoding()
    if allow_special:
        return enc.encode(text, allowed_special={"<|endoftext|>"}, disallowed_special=())
    return enc.encode_ordinary(text)


def encode_batch(texts: list[str], num_threads: int = 8) -> list[list[int]]:
    return get_encoding().encode_ordinary_batch(texts, num_threads=num_threads)


def decode(tokens) -> str:
    return get_encoding().decode([int(t) for t in np.asarray(tokens).reshape(-1)])


@functools.lru_cache(maxsize=1)
def token_bytes() -> np.ndarray:
    """(VOCAB_SIZE,) int32: the number of UTF-8 bytes each token stands for (a token may hold part of a multi-byte
    character: its own bytes count), 0 for the special <|endoftext|>. Bits per byte divide by these."""
    enc = get_encoding()
    out = np.array([len(enc.decode_single_token_bytes(i)) for i in range(VOCAB_SIZE)], dtype=np.int32)
    out[EOT] = 0
    return out
