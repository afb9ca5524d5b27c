"""Text generation over the core's KV-cache inference path (GPT2.generate, gpt2core-generate, the server).

The loop, per batch of prompts (which may differ in length):
  1. prefill: each prompt (its last block_size tokens) in one pass, writing every layer's K and V into the
     sequence's cache slot; the language-model head runs on the last position only;
  2. sample: temperature, top-k, top-p from those logits where they are (only the ids come back);
  3. decode: the sampled token of every still-running sequence, one query per sequence against its cache;
  4. repeat 2-3 until each sequence has stopped: at <|endoftext|> or the chat format's <|assistant_end|> (where the
     vocabulary has them: tokenizer.END_IDS), after its max_new_tokens, or once its generated text contains one of
     the stop strings.

Every architecture the config describes runs this loop (csrc/model/gpt2_infer.h follows forward_ops: rotary
positions at each sequence's own position, QK-norm after the rotation, RMSNorm, ReLU², no biases, the untied head,
soft-capped logits, which are what is sampled from).

Past block_size (GPT-2's learned positions end there) a sequence keeps the window the full forward sees: its
context is its last block_size tokens, re-prefilled from position 0 at every step past the limit (exactly what
`model.forward(x[:, -block_size:])` computes, so a cached and an uncached run agree; each such step costs a
prefill of block_size tokens instead of one decode). Rotary models do the same: their positions could run on,
but they were trained on windows of block_size from position 0, and the window keeps cached = uncached.

Sampling is reproducible: sequence b's i-th token is drawn with the uniform number uniform(seed_b, stream_b, i)
(a counter-based hash, the same on every backend), so a fixed seed gives the same ids whatever the batch
around a sequence or the number of threads. `sample_reference` is the distribution in plain numpy (what the
tests compare the core's sampler with).
"""
from __future__ import annotations

import collections
import numbers
import threading
import weakref
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

from .. import tokenizer
from ..errors import ArgError, Error

EOT = tokenizer.EOT
_MASK64 = (1 << 64) - 1
# what the core stores: top_k and the token counts as int32, seeds as uint64
INT32_MAX = 2**31 - 1
SEED_MAX = _MASK64


# ----------------------------------------------------------------------------------------------- random numbers
def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    z = x
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def uniform(seed: int, stream: int, step: int) -> float:
    """The uniform number in [0, 1) that draws token `step` of sequence `stream` under `seed`: splitmix64 of
    the three mixed, top 53 bits (the core's sample_uniform computes the same bits)."""
    x = _splitmix64((seed & _MASK64) ^ _splitmix64(((stream & _MASK64) * 0xD1B54A32D192ED03 + step) & _MASK64))
    return (x >> 11) * (1.0 / (1 << 53))


# ----------------------------------------------------------------------------------------------- the reference
def sample_distribution(logits: np.ndarray, temperature: float = 1.0, top_k: int | None = 0,
                        top_p: float | None = None) -> np.ndarray:
    """The probabilities (V,) the sampler draws from, in float64: logits / temperature, the top_k largest kept
    (0 / None: all; ties broken towards the lower id), softmax, then the smallest set of most likely tokens whose
    probability sums to at least top_p (None or 1: all; at least one token), renormalised. temperature 0 or
    top_k 1: all mass on the arg max (lowest id on ties)."""
    z = np.asarray(logits, dtype=np.float64)
    V = z.shape[0]
    p = np.zeros(V)
    if temperature == 0 or top_k == 1:
        p[int(np.argmax(z))] = 1.0
        return p
    z = z / temperature
    order = np.lexsort((np.arange(V), -z))  # by value descending, then id ascending
    k = V if not top_k else min(int(top_k), V)
    keep = order[:k]
    e = np.exp(z[keep] - z[keep[0]])
    e /= e.sum()
    if top_p is not None and top_p < 1:
        c = np.cumsum(e)
        m = int(np.searchsorted(c, top_p * c[-1])) + 1  # smallest prefix with sum >= top_p
        keep, e = keep[:m], e[:m] / c[min(m, len(c)) - 1]
    p[keep] = e
    return p


