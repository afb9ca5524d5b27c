"""One model, many callers (issue 38): threads and live streams sharing one GPT2, and the inputs checked where they
enter.

The reference for every result is the same call made alone, one after another on a fresh model (the single-threaded
answer): a thread's generate, stream, forward, token losses or gradients must equal it exactly (same bits), whatever
the other threads do meanwhile, and every stream advanced among other live streams must give the ids it gives alone.
Threads run with random start delays and random call orders (seeded), a bounded number of calls each."""
import gc
import threading

import numpy as np
import pytest

from gpt2core import GPT2, GPT2Config, inference

CFG = GPT2Config(block_size=24, vocab_size=97, padded_vocab_size=128, n_layer=2, n_head=2, n_embd=32)


def tiny(training=True, weights="fp32", seed=0):
    m = GPT2(CFG, seed=seed, training=training)
    if weights != "fp32":
        m.inference_weights = weights
    return m


def calls(rng, n):
    """n random calls: (kind, args) with random prompts, lengths and seeds."""
    out = []
    for i in range(n):
        kind = ["generate", "stream", "forward", "losses"][int(rng.integers(4))]
        B, T = int(rng.integers(1, 3)), int(rng.integers(2, 10))
        x = rng.integers(0, CFG.vocab_size, (B, T)).astype(np.int32)
        y = rng.integers(0, CFG.vocab_size, (B, T)).astype(np.int32)
        out.append((kind, x, y, int(rng.integers(1, 8)), int(rng.integers(0, 2**63))))
    return out


def run_call(m, call):
    kind, x, y, new, seed = call
    if kind == "generate":
        return m.generate(x, new, seed=seed)
    if kind == "stream":
        return np.stack(list(m.generate(x, new, seed=seed, stream=True)))
    if kind == "forward":
        loss, logits = m.forward(x, y, return_logits=True)
        return np.append(logits.ravel(), loss)
    with m.lock:  # a forward and ITS token losses: atomic under the model's lock
        m.forward(x, y)
        return m.token_losses().copy()


