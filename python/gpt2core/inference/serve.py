"""An OpenAI-style completions server over the model: `gpt2core-serve --model out/model.bin` (pip install
gpt2core[serve]: Starlette, uvicorn, prometheus-client).

    POST /v1/completions   {"prompt": "Hello", "max_tokens": 16, "temperature": 1.0, "top_p": 1.0,
                            "stream": false, "stop": null, "seed": null, "logprobs": null, "echo": false}
    POST /v1/chat/completions  {"messages": [{"role": "user", "content": "Hi"}], and the sampling fields above}: a
                           model fine-tuned on conversations (gpt2core-train --sft); the messages are rendered by
                           gpt2core.chat and the reply generated on the completions path up to <|assistant_end|>
    GET  /v1/models        the one model served
    GET  /health           {"status": "ok", ...} with the scheduler's counters (never needs a key)
    GET  /metrics          (--metrics) Prometheus' text format: requests by status, prompt and generated tokens,
                           running and waiting sequences, slots in use, time to first token and inter-token latency
    GET  /                 a page to type a prompt (and the API key, when the server has one) and watch the text

Requests are validated before they reach the model; a bad one gets a 4xx answer in OpenAI's error shape
({"error": {"message", "type", "param", "code"}}) and nothing else happens. The model runs in ONE worker thread
(gpt2core.scheduler: continuous batching over KV-cache slots, --max-batch of them, prompts prefilled in chunks of
--prefill-chunk tokens between decode steps), never on the event loop, so the server keeps answering (health, new
requests, other streams) while it generates. A request with a seed gets the same text whatever else runs.

Limits: at most --max-queue requests wait for a slot; one more gets 429 (type "rate_limit_error") with a
Retry-After header (seconds: the recent mean time of a request times the queue over the slots). --request-timeout S
ends a request S seconds after it arrived (waiting or running): a stream gets the text made so far, then a final
chunk with finish_reason "timeout" and [DONE]; a JSON request gets 408 (type "timeout_error", code
"request_timeout"). --max-tokens-cap N lowers a larger max_tokens to N.

API keys (--api-key-file, one a line, and the environment variable GPT2CORE_API_KEY): every route but GET /health
and the page at / (a static file that asks for the key) needs "Authorization: Bearer <key>" (401 otherwise,
compared in constant time). Without a key the server listens on the loopback address by default and warns when
bound to another. CORS is off unless --cors-origin names the one origin allowed.

logprobs (0..5) and echo as OpenAI's legacy completions: {"tokens", "token_logprobs", "top_logprobs",
"text_offset"} per choice, the log-probabilities of the model's own distribution (soft-capped logits where the
config caps them; no temperature or top_p), the chosen token's and the `logprobs` most likely alternatives; token
names are the token's text, or "bytes:\\xNN" for a token that is part of a UTF-8 character; text_offset counts
characters of the returned text (echoed prompt included) from each token's decoded text. echo returns the prompt
before the completion; with logprobs its first token has null entries. max_tokens 0 is allowed with echo: the
prompt's log-probabilities alone (what lm-evaluation-harness's local-completions model asks for). With a stop
string the tokens listed run to the one that completed it; the text stops before it.

A client that disconnects is marked cancelled: its sequences leave their slots at the next step.

Prompt length rule (OpenAI's): prompt tokens + max_tokens must fit the model's context (block_size); a request
that does not fit gets 400 with code "context_length_exceeded". The server never slides the window past
block_size.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import signal
import socket
import sys
import time
import uuid
from pathlib import Path


from .. import chat, cli, tokenizer
from ..errors import ArgError, Error
from .auth import API_KEY_ENV, APIKeyGate, is_loopback, read_api_keys  # noqa: F401
from .metrics import Metrics
from .protocol import (MAX_BODY, MAX_DEPTH, APIError, ChatShape, Completion, ModelCard, ModelList,  # noqa: F401
                       TextShape, Usage, bad_request, dump, json_depth, parse_chat_completion, parse_completion,
                       too_large)
from .scheduler import (Job, ModelThread, Scheduler, SeqParams, SlotEngine,  # noqa: F401  (SeqParams, TextStream: tests)
                        TextStream)

PAGE = Path(__file__).resolve().parent.parent / "assets" / "serve.html"
log = logging.getLogger("gpt2core.serve")
BODY_TIMEOUT = 30.0       # seconds a client has to send the whole body once its headers are in
DRAIN_MAX = 16 << 20      # bytes of a refused (too large) body read and dropped so that the client reads the 413


class ClientGone(Exception):
    """The client closed its connection before its request body was in."""


async def read_body(request, limit: int = MAX_BODY, timeout: float = BODY_TIMEOUT) -> bytes:
    """The request's body, read with the limits enforced WHILE reading: nothing over `limit` is kept (APIError 413,
    decided from a Content-Length over it before a byte is kept, or, chunked, as soon as the count passes it); a
    body that is not all in within `timeout` seconds gets 408. A client that disconnects meanwhile raises ClientGone
    (nobody is left to answer).

    A refused body whose Content-Length is at most DRAIN_MAX bytes is still read to its end (within the same
    timeout) and dropped before the 413 goes out: a server that answers and closes while the client is still
    sending makes the kernel reset the connection, and the client sees "connection reset" instead of the 413
    (nginx's lingering close, for the same reason). A larger one, or a chunked one, is answered at once."""
    from starlette.requests import ClientDisconnect
    length = request.headers.get("content-length")
    if length is not None and not length.strip().isdigit():
        raise bad_request(f"Content-Length must be a number of bytes, got {length!r}", None, "invalid_request")
    size = None if length is None else int(length)
    refused = too_large(f"{size}") if size is not None and size > limit else None
    if refused is not None and size > DRAIN_MAX:
        raise refused

    async def collect() -> bytes:
        parts, n = [], 0
        async for chunk in request.stream():
            if refused is not None:
                continue  # drained and dropped (the Content-Length bounds it)
            n += len(chunk)
            if n > limit:
                raise too_large(f"more than {limit}")
            parts.append(chunk)
        if refused is not None:
            raise refused
        return b"".join(parts)

    try:
        return await asyncio.wait_for(collect(), timeout)
    except asyncio.TimeoutError:
        if refused is not None:
            raise refused from None
        raise APIError(408, f"the request body did not arrive within {timeout:g} s", None, "request_timeout") from None
    except ClientDisconnect:
        raise ClientGone() from None


# ------------------------------------------------------------------------------------------------ the app
class _Answer:
    """A request's events gathered (a JSON answer), or turned into SSE chunks (a stream)."""

    def __init__(self, n: int):
        self.texts, self.reasons, self.made = [""] * n, [None] * n, [0] * n
        self.logprobs = [None] * n

    def add_logprobs(self, i: int, piece: dict | None) -> None:
        if piece is None:
            return
        if self.logprobs[i] is None:
            self.logprobs[i] = {k: [] for k in piece}
        for k, v in piece.items():
            self.logprobs[i][k] += v


def check_vocab(vocab_size: int) -> str | None:
    """Why a model with this vocab_size cannot be served (None: it can): the server speaks GPT-2's tokens, and the
    chat tokens (gpt2core.chat) of a fine-tuned model."""
    if vocab_size in (tokenizer.VOCAB_SIZE, chat.CHAT_VOCAB_SIZE):
        return None
    return (f"its vocab_size is {vocab_size}, but the server speaks GPT-2's tokenizer ({tokenizer.VOCAB_SIZE} tokens, "
            f"{chat.CHAT_VOCAB_SIZE} with the chat tokens): serve a model trained on GPT-2 tokens")


def event_error(ev) -> APIError:
    """The answer to the scheduler's ("error", message[, status]) event: 503 while shutting down, else 500."""
    status = ev[2] if len(ev) > 2 else 500
    return APIError(status, ev[1], None, "server_shutdown" if status == 503 else None, "server_error")


def create_app(model, model_name: str = "gpt2core", max_batch: int = 8, prefill_chunk: int = 256,
               threads: int | None = None, on_ready=None, max_queue: int = 64, request_timeout: float | None = None,
               max_tokens_cap: int | None = None, api_keys=(), cors_origin: str | None = None,
               metrics: bool = False, body_timeout: float = BODY_TIMEOUT, model_thread=None):
    """The Starlette app over `model` (a GPT2). threads: OpenMP threads of the model thread (None: OpenMP's
    default). on_ready(): called once the worker thread is running. max_batch: KV-cache slots; prefill_chunk:
    prompt tokens per prefill call; max_queue: requests waiting for a slot beyond which a request gets 429;
    request_timeout: seconds after which a request ends (None: never); max_tokens_cap: the largest max_tokens;
    api_keys: the keys one of which every route but /health and / needs (none: open); cors_origin: the one origin
    browsers may call from (None: CORS off); metrics: serve GET /metrics; body_timeout: seconds a client has to
    send its request body (408 after); model_thread: a scheduler.ModelThread that loaded the model, where the
    KV cache is reserved and the model loop runs (None: the loop gets a thread of its own)."""
    try:
        from starlette.applications import Starlette
        from starlette.concurrency import run_in_threadpool
        from starlette.middleware import Middleware
        from starlette.middleware.cors import CORSMiddleware
        from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
        from starlette.routing import Route
    except ImportError as e:  # pragma: no cover - the [serve] extra is missing
        raise ImportError("gpt2core-serve needs Starlette and uvicorn: pip install 'gpt2core[serve]'") from e
    import contextlib

    if check_vocab(model.config.vocab_size):
        raise ValueError(f"the model: {check_vocab(model.config.vocab_size)}")
    block_size, vocab_size = model.config.block_size, model.config.vocab_size
    engine = (model_thread.call(SlotEngine, model, max_batch, block_size) if model_thread
              else SlotEngine(model, max_batch, block_size))
    sched = Scheduler(engine, max_batch=max_batch, prefill_chunk=prefill_chunk, threads=threads,
                      model_thread=model_thread)
    mx = Metrics(sched, max_batch) if metrics else None
    sched.metrics = mx
    tokenizer.get_encoding()  # build the BPE tables now, not in the first request
    seconds_per_request = [1.0]  # a running mean, for Retry-After

    def error(e: APIError, headers: dict | None = None) -> JSONResponse:
        if mx is not None:
            mx.answered(e.status)
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    async def page(request):
        return HTMLResponse(PAGE.read_text(encoding="utf-8"))

    async def health(request):
        st = sched.stats
        return JSONResponse({"status": "ok", "model": model_name, "block_size": block_size, "max_batch": max_batch,
                             "waiting": sched.waiting(), "running": st.running, "slots_used": sched.slots_used(),
                             "admitted": st.admitted, "cancelled": st.cancelled, "timed_out": st.timed_out,
                             "tokens": st.tokens, "prompt_tokens": st.prompt_tokens, "decode_steps": st.steps,
                             "prefills": st.prefills, "largest_batch": st.largest_batch})

    async def models(request):
        return JSONResponse(ModelList(data=[ModelCard(id=model_name, created=created_at)]).model_dump())

    async def metrics_route(request):
        return Response(mx.render(), media_type=mx.pc.CONTENT_TYPE_LATEST)

    async def completions(request):
        return await answer(request, parse_completion, TextShape)

    async def chat_completions(request):
        return await answer(request, parse_chat_completion, ChatShape)

    async def answer(request, parse, shape):
        try:
            raw = await read_body(request, MAX_BODY, body_timeout)
            req = await run_in_threadpool(parse, raw, block_size, vocab_size, max_batch, max_tokens_cap)
        except APIError as e:  # 408 / 413: the rest of that body is never read, so the connection closes
            return error(e, headers={"Connection": "close"} if e.status in (408, 413) else None)
        except ClientGone:
            log.debug("gpt2core-serve: client left before its request body was in")
            return Response(status_code=499)  # nobody reads it (nginx's "client closed request")
        waiting = sched.waiting()
        if waiting >= max_queue:
            retry = max(1, math.ceil(seconds_per_request[0] * (waiting + 1) / max_batch))
            return error(APIError(429, f"the server is busy: {waiting} requests are waiting (--max-queue "
                                       f"{max_queue}); retry after {retry} s", None, "rate_limit_exceeded",
                                  "rate_limit_error"), headers={"Retry-After": str(retry)})
        loop, events = asyncio.get_running_loop(), asyncio.Queue()

        def emit(ev) -> None:  # from the model thread
            try:
                loop.call_soon_threadsafe(events.put_nowait, ev)
            except RuntimeError:  # the loop has closed (the server is stopping): nobody reads it
                job.cancelled = True

        job = Job(req.sequences(), emit, request_timeout)
        sched.submit(job)
        t0 = time.monotonic()
        cid, created = f"{shape.prefix}{uuid.uuid4().hex}", int(time.time())
        head = {"id": cid, "created": created, "model": model_name}
        n = len(req.prompts)
        ans = _Answer(n)
        usage = lambda: Usage(prompt_tokens=sum(map(len, req.prompts)), completion_tokens=sum(ans.made),
                              total_tokens=sum(map(len, req.prompts)) + sum(ans.made))

        def took():
            seconds_per_request[0] = 0.9 * seconds_per_request[0] + 0.1 * (time.monotonic() - t0)

        if req.stream:
            if mx is not None:
                mx.answered(200)
            return StreamingResponse(sse(job, events, head, ans, usage, req, took, shape),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

        async def watch():  # the body has been read: the next ASGI message is the client going away
            while (await request.receive())["type"] != "http.disconnect":
                pass
            job.cancelled = True

        watcher = asyncio.ensure_future(watch())
        try:
            left = n
            while left:
                get = asyncio.ensure_future(events.get())
                await asyncio.wait({get, watcher}, return_when=asyncio.FIRST_COMPLETED)
                if not get.done():
                    get.cancel()
                    return error(APIError(499, "the client closed the request", None, "client_closed"))
                ev = get.result()
                if ev[0] == "text":
                    ans.texts[ev[1]] += ev[2]
                    ans.add_logprobs(ev[1], ev[3])
                elif ev[0] == "done":
                    ans.reasons[ev[1]], ans.made[ev[1]] = ev[2], ev[3]
                    left -= 1
                else:
                    return error(event_error(ev))
        finally:
            watcher.cancel()
            if any(r is None for r in ans.reasons):
                job.cancelled = True
        took()
        if "timeout" in ans.reasons:
            return error(APIError(408, f"the request ran past the server's --request-timeout of {request_timeout:g} "
                                       "s", None, "request_timeout", "timeout_error"))
        choices = [shape.choice(i, ans.texts[i], ans.reasons[i], ans.logprobs[i]) for i in range(n)]
        if mx is not None:
            mx.answered(200)
        return JSONResponse(dump(shape.answer(**head, choices=choices, usage=usage())))

    async def sse(job: Job, events, head: dict, ans: _Answer, usage, req: Completion, took, shape=TextShape):
        def chunk(choices, usage=None) -> str:
            return f"data: {json.dumps(dump(shape.chunk_answer(**head, choices=choices, usage=usage)))}\n\n"

        left = len(ans.made)
        try:
            for i in range(left):
                if shape.opening(i) is not None:
                    yield chunk([shape.opening(i)])
            while left:
                ev = await events.get()
                if ev[0] == "text":
                    yield chunk([shape.chunk(ev[1], ev[2], None, ev[3])])
                elif ev[0] == "done":
                    ans.made[ev[1]] = ev[3]
                    left -= 1
                    yield chunk([shape.chunk(ev[1], "", ev[2])])
                else:
                    yield f"data: {json.dumps(event_error(ev).body())}\n\n"
                    return
            took()
            if req.include_usage:
                yield chunk([], usage())
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

    routes = ["POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models", "GET /health", "GET /"] + (["GET /metrics"] if mx else [])

    async def not_found(request, exc):
        return error(APIError(404, f"no route {request.method} {request.url.path} (this server has "
                                   f"{', '.join(routes)})", None, "not_found"))

    async def bad_method(request, exc):
        return error(APIError(405, f"{request.method} is not allowed on {request.url.path}", None,
                              "method_not_allowed"))

    created_at = int(time.time())
    middleware = []
    if cors_origin is not None:  # outermost: a browser's preflight (OPTIONS) carries no key
        middleware.append(Middleware(CORSMiddleware, allow_origins=[cors_origin], allow_methods=["GET", "POST"],
                                     allow_headers=["Authorization", "Content-Type"]))
    if api_keys:
        middleware.append(Middleware(APIKeyGate, keys=list(api_keys)))
    app = Starlette(routes=[Route("/", page), Route("/health", health), Route("/v1/models", models),
                            Route("/v1/completions", completions, methods=["POST"]),
                            Route("/v1/chat/completions", chat_completions, methods=["POST"])] +
                           ([Route("/metrics", metrics_route)] if mx else []),
                    middleware=middleware, lifespan=lifespan, exception_handlers={404: not_found, 405: bad_method})
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
    ap.add_argument("--weights", choices=["fp32", "bf16", "fp16", "int8"], default="fp32",
                    help="decode from 16-bit or 8-bit copies of the weights (as gpt2core-generate --weights; CPU; "
                         "the weights are rounded)")
    ap.add_argument("--max-batch", type=cli.positive_int, default=8,
                    help="KV-cache slots: most sequences generated together (default 8)")
    ap.add_argument("--prefill-chunk", type=cli.positive_int, default=256,
                    help="prompt tokens per prefill call: a longer prompt goes in chunks, with decode steps of the "
                         "running streams between them (default 256)")
    ap.add_argument("--max-queue", type=cli.non_negative_int, default=64,
                    help="requests that may wait for a slot; beyond them a request gets 429 with Retry-After "
                         "(default 64)")
    ap.add_argument("--request-timeout", type=cli.Float(0, None, lo_open=True), default=None, metavar="S",
                    help="end a request that has run S seconds (a stream ends with finish_reason \"timeout\", a "
                         "JSON request gets 408; default: no limit)")
    ap.add_argument("--max-tokens-cap", type=cli.positive_int, default=None, metavar="N",
                    help="the largest max_tokens: a larger request is lowered to N (default: the context)")
    ap.add_argument("--api-key-file", default=None, metavar="PATH",
                    help=f"keys, one a line: every route but GET /health (and the page at /) needs "
                         f"'Authorization: Bearer <key>'; the environment variable {API_KEY_ENV} adds one (default: "
                         "no key)")
    ap.add_argument("--cors-origin", default=None, metavar="ORIGIN",
                    help="let browser pages from ORIGIN (e.g. https://example.org) call the server (default: CORS "
                         "off)")
    ap.add_argument("--metrics", action="store_true",
                    help="serve GET /metrics in Prometheus' text format (counts and latencies, never text)")
    ap.add_argument("--body-timeout", type=cli.Float(0, 3600, lo_open=True), default=BODY_TIMEOUT, metavar="S",
                    help=f"seconds a client has to send its request body once its headers are in (default "
                         f"{BODY_TIMEOUT:g}; 408 after)")
    return ap


def wait_ready(url: str, proc, timeout: float = 600) -> None:
    """Block until the gpt2core-serve process `proc` at `url` answers GET /health with 200 (a benchmark's or the
    lease driver's start); RuntimeError when it exits first or `timeout` seconds pass."""
    import httpx
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"gpt2core-serve exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"gpt2core-serve at {url} did not answer /health within {timeout:.0f} s")


def graceful_server(app, sched: Scheduler, **config):
    """A uvicorn.Server whose SIGINT / SIGTERM ends the running requests (each gets a 503 error, code
    server_shutdown: a stream as its last event), answers waiting requests with 503, lets the responses finish and
    returns normally: exit 0, no traceback (uvicorn itself would raise the signal again once shut down). A second
    SIGINT quits without waiting."""
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
        import uvicorn  # noqa: F401
    except ImportError:
        raise Error("needs Starlette and uvicorn: pip install 'gpt2core[serve]'") from None
    from ..model import load_model

    keys = read_api_keys(args.api_key_file)
    if args.metrics:
        try:
            import prometheus_client  # noqa: F401
        except ImportError:
            raise Error("--metrics needs prometheus-client: pip install 'gpt2core[serve]'") from None
    cli.check_device_available(args.device)
    # bind before loading: a taken port fails in a second, not after the model has loaded
    sock = _listen(args.host, 0 if args.port == "auto" else args.port)
    if not keys and not is_loopback(sock.getsockname()[0]):
        print(f"gpt2core-serve: warning: listening on {args.host} without an API key: anyone who reaches the port "
              f"can generate (--api-key-file or {API_KEY_ENV})", file=sys.stderr, flush=True)
    # one thread loads the model, reserves its KV cache and runs the model loop: every OpenMP call in one thread
    # (scheduler.ModelThread says why)
    model_thread = ModelThread()

    def load():
        if args.threads is not None:
            from .. import _C
            _C.set_num_threads(args.threads)
        return load_model(args.model, training=False, device=args.device, inference_weights=args.weights)

    model = model_thread.call(load)
    if check_vocab(model.config.vocab_size):
        raise ArgError(f"--model {args.model}: {check_vocab(model.config.vocab_size)}")
    host, port = sock.getsockname()[:2]
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"

    def ready():
        print(f"gpt2core-serve: {args.model} listening on {url} (POST /v1/completions, /v1/chat/completions, GET /v1/models, "
              f"GET /health"
              f"{', GET /metrics' if args.metrics else ''}, page at /{'; API key required' if keys else ''})",
              flush=True)

    app = create_app(model, os.path.basename(os.path.normpath(str(args.model))), max_batch=args.max_batch,
                     prefill_chunk=args.prefill_chunk, threads=args.threads, on_ready=ready,
                     max_queue=args.max_queue, request_timeout=args.request_timeout,
                     max_tokens_cap=args.max_tokens_cap, api_keys=keys, cors_origin=args.cors_origin,
                     metrics=args.metrics, body_timeout=args.body_timeout, model_thread=model_thread)
    server = graceful_server(app, app.state.scheduler, log_level="warning", timeout_graceful_shutdown=5)
    server.run(sockets=[sock])
    return 0


# the console script `gpt2core-serve` (behind gpt2core.cli's error boundary: exit 1 / 2 with one line)
console = cli.entry("gpt2core-serve", main)


if __name__ == "__main__":
    sys.exit(console())