def sample_reference(logits: np.ndarray, u: float, temperature: float = 1.0, top_k: int | None = 0,
                     top_p: float | None = None) -> int:
    """The id the sampler returns for uniform number u: the inverse CDF of sample_distribution over the kept
    tokens in order of decreasing probability (ties: lower id first), or in id order when nothing is cut (top_k
    0 and top_p off: no sort needed)."""
    p = sample_distribution(logits, temperature, top_k, top_p)
    z = np.asarray(logits, dtype=np.float64)
    if (not top_k or top_k >= z.shape[0]) and (top_p is None or top_p >= 1):
        order = np.arange(z.shape[0])  # nothing cut: no sort, ids in order
    else:
        order = np.lexsort((np.arange(z.shape[0]), -z))
    order = order[p[order] > 0]
    c = np.cumsum(p[order])
    i = int(np.searchsorted(c, u * c[-1], side="right"))
    return int(order[min(i, len(order) - 1)])


# ----------------------------------------------------------------------------------------------- arguments
@dataclass
class _Seq:
    prompt: np.ndarray          # int32 ids
    max_new: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    stream: int
    out: list
    done: bool = False


def _per_seq(value, B: int, name: str) -> list:
    if isinstance(value, (list, tuple, np.ndarray)) and not isinstance(value, str):
        vals = list(value)
        if len(vals) != B:
            raise ArgError(f"{name}: {len(vals)} values for {B} prompts (give one value, or one per prompt)")
        return vals
    return [value] * B


def _check_real(v, name: str, lo: float, hi: float, text: str) -> float:
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not (lo <= float(v) <= hi):
        raise ArgError(f"{name} must be a number in {text}, got {v!r}")
    return float(v)