def hammer(m, per_thread, threads_seed):
    """Each thread runs its calls (random start delays), returning the results by thread; an exception in a thread
    is re-raised here."""
    results = [None] * len(per_thread)
    errors = []
    start = threading.Barrier(len(per_thread))

    def work(i):
        try:
            rng = np.random.default_rng(threads_seed + i)
            start.wait()
            out = []
            for c in per_thread[i]:
                if rng.random() < 0.3:
                    threading.Event().wait(float(rng.random()) * 1e-3)
                out.append(run_call(m, c))
            results[i] = out
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    ts = [threading.Thread(target=work, args=(i,)) for i in range(len(per_thread))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert not errors, errors
    return results


@pytest.mark.parametrize("training", [True, False], ids=["training", "inference-only"])
def test_threads_sharing_a_model_get_the_single_threaded_results(training):
    """3 threads x 6 mixed calls (generate, stream, forward with logits, forward + token_losses), two rounds of
    random interleavings: every result equals the same call run alone on the same weights."""
    rng = np.random.default_rng(7)
    per_thread = [calls(rng, 6) for _ in range(3)]
    alone = tiny(training)
    want = [[run_call(alone, c) for c in cs] for cs in per_thread]
    shared = tiny(training)
    for round_ in range(2):
        got = hammer(shared, per_thread, 100 * round_)
        for i in range(len(per_thread)):
            for c, g, w in zip(per_thread[i], got[i], want[i]):
                np.testing.assert_array_equal(g, w, err_msg=f"thread {i} {c[0]}")


def test_gradients_in_one_thread_while_others_generate():
    """forward / backward under the lock in one thread (zero_grad, forward, backward, read the gradients) while
    two threads generate and run forwards: the gradients are those of a model alone."""
    x = np.random.default_rng(1).integers(0, 97, (2, 9)).astype(np.int32)
    y = np.roll(x, -1, axis=1)
    alone = tiny()
    alone.forward(x, y)
    alone.backward()
    want = {k: g.copy() for k, g in alone.grads.items()}
    m = tiny()
    got, errors = [], []

    def grads():
        try:
            for _ in range(4):
                with m.lock:
                    m.zero_grad()
                    m.forward(x, y)
                    m.backward()
                    got.append({k: g.copy() for k, g in m.grads.items()})
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    def other(seed):
        try:
            r = np.random.default_rng(seed)
            for _ in range(4):
                m.generate(r.integers(0, 97, (1, 5)), 6, seed=seed)
                m.forward(r.integers(0, 97, (3, 7)))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    ts = [threading.Thread(target=grads)] + [threading.Thread(target=other, args=(s,)) for s in (2, 3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert not errors, errors
    assert len(got) == 4
    for g in got:
        for k in want:
            np.testing.assert_array_equal(g[k], want[k], err_msg=k)


def interleave_streams(m, specs, rng, first, join, between):
    """Streams of `m` for specs [(prompt, max_new_tokens, seed)], the first `first` made at once, advanced one step
    at a time in a random order (rng); the next spec's stream joins when join(steps so far) says so, or when no
    stream is left to advance; between() runs after each step (other calls on the model). The steps each stream
    yielded, per spec."""
    streams = [m.generate(p, n, seed=s, stream=True) for p, n, s in specs[:first]]
    got = [[] for _ in specs]
    pending = list(range(len(streams)))
    while pending or len(streams) < len(specs):
        if len(streams) < len(specs) and (not pending or join(got)):  # a new stream joins mid-way
            p, n, s = specs[len(streams)]
            streams.append(m.generate(p, n, seed=s, stream=True))
            pending.append(len(streams) - 1)
            continue
        i = pending[int(rng.integers(len(pending)))]
        step = next(streams[i], None)
        if step is None:
            pending.remove(i)
        else:
            got[i].append(step)
        between()
    return got


@pytest.mark.parametrize("weights", ["fp32", "bf16", "fp16", "int8"])
@pytest.mark.parametrize("n_streams", [2, 8])
def test_live_streams_advanced_in_random_order_equal_their_solo_runs(weights, n_streams):
    """n live streams of one model (different prompts, lengths, seeds; some with two prompts), advanced in a random
    order, with generate and forward calls in between (and the KV cache growing under them, as streams with longer
    contexts join): each yields exactly what it yields alone."""
    rng = np.random.default_rng(n_streams)
    specs = []
    for i in range(n_streams):
        B = 1 + (i % 3 == 2)
        prompt = [list(rng.integers(0, 97, int(rng.integers(1, 8)))) for _ in range(B)]
        specs.append((prompt, int(rng.integers(3, 12 + 2 * i)), int(rng.integers(0, 2**64, dtype=np.uint64))))
    m = tiny(training=False, weights=weights)
    solo = [np.stack(list(m.generate(p, n, seed=s, stream=True))) for p, n, s in specs]
    m2 = tiny(training=False, weights=weights)

    def between():  # other calls on the model between the streams' steps
        if rng.random() < 0.2:
            m2.generate(rng.integers(0, 97, (2, 4)), 3, seed=1)
            m2.forward(rng.integers(0, 97, (2, 6)))
    got = interleave_streams(m2, specs, rng, n_streams // 2, lambda got: rng.random() < 0.3, between)
    for i, (g, w) in enumerate(zip(got, solo)):
        np.testing.assert_array_equal(np.stack(g), w, err_msg=f"stream {i}")


def test_streams_free_their_slots_when_closed_or_collected_and_are_bounded():
    """A stream owns its slots from generate(..., stream=True) until it ends, close() or garbage collection; the
    cache grows only while no slot is free, and beyond kv_cache_limit a new stream is a KVCacheFull naming the live
    streams."""
    m = tiny(training=False)
    pool = inference.SlotPool.of(m)
    a = m.generate([[1, 2, 3]], 5, stream=True)
    b = m.generate([[4, 5]], 5, stream=True)
    assert len(pool.owned) == 2 and m._m.kv_slots == 2
    next(a)
    a.close()
    a.close()  # idempotent
    with pytest.raises(StopIteration):
        next(a)
    c = m.generate([[6]], 4, stream=True)  # takes a's slot: no growth
    assert m._m.kv_slots == 2 and len(pool.owned) == 2
    del b
    gc.collect()
    list(c)  # ran to its end: its slot is back too
    d = m.generate([[7, 8]], 4, stream=True)
    assert m._m.kv_slots == 2 and len(pool.owned) == 1
    d.close()
    # bounded: a limit of two slots of the block size
    per_slot = 2 * CFG.n_layer * CFG.block_size * CFG.n_embd * 4
    m.kv_cache_limit = 2 * per_slot
    live = [m.generate([[1]], CFG.block_size - 1, stream=True) for _ in range(2)]
    with pytest.raises(inference.KVCacheFull, match=r"2 live generations .* hold 2 slots.*close\(\)"):
        m.generate([[1]], CFG.block_size - 1, stream=True)
    with pytest.raises(MemoryError):  # KVCacheFull is a MemoryError (and a gpt2core Error: one line in commands)
        m.generate([[1, 2]], 3)
    live[0].close()
    assert len(list(m.generate([[1]], 3, stream=True))) == 3  # room again
    with m.generate([[2]], 3, stream=True) as s:
        next(s)
    with m.lock:
        assert pool.in_use() == 1  # the context manager closed it; live[1] still holds its slot
    with pytest.raises(ValueError, match="kv_cache_limit"):
        m.kv_cache_limit = -1


@pytest.mark.parametrize("kw,name,rng_text", [
    (dict(top_k=2**31), "top_k", "2,147,483,647"),
    (dict(seed=2**64), "seed", "18,446,744,073,709,551,615"),
    (dict(seed=[1, -1]), "seed", "18,446,744,073,709,551,615"),
    (dict(max_new_tokens=10**18), "max_new_tokens", "2,147,483,647"),
])
def test_integer_arguments_beyond_the_core_are_refused_by_name(kw, name, rng_text):
    m = tiny(training=False)
    kw.setdefault("max_new_tokens", 3)
    x = np.array([[1, 2], [3, 4]])
    for stream in (False, True):
        with pytest.raises(ValueError, match=rf"{name} must be an integer >= 0, got .*at most {rng_text}, what"):
            m.generate(x, stream=stream, **kw)
    assert len(m.generate(x, 3, seed=2**64 - 1, top_k=2**31 - 1)[0]) == 5  # the ends of the ranges work


def test_model_seed_is_named():
    with pytest.raises(ValueError, match=r"seed must be an integer >= 0, got -1"):
        GPT2(CFG, seed=-1)
    with pytest.raises(ValueError, match="seed must be"):
        GPT2(CFG, seed=1.5)
