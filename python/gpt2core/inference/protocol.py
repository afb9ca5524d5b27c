"""The OpenAI protocol gpt2core-serve speaks, as pydantic models (the way vLLM writes its protocol): the requests and
answers of POST /v1/completions, POST /v1/chat/completions and GET /v1/models, and the error shape.

A request body is checked in two stages. The bytes first (read_body's limits in gpt2core.inference.serve, then
`json_body`: the nesting depth, valid JSON without NaN or Infinity, an object). Then the object against a request
model: strict types (no "5" for 5, no true for 1), ranges from the fields' constraints, unknown fields refused
(`extra="forbid"`), and the rules a type cannot say as validators (the prompt's token ids inside the vocabulary,
n = 1, the context length, stream_options only with stream). The server's own limits (block_size, vocabulary,
--max-batch, --max-tokens-cap) come in as the validation context. The first problem becomes a 400 in OpenAI's
shape, {"error": {"message", "type", "param", "code"}}, whose param names the field and whose message says what
the field takes, from the field's description:

    >>> parse_completion(b'{"prompt": "hi", "top_p": 0}', block_size=64, vocab_size=50257, max_batch=8)
    Traceback (most recent call last):
    gpt2core.inference.protocol.APIError: top_p must be a number in (0, 1], got 0

Conversations are checked by gpt2core.chat (the same rules as SFT data), which names the field it refuses
("messages[1].role").
"""
from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_serializer, \
    field_validator, model_validator
from pydantic_core import PydanticCustomError
from typing_extensions import Annotated

from .. import chat, tokenizer
from .scheduler import SeqParams

MAX_BODY = 1 << 20        # bytes of a request body
MAX_DEPTH = 32            # nesting of JSON arrays / objects in a body (a request needs 3)
MAX_STOP = 4              # stop strings per request (OpenAI's limit)
MAX_LOGPROBS = 5          # alternatives per token (OpenAI's limit for completions)
SEED_MAX = 2**63 - 1
DEFAULT_MAX_TOKENS = 16   # /v1/completions without max_tokens (OpenAI's default)