def _check_int(v, name: str, lo: int, hi: int, text: str) -> int:
    """v as an int in [lo, hi] (hi: what the core stores), else ArgError naming `name` and the range."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or not lo <= int(v) <= hi:
        raise ArgError(f"{name} must be an integer >= {lo}, got {v!r} ({text}; at most {hi:,}, what the core stores)")
    return int(v)


def as_prompts(idx, vocab_size: int) -> tuple[list[np.ndarray], bool]:
    """idx -> (list of int32 id arrays, rectangular?). idx: an int array (T,) or (B, T), or a list of id lists
    of different lengths. Every prompt needs at least one id, each in [0, vocab_size)."""
    rect = True
    if isinstance(idx, np.ndarray) or (isinstance(idx, (list, tuple)) and idx and
                                       all(isinstance(t, numbers.Integral) for t in idx)):
        arr = np.asarray(idx)
        if arr.dtype.kind not in "iu":
            raise TypeError(f"idx must hold integer token ids, got dtype {arr.dtype}")
        if arr.ndim == 1:
            arr = arr[None, :]
        if arr.ndim != 2:
            raise ArgError(f"idx must have shape (B, T) or be a list of id lists, got shape {arr.shape}")
        rows = list(arr)
    elif isinstance(idx, (list, tuple)):
        rows = [np.asarray(r) for r in idx]
        rect = False
    else:
        raise TypeError(f"idx must be an int array (B, T) or a list of token-id lists, got {type(idx).__name__}")
    if not rows:
        raise ArgError("idx: no prompts")
    out = []
    for b, r in enumerate(rows):
        if r.ndim != 1 or r.dtype.kind not in "iu":
            raise ArgError(f"idx[{b}] must be a 1-D list of integer token ids")
        if r.size == 0:
            raise ArgError(f"idx[{b}] is empty: every prompt needs at least one token (e.g. <|endoftext|>, {EOT})")
        if int(r.min()) < 0 or int(r.max()) >= vocab_size:
            raise ArgError(f"idx[{b}] has ids outside [0, {vocab_size})")
        out.append(np.ascontiguousarray(r, dtype=np.int32))
    return out, rect


def check_stop(stop) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
        raise ArgError(f"stop must be a non-empty string or a list of them, got {stop!r}")
    return list(stop)


def truncate_at_stop(text: str, stop) -> str:
    """text up to (not including) the first occurrence of any stop string (OpenAI's rule for the returned text)."""
    cut = len(text)
    for s in check_stop(stop):
        i = text.find(s)
        if i >= 0:
            cut = min(cut, i)
    return text[:cut]


# ----------------------------------------------------------------------------------------------- the loop
def generate_stream(model, idx, max_new_tokens, top_k=50, temperature=1.0, seed=0, top_p=None,
                    stop=None) -> "Stream":
    """A Stream that yields, per step, an int32 array (B,) of the token each sequence made in that step (-1 for a
    sequence that had already stopped). Arguments as GPT2.generate; max_new_tokens, top_k, temperature, top_p and
    seed may also be one value per prompt. Validates everything, and takes its KV-cache slots, before returning."""
    seqs, stops = _prepare(model, idx, max_new_tokens, top_k, temperature, seed, top_p, stop)
    return Stream(model, seqs, stops)


def _prepare(model, idx, max_new_tokens, top_k, temperature, seed, top_p, stop):
    cfg = model.config
    prompts, _ = as_prompts(idx, cfg.vocab_size)
    B = len(prompts)
    stops = check_stop(stop)
    seed_list = isinstance(seed, (list, tuple, np.ndarray))
    seqs = []
    for b, (p, mx, k, t, tp, s) in enumerate(zip(
            prompts, _per_seq(max_new_tokens, B, "max_new_tokens"), _per_seq(top_k, B, "top_k"),
            _per_seq(temperature, B, "temperature"), _per_seq(top_p, B, "top_p"), _per_seq(seed, B, "seed"))):
        mx = _check_int(mx, "max_new_tokens", 0, INT32_MAX, "tokens to add")
        k = 0 if k is None else _check_int(k, "top_k", 0, INT32_MAX, "0 or None: the whole vocabulary; 1: greedy")
        t = _check_real(t, "temperature", 0.0, float("inf"), "(0, inf) (for greedy decoding use top_k=1)")
        if t == 0:
            raise ArgError("temperature must be > 0 (for greedy decoding use top_k=1), got 0")
        tp = 1.0 if tp is None else _check_real(tp, "top_p", 0.0, 1.0, "(0, 1] (None: off)")
        if tp == 0:
            raise ArgError("top_p must be a number in (0, 1] (None: off), got 0")
        s = _check_int(s, "seed", 0, SEED_MAX, "an unsigned 64-bit integer")
        # a scalar seed: sequence b draws from stream b; one seed per sequence: stream 0 (a request's own seed
        # gives the same ids whatever batch it runs in)
        seqs.append(_Seq(p, mx, t, k, tp, s, 0 if seed_list else b, []))
    return seqs, stops


# ----------------------------------------------------------------------------------------------- sharing a model
def model_lock(model) -> threading.RLock:
    """The lock every entry point that uses the model's buffers holds (GPT2.lock; created on first use for objects
    that only look like a GPT2, such as the tests' wrappers of a bare core model)."""
    lock = getattr(model, "lock", None)
    if lock is None:
        lock = model.__dict__.setdefault("_lock", threading.RLock())
    return lock


class KVCacheFull(Error, MemoryError):
    """The KV cache cannot grow for another stream: more sequences are live than memory (or GPT2.kv_cache_limit)
    holds. The message says how many are live and what the cache would need."""


def _available_bytes() -> int | None:
    """The memory the kernel says a new allocation can take (MemAvailable), None where it does not say."""
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class SlotPool:
    """The KV-cache slots of one core model and who owns them. A generation (a stream, a generate call, an
    inference-only forward) takes its slots with acquire() and gives them back with release(); a slot is never
    shared, so sequences in different slots cannot see each other's cache. When no free slot is left the cache
    grows (the core keeps every slot's contents, GPT2Model::kv_reserve), up to `limit` bytes (None: what the
    machine has free, checked on the CPU backend; a GPU's own allocation fails cleanly), beyond which acquire
    raises KVCacheFull. acquire() runs under the model's lock; release() may run anywhere (a finaliser during
    garbage collection, another thread): it only queues the slots, which the next acquire() takes back."""

    _ELEM = {"ModelF64": 8, "ModelBF16": 2, "ModelF16": 2}

    def __init__(self, core):
        self.core = core
        self.owned: set[int] = set()
        self.holders = 0                # generations holding slots now
        self.limit: int | None = None   # bytes of K and V cache at most (None: the machine's free memory)
        self._returned = collections.deque()  # (slots,) given back, not yet taken off `owned`

    @classmethod
    def of(cls, model) -> "SlotPool":
        pool = model.__dict__.get("_kv_pool")
        return pool if pool is not None else model.__dict__.setdefault("_kv_pool", cls(model._m))

    def _cache_bytes(self, slots: int, max_len: int, cfg) -> int:
        elem = self._ELEM.get(type(self.core).__name__, 4)
        L, C = getattr(cfg, "n_layer", None), getattr(cfg, "n_embd", None)
        return 0 if L is None or C is None else 2 * L * slots * max_len * C * elem  # 0: a config without sizes

    def _drain(self) -> None:
        free = getattr(self.core, "kv_free", None)
        while self._returned:
            slots = self._returned.popleft()
            self.owned.difference_update(slots)
            self.holders -= 1
            if free is not None:  # its positions forgotten: a later growth of the cache does not copy its rows
                for slot in slots:
                    free(int(slot))

    def acquire(self, n: int, max_len: int, cfg) -> list[int]:
        """n free slots of at least max_len positions (the cache grown if needed)."""
        self._drain()
        S, T = self.core.kv_slots, self.core.kv_max_len
        free = [i for i in range(S) if i not in self.owned]
        if len(free) < n or max_len > T:
            S2, T2 = max(S, len(self.owned) + n), max(T, max_len)
            need, have = self._cache_bytes(S2, T2, cfg), self._cache_bytes(S, T, cfg)
            limit = self.limit
            if limit is None and getattr(self.core, "device", "cpu") == "cpu":
                avail = _available_bytes()
                limit = None if avail is None else have + avail * 9 // 10
            if limit is not None and need > limit:
                raise self._full(n, max_len, S2, T2, need, limit)
            try:
                self.core.kv_reserve(S2, T2)
            except MemoryError as e:  # std::bad_alloc, a GPU out of memory
                raise self._full(n, max_len, S2, T2, need, None, e) from None
            free = [i for i in range(S2) if i not in self.owned]
        take = free[:n]
        self.owned.update(take)
        self.holders += 1
        return take

    def _full(self, n, max_len, S2, T2, need, limit, why=None) -> KVCacheFull:
        lim = (f"over the limit of {limit / 2**20:,.1f} MiB (GPT2.kv_cache_limit, else 90% of the memory free)"
               if limit is not None else f"which failed ({why})")
        return KVCacheFull(
            f"the KV cache cannot take {n} more sequence{'s' * (n > 1)} of up to {max_len} tokens: "
            f"{self.holders} live generation{'s' * (self.holders != 1)} (streams, generate calls) hold "
            f"{len(self.owned)} slot{'s' * (len(self.owned) != 1)}, and a cache of {S2} slots x {T2} positions "
            f"needs {need / 2**20:,.1f} MiB, {lim}; close() the streams you no longer read, or let them finish")

    def release(self, slots) -> None:
        self._returned.append(tuple(slots))

    def in_use(self) -> int:
        """Slots owned now (call under the model's lock)."""
        self._drain()
        return len(self.owned)


class Stream:
    """What generate(..., stream=True) returns: an iterator over the steps of one generation (each an int32 array
    (B,) of the ids just made, -1 for a sequence that had already stopped). It owns its KV-cache slots from
    creation until it ends, close() is called or it is garbage collected, so several live streams of one model
    (and generate / forward calls between their steps) each give exactly what they give alone. Each step runs
    under the model's lock: a stream may be advanced from any thread. Also a context manager (closes on exit)."""

    def __init__(self, model, seqs: list[_Seq], stops: list[str]):
        for s in seqs:
            s.done = s.max_new == 0
        block = model.config.block_size
        live = [s for s in seqs if not s.done]
        self._lock = model_lock(model)
        self._eng = None
        if live:
            longest = max(min(len(s.prompt), block) + s.max_new for s in live)
            with self._lock:
                self._eng = model._inference_engine(len(seqs), min(block, longest))
        eng = self._eng
        self._free = weakref.finalize(self, eng.close if eng is not None and hasattr(eng, "close") else _nothing)
        self._gen = _loop(model, seqs, stops, eng) if live else _no_steps()
        self.seqs = seqs

    def __iter__(self):
        return self

    def __next__(self) -> np.ndarray:
        with self._lock:
            try:
                return next(self._gen)
            except BaseException:
                self.close()  # finished (StopIteration) or failed: the slots go back now
                raise

    def close(self) -> None:
        """Stop generating and give the KV-cache slots back (idempotent)."""
        with self._lock:
            self._gen.close()
        self._free()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _nothing() -> None:
    pass


def _no_steps() -> Iterator[np.ndarray]:
    return
    yield


def _loop(model, seqs: list[_Seq], stops: list[str], eng) -> Iterator[np.ndarray]:
    cfg = model.config
    block = cfg.block_size
    ends = {t for t in tokenizer.END_IDS if t < cfg.vocab_size}
    B = len(seqs)
    live = [b for b in range(B) if not seqs[b].done]
    ctx_len = [0] * B
    groups = [("prefill", live)]
    while True:
        step = np.full(B, -1, dtype=np.int32)
        for kind, g in groups:
            if kind == "decode":
                eng.decode(g, [seqs[b].out[-1] for b in g])
                for b in g:
                    ctx_len[b] += 1
            else:  # the prompt, or past block_size the last block_size tokens from position 0 (the full forward's window)
                windows = [np.concatenate([seqs[b].prompt, np.array(seqs[b].out, np.int32)])[-block:] for b in g]
                eng.prefill(g, windows)
                for b, w in zip(g, windows):
                    ctx_len[b] = len(w)
            ids = eng.sample(g, [seqs[b].temperature for b in g], [seqs[b].top_k for b in g],
                             [seqs[b].top_p for b in g], [seqs[b].seed for b in g], [seqs[b].stream for b in g],
                             [len(seqs[b].out) for b in g])
            for b, t in zip(g, ids):
                s = seqs[b]
                s.out.append(int(t))
                step[b] = t
                if len(s.out) >= s.max_new or t in ends:
                    s.done = True
                elif stops and _hit_stop(s.out, stops):
                    s.done = True
        yield step
        live = [b for b in live if not seqs[b].done]
        if not live:
            return
        groups = [(kind, g) for kind, g in (("decode", [b for b in live if ctx_len[b] < block]),
                                            ("prefill", [b for b in live if ctx_len[b] >= block])) if g]


def _hit_stop(out: list, stops: list[str]) -> bool:
    longest = max(len(s.encode("utf-8")) for s in stops)
    # a token decodes to at least one byte: the last len(stop in UTF-8 bytes) + a few tokens hold any stop string just
    # completed (counted in characters, a stop of 4-byte characters generated one byte per token is never whole)
    text = tokenizer.decode(out[-(longest + 8):])
    return any(s in text for s in stops)


def generate(model, idx, max_new_tokens, top_k=50, temperature=1.0, seed=0, top_p=None, stop=None,
             stream=False):
    """GPT2.generate (see there)."""
    seqs, stops = _prepare(model, idx, max_new_tokens, top_k, temperature, seed, top_p, stop)
    if stream:
        return Stream(model, seqs, stops)
    prompts, rect = as_prompts(idx, model.config.vocab_size)
    out = None
    if rect:  # the result (B, T + max_new_tokens) exists before the work starts, or the call is refused
        width = max(len(s.prompt) + s.max_new for s in seqs)
        nbytes, avail = 4 * len(seqs) * width, _available_bytes()
        if avail is not None and nbytes > avail:
            raise ArgError(f"max_new_tokens: the result array ({len(seqs)}, {width}) would need "
                           f"{nbytes / 2**30:,.1f} GiB, more than the {avail / 2**30:,.1f} GiB free; ask for fewer "
                           "tokens, or use stream=True or a list of prompts (whose results are as long as made)")
        out = np.full((len(seqs), width), EOT, dtype=np.int32)
    with Stream(model, seqs, stops) as steps:
        for _ in steps:
            pass
    if not rect:
        return [np.concatenate([s.prompt, np.array(s.out, dtype=np.int32)]) for s in seqs]
    for b, s in enumerate(seqs):
        row = np.concatenate([s.prompt, np.array(s.out, dtype=np.int32)])
        out[b, :len(row)] = row
    return out


# ----------------------------------------------------------------------------------------------- engines
class ForwardEngine:
    """The uncached path: every step runs the full forward over each sequence's window and samples on the host
    with sample_reference. The reference the KV-cache engine is tested against, and the fallback of backends
    without KV-cache ops."""

    def __init__(self, model, batch: int, max_len: int):
        self.model = model
        self.ctx: dict[int, np.ndarray] = {}
        self.logits: dict[int, np.ndarray] = {}

    def _run(self, slots):
        V, block = self.model.config.vocab_size, self.model.config.block_size
        for b in slots:
            x = self.ctx[b][-block:]
            _, lg = self.model.forward(x[None, :], return_logits=True)
            self.logits[b] = lg[0, -1, :V]

    def prefill(self, slots, prompts):
        for b, p in zip(slots, prompts):
            self.ctx[b] = np.asarray(p, dtype=np.int32)
        self._run(slots)

    def decode(self, slots, tokens):
        for b, t in zip(slots, tokens):
            self.ctx[b] = np.append(self.ctx[b], np.int32(t))
        self._run(slots)

    def last_logits(self, slots) -> np.ndarray:
        return np.stack([self.logits[b] for b in slots])

    def sample(self, slots, temperature, top_k, top_p, seed, stream, step) -> np.ndarray:
        return np.array([sample_reference(self.logits[b], uniform(s, st, i), t, k, p)
                         for b, t, k, p, s, st, i in zip(slots, temperature, top_k, top_p, seed, stream, step)],
                        dtype=np.int32)


class KVEngine:
    """The core's KV-cache path: sequence b lives in cache slot self.slots[b], taken from the model's SlotPool for
    the engine's lifetime (close() gives them back); prefill pads the prompts of one call on the right to the
    longest (the core attends no padding: per-sequence positions), decode runs one token per sequence, sampling
    happens in the core (only the ids come back). Create and use it under the model's lock (model_lock)."""

    def __init__(self, model, batch: int, max_len: int):
        self.m = model._m
        self.V = model.config.vocab_size
        self.pool = SlotPool.of(model)
        self.slots = np.asarray(self.pool.acquire(batch, max_len, model.config), dtype=np.int32)

    def close(self) -> None:
        """Give the slots back (once; safe from a finaliser)."""
        slots, self.slots = self.slots, None
        if slots is not None:
            self.pool.release(slots.tolist())

    def prefill(self, slots, prompts):
        Tq = max(len(p) for p in prompts)
        x = np.zeros((len(prompts), Tq), dtype=np.int32)
        for i, p in enumerate(prompts):
            x[i, :len(p)] = p
        self.m.kv_prefill(x, np.array([len(p) for p in prompts], dtype=np.int32), self.slots[np.asarray(slots)])

    def decode(self, slots, tokens):
        self.m.kv_decode(np.asarray(tokens, dtype=np.int32), self.slots[np.asarray(slots)])

    def last_logits(self, slots) -> np.ndarray:
        return self.m.kv_logits()[:, :self.V]

    def sample(self, slots, temperature, top_k, top_p, seed, stream, step) -> np.ndarray:
        # the core takes float32: a temperature beyond its range is the same uniform-over-kept draw at 3e38
        return self.m.kv_sample([min(float(t), 3e38) for t in temperature], [int(k) for k in top_k], [float(p) for p in top_p],
                                [int(s) for s in seed], [int(s) for s in stream], [int(i) for i in step])
