"""The chat format: conversations as token ids, the one rendering that training (SFT), GPT2.chat, gpt2core-chat
and the server's /v1/chat/completions share.

A conversation is OpenAI's list of messages, [{"role": "system" | "user" | "assistant", "content": str}, ...].
render(messages) -> (ids, mask): <|endoftext|> (GPT-2's document separator, as nanochat begins each document
with its <|bos|>), then every message as its role's start token, the BPE of its content, its role's end token:

    <|endoftext|><|system_start|>Be brief.<|system_end|><|user_start|>Hi<|user_end|>
    <|assistant_start|>Hello!<|assistant_end|>

mask is 1 on the tokens trained on: an assistant turn's content and its <|assistant_end|> (the model learns to
write the reply and to stop), 0 elsewhere (the system and user turns, every start token), as nanochat's
render_conversation masks. The special tokens are ids 50257..50262 (tokenizer.CHAT_TOKENS), in GPT-2's padded
vocabulary rows; the content's text never becomes one of them (a message that says "<|user_start|>" is the BPE of
that string). prompt(messages) renders a conversation for generation: the messages, then <|assistant_start|>; the
reply is what the model writes up to its <|assistant_end|>.

A model speaks the format once its vocab_size covers the tokens (CHAT_VOCAB_SIZE = 50263): chat_config(config)
raises vocab_size within the padded rows (GPT-2's 50304: no weight changes shape), and with_chat_vocab(config,
flat) also adds rows where a model has fewer padded rows; the new rows start at the mean of the real embeddings
plus N(0, 0.02) noise (a padded row is zero), so the tokens begin as likely as an average token.
"""
from __future__ import annotations

import codecs
import math
from typing import Iterator

import numpy as np

from . import tokenizer
from .errors import ArgError

TOKENS = tokenizer.CHAT_TOKENS
BOS = tokenizer.EOT
USER_START, USER_END = TOKENS["<|user_start|>"], TOKENS["<|user_end|>"]
ASSISTANT_START, ASSISTANT_END = TOKENS["<|assistant_start|>"], TOKENS["<|assistant_end|>"]
SYSTEM_START, SYSTEM_END = TOKENS["<|system_start|>"], TOKENS["<|system_end|>"]
CHAT_VOCAB_SIZE = tokenizer.CHAT_VOCAB_SIZE
ROLES = {"system": (SYSTEM_START, SYSTEM_END), "user": (USER_START, USER_END),
         "assistant": (ASSISTANT_START, ASSISTANT_END)}


class ChatFormatError(ArgError):
    """A conversation that cannot be rendered; the message names the field (messages[2].role)."""

    def __init__(self, message: str, field: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.reason = message


def check_messages(messages, for_reply: bool = False) -> list[tuple[str, str]]:
    """[(role, content), ...] of an OpenAI-style message list, or ChatFormatError naming the field. Roles: system,
    user, assistant, in any order; content a string (null or absent: empty) or a list of {"type": "text", "text"}
    parts (OpenAI's content parts), joined. for_reply: the conversation a reply is asked for (it needs a message);
    otherwise (training) it needs an assistant turn to learn from."""
    if not isinstance(messages, list) or not messages:
        raise ChatFormatError("must be a non-empty list of {\"role\", \"content\"} objects", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ChatFormatError(f"must be an object with role and content, got {type(m).__name__}", where)
        role = m.get("role")
        if role not in ROLES:
            raise ChatFormatError(f"must be one of {', '.join(ROLES)}, got {role!r}", where + ".role")
        content = m.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):
            parts = []
            for k, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise ChatFormatError("content parts must be {\"type\": \"text\", \"text\": string}",
                                          f"{where}.content[{k}]")
                parts.append(part["text"])
            content = "".join(parts)
        elif not isinstance(content, str):
            raise ChatFormatError(f"must be a string, got {type(content).__name__}", where + ".content")
        out.append((role, content))
    if not for_reply and not any(r == "assistant" for r, _ in out):
        raise ChatFormatError("has no assistant message to train on", "messages")
    return out


def _render(turns: list[tuple[str, str]]) -> tuple[list[int], list[int]]:
    ids, mask = [BOS], [0]
    for role, content in turns:
        start, end = ROLES[role]
        body = tokenizer.encode(content)
        on = int(role == "assistant")
        ids += [start, *body, end]
        mask += [0, *([on] * len(body)), on]
    return ids, mask


def render(messages) -> tuple[np.ndarray, np.ndarray]:
    """(ids, mask): int32 arrays of one length, the conversation's tokens and 1 where training scores them (an
    assistant turn's content and its end token). ChatFormatError (naming the field) for a malformed list or one
    without an assistant message."""
    ids, mask = _render(check_messages(messages))
    return np.asarray(ids, np.int32), np.asarray(mask, np.int32)


def prompt(messages) -> np.ndarray:
    """The ids a reply is generated from: the rendered messages, then <|assistant_start|> (int32)."""
    ids, _ = _render(check_messages(messages, for_reply=True))
    return np.asarray(ids + [ASSISTANT_START], np.int32)


def decode(ids) -> str:
    """Text of ids, the special tokens by name (render's inverse, up to BPE)."""
    return tokenizer.decode(ids)


def reply_text(ids) -> str:
    """The assistant's text of generated ids: up to the first <|assistant_end|> / <|endoftext|>, without it."""
    out = []
    for t in np.asarray(ids).reshape(-1):
        if int(t) in tokenizer.END_IDS:
            break
        out.append(int(t))
    return tokenizer.get_encoding().decode_bytes([t for t in out if t not in _SPECIAL]).decode("utf-8", "replace")


_SPECIAL = {BOS, *TOKENS.values()}


class ReplyStream:
    """Generated ids -> the reply's text, incrementally: feed(id) returns the new text (a UTF-8 character split
    over tokens waits for its last byte; special tokens add nothing)."""

    def __init__(self):
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token: int) -> str:
        if token in _SPECIAL or token < 0:
            return ""
        return self._dec.decode(tokenizer.get_encoding().decode_single_token_bytes(int(token)))

    def finish(self) -> str:
        return self._dec.decode(b"", final=True)


