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
                             special_tokens={"<|endoftext|>": EOT})


def encode(text: str, allow_special: bool = False) -> list[int]:
    """Token ids of `text`. With allow_special, the literal "<|endoftext|>" becomes token 50256."""
    enc = get_encoding()
    if allow_special:
        return enc.encode(text, allowed_special="all")
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
