"""The model side of gpt2core-serve: the one thread that owns the model (ModelThread: every call on the model runs
there, so the KV cache lives where it was reserved) and the core's slot API the scheduler drives (SlotEngine: a cache
of `slots` sequences reserved once; prefill tokens into slot i at its position, decode one token for each of some
slots, sample where the logits are, free slot i)."""
from __future__ import annotations

import concurrent.futures
import functools
import queue
import threading

import numpy as np


# ------------------------------------------------------------------------------------------------ the model thread
class ModelThread:
    """One daemon thread that runs what it is given, in order: gpt2core-serve loads the model, reserves the KV cache
    and runs the scheduler's loop in it, so that ONE thread makes every OpenMP call of the process.

    Why: GNU OpenMP keeps a pool of worker threads per thread that has started a parallel region. Once two threads
    have pools (the main thread loaded the model, the scheduler's thread decodes), the process holds more OpenMP
    threads than cores, and libgomp stops letting its idle workers spin before they sleep; every small parallel
    region of a decode step then waits for its workers to wake. Measured on 2 cores, d12, one decode step: 16.7 ms
    (fp32) and 6.5 ms (int8) from the thread that loaded the model, 34 ms and 25 ms from another thread, 21.6 ms and
    8.4 ms when that other thread did everything (the bench's serve numbers in the issue note)."""

    def __init__(self, name: str = "gpt2core-serve-model"):
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def _work(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            fn, future = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
                    future.set_exception(e)

    def submit(self, fn, *args, **kwargs):
        """fn(*args, **kwargs) in the thread, after what was submitted before: a concurrent.futures.Future."""
        future = concurrent.futures.Future()
        self._q.put((functools.partial(fn, *args, **kwargs), future))
        return future

    def call(self, fn, *args, **kwargs):
        """fn(*args, **kwargs) in the thread; its result here (or its exception raised here)."""
        return self.submit(fn, *args, **kwargs).result()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def close(self) -> None:
        """The thread ends once what was submitted has run."""
        self._q.put(None)


# ------------------------------------------------------------------------------------------------ the engine
class SlotEngine:
    """The core's KV-cache slot API for the scheduler: `slots` sequences of up to `max_len` tokens, reserved once.
    The slots are taken from the model's SlotPool (gpt2core.inference: the scheduler's slot i is the core's slot
    self.core_slots[i]), so that streams, generate calls or forwards of the same model elsewhere never share one;
    `lock` is the model's lock, held by the scheduler around each iteration."""

    def __init__(self, model, slots: int, max_len: int):
        from ..model import engine as inference
        self.m = model._m
        if not (hasattr(self.m, "kv_free") and self.m.kv_supported):
            raise ValueError(f"the {model.device} backend of this model has no KV-cache inference ops: the server "
                             "needs them")
        self.V = model.config.vocab_size
        self.lock = inference.model_lock(model)
        with self.lock:
            self.core_slots = np.asarray(inference.SlotPool.of(model).acquire(slots, max_len, model.config), np.int32)
        self.slots, self.max_len = slots, max_len

    def prefill(self, slots, chunks, starts, all_logits: bool = False) -> None:
        Tq = max(len(c) for c in chunks)
        x = np.zeros((len(chunks), Tq), dtype=np.int32)
        for i, c in enumerate(chunks):
            x[i, :len(c)] = c
        self.m.kv_prefill(x, np.array([len(c) for c in chunks], np.int32), self.core_slots[np.asarray(slots)],
                          all_logits, np.asarray(starts, np.int32))

    def decode(self, slots, tokens) -> None:
        self.m.kv_decode(np.asarray(tokens, np.int32), self.core_slots[np.asarray(slots)])

    def sample(self, temperature, top_k, top_p, seed, step) -> np.ndarray:
        n = len(temperature)
        return self.m.kv_sample([float(t) for t in temperature], [int(k) for k in top_k], [float(p) for p in top_p],
                                [int(s) for s in seed], [0] * n, [int(i) for i in step])

    def logits(self) -> np.ndarray:
        """The last call's logits (rows, vocab_size), float64."""
        return np.asarray(self.m.kv_logits()[:, :self.V], dtype=np.float64)

    def free(self, slot: int) -> None:
        self.m.kv_free(int(self.core_slots[slot]))
