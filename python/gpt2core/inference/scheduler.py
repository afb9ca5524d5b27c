"""Continuous batching over the core's KV-cache slots: the policy of gpt2core-serve's model thread (the HTTP side is
serve.py; nothing here knows about HTTP).

The engine (SlotEngine) is the core's slot API: a cache of `slots` sequences reserved once; prefill tokens into
slot i at its current position (a prompt in chunks, kv_prefill's start); decode one token for each of some slots;
sample where the logits are; free slot i.

The Scheduler runs in one thread that owns the model. Each iteration:
  (a) admission: waiting requests, oldest first, take free slots (a request with a list of prompts takes one slot
      per prompt, all at once; an older request that does not fit yet is not overtaken, so nobody starves);
      cancelled and timed-out requests leave the queue;
  (b) one prefill call: the admitted sequences whose prompt is not yet in the cache, each with its next chunk of
      at most `prefill_chunk` tokens (padded to the call's longest chunk, prefill_chunk rows in all, the first
      sequence always taken). A prompt longer than the chunk takes several iterations, so the running streams
      get a decode step between its chunks. A sequence whose prompt is complete samples its first token here;
  (c) one decode step for every running sequence (one token each);
  (d) finished sequences (max_tokens, <|endoftext|>, a stop string, a client gone, --request-timeout) leave
      and free their slots at once; the next iteration admits into them.
With nothing to run, the thread sleeps on the queue.

Determinism: sequence i of a request draws token k with the uniform number of (its seed, stream 0, step k) (the
core's counter-based sampler, the same on every backend), and its prompt is cut into chunks at multiples of
prefill_chunk whatever else runs, so a seeded request gets the same text alone or among others. What other
sequences change is only the rounding of the float32 arithmetic around it (the BLAS blocks a GEMM by its row count:
a sequence's logits move by ~1e-7 relative with the rows beside it), which changes a drawn id only when its uniform
number falls that close to a boundary of the cumulative distribution; float64 models are exact to ~1e-15. With
--weights bf16/fp16/int8 every call reads the 16/8-bit weights through the CPU backend's GEMV, whose arithmetic for
a row does not depend on the other rows: a sequence's logits, and so a seeded text, are the same bits whatever runs
(tests/python/test_determinism.py).

Log-probabilities (a request's logprobs / echo): log-softmax in float64 of the logits the model defines (soft-capped
where the config caps, no temperature or top_p), read from the core for the rows that need them. An echoed prompt's
log-probabilities come from a prefill of its first n-1 tokens with every position's logits (the last token then
goes in alone, so the first generated token is sampled as for any other sequence).
"""
from __future__ import annotations

import collections
import concurrent.futures
import logging
import math
import queue
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from .. import tokenizer
from .logprobs import LogprobsPiece, log_softmax, token_text, top_alternatives  # noqa: F401
from .slots import ModelThread, SlotEngine  # noqa: F401  (the model side: serve.py takes them from here)

log = logging.getLogger("gpt2core.serve")
SEED_MAX = 2**63 - 1
SHUTDOWN = "the server is shutting down"
_GOLDEN = 0x9E3779B97F4A7C15


# ------------------------------------------------------------------------------------------------ requests
@dataclass
class SeqParams:
    """One sequence to generate: a prompt (token ids) and its sampling settings."""
    prompt: list
    max_tokens: int
    temperature: float      # 0: greedy
    top_p: float
    seed: int
    stop: list
    logprobs: int | None = None   # 0..5 alternatives per token, None: no log-probabilities
    echo: bool = False


@dataclass
class Job:
    """One request: its sequences, and `emit(event)` that hands the HTTP side an event (thread-safe). Events:
    ("text", i, text, logprobs or None), ("done", i, finish_reason, completion_tokens) with finish_reason "stop",
    "length" or "timeout", ("error", message[, http status: 503 when the server is shutting down, else 500])."""
    seqs: list
    emit: object
    timeout: float | None = None        # seconds from submission
    cancelled: bool = False             # the client has gone (set by the HTTP side)
    t_submit: float = field(default_factory=time.monotonic)

    @property
    def deadline(self) -> float:
        return math.inf if self.timeout is None else self.t_submit + self.timeout