# ----------------------------------------------------------------------------------------------- models
def check_model(config) -> None:
    """ArgError unless a model's vocabulary holds the chat tokens."""
    if config.vocab_size < CHAT_VOCAB_SIZE:
        raise ArgError(f"the model's vocab_size is {config.vocab_size}: it has no chat tokens (ids up to "
                       f"{CHAT_VOCAB_SIZE - 1}); fine-tune it on conversations first (gpt2core-train --sft "
                       "conversations.jsonl --init MODEL)")


def chat_config(config):
    """config with a vocab_size that covers the chat tokens (padded_vocab_size grown, to a multiple of 128, only
    where it is smaller)."""
    if config.vocab_size >= CHAT_VOCAB_SIZE:
        return config
    padded = max(config.padded_vocab_size, math.ceil(CHAT_VOCAB_SIZE / 128) * 128)
    return config.replace(vocab_size=CHAT_VOCAB_SIZE, padded_vocab_size=padded)


def with_chat_vocab(config, flat: np.ndarray, seed: int = 0):
    """(chat_config(config), flat weights for it): wte (and an untied lm_head) gain rows where the padded vocab was
    too small; the chat tokens' rows, when all zero (a padded row), become the mean real embedding plus N(0, 0.02)
    noise. flat is in layout order (GPT2Config.param_shapes)."""
    new = chat_config(config)
    if new is config:
        return config, flat
    old_shapes, new_shapes = config.param_shapes(), new.param_shapes()
    rng = np.random.default_rng(seed)
    out, off = [], 0
    for name, shape in old_shapes.items():
        size = math.prod(shape)
        t = flat[off:off + size].reshape(shape)
        off += size
        if name in ("wte", "lm_head"):
            grown = np.zeros(new_shapes[name], dtype=np.float32)
            grown[:shape[0]] = t
            rows = grown[config.vocab_size:CHAT_VOCAB_SIZE]
            if not rows.any():
                mean = grown[:config.vocab_size].mean(axis=0) if name == "wte" else 0.0
                rows[...] = mean + 0.02 * rng.standard_normal(rows.shape, dtype=np.float32)
            t = grown
        out.append(np.asarray(t, np.float32).reshape(-1))
    return new, np.concatenate(out)


def generate_reply(model, messages, max_new_tokens: int = 256, top_k: int | None = 50, temperature: float = 1.0,
                   top_p: float | None = None, seed: int = 0, stream: bool = False):
    """GPT2.chat (see there)."""
    check_model(model.config)
    ids = prompt(messages)
    room = model.config.block_size - len(ids)
    if room < 1:
        raise ArgError(f"the conversation is {len(ids)} tokens, as long as the model's context ({model.config.block_size}"
                       "): no room for a reply; start a new one")
    steps = model.generate([ids], min(max_new_tokens, room), top_k=top_k, temperature=temperature, seed=seed,
                           top_p=top_p, stream=True)
    if stream:
        return _stream_text(steps)
    return "".join(_stream_text(steps))


def _stream_text(steps) -> Iterator[str]:
    dec = ReplyStream()
    for step in steps:
        t = int(step[0])
        if t < 0 or t in tokenizer.END_IDS:
            break
        piece = dec.feed(t)
        if piece:
            yield piece
    tail = dec.finish()
    if tail:
        yield tail