class APIError(Exception):
    """An answer in OpenAI's error shape: {"error": {"message", "type", "param", "code"}} with HTTP `status`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param,
                                             code=self.code)).model_dump()


def bad_request(msg: str, param: str | None, code: str | None = None) -> APIError:
    return APIError(400, msg, param, code)


def too_large(size: str) -> APIError:
    return APIError(413, f"request body of {size} bytes is over the limit of {MAX_BODY} bytes", None,
                    "request_too_large")


# ------------------------------------------------------------------------------------------------ the JSON text
def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')


def json_depth(raw: bytes) -> int:
    """The deepest nesting of arrays and objects in JSON text (brackets inside strings do not count)."""
    b = np.frombuffer(_JSON_STRING.sub(b'""', raw), dtype=np.uint8)
    if not b.size:
        return 0
    step = (b == ord("[")).astype(np.int32) + (b == ord("{")) - (b == ord("]")) - (b == ord("}"))
    return int(np.cumsum(step).max(initial=0))


def json_body(raw: bytes) -> dict:
    """A request body (already read within the limits, read_body) -> its JSON object, or APIError (400, 413)."""
    if len(raw) > MAX_BODY:
        raise too_large(f"{len(raw)}")
    depth = json_depth(raw)
    if depth > MAX_DEPTH:
        raise bad_request(f"the request body nests arrays / objects {depth} deep: at most {MAX_DEPTH}", None,
                          "invalid_json")
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}", None)
    return body


# ------------------------------------------------------------------------------------------------ requests
def _error(kind: str, message: str, param: str | None = None) -> PydanticCustomError:
    """A rule's refusal: kind becomes the error's code where OpenAI has one (context_length_exceeded), param the
    field it names when that is not the field being validated."""
    return PydanticCustomError(kind, message, {"param": param} if param else None)


def _limits(info: ValidationInfo) -> dict:
    return info.context or {}


NonEmpty = Annotated[str, Field(min_length=1)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class SamplingRequest(BaseModel):
    """The fields both endpoints take. Values are checked strictly: a number where a number belongs."""
    model_config = ConfigDict(extra="forbid", strict=True)

    model: Optional[str] = Field(None, description="a string")
    user: Optional[str] = Field(None, description="a string")
    n: Optional[int] = Field(None, description="1 (one completion per prompt)")
    max_tokens: Optional[int] = Field(None, description="an integer >= 1 (0 only with echo)")
    temperature: Optional[float] = Field(None, ge=0.0, le=2.0, allow_inf_nan=False,
                                         description="a number in [0, 2] (0: greedy)")
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0, allow_inf_nan=False, description="a number in (0, 1]")
    stream: Optional[bool] = Field(None, description="true or false")
    stream_options: Optional[StreamOptions] = Field(None, description='{"include_usage": true|false}')
    stop: Union[None, NonEmpty, Annotated[list[NonEmpty], Field(max_length=MAX_STOP)]] = Field(
        None, description=f"a non-empty string or a list of at most {MAX_STOP} non-empty strings")
    seed: Optional[int] = Field(None, ge=0, le=SEED_MAX, description=f"an integer in [0, {SEED_MAX}]")

    @field_validator("n")
    @classmethod
    def _one_completion(cls, n):
        if n is not None and n != 1:
            raise _error("value_error", f"n must be 1 (one completion per prompt), got {n}")
        return n

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise _error("value_error", "stream_options is only allowed when stream is true", "stream_options")
        return self

    def check_context(self, prompts: list[list[int]], max_tokens: int, info: ValidationInfo) -> int:
        """max_tokens after --max-tokens-cap, once the prompts and the completion fit the model's context (OpenAI's
        rule: prompt tokens + max_tokens <= block_size)."""
        lim = _limits(info)
        if lim.get("max_tokens_cap") is not None:
            max_tokens = min(max_tokens, lim["max_tokens_cap"])
        block_size = lim.get("block_size")
        longest = max(len(q) for q in prompts)
        if block_size is not None and longest + max_tokens > block_size:
            raise _error("context_length_exceeded",
                         f"this model's maximum context length is {block_size} tokens, however you requested "
                         f"{longest + max_tokens} tokens ({longest} in your prompt; {max_tokens} for the "
                         "completion). Please reduce the prompt or max_tokens.",
                         "prompt" if longest >= block_size else "max_tokens")
        return max_tokens


def _token_ids(v, vocab_size: int | None, param: str) -> list[int] | None:
    """v as a list of token ids if it is a non-empty list of integers (None if it is not such a list)."""
    if not isinstance(v, list) or not v or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        return None
    for t in v:
        if vocab_size is not None and not 0 <= t < vocab_size:
            raise _error("value_error", f"{param} holds token id {t}, outside the vocabulary [0, {vocab_size})")
    return v


class CompletionRequest(SamplingRequest):
    """POST /v1/completions. `prompt` leaves validation as token ids, one list per prompt."""
    prompt: Any = Field(description="a string, a list of strings, or token ids")
    echo: Optional[bool] = Field(None, description="true or false")
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS,
                                    description=f"an integer in [0, {MAX_LOGPROBS}] (alternatives per token) or null")

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, p, info: ValidationInfo) -> list[list[int]]:
        lim = _limits(info)
        vocab_size, max_batch = lim.get("vocab_size"), lim.get("max_batch")
        ids = _token_ids(p, vocab_size, "prompt")
        if isinstance(p, str):
            items = [p]
        elif ids is not None:
            items = [ids]
        elif isinstance(p, list) and p:
            items = p
        else:
            raise _error("value_error", "prompt must be a string, a non-empty list of strings, or a list of token "
                         f"ids, got {json.dumps(p)[:80]}")
        if max_batch is not None and len(items) > max_batch:
            raise _error("value_error", f"prompt has {len(items)} prompts: at most {max_batch} per request (the "
                         "server's --max-batch)")
        prompts = []
        for i, item in enumerate(items):
            if isinstance(item, str):
                prompts.append(tokenizer.encode(item) or [tokenizer.EOT])  # "" -> <|endoftext|>, as GPT-2 starts
                continue
            t = _token_ids(item, vocab_size, f"prompt[{i}]")
            if t is None:
                raise _error("value_error", f"prompt[{i}] must be a string or a non-empty list of token ids, got "
                             f"{json.dumps(item)[:80]}")
            prompts.append(t)
        return prompts

    @model_validator(mode="after")
    def _length(self, info: ValidationInfo):
        mt = DEFAULT_MAX_TOKENS if self.max_tokens is None else self.max_tokens
        lowest = 0 if self.echo else 1  # 0 with echo: the prompt (and its log-probabilities) alone
        if mt < lowest:
            raise _error("value_error", f"max_tokens must be an integer >= {lowest}"
                         f"{' (0 only with echo)' if not self.echo else ''}, got {mt}", "max_tokens")
        self.max_tokens = self.check_context(self.prompt, mt, info)
        return self


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions: messages instead of prompt (rendered by gpt2core.chat, ending in
    <|assistant_start|>); max_completion_tokens is max_tokens; neither given: up to the end of the context. No
    legacy logprobs / echo (the chat API's logprobs differ)."""
    messages: Any = Field(description='a list of {"role", "content"} objects')
    max_completion_tokens: Optional[int] = Field(None, description="an integer >= 1")

    @model_validator(mode="before")
    @classmethod
    def _model_speaks_chat(cls, body, info: ValidationInfo):
        vocab_size = _limits(info).get("vocab_size")
        if vocab_size is not None and vocab_size < chat.CHAT_VOCAB_SIZE:
            raise _error("model_not_chat", "this model has no chat format (its vocabulary has no chat tokens): "
                         "fine-tune it on conversations (gpt2core-train --sft), or use /v1/completions", "messages")
        return body

    @field_validator("messages")
    @classmethod
    def _render(cls, messages) -> list[list[int]]:
        try:
            return [chat.prompt(messages).tolist()]
        except chat.ChatFormatError as e:
            raise _error("value_error", str(e), e.field) from None

    @model_validator(mode="after")
    def _length(self, info: ValidationInfo):
        mt = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if mt is None:
            mt = max(1, _limits(info).get("block_size", 1) - len(self.messages[0]))
        if mt < 1:
            field = "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"
            raise _error("value_error", f"{field} must be an integer >= 1, got {mt}", field)
        try:
            self.max_tokens = self.check_context(self.messages, mt, info)
        except PydanticCustomError as e:
            raise _error(e.type, e.message(), "messages" if e.context["param"] == "prompt" else "max_tokens") from None
        return self


