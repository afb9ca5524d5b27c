"""Log-probabilities as OpenAI's legacy completions report them: log-softmax in float64, each token's name (its
text, or "bytes:\\xNN" for part of a UTF-8 character) and the most likely alternatives, gathered per choice as
{"tokens", "token_logprobs", "top_logprobs", "text_offset"}."""
from __future__ import annotations

import numpy as np

from .. import tokenizer


def log_softmax(z: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float64."""
    z = np.asarray(z, dtype=np.float64)
    m = z.max(axis=-1, keepdims=True)
    return z - m - np.log(np.exp(z - m).sum(axis=-1, keepdims=True))


def token_text(t: int) -> str:
    """A token as OpenAI's logprobs name it: its text, or "bytes:\\xNN..." when its bytes are not whole UTF-8."""
    b = tokenizer.get_encoding().decode_single_token_bytes(int(t))
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{c:02x}" for c in b)


def top_alternatives(lp: np.ndarray, k: int) -> dict:
    """{token text: log-probability} of the k most likely tokens of one row of log-probabilities (most likely first;
    ties towards the lower id)."""
    if k <= 0:
        return {}
    idx = np.argpartition(-lp, k - 1)[:k]
    idx = idx[np.lexsort((idx, -lp[idx]))]
    out = {}
    for t in idx:
        out.setdefault(token_text(int(t)), float(lp[t]))
    return out


class LogprobsPiece:
    """OpenAI's legacy logprobs object for some tokens: {"tokens", "token_logprobs", "top_logprobs", "text_offset"}."""

    def __init__(self):
        self.tokens, self.token_logprobs, self.top_logprobs, self.text_offset = [], [], [], []

    def add(self, token: str, logprob, top, offset: int) -> None:
        self.tokens.append(token)
        self.token_logprobs.append(logprob)
        self.top_logprobs.append(top)
        self.text_offset.append(offset)

    def as_dict(self) -> dict:
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs, "top_logprobs": self.top_logprobs,
                "text_offset": self.text_offset}
