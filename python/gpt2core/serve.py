"""An OpenAI-style completions server over the model: `gpt2core-serve --model out/model.bin` (pip install
gpt2core[serve]: Starlette + uvicorn).

    POST /v1/completions   {"prompt": "Hello", "max_tokens": 16, "temperature": 1.0, "top_p": 1.0,
                            "stream": false, "stop": null, "seed": null}
    GET  /health           {"status": "ok", ...} with the scheduler's counters
    GET  /                 a page to type a prompt and watch the text stream

Requests are validated before they reach the model; a bad one gets a 4xx answer in OpenAI's error shape
({"error": {"message", "type", "param", "code"}}) and nothing else happens. The model runs in ONE worker thread
(the scheduler below), never on the event loop, so the server keeps answering (health, new requests, other
streams) while it generates.

Batching policy (static batches, gathered from the queue):
  - the worker takes the oldest waiting request, then every request already waiting, in arrival order, while the
    batch holds at most `max_batch` sequences (a request's prompt list is one sequence per prompt and is never
    split);
  - when the queue is empty it waits up to `batch_window_ms` (default 10 ms) for more, so that requests sent at
    the same moment to an idle server share one batch; a batch that is full starts at once. 10 ms is small next
    to one decode step of d12 on a CPU (~20 ms) and a prefill (hundreds of ms), so a lone request barely pays it;
  - under load nothing waits for the window: requests that arrive while a batch runs queue up and form the next
    batch together;
  - every sequence keeps its own max_tokens, temperature, top_p, seed and stop strings (the engine takes one
    value per sequence), so any requests can share a batch, and a request with a seed gets the same text whatever
    batch it runs in;
  - a batch runs until each of its sequences has finished (max_tokens, <|endoftext|>, a stop string) or lost its
    client; then the next batch starts. This is static batching: a request arriving during a long batch waits for
    it (at most block_size decode steps, since prompt + max_tokens must fit the context). Admitting new
    sequences between decode steps (continuous batching) would need the engine to take new prompts mid-run.

A client that disconnects mid-stream is marked cancelled: its sequence emits nothing more, and when every
sequence of its batch is finished or cancelled the generation stops at once (a lone stream stops the model
within one step); a cancelled sequence that shares a batch with live ones is decoded until they finish.

Prompt length rule (OpenAI's): prompt tokens + max_tokens must fit the model's context (block_size); a request
that does not fit gets 400 with code "context_length_exceeded". The server never slides the window past
block_size.
"""
from __future__ import annotations

import asyncio
import codecs
import json
import logging
import math
import numbers
import os
import queue
import re
import secrets
import signal
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import cli, tokenizer
from .errors import ArgError, Error

PAGE = Path(__file__).resolve().parent / "assets" / "serve.html"
log = logging.getLogger("gpt2core.serve")
MAX_BODY = 1 << 20        # bytes of a request body
MAX_DEPTH = 32            # nesting of JSON arrays / objects in a body (a request needs 3)
BODY_TIMEOUT = 30.0       # seconds a client has to send the whole body once its headers are in
MAX_STOP = 4              # stop strings per request (OpenAI's limit)
SEED_MAX = 2**63 - 1

KNOWN_FIELDS = {"prompt", "max_tokens", "temperature", "top_p", "stream", "stop", "seed", "model", "n", "user",
                "stream_options"}


