"""Log-likelihoods of token spans through the inference path: what CORE (gpt2core.core_eval) and lm-eval's model class
(gpt2core.lm_eval) score with.

A request is a row of token ids and a span [start, end) of it: the tokens row[start:end] are scored given every token
before them, i.e. the losses at positions start-1 .. end-2 of row[:-1]. score_spans packs the rows into forwards
(longest first, at most batch_tokens positions per forward, right-padded: attention is causal, so padding on the
right changes nothing before it) and runs ``model.forward(idx, targets)`` with targets on the spans only, then reads
``model.token_losses()``. On an inference-only model (load_model's default) that forward is the KV-cache prefill of
every position (kv_forward in csrc/model/gpt2_infer.h), the batched path generate() runs, on every backend that has
it (else the full forward). With greedy=True it also says whether each span is what greedy decoding would produce:
every span token the arg max of its position's logits (lowest id on ties), taken by the core's sampler with top_k=1
where the logits are (the device) when the model has the KV path, else from logits() on the host.
"""
from __future__ import annotations

import numpy as np

from ..errors import ArgError


def _batches(lengths: np.ndarray, batch_tokens: int):
    """Index arrays of rows per forward: rows by decreasing length, as many as fit batch_tokens positions (a row of
    n tokens is n - 1 positions; at least one row per forward)."""
    order = np.argsort(-lengths, kind="stable")
    i = 0
    while i < len(order):
        width = max(1, int(lengths[order[i]]) - 1)
        k = max(1, min(len(order) - i, batch_tokens // width))
        yield order[i:i + k]
        i += k


def _greedy_ids(model, B: int, T: int) -> np.ndarray:
    """(B, T) arg max ids of the last forward's logits."""
    m = model._m
    if not getattr(m, "training", True) and getattr(m, "kv_supported", False):
        N = B * T  # the inference forward left every position's logits in the KV engine: top_k=1 is the arg max
        return np.asarray(m.kv_sample([1.0] * N, [1] * N, [1.0] * N, [0] * N, [0] * N, [0] * N)).reshape(B, T)
    return np.asarray(m.logits())[:, :, :model.config.vocab_size].argmax(axis=-1)


def score_spans(model, rows, spans, batch_tokens: int = 4096, greedy: bool = False):
    """For each row (a sequence of token ids, at most block_size + 1 of them) and span (start, end) with
    1 <= start <= end <= len(row): the summed negative log-likelihood of row[start:end] in nats (float64), the
    number of tokens scored (end - start), and with greedy=True whether greedy decoding would produce the span
    (else None). An empty span scores 0 over 0 tokens (greedy: True)."""
    if len(rows) != len(spans):
        raise ArgError(f"score_spans: {len(rows)} rows for {len(spans)} spans")
    if isinstance(batch_tokens, bool) or not isinstance(batch_tokens, int) or batch_tokens < 1:
        raise ArgError(f"batch_tokens must be an integer >= 1, got {batch_tokens!r}")
    block = int(model.config.block_size)
    rows = [np.asarray(r, dtype=np.int32).reshape(-1) for r in rows]
    starts = np.array([int(s) for s, _ in spans], dtype=np.int64)
    ends = np.array([int(e) for _, e in spans], dtype=np.int64)
    lengths = np.array([len(r) for r in rows], dtype=np.int64)
    for i, (r, s, e) in enumerate(zip(rows, starts, ends)):
        if not 1 <= s <= e <= len(r):
            raise ArgError(f"score_spans: span {i} ({s}, {e}) must satisfy 1 <= start <= end <= {len(r)} (the row's "
                           "length; the first token has no prediction)")
        if len(r) - 1 > block:
            raise ArgError(f"score_spans: row {i} has {len(r)} tokens, more than block_size + 1 = {block + 1}: "
                           "crop it first (the caller decides from which side)")
    nll = np.zeros(len(rows), dtype=np.float64)
    match = np.ones(len(rows), dtype=bool) if greedy else None
    for ids in _batches(np.maximum(lengths, 2), batch_tokens):
        T = max(1, int(lengths[ids].max()) - 1)
        x = np.zeros((len(ids), T), dtype=np.int32)
        y = np.full((len(ids), T), -1, dtype=np.int32)
        for b, i in enumerate(ids):
            r, s, e = rows[i], starts[i], ends[i]
            x[b, :len(r) - 1] = r[:-1]
            y[b, s - 1:e - 1] = r[s:e]
        model.forward(x, y)
        losses = np.asarray(model.token_losses(), dtype=np.float64)
        nll[ids] = np.where(y >= 0, losses, 0.0).sum(axis=1)
        if greedy:
            pred = _greedy_ids(model, len(ids), T)
            match[ids] = ((pred == y) | (y < 0)).all(axis=1)
    return nll, ends - starts, match


__all__ = ["score_spans"]