class TextStream:
    """Token ids -> text, incrementally: bytes that end inside a UTF-8 character wait for the rest, and text that
    could be the start of a stop string is held back until it is known not to be one. The text returned never
    contains a stop string (OpenAI's rule)."""

    def __init__(self, stop: list[str]):
        import codecs
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


class _Seq:
    """A sequence in the scheduler: its slot, how much of its prompt is in the cache, what it has made."""

    def __init__(self, job: Job, index: int, p: SeqParams):
        self.job, self.i, self.p = job, index, p
        self.prompt = np.asarray(p.prompt, dtype=np.int32)
        # prompt i of a request draws from its own seed (seed + i, mixed): its text depends on its seed alone
        self.seed = (p.seed + index * _GOLDEN) % (SEED_MAX + 1)
        self.slot: int | None = None
        self.fed = 0                   # prompt tokens in the cache
        self.out: list[int] = []
        self.text = TextStream(p.stop)
        self.finished = False
        self.t_last = 0.0
        self.offset = 0                # text_offset of the next token's logprobs entry
        # an echoed prompt with logprobs: its first n-1 tokens go in with every position's logits; its text and
        # entries wait in echo_text / pending_lp until the first generated token's (or the prompt's end)
        self.echo_lp = p.echo and p.logprobs is not None
        self.echo_text: str | None = None
        self.pending_lp: LogprobsPiece | None = None

    def chunk_end(self, chunk: int) -> int:
        """Where the next prefill chunk of the prompt ends: chunks at multiples of `chunk` (an echoed prompt's
        last token alone), whatever runs beside the sequence."""
        n = len(self.prompt)
        limit = n - 1 if self.echo_lp and self.fed < n - 1 else n
        return min(limit, (self.fed // chunk + 1) * chunk)


@dataclass
class Stats:
    admitted: int = 0         # sequences admitted into slots
    cancelled: int = 0        # sequences whose client left
    timed_out: int = 0        # sequences ended by --request-timeout
    tokens: int = 0           # tokens sampled, all sequences
    prompt_tokens: int = 0    # prompt tokens prefilled
    steps: int = 0            # decode steps
    prefills: int = 0         # prefill calls
    running: int = 0          # sequences in slots now
    largest_batch: int = 0    # most sequences in one decode step


class Scheduler:
    """The model thread (policy in the module docstring). submit(job) from any thread; the job's events come
    back through job.emit. `metrics` (optional) gets observe_ttft, observe_itl, generated_tokens and prompt_tokens
    calls (serve.Metrics)."""

    def __init__(self, engine: SlotEngine, max_batch: int = 8, prefill_chunk: int = 256, threads: int | None = None,
                 metrics=None, model_thread: ModelThread | None = None):
        """model_thread: run the loop there (the thread that loaded the model and made the engine: see
        ModelThread); None: a ModelThread of its own, made by start() and ended by close()."""
        self.engine = engine
        self.max_batch = max_batch
        self.chunk = prefill_chunk
        self.threads = threads
        self.metrics = metrics
        self.stats = Stats()
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._waiting: collections.deque = collections.deque()   # jobs not yet admitted (model thread only)
        self._n_waiting = self._n_waiting_seqs = 0             # jobs (their sequences) not yet admitted or dropped
        self._count_lock = threading.Lock()
        self._free = list(range(max_batch))
        self._running: list[_Seq] = []                           # admission order
        self._closing = False
        self._model_thread = model_thread
        self._own_thread = model_thread is None  # start() makes it, close() ends it
        self._loop = None  # the loop's Future in the model thread

    # ---- the HTTP side's calls
    def start(self) -> None:
        if self._model_thread is None:
            self._model_thread = ModelThread()
        self._loop = self._model_thread.submit(self._run)

    def stop(self) -> None:
        """Shutting down (SIGINT / SIGTERM): the model thread leaves its loop at the next iteration, answering every
        running and waiting request with a 503 error event. Only sets a flag: safe in a signal handler."""
        self._closing = True

    def close(self) -> None:
        self._closing = True
        self._q.put(None)
        if self._loop is not None:
            concurrent.futures.wait([self._loop], 30)
        if self._loop is None or self._loop.done():
            self._refuse_all()  # anything submitted while the thread was leaving
            if self._own_thread and self._model_thread is not None:
                self._model_thread.close()

    def submit(self, job: Job) -> None:
        if self._closing:
            job.emit(("error", SHUTDOWN, 503))
            return
        with self._count_lock:
            self._n_waiting += 1
            self._n_waiting_seqs += len(job.seqs)
        self._q.put(job)

    def waiting(self) -> int:
        """Requests submitted and not yet in slots."""
        return self._n_waiting

    def waiting_sequences(self) -> int:
        """Their sequences (a request with a list of prompts has one per prompt)."""
        return self._n_waiting_seqs

    def running(self) -> int:
        return self.stats.running

    def slots_used(self) -> int:
        return self.max_batch - len(self._free)

    # ---- the model thread
    def _left_queue(self, job: Job) -> None:
        with self._count_lock:
            self._n_waiting -= 1
            self._n_waiting_seqs -= len(job.seqs)

    def _take(self, block: bool) -> None:
        """Move submitted jobs into the waiting list (block: sleep until one comes)."""
        try:
            job = self._q.get() if block else self._q.get_nowait()
            while True:
                if job is not None:
                    self._waiting.append(job)
                job = self._q.get_nowait()
        except queue.Empty:
            pass

    def _run(self) -> None:
        if self.threads:  # OpenMP's thread count is per calling thread: set it in the one that runs the model
            from .. import _C
            _C.set_num_threads(self.threads)
        while not self._closing:
            self._take(block=not self._running and not self._waiting)
            if self._closing:
                break
            try:
                with self.engine.lock:  # the model's lock: other users of the model wait for this iteration
                    self._iteration()
            except Exception as e:  # a bug or a backend failure: answer the running requests, keep serving
                log.exception("gpt2core-serve: a model step failed")
                for s in list(self._running):
                    s.job.emit(("error", f"generation failed: {type(e).__name__}: {e}"))
                    self._release(s)
        self._refuse_all()

    def _refuse_all(self) -> None:
        """Every running and waiting request ends with a 503 error event (once per request); slots freed."""
        answered = set()
        with self.engine.lock:
            for s in list(self._running):
                if not s.job.cancelled and id(s.job) not in answered:
                    answered.add(id(s.job))
                    s.job.emit(("error", SHUTDOWN, 503))
                self._release(s)
        self._take(block=False)
        while self._waiting:
            job = self._waiting.popleft()
            self._left_queue(job)
            if not job.cancelled and id(job) not in answered:
                answered.add(id(job))
                job.emit(("error", SHUTDOWN, 503))

    def _iteration(self) -> None:
        now = time.monotonic()
        self._expire(now)
        self._admit()
        self._prefill()
        self._decode()
        self.stats.running = len(self._running)

    def _expire(self, now: float) -> None:
        keep = collections.deque()
        for job in self._waiting:
            if job.cancelled:
                self.stats.cancelled += len(job.seqs)
                self._left_queue(job)
            elif now >= job.deadline:
                self._left_queue(job)
                for i in range(len(job.seqs)):
                    self.stats.timed_out += 1
                    job.emit(("done", i, "timeout", 0))
            else:
                keep.append(job)
        self._waiting = keep
        for s in list(self._running):
            if s.job.cancelled:
                self.stats.cancelled += 1
                self._release(s)
            elif now >= s.job.deadline:
                self.stats.timed_out += 1
                self._finish(s, "timeout")

    def _admit(self) -> None:
        while self._waiting and len(self._waiting[0].seqs) <= len(self._free):
            job = self._waiting.popleft()
            self._left_queue(job)
            for i, p in enumerate(job.seqs):
                s = _Seq(job, i, p)
                if p.echo:
                    self._echo_prompt(s)
                if p.max_tokens == 0 and (not s.echo_lp or len(s.prompt) == 1):
                    self._flush_echo(s)  # echo alone, or a one-token prompt (its token has no log-probability)
                    self._done(s, "length")
                    continue
                s.slot = self._free.pop(0)
                self._running.append(s)
                self.stats.admitted += 1
                self.stats.running = len(self._running)  # before its first token goes out (/health, /metrics)

    def _echo_prompt(self, s: _Seq) -> None:
        """echo: the prompt's text leaves first; with logprobs it waits for its tokens' entries (the first token has
        none, the others come from the prefill) and leaves with the first generated token's."""
        text = tokenizer.decode(s.prompt.tolist())
        if s.p.logprobs is None:
            s.job.emit(("text", s.i, text, None))
            return
        t0 = int(s.prompt[0])
        s.echo_text = text
        s.pending_lp = LogprobsPiece()
        s.pending_lp.add(token_text(t0), None, None, 0)
        s.offset = len(tokenizer.decode([t0]))

    # ---- prefill
    def _prefill(self) -> None:
        """One prefill call: the waiting prompt chunks, shortest first (a short prompt is not held up by a long
        one's chunks; a long one waits at most one call per slot), padded to the call's longest, prefill_chunk
        rows in all. An echoed prompt's all-logits chunk runs alone."""
        todo = [s for s in self._running if s.fed < len(s.prompt) and not s.finished]
        if not todo:
            return
        chunk_of = lambda s: s.prompt[s.fed:s.chunk_end(self.chunk)]
        wants_all = lambda s: s.echo_lp and s.fed < len(s.prompt) - 1
        todo.sort(key=lambda s: len(chunk_of(s)))  # stable: admission order among equals
        first = todo[0]
        all_logits = wants_all(first)
        group, Tq = [first], len(chunk_of(first))
        if not all_logits:
            for s in todo[1:]:
                t = max(Tq, len(chunk_of(s)))
                if wants_all(s) or (len(group) + 1) * t > self.chunk or \
                        any(o.fed + t > self.engine.max_len for o in group + [s]):
                    continue
                group.append(s)
                Tq = t
        chunks = [chunk_of(s) for s in group]
        self.engine.prefill([s.slot for s in group], chunks, [s.fed for s in group], all_logits)
        self.stats.prefills += 1
        n_tokens = sum(len(c) for c in chunks)
        self.stats.prompt_tokens += n_tokens
        if self.metrics is not None:
            self.metrics.prompt_tokens(n_tokens)
        if all_logits:
            self._prompt_logprobs(first, chunks[0])
            return
        for s, c in zip(group, chunks):
            s.fed += len(c)
        done = [s for s in group if s.fed == len(s.prompt)]
        if not done:
            return
        # kv_sample takes one setting per row of the call: rows still in their prompt draw too, and are ignored
        ids = self._sample(group)
        lp = self._logprob_rows(group, [s for s in done if s.p.logprobs is not None])
        for b, s in enumerate(group):
            if s in done:
                self._accept(s, int(ids[b]), lp.get(b))

    def _prompt_logprobs(self, s: _Seq, chunk: np.ndarray) -> None:
        """After an all-logits prefill of prompt[fed:fed+len(chunk)]: position j's logits score token j+1."""
        lp = log_softmax(self.engine.logits()[:len(chunk)])
        n = len(s.prompt)
        for j in range(len(chunk)):
            pos = s.fed + j
            if pos + 1 >= n:
                break
            t = int(s.prompt[pos + 1])
            name = token_text(t)
            s.pending_lp.add(name, float(lp[j, t]), top_alternatives(lp[j], s.p.logprobs), s.offset)
            s.offset += len(tokenizer.decode([t]))
        s.fed += len(chunk)
        if s.fed == n - 1 and s.p.max_tokens > 0:
            return  # the last prompt token goes in alone next; the echo's logprobs leave with the first token
        if s.fed == n - 1:
            self._flush_echo(s)
            self._done(s, "length", release=True)

    def _flush_echo(self, s: _Seq) -> None:
        piece = s.pending_lp
        if piece is not None:
            s.job.emit(("text", s.i, s.echo_text, piece.as_dict()))
            s.pending_lp = s.echo_text = None

    # ---- decode
    def _decode(self) -> None:
        live = [s for s in self._running if s.fed == len(s.prompt) and s.out and not s.finished]
        if not live:
            return
        self.engine.decode([s.slot for s in live], [s.out[-1] for s in live])
        self.stats.steps += 1
        self.stats.largest_batch = max(self.stats.largest_batch, len(live))
        ids = self._sample(live)
        lp = self._logprob_rows(live, [s for s in live if s.p.logprobs is not None])
        for b, s in enumerate(live):
            self._accept(s, int(ids[b]), lp.get(b))

    def _sample(self, seqs) -> np.ndarray:
        # OpenAI's temperature 0 is greedy decoding: top_k = 1; otherwise the whole vocabulary (top_k = 0)
        return self.engine.sample([s.p.temperature if s.p.temperature > 0 else 1.0 for s in seqs],
                                  [1 if s.p.temperature == 0 else 0 for s in seqs], [s.p.top_p for s in seqs],
                                  [s.seed for s in seqs], [len(s.out) for s in seqs])

    def _logprob_rows(self, seqs, want) -> dict:
        """{row: log-probabilities (V,)} for the rows of `seqs` in `want` (the last call's logits)."""
        if not want:
            return {}
        lp = log_softmax(self.engine.logits())
        return {b: lp[b] for b, s in enumerate(seqs) if s in want}

    def _accept(self, s: _Seq, t: int, lp_row) -> None:
        """Token t made by sequence s: its text (and logprobs entry) out, and the sequence ends where it should."""
        now = time.monotonic()
        if self.metrics is not None:
            if not s.out:
                self.metrics.observe_ttft(now - s.job.t_submit)
            else:
                self.metrics.observe_itl(now - s.t_last)
            self.metrics.generated_tokens(1)
        s.t_last = now
        s.out.append(t)
        self.stats.tokens += 1
        piece = None
        if lp_row is not None:
            piece = s.pending_lp or LogprobsPiece()
            s.pending_lp = None
            piece.add(token_text(t), float(lp_row[t]), top_alternatives(lp_row, s.p.logprobs), s.offset)
        if t in tokenizer.END_IDS:  # <|endoftext|>, or a chat model's <|assistant_end|>
            self._emit(s, "", piece)
            self._finish(s, "stop")
            return
        text = s.text.feed(t)
        if piece is not None:
            s.offset += len(tokenizer.decode([t]))
        self._emit(s, text, piece)
        if s.text.stopped:
            self._finish(s, "stop")
        elif len(s.out) >= s.p.max_tokens:
            self._finish(s, "length")

    def _emit(self, s: _Seq, text: str, piece) -> None:
        echo = s.echo_text
        if echo is not None:  # the echoed prompt leaves with the first token's entry
            text, s.echo_text = echo + text, None
        if text or piece is not None:
            s.job.emit(("text", s.i, text, None if piece is None else piece.as_dict()))

    def _finish(self, s: _Seq, reason: str) -> None:
        tail = s.text.finish() if reason != "timeout" else ""
        if tail:
            s.job.emit(("text", s.i, tail, None))
        self._done(s, reason, release=True)

    def _done(self, s: _Seq, reason: str, release: bool = False) -> None:
        s.job.emit(("done", s.i, reason, len(s.out)))
        if release:
            self._release(s)
        s.finished = True

    def _release(self, s: _Seq) -> None:
        s.finished = True
        if s.slot is not None:
            self.engine.free(s.slot)
            self._free.append(s.slot)
            self._free.sort()
            s.slot = None
        if s in self._running:
            self._running.remove(s)
        self.stats.running = len(self._running)