# ------------------------------------------------------------------------------------------------ request parsing
class APIError(Exception):
    """An answer in OpenAI's error shape: {"error": {"message", "type", "param", "code"}} with HTTP `status`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class Completion:
    """A validated request: token ids per prompt and the sampling settings."""
    prompts: list[list[int]]
    max_tokens: int
    temperature: float
    top_p: float
    stream: bool
    stop: list[str]
    seed: int
    include_usage: bool = False


def _bad(msg: str, param: str | None, code: str | None = None) -> APIError:
    return APIError(400, msg, param, code)


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _number(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool, text: str) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise _bad(f"{name} must be a number in {text}, got {json.dumps(v)}", name)
    v = float(v)
    if not (math.isfinite(v) and lo <= v <= hi) or (lo_open and v == lo):
        raise _bad(f"{name} must be a number in {text}, got {v!r}", name)
    return v


def _token_list(v, vocab_size: int, param: str) -> list[int] | None:
    """v as a list of token ids if it is a list of integers (None if it is not such a list)."""
    if not isinstance(v, list) or not v or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        return None
    for t in v:
        if not 0 <= t < vocab_size:
            raise _bad(f"{param} holds token id {t}, outside the vocabulary [0, {vocab_size})", "prompt")
    return v


def _too_large(size: str) -> APIError:
    return APIError(413, f"request body of {size} bytes is over the limit of {MAX_BODY} bytes", None,
                    "request_too_large")


class ClientGone(Exception):
    """The client closed its connection before its request body was in."""


async def read_body(request, limit: int = MAX_BODY, timeout: float = BODY_TIMEOUT) -> bytes:
    """The request's body, read with the limits enforced WHILE reading: a Content-Length over `limit` is refused
    before a byte of the body is read, and a body without one (chunked) is counted chunk by chunk and refused as
    soon as it passes `limit` (APIError 413); a body that is not all in within `timeout` seconds gets 408. A client
    that disconnects meanwhile raises ClientGone (nobody is left to answer)."""
    from starlette.requests import ClientDisconnect
    length = request.headers.get("content-length")
    if length is not None:
        if not length.strip().isdigit():
            raise _bad(f"Content-Length must be a number of bytes, got {length!r}", None, "invalid_request")
        if int(length) > limit:
            raise _too_large(f"{int(length)}")

    async def collect() -> bytes:
        parts, n = [], 0
        async for chunk in request.stream():
            n += len(chunk)
            if n > limit:
                raise _too_large(f"more than {limit}")
            parts.append(chunk)
        return b"".join(parts)

    try:
        return await asyncio.wait_for(collect(), timeout)
    except asyncio.TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout:g} s", None, "request_timeout") from None
    except ClientDisconnect:
        raise ClientGone() from None


_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')


def json_depth(raw: bytes) -> int:
    """The deepest nesting of arrays and objects in JSON text (brackets inside strings do not count)."""
    b = np.frombuffer(_JSON_STRING.sub(b'""', raw), dtype=np.uint8)
    if not b.size:
        return 0
    step = (b == ord("[")).astype(np.int32) + (b == ord("{")) - (b == ord("]")) - (b == ord("}"))
    return int(np.cumsum(step).max(initial=0))


def parse_completion(raw: bytes, block_size: int, vocab_size: int, max_batch: int) -> Completion:
    """The body of POST /v1/completions -> Completion, or APIError (400, 413) saying which field is wrong."""
    if len(raw) > MAX_BODY:
        raise _too_large(f"{len(raw)}")
    depth = json_depth(raw)
    if depth > MAX_DEPTH:
        raise _bad(f"the request body nests arrays / objects {depth} deep: at most {MAX_DEPTH}", None, "invalid_json")
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as e:
        raise _bad(f"the request body is not valid JSON: {e}", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise _bad(f"the request body must be a JSON object, got {type(body).__name__}", None)
    unknown = sorted(set(body) - KNOWN_FIELDS)
    if unknown:
        raise _bad(f"unrecognized request argument supplied: {unknown[0]} (this server takes "
                   f"{', '.join(sorted(KNOWN_FIELDS))})", unknown[0])
    for name in ("model", "user"):
        if body.get(name) is not None and not isinstance(body[name], str):
            raise _bad(f"{name} must be a string, got {json.dumps(body[name])}", name)
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or n != 1):
        raise _bad(f"n must be 1 (one completion per prompt), got {json.dumps(n)}", "n")

    # prompt: a string, a list of strings, a list of token ids, or a list of lists of token ids
    if "prompt" not in body:
        raise _bad("prompt is required: a string, a list of strings, or token ids", "prompt")
    p = body["prompt"]
    ids = _token_list(p, vocab_size, "prompt")
    if isinstance(p, str):
        items = [p]
    elif ids is not None:
        items = [ids]
    elif isinstance(p, list) and p:
        items = p
    else:
        raise _bad(f"prompt must be a string, a non-empty list of strings, or a list of token ids, got "
                   f"{json.dumps(p)[:80]}", "prompt")
    if len(items) > max_batch:
        raise _bad(f"prompt has {len(items)} prompts: at most {max_batch} per request (the server's "
                   "--max-batch)", "prompt")
    prompts = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            prompts.append(tokenizer.encode(item) or [tokenizer.EOT])  # "" -> <|endoftext|>, as GPT-2 starts
            continue
        t = _token_list(item, vocab_size, f"prompt[{i}]")
        if t is None:
            raise _bad(f"prompt[{i}] must be a string or a non-empty list of token ids, got "
                       f"{json.dumps(item)[:80]}", "prompt")
        prompts.append(t)

    mt = body.get("max_tokens", 16)
    if mt is None:
        mt = 16
    if isinstance(mt, bool) or not isinstance(mt, int):
        raise _bad(f"max_tokens must be an integer >= 1, got {json.dumps(mt)}", "max_tokens")
    if mt < 1:
        raise _bad(f"max_tokens must be an integer >= 1, got {mt}", "max_tokens")
    longest = max(len(q) for q in prompts)
    if longest + mt > block_size:
        param = "prompt" if longest >= block_size else "max_tokens"
        raise _bad(f"this model's maximum context length is {block_size} tokens, however you requested "
                   f"{longest + mt} tokens ({longest} in your prompt; {mt} for the completion). Please reduce "
                   "the prompt or max_tokens.", param, "context_length_exceeded")

    temperature = _number(body, "temperature", 1.0, 0.0, 2.0, False, "[0, 2] (0: greedy)")
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0, True, "(0, 1]")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise _bad(f"stream must be true or false, got {json.dumps(stream)}", "stream")
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not isinstance(opts, dict) or set(opts) - {"include_usage"} or \
                not isinstance(opts.get("include_usage", False), bool):
            raise _bad(f"stream_options must be {{\"include_usage\": true|false}}, got {json.dumps(opts)}",
                       "stream_options")
        if not stream:
            raise _bad("stream_options is only allowed when stream is true", "stream_options")
        include_usage = opts.get("include_usage", False)

    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or len(stop) > MAX_STOP or not all(isinstance(s, str) and s for s in stop):
        raise _bad(f"stop must be a non-empty string or a list of at most {MAX_STOP} non-empty strings, got "
                   f"{json.dumps(body.get('stop'))[:80]}", "stop")

    seed = body.get("seed")
    if seed is None:
        seed = secrets.randbits(63)  # no seed: a fresh one (OpenAI: not reproducible unless a seed is given)
    elif isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= SEED_MAX:
        raise _bad(f"seed must be an integer in [0, {SEED_MAX}], got {json.dumps(seed)}", "seed")
    return Completion(prompts, mt, temperature, top_p, stream, stop, seed, include_usage)


# ------------------------------------------------------------------------------------------------ text streams
class TextStream:
    """Token ids -> text, incrementally: bytes that end inside a UTF-8 character wait for the rest, and text that
    could be the start of a stop string is held back until it is known not to be one. The text returned never
    contains a stop string (OpenAI's rule)."""

    def __init__(self, stop: list[str]):
        self.stop = stop
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = ""   # decoded, not yet returned (a possible stop-string start)
        self.stopped = False

    def feed(self, token: int) -> str:
        self._pending += self._dec.decode(tokenizer.get_encoding().decode_single_token_bytes(token))
        return self._release()

    def _release(self, final: bool = False) -> str:
        text = self._pending
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self._pending = ""
            return text[:cut]
        hold = 0
        if not final:
            for s in self.stop:  # the longest tail of text that begins some stop string
                for k in range(min(len(s) - 1, len(text)), hold, -1):
                    if text.endswith(s[:k]):
                        hold = k
                        break
        self._pending = text[len(text) - hold:]
        return text[:len(text) - hold]

    def finish(self) -> str:
        """What is left when the sequence ends for another reason (max_tokens, <|endoftext|>)."""
        if self.stopped:
            return ""
        self._pending += self._dec.decode(b"", final=True)
        return self._release(final=True)


# ------------------------------------------------------------------------------------------------ the engine
class Engine:
    """What the scheduler needs from a model: `stream(prompts, max_new, temperature, top_p, seed)` yields, per
    step, the (B,) ids made (-1 for a sequence that has stopped), each argument one value per sequence: the KV-cache
    inference path of GPT2.generate(stream=True), sampling from the whole vocabulary (top_k=0) as OpenAI's API
    does. One seed per sequence: a sequence's ids depend on its seed alone, not on the batch it runs in."""

    def __init__(self, model):
        self.model = model
        self.block_size = model.config.block_size
        self.vocab_size = model.config.vocab_size

    def stream(self, prompts, max_new, temperature, top_p, seed):
        # OpenAI's temperature 0 is greedy decoding: top_k=1 (GPT2.generate's greedy), else the whole vocabulary
        return self.model.generate([np.asarray(p, np.int32) for p in prompts], list(max_new),
                                   top_k=[1 if t == 0 else 0 for t in temperature],
                                   temperature=[t if t > 0 else 1.0 for t in temperature], top_p=list(top_p),
                                   seed=list(seed), stream=True)


# ------------------------------------------------------------------------------------------------ the scheduler
SHUTDOWN = "the server is shutting down"


@dataclass
class Job:
    """One request in flight: its sequences' events go to `events` (an asyncio.Queue on the server's loop)."""
    req: Completion
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    cancelled: bool = False   # set by the HTTP side when the client has gone

    def emit(self, *event) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


@dataclass
class Stats:
    batches: int = 0
    sequences: int = 0
    largest_batch: int = 0
    cancelled: int = 0
    tokens: int = 0           # ids the engine made, all batches
    running: int = 0
    batch_sizes: list = field(default_factory=list)  # the last 100 batches' sizes (sequences)


class Scheduler:
    """The one worker thread that owns the model: gathers waiting jobs into a batch (policy in the module
    docstring), runs it, and sends each sequence's text as events: ("text", i, str), ("done", i, finish_reason,
    completion_tokens), ("error", message)."""

    def __init__(self, engine: Engine, max_batch: int = 8, batch_window_ms: float = 10.0,
                 threads: int | None = None):
        self.engine = engine
        self.threads = threads
        self.max_batch = max_batch
        self.window = batch_window_ms / 1000.0
        self.stats = Stats()
        self._q: queue.Queue = queue.Queue()
        self._held: Job | None = None  # a job taken from the queue that did not fit the last batch
        self._thread = threading.Thread(target=self._run, name="gpt2core-serve-model", daemon=True)
        self._closing = False

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """End the running batch at its next step and answer every waiting request with a 503 (the server is
        shutting down). Only sets a flag: safe from a signal handler."""
        self._closing = True

    def close(self) -> None:
        self._closing = True
        self._q.put(None)
        self._thread.join(timeout=30)
        self._refuse_waiting()

    def submit(self, job: Job) -> None:
        if self._closing:
            job.emit("error", SHUTDOWN, 503)
            return
        self._q.put(job)

    def _refuse_waiting(self) -> None:
        held, self._held = self._held, None
        jobs = [held] if held is not None else []
        while True:
            try:
                jobs.append(self._q.get_nowait())
            except queue.Empty:
                break
        for job in jobs:
            if job is not None:
                job.emit("error", SHUTDOWN, 503)

    def waiting(self) -> int:
        return self._q.qsize() + (self._held is not None)

    def _next(self, timeout: float | None) -> Job | None:
        if self._held is not None:
            job, self._held = self._held, None
            return job
        try:
            return self._q.get(timeout=timeout) if timeout is None or timeout > 0 else self._q.get_nowait()
        except queue.Empty:
            return None

    def _gather(self) -> list[Job]:
        first = self._next(None)
        if first is None:
            return []
        batch, n = [first], len(first.req.prompts)
        deadline = time.monotonic() + self.window
        while n < self.max_batch and not self._closing:
            job = self._next(max(0.0, deadline - time.monotonic()))
            if job is None:
                break
            if n + len(job.req.prompts) > self.max_batch:
                self._held = job  # first in the next batch: arrival order is kept
                break
            batch.append(job)
            n += len(job.req.prompts)
        return batch

    def _run(self) -> None:
        if self.threads:  # OpenMP's thread count is per calling thread: set it in the one that runs the model
            from . import _C
            _C.set_num_threads(self.threads)
        while not self._closing:
            batch = self._gather()
            if not batch:
                continue
            live = [j for j in batch if not j.cancelled]
            self.stats.cancelled += sum(len(j.req.prompts) for j in batch if j.cancelled)  # left while waiting
            if live:
                try:
                    self._run_batch(live)
                except Exception as e:  # a bug or a backend failure: answer these requests, keep serving
                    log.exception("gpt2core-serve: a batch of %d requests failed", len(live))
                    for j in live:
                        j.emit("error", f"generation failed: {type(e).__name__}: {e}")
        self._refuse_waiting()

    def _run_batch(self, jobs: list[Job]) -> None:
        seqs = [(j, i, p) for j in jobs for i, p in enumerate(j.req.prompts)]
        B = len(seqs)
        st = self.stats
        st.batches += 1
        st.sequences += B
        st.largest_batch = max(st.largest_batch, B)
        st.batch_sizes = (st.batch_sizes + [B])[-100:]
        st.running = B
        texts = [TextStream(j.req.stop) for j, _, _ in seqs]
        made = [0] * B
        finished = [False] * B
        # prompt i of a request draws from its own seed (seed + i, mixed): a request's text depends on its seed
        # alone, never on the batch around it
        gen = self.engine.stream([p for _, _, p in seqs], [j.req.max_tokens for j, _, _ in seqs],
                                 [j.req.temperature for j, _, _ in seqs], [j.req.top_p for j, _, _ in seqs],
                                 [(j.req.seed + i * 0x9E3779B97F4A7C15) % (SEED_MAX + 1) for j, i, _ in seqs])

        def finish(b: int, reason: str) -> None:
            j, i, _ = seqs[b]
            tail = texts[b].finish()
            if tail:
                j.emit("text", i, tail)
            j.emit("done", i, reason, made[b])
            finished[b] = True

        try:
            for step in gen:
                st.tokens += int((np.asarray(step) >= 0).sum())
                for b, t in enumerate(step):
                    j, i, _ = seqs[b]
                    if finished[b]:
                        continue
                    if j.cancelled:
                        finished[b] = True
                        st.cancelled += 1
                        continue
                    t = int(t)
                    if t < 0:  # the engine stopped it (its max_tokens)
                        finish(b, "length")
                        continue
                    made[b] += 1
                    if t == tokenizer.EOT:
                        finish(b, "stop")
                        continue
                    text = texts[b].feed(t)
                    if text:
                        j.emit("text", i, text)
                    if texts[b].stopped:
                        finish(b, "stop")
                    elif made[b] >= j.req.max_tokens:
                        finish(b, "length")
                if all(finished) or self._closing:
                    break
        finally:
            close = getattr(gen, "close", None)
            if close is not None:
                close()  # stops the engine's loop (and frees its cache) when we leave early
            st.running = 0
        stopped = set()
        for b in range(B):
            j = seqs[b][0]
            if finished[b] or j.cancelled:
                continue
            if self._closing:  # the server is shutting down: the request ends with an error, not a cut text
                if id(j) not in stopped:
                    stopped.add(id(j))
                    j.emit("error", SHUTDOWN, 503)
            else:
                finish(b, "length")


# ------------------------------------------------------------------------------------------------ the app
def _event_error(ev) -> APIError:
    """The answer to an ("error", message[, status]) event of the scheduler: 503 while shutting down, else 500."""
    status = ev[2] if len(ev) > 2 else 500
    return APIError(status, ev[1], None, "server_shutdown" if status == 503 else None, "server_error")


def create_app(model, model_name: str = "gpt2core", max_batch: int = 8, batch_window_ms: float = 10.0,
               threads: int | None = None, on_ready=None, body_timeout: float = BODY_TIMEOUT):
    """The Starlette app over `model` (a GPT2). threads: OpenMP threads of the model thread (None: OpenMP's
    default). on_ready(): called once the worker thread is running. body_timeout: seconds a client has to send
    its request body (408 after)."""
    try:
        from starlette.applications import Starlette
        from starlette.concurrency import run_in_threadpool
        from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
        from starlette.routing import Route
    except ImportError as e:  # pragma: no cover - the [serve] extra is missing
        raise ImportError("gpt2core-serve needs Starlette and uvicorn: pip install 'gpt2core[serve]'") from e
    import contextlib

    if model.config.vocab_size != tokenizer.VOCAB_SIZE:
        raise ValueError(f"the model's vocab_size is {model.config.vocab_size}, but the server speaks GPT-2's "
                         f"tokenizer ({tokenizer.VOCAB_SIZE} tokens): serve a model trained on GPT-2 tokens")
    engine = Engine(model)
    sched = Scheduler(engine, max_batch=max_batch, batch_window_ms=batch_window_ms, threads=threads)
    tokenizer.get_encoding()  # build the BPE tables now, not in the first request

    def error(e: APIError, close: bool = False) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers={"Connection": "close"} if close else None)

    async def page(request):
        return HTMLResponse(PAGE.read_text(encoding="utf-8"))

    async def health(request):
        s = sched.stats
        return JSONResponse({"status": "ok", "model": model_name, "block_size": engine.block_size,
                             "max_batch": max_batch, "waiting": sched.waiting(), "running": s.running,
                             "batches": s.batches, "sequences": s.sequences, "largest_batch": s.largest_batch,
                             "cancelled": s.cancelled, "tokens": s.tokens, "recent_batch_sizes": s.batch_sizes[-10:]})

    async def completions(request):
        try:
            raw = await read_body(request, MAX_BODY, body_timeout)
            req = await run_in_threadpool(parse_completion, raw, engine.block_size, engine.vocab_size, max_batch)
        except APIError as e:
            return error(e, close=e.status in (408, 413))  # the rest of that body is never read
        except ClientGone:
            log.debug("gpt2core-serve: client left before its request body was in")
            return Response(status_code=499)  # nobody reads it (nginx's "client closed request")
        job = Job(req, asyncio.get_running_loop(), asyncio.Queue())
        sched.submit(job)
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": cid, "object": "text_completion", "created": created, "model": model_name}
        n = len(req.prompts)
        usage = lambda made: {"prompt_tokens": sum(map(len, req.prompts)), "completion_tokens": sum(made),
                              "total_tokens": sum(map(len, req.prompts)) + sum(made)}
        if req.stream:
            return StreamingResponse(sse(job, head, n, usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        texts, reasons, made = [""] * n, [None] * n, [0] * n

        async def watch():  # the body has been read: the next ASGI message is the client going away
            while (await request.receive())["type"] != "http.disconnect":
                pass
            job.cancelled = True

        watcher = asyncio.ensure_future(watch())
        try:
            left = n
            while left:
                get = asyncio.ensure_future(job.events.get())
                await asyncio.wait({get, watcher}, return_when=asyncio.FIRST_COMPLETED)
                if not get.done():
                    get.cancel()
                    return JSONResponse({}, status_code=499)  # nobody reads it (nginx's "client closed request")
                ev = get.result()
                if ev[0] == "text":
                    texts[ev[1]] += ev[2]
                elif ev[0] == "done":
                    reasons[ev[1]], made[ev[1]] = ev[2], ev[3]
                    left -= 1
                else:
                    return error(_event_error(ev))
        finally:
            watcher.cancel()
            if any(r is None for r in reasons):
                job.cancelled = True
        choices = [{"text": texts[i], "index": i, "logprobs": None, "finish_reason": reasons[i]} for i in range(n)]
        return JSONResponse({**head, "choices": choices, "usage": usage(made)})

    async def sse(job: Job, head: dict, n: int, usage):
        def chunk(obj) -> str:
            return f"data: {json.dumps(obj)}\n\n"

        made, left = [0] * n, n
        try:
            while left:
                ev = await job.events.get()
                if ev[0] == "text":
                    yield chunk({**head, "choices": [{"text": ev[2], "index": ev[1], "logprobs": None,
                                                      "finish_reason": None}]})
                elif ev[0] == "done":
                    made[ev[1]] = ev[3]
                    left -= 1
                    yield chunk({**head, "choices": [{"text": "", "index": ev[1], "logprobs": None,
                                                      "finish_reason": ev[2]}]})
                else:
                    yield chunk(_event_error(ev).body())
                    return
            if job.req.include_usage:
                yield chunk({**head, "choices": [], "usage": usage(made)})
            yield "data: [DONE]\n\n"
        finally:
            if left:  # the client went away (or the server is stopping): free its sequences
                job.cancelled = True

    @contextlib.asynccontextmanager
    async def lifespan(app):
        sched.start()
        if on_ready is not None:
            on_ready()
        try:
            yield
        finally:
            sched.close()

    async def not_found(request, exc):
        return error(APIError(404, f"no route {request.method} {request.url.path} (this server has POST "
                                   "/v1/completions, GET /health and GET /)", None, "not_found"))

    async def bad_method(request, exc):
        return error(APIError(405, f"{request.method} is not allowed on {request.url.path}", None,
                              "method_not_allowed"))

    app = Starlette(routes=[Route("/", page), Route("/health", health),
                            Route("/v1/completions", completions, methods=["POST"])],
                    lifespan=lifespan, exception_handlers={404: not_found, 405: bad_method})
    app.state.scheduler = sched
    return app


# ------------------------------------------------------------------------------------------------ the command
def build_parser():
    ap = cli.ArgumentParser(prog="gpt2core-serve", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True,
                    help="an llm.c model file (e.g. out/model.bin), a training checkpoint directory, a Hugging "
                         "Face GPT-2 directory, or a Hub name such as gpt2")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine "
                                                        "only; 0.0.0.0: every interface)")
    ap.add_argument("--port", type=cli.port_or_auto, default=8000,
                    help="TCP port (default 8000; 0 or auto: a free one, printed)")
    ap.add_argument("--device", type=cli.device, default="cpu", help="cpu (default), cuda or cuda:N")
    ap.add_argument("--threads", type=cli.positive_int, default=None,
                    help="OpenMP threads of the CPU backend (default: all cores)")
    ap.add_argument("--max-batch", type=cli.positive_int, default=8,
                    help="most sequences generated together in one batch (default 8)")
    ap.add_argument("--batch-window-ms", type=cli.Float(0, 60000), default=10.0,
                    help="how long an idle server waits after a request for others to batch with it (default 10)")
    ap.add_argument("--body-timeout", type=cli.Float(0, 3600, lo_open=True), default=BODY_TIMEOUT,
                    help=f"seconds a client has to send its request body once its headers are in (default "
                         f"{BODY_TIMEOUT:g}; 408 after)")
    return ap


def graceful_server(app, sched: "Scheduler", **config):
    """A uvicorn.Server whose SIGINT / SIGTERM ends the running streams (each gets a 503 error event), answers
    waiting requests with 503, lets the responses finish and returns normally: exit 0, no traceback (uvicorn
    itself would raise the signal again once shut down). A second SIGINT quits without waiting."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:  # a signal handler: only sets flags
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            sched.stop()
            self.should_exit = True

    return Server(uvicorn.Config(app, **config))


def _listen(host: str, port: int) -> socket.socket:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ArgError(f"--host {host!r}: {e.strerror}") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise Error(f"--host {host} --port {port}: cannot listen there: {e.strerror}") from None
    sock.listen(128)
    return sock


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads is not None:
        cli.threads(args.threads, "--threads")
    try:
        import starlette  # noqa: F401
        import uvicorn
    except ImportError:
        raise Error("needs Starlette and uvicorn: pip install 'gpt2core[serve]'") from None
    from .model import load_model

    cli.check_device_available(args.device)
    # bind before loading: a taken port fails in a second, not after the model has loaded
    sock = _listen(args.host, 0 if args.port == "auto" else args.port)
    model = load_model(args.model, training=False, device=args.device)
    if model.config.vocab_size != tokenizer.VOCAB_SIZE:
        raise ArgError(f"--model {args.model}: its vocab_size is {model.config.vocab_size}, but the server speaks "
                       f"GPT-2's tokenizer ({tokenizer.VOCAB_SIZE} tokens): serve a model trained on GPT-2 tokens")
    host, port = sock.getsockname()[:2]
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"

    def ready():
        print(f"gpt2core-serve: {args.model} listening on {url} (POST /v1/completions, GET /health, page at /)",
              flush=True)

    app = create_app(model, os.path.basename(os.path.normpath(str(args.model))), max_batch=args.max_batch,
                     batch_window_ms=args.batch_window_ms, threads=args.threads, on_ready=ready,
                     body_timeout=args.body_timeout)
    server = graceful_server(app, app.state.scheduler, log_level="warning", timeout_graceful_shutdown=5)
    server.run(sockets=[sock])
    return 0


# the console script `gpt2core-serve` (behind gpt2core.cli's error boundary: exit 1 / 2 with one line)
console = cli.entry("gpt2core-serve", main)


if __name__ == "__main__":
    sys.exit(console())
