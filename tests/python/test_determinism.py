"""A seeded request's text does not depend on what runs beside it (issue 36), with every inference weight type.

With --weights bf16 / fp16 / int8 every matmul of the KV path reads the 16/8-bit copy through the CPU backend's
GEMV, whose arithmetic for one row does not depend on the call's other rows (csrc/cpu/ops_infer.h: one kernel for
any group of input rows, each row summed in the same order; csrc/model/gpt2_infer.h: prefill takes the GEMV too).
So a row's logits are the same bits alone and within a larger prefill or decode, in every instruction-set variant,
and a seeded sampled request through the scheduler draws the same ids alone and among 7-15 other sequences. fp32
prefill and decode beside more than 8 rows take BLAS's GEMM, whose rounding depends on the row count (the logits
move by a few 1e-7 relative): its sampled ids are the same here, not bit-identical logits by construction.
"""
import time

import numpy as np
import pytest

import numpy_gpt2 as ref
from gpt2core import GPT2, GPT2Config

V, VP = 97, 104  # 104: the head's last block of 16 outputs is partial (the GEMVs' tail paths)
# cpu_isa: the fixture of tests/conftest.py (every variant this CPU runs; the others skip)


def inference_model(weights, C=64, NH=4, V=V, Vp=VP, block=48, seed=0):
    """An inference-only float32 model of random weights that make every part matter (tests/numpy_gpt2.py)."""
    cfg = GPT2Config(block_size=block, vocab_size=V, padded_vocab_size=Vp, n_layer=2, n_head=NH, n_embd=C)
    m = GPT2(cfg, dtype="float32", init=False, training=False)
    params = ref.random_params(np.random.default_rng(seed), maxT=block, V=V, Vp=Vp, L=2, NH=NH, C=C)
    for k, v in params.items():
        m.params[k][...] = v
    m.params_changed()
    if weights != "fp32":
        m.inference_weights = weights.split("-")[0]
    if weights == "int8-widen":
        m._m.q8_int_dot = False
    return m


def prefill_then_decode(core, target, others, slot, at, apart=False):
    """Prefill `target` into `slot` with `others` (into other slots; the call's row `at` is the target's; apart:
    the target alone, then the others), then decode one token for all of them: the target's prefill and decode
    logits."""
    seqs = list(others)
    seqs.insert(at, target)
    n = len(seqs)
    slots = [s for s in range(n + 1) if s != slot][:n - 1]
    slots.insert(at, slot)
    lengths = np.array([len(s) for s in seqs], np.int32)
    x = np.zeros((n, lengths.max()), np.int32)
    for i, s in enumerate(seqs):
        x[i, :len(s)] = s
    if apart:
        core.kv_prefill(x[at:at + 1], lengths[at:at + 1], np.array(slots[at:at + 1], np.int32))
        first = core.kv_logits()[0].copy()
        rest = [i for i in range(n) if i != at]
        if rest:
            core.kv_prefill(x[rest], lengths[rest], np.array(slots, np.int32)[rest])
    else:
        core.kv_prefill(x, lengths, np.array(slots, np.int32))
        first = core.kv_logits()[at].copy()
    nxt = np.array([(7 * i + 5) % V for i in range(n)], np.int32)
    nxt[at] = 3  # the target's next token
    core.kv_decode(nxt, np.array(slots, np.int32))
    return first, core.kv_logits()[at].copy()


@pytest.mark.parametrize("weights", ["bf16", "fp16", "int8", "int8-widen"])
def test_row_logits_bitwise_equal_alone_and_in_any_batch(cpu_isa, weights):
    """A sequence's prefill and decode logits, alone, then among 1 .. 40 others of mixed lengths (prefill calls of
    up to 41 x 9 rows: the GEMV's 32-row blocks, a partial last one; decode batches across the 1-row, 2..8-row and
    more-row cases), at several positions in the call and in other slots, its prompt prefilled with theirs or
    alone: the same bits every time."""
    m = inference_model(weights)
    core = m._m
    rng = np.random.default_rng(1)
    target = [int(t) for t in rng.integers(0, V, 5)]
    core.kv_reserve(42, 16)
    alone = prefill_then_decode(core, target, [], 3, 0)
    for n_others in (1, 2, 3, 7, 8, 12, 40):
        others = [[int(t) for t in rng.integers(0, V, k)] for k in rng.integers(1, 10, n_others)]
        at = int(rng.integers(0, n_others + 1))
        slot = int(rng.integers(0, 42))
        together = prefill_then_decode(core, target, others, slot, at)
        apart = prefill_then_decode(core, target, others, slot, at, apart=True)
        for what, a, b in zip(("prefill", "decode", "prefill alone", "decode"), alone + alone, together + apart):
            same = bool(np.array_equal(a.view(np.uint32), b.view(np.uint32)))
            assert same, (weights, cpu_isa, what, n_others, float(np.abs(a - b).max() / np.abs(a).max()))
    # and the logits are the model's: the 16/8-bit path agrees with the float32 forward (own tests bound it
    # closely; here: not garbage)
    _, full = m.forward(np.array([target + [3]], np.int32), return_logits=True)
    assert np.abs(alone[1] - full[0, -1]).max() < 0.05 * np.abs(full[0, -1]).max()


@pytest.mark.parametrize("weights", ["fp32", "bf16", "fp16", "int8"])
def test_seeded_request_same_ids_alone_and_among_others(weights):
    """Through the scheduler (the server's model thread, no HTTP): a seeded sampled request gives the same ids
    alone and submitted with 7-15 other sequences of different prompt lengths and max_tokens (so the batch it
    decodes in shrinks step by step from 16 through the 1-row and <= 8-row cases), its prompt prefilled together
    with theirs."""
    from gpt2core.scheduler import Job, Scheduler, SeqParams, SlotEngine

    class Recording(Scheduler):
        def _accept(self, s, t, lp_row):
            self.ids.setdefault(s.job.name, []).append(int(t))
            super()._accept(s, t, lp_row)

    # ids < 97 are GPT-2 tokens too (the scheduler detokenises); random weights that make the distribution far
    # from uniform
    m = inference_model(weights, seed=2, block=64)
    rng = np.random.default_rng(3)
    target = SeqParams([int(t) for t in rng.integers(0, V, 6)], 24, 1.0, 1.0, 1234, [])

    def run(jobs):
        sched = Recording(SlotEngine(m, 16, 64), max_batch=16, prefill_chunk=128, threads=None)
        sched.ids = {}
        done = []
        for name, p in jobs:
            job = Job([p], lambda ev, name=name: done.append(name) if ev[0] in ("done", "error") else None)
            job.name = name
            sched.submit(job)
        sched.start()  # all submitted first: admitted together, the prompts prefilled in one call
        try:
            t0 = time.monotonic()
            while len(done) < len(jobs) and time.monotonic() - t0 < 60:
                time.sleep(0.005)
        finally:
            sched.close()
        assert len(done) == len(jobs) and sched.stats.largest_batch == len(jobs)
        return sched.ids

    alone = run([("target", target)])["target"]
    assert len(alone) == 24
    for n_others in (7, 15):
        others = [(f"o{k}", SeqParams([int(t) for t in rng.integers(0, V, int(rng.integers(1, 20)))],
                                      int(rng.integers(1, 30)), 0.8, 0.9, int(rng.integers(0, 2**31)), []))
                  for k in range(n_others)]
        jobs = others[:n_others // 2] + [("target", target)] + others[n_others // 2:]
        assert run(jobs)["target"] == alone, (weights, n_others)
