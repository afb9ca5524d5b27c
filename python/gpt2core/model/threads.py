"""One model, several threads: the lock every call on the model's buffers holds (GPT2.lock)."""
from __future__ import annotations

import functools


def locked(method):
    """The method runs under the model's lock (GPT2.lock): one call at a time on the model's buffers."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self.lock:
            return method(self, *args, **kwargs)
    return run