def _api_error(e: ValidationError, model: type[BaseModel]) -> APIError:
    """pydantic's first complaint as OpenAI's 400, naming the field and what it takes."""
    errors = sorted(e.errors(include_url=False), key=lambda x: x["type"] != "extra_forbidden")  # unknown first
    err = errors[0]
    loc = [str(p) for p in err["loc"]]
    name = loc[0] if loc else None
    ctx = err.get("ctx") or {}
    if err["type"] == "extra_forbidden":
        fields = ", ".join(sorted(model.model_fields))
        return bad_request(f"unrecognized request argument supplied: {name} (this endpoint takes {fields})", name)
    info = model.model_fields.get(name) if name else None
    what = info.description if info is not None else None
    if err["type"] == "missing":
        return bad_request(f"{name} is required: {what}", name)
    if isinstance(ctx.get("param"), str) or err["type"] in ("value_error", "context_length_exceeded", "model_not_chat"):
        message = err["msg"].removeprefix("Value error, ")
        code = err["type"] if err["type"] not in ("value_error",) else None
        return bad_request(message, ctx.get("param") or name, code)
    # a type or range error: the field's description says what it takes
    shown = json.dumps(err["input"]) if _jsonable(err["input"]) else repr(err["input"])
    return bad_request(f"{name} must be {what}, got {shown[:80]}" if what else f"{'.'.join(loc)}: {err['msg']}",
                       name)


def _jsonable(v) -> bool:
    try:
        json.dumps(v)
        return True
    except (TypeError, ValueError):
        return False


@dataclass
class Completion:
    """A validated request, as the scheduler takes it: token ids per prompt and the sampling settings."""
    prompts: list[list[int]]
    max_tokens: int
    temperature: float
    top_p: float
    stream: bool
    stop: list[str]
    seed: int
    include_usage: bool = False
    logprobs: int | None = None   # alternatives per token (0..5); None: no log-probabilities
    echo: bool = False            # the prompt comes back before the completion

    def sequences(self) -> list[SeqParams]:
        return [SeqParams(p, self.max_tokens, self.temperature, self.top_p, self.seed, self.stop, self.logprobs,
                          self.echo) for p in self.prompts]


def _validate(model: type[SamplingRequest], raw: bytes | dict, **limits) -> SamplingRequest:
    body = raw if isinstance(raw, dict) else json_body(raw)
    try:
        return model.model_validate(body, context=limits)
    except ValidationError as e:
        raise _api_error(e, model) from None


def _completion(r: SamplingRequest, prompts, logprobs=None, echo=False) -> Completion:
    stop = [] if r.stop is None else [r.stop] if isinstance(r.stop, str) else list(r.stop)
    seed = secrets.randbits(63) if r.seed is None else r.seed  # no seed: a fresh one (OpenAI: not reproducible)
    return Completion(prompts, r.max_tokens, 1.0 if r.temperature is None else r.temperature,
                      1.0 if r.top_p is None else r.top_p, bool(r.stream), stop, seed,
                      bool(r.stream_options and r.stream_options.include_usage), logprobs, bool(echo))


def parse_completion(raw: bytes | dict, block_size: int, vocab_size: int, max_batch: int,
                     max_tokens_cap: int | None = None) -> Completion:
    """The body of POST /v1/completions (bytes, or the decoded object) -> Completion, or APIError (400, 413) saying
    which field is wrong. max_tokens_cap (--max-tokens-cap): max_tokens above it is lowered to it (the completion
    then ends with finish_reason "length" there)."""
    r = _validate(CompletionRequest, raw, block_size=block_size, vocab_size=vocab_size, max_batch=max_batch,
                  max_tokens_cap=max_tokens_cap)
    return _completion(r, r.prompt, r.logprobs, r.echo)


def parse_chat_completion(raw: bytes | dict, block_size: int, vocab_size: int, max_batch: int,
                          max_tokens_cap: int | None = None) -> Completion:
    """The body of POST /v1/chat/completions -> Completion: the messages rendered for a reply (one prompt of token
    ids, ending in <|assistant_start|>), the other fields as /v1/completions reads them. A bad message names its
    field (param "messages[1].role")."""
    r = _validate(ChatCompletionRequest, raw, block_size=block_size, vocab_size=vocab_size, max_batch=max_batch,
                  max_tokens_cap=max_tokens_cap)
    return _completion(r, r.messages)


# ------------------------------------------------------------------------------------------------ answers
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy logprobs of a choice: per token its name, log-probability, the most likely alternatives and
    the character offset of its text (null entries for an echoed prompt's first token)."""
    tokens: list[str]
    token_logprobs: list[Optional[float]]
    top_logprobs: list[Optional[dict[str, float]]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    text: str
    index: int
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None


class CompletionResponse(BaseModel):
    """The answer of /v1/completions and, with object the same, each of its streamed chunks."""
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None


class ChatMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: None = None
    finish_reason: Optional[str] = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Optional[Usage] = None


class DeltaMessage(BaseModel):
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: None = None
    finish_reason: Optional[str] = None

    @field_serializer("delta")
    def _only_what_changed(self, delta: DeltaMessage):  # {"content": "8"}, or {} with the finish reason
        return delta.model_dump(exclude_none=True)


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Optional[Usage] = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "gpt2core"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def dump(answer: BaseModel) -> dict:
    """An answer as the JSON object it is sent as (a streamed chunk without usage leaves the key out, as OpenAI's
    do; a JSON answer always has it)."""
    out = answer.model_dump()
    if out.get("usage", 0) is None:
        del out["usage"]
    return out


class TextShape:
    """/v1/completions' answers: a choice, a streamed chunk's choice, the answer (the chat shape differs only here)."""
    prefix = "cmpl-"

    @staticmethod
    def choice(i: int, text: str, reason, logprobs=None) -> CompletionChoice:
        return CompletionChoice(text=text, index=i, logprobs=logprobs, finish_reason=reason)

    chunk = choice

    @staticmethod
    def opening(i: int) -> None:
        return None

    answer = chunk_answer = CompletionResponse


class ChatShape:
    """/v1/chat/completions' answers (OpenAI's chat.completion and chat.completion.chunk): the reply as an assistant
    message; streamed, a first delta with the role, then the content, then an empty delta with the finish reason."""
    prefix = "chatcmpl-"

    @staticmethod
    def choice(i: int, text: str, reason, logprobs=None) -> ChatChoice:
        return ChatChoice(index=i, message=ChatMessage(content=text), finish_reason=reason)

    @staticmethod
    def chunk(i: int, text: str, reason, logprobs=None) -> ChatStreamChoice:
        return ChatStreamChoice(index=i, delta=DeltaMessage(content=text or None), finish_reason=reason)

    @staticmethod
    def opening(i: int) -> ChatStreamChoice:
        return ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))

    answer, chunk_answer = ChatCompletionResponse, ChatCompletionStreamResponse


__all__ = ["APIError", "Completion", "CompletionRequest", "ChatCompletionRequest", "CompletionResponse",
           "ChatCompletionResponse", "ChatCompletionStreamResponse", "ModelList", "ModelCard", "ErrorResponse",
           "Usage", "parse_completion", "parse_chat_completion", "json_body", "json_depth"]
