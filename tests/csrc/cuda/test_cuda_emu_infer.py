"""KV-cache inference on the emulated CUDA backend (csrc/cuda/infer.cuh, model/gpt2_infer.h over CudaBackend):

- the decode attention kernel (kv_write + attention_kv) against a float64 numpy reference: several heads of size 64,
  mixed per-sequence positions and odd lengths, slots out of order, prefill (Tq > 1) and decode (Tq = 1), the output
  poisoned with NaN and every cache position the kernel must not read poisoned with NaN too;
- encoder_forward_at and gather_rows against numpy;
- the whole model: at every decode step (mixed prompt lengths 7, 13 and 1, one sequence left out of some steps) the
  CUDA backend's cached logits against the CPU backend's: fp32 within 1e-5 normwise (the summation-order rounding
  of fp32, as test_cuda_emu.py), bf16 / fp16 models against the CPU fp32 model within their storage precision
  (normwise 3e-2 / 4e-3: test_cuda_emu_bf16_model.py's 1e-2 / 1.3e-3 for one forward, x3 for the rounded K/V cache
  and the steps that follow);
- sampling on the device: the same ids as the CPU backend's sampler for the same logits and (seed, stream, step)
  (greedy with ties, all tokens, top-k, top-p, both, a nucleus larger than the kernel's 1024 sorted candidates
  (sampled on the host from the logits), top_k above them); top_k = 1 is the arg max; and a chi-square test of the
  frequencies of 600 draws against inference.sample_distribution.
"""
import numpy as np
import pytest

from test_cuda_emu import CFG, emu, init_params, normwise  # noqa: F401  (emu: fixture)

rng = np.random.default_rng(31)


def f32(*shape):
    return rng.standard_normal(shape).astype(np.float32)


def attention_kv_reference(qkv, kcache, vcache, slot, pos, NH):
    """float64: K, V of qkv into the caches, then each query against its slot's positions 0..pos[b]+t."""
    B, Tq, C3 = qkv.shape
    C = C3 // 3
    hs = C // NH
    kc, vc = kcache.astype(np.float64), vcache.astype(np.float64)
    q = qkv.astype(np.float64)
    out = np.zeros((B, Tq, C))
    for b in range(B):
        for t in range(Tq):
            kc[slot[b], pos[b] + t] = q[b, t, C:2 * C]
            vc[slot[b], pos[b] + t] = q[b, t, 2 * C:]
    for b in range(B):
        n_all = pos[b] + Tq
        for h in range(NH):
            K = kc[slot[b], :n_all, h * hs:(h + 1) * hs]
            V = vc[slot[b], :n_all, h * hs:(h + 1) * hs]
            for t in range(Tq):
                s = K[:pos[b] + t + 1] @ q[b, t, h * hs:(h + 1) * hs] / np.sqrt(hs)
                p = np.exp(s - s.max())
                out[b, t, h * hs:(h + 1) * hs] = (p / p.sum()) @ V[:pos[b] + t + 1]
    return out, kc, vc


@pytest.mark.parametrize("Tq", [1, 5])
def test_attention_kv_matches_float64(emu, Tq):  # noqa: F811
    S, maxT, NH, hs = 4, 41, 3, 64
    C = NH * hs
    slot = np.array([2, 0, 3], np.int32)          # out of order; slot 1 unused
    pos = np.array([17, 0, 35], np.int32)         # mixed lengths: 0 (a prefill), odd, near the end of the cache
    B = len(slot)
    kcache = np.full((S, maxT, C), np.nan, np.float32)  # every position the kernel must not read: NaN
    vcache = np.full((S, maxT, C), np.nan, np.float32)
    for b in range(B):
        kcache[slot[b], :pos[b]] = f32(pos[b], C)
        vcache[slot[b], :pos[b]] = f32(pos[b], C)
    qkv = f32(B, Tq, 3 * C)
    want, kw, vw = attention_kv_reference(qkv, kcache, vcache, slot, pos, NH)
    out, kc, vc = emu.Ops("cuda").attention_kv(qkv, kcache, vcache, slot, pos, NH)
    assert np.all(np.isfinite(out))
    assert normwise(out, want) <= 1e-5
    for b in range(B):  # the new rows written, the rest of the cache untouched
        n = pos[b] + Tq
        assert np.array_equal(kc[slot[b], :n], kw[slot[b], :n].astype(np.float32))
        assert np.array_equal(vc[slot[b], :n], vw[slot[b], :n].astype(np.float32))
        assert np.all(np.isnan(kc[slot[b], n:])) and np.all(np.isnan(vc[slot[b], n:]))
    assert np.all(np.isnan(kc[1])) and np.all(np.isnan(vc[1]))
    for cls, tol in (("OpsBF16", 2e-2), ("OpsF16", 3e-3)):  # the 16-bit kernels: inputs rounded, fp32 inside
        if hasattr(emu, cls):
            got = getattr(emu, cls)("cuda").attention_kv(qkv, kcache, vcache, slot, pos, NH)[0]
            assert normwise(got, want) <= tol, cls


# ---------------------------------------------------------------------- split-key decode attention (flash-decoding)
def _split_case(lengths, Tq, NH=3, hs=64, S=None, seed=0):
    """Caches with NaN at every position the kernel must not read, sequences at positions `lengths` of slots in
    reverse order."""
    g = np.random.default_rng(seed)
    C = NH * hs
    B = len(lengths)
    S = S or B + 1
    maxT = max(lengths) + Tq + 3
    slot = np.array([S - 1 - b for b in range(B)], np.int32)
    pos = np.array(lengths, np.int32)
    kcache = np.full((S, maxT, C), np.nan, np.float32)
    vcache = np.full((S, maxT, C), np.nan, np.float32)
    for b in range(B):
        kcache[slot[b], :pos[b]] = g.standard_normal((pos[b], C))
        vcache[slot[b], :pos[b]] = g.standard_normal((pos[b], C))
    qkv = (g.standard_normal((B, Tq, 3 * C)) * 1.5).astype(np.float32)  # scores of a few units: a peaked softmax
    return qkv, kcache, vcache, slot, pos, NH


# contexts of 1, 7, 257 and 1000 positions (pos + 1 keys), each split unevenly: ceil(n / splits) per block, the last
# share shorter, and for n < splits empty shares (their partial is m = -inf, l = 0)
@pytest.mark.parametrize("splits", [1, 2, 3, 7, 16, 64])
def test_split_decode_attention_matches_float64(emu, splits):  # noqa: F811
    args = _split_case([0, 6, 256, 999], Tq=1, seed=splits)
    want, kw, vw = attention_kv_reference(*args)
    for dtype, tol in ((0, 1e-5), (1, 2e-2), (2, 3e-3)):  # fp32, bf16, fp16: the existing tolerances
        out, kc, vc = emu.k_attention_kv_splits(dtype, *args, splits=splits)
        assert np.all(np.isfinite(out)), (dtype, splits)
        assert normwise(out, want) <= tol, (dtype, splits, normwise(out, want))
        if dtype == 0:
            slot, pos = args[3], args[4]
            for b in range(len(slot)):  # the new rows written, the rest of the cache untouched
                n = pos[b] + 1
                assert np.array_equal(kc[slot[b], :n], kw[slot[b], :n].astype(np.float32))
                assert np.array_equal(vc[slot[b], :n], vw[slot[b], :n].astype(np.float32))
                assert np.all(np.isnan(kc[slot[b], n:])) and np.all(np.isnan(vc[slot[b], n:]))
            assert np.all(np.isnan(kc[0]))  # the unused slot


def test_split_prefill_and_head_sizes(emu):  # noqa: F811
    """Tq > 1 (each query its own length, so its own chunk), head sizes 16 / 10 / 128 (lanes past hs idle)."""
    for NH, hs, Tq, splits in ((4, 16, 5, 3), (2, 10, 1, 5), (1, 128, 2, 4)):
        args = _split_case([40, 3, 0], Tq=Tq, NH=NH, hs=hs, seed=hs)
        want = attention_kv_reference(*args)[0]
        got = emu.k_attention_kv_splits(0, *args, splits=splits)[0]
        assert normwise(got, want) <= 1e-5, (NH, hs, Tq, splits)


def test_split_choice(emu):  # noqa: F811
    """infer.cuh's decode_splits: one block per (head, query, sequence) below 128 cache positions or when that grid
    has 8 blocks per SM; otherwise about 8 blocks per SM, >= 64 positions of a full cache each, at most 64."""
    ds = emu.decode_splits
    assert ds(1, 1, 12, 127, 132) == 1 and ds(88, 1, 12, 4096, 132) == 1  # short cache; 1,056 blocks already
    assert ds(1, 1, 12, 128, 132) == 2 and ds(1, 1, 12, 191, 132) == 2
    assert ds(87, 1, 12, 4096, 132) == 2       # 1,044 blocks: two each
    assert ds(1, 1, 12, 1024, 132) == 16       # d12 at batch 1, 1,024 positions: 192 blocks (1,024 / 64)
    assert ds(8, 1, 12, 1024, 132) == 11       # batch 8: 96 blocks -> ceil(1,056 / 96) = 11
    assert ds(64, 1, 12, 1024, 132) == 2       # batch 64: 768 blocks -> 1,536
    assert ds(1, 1, 12, 8192, 132) == 64       # ceil(1,056 / 12) = 88: the cap
    assert ds(1, 1, 12, 256, 132) == 4         # 256 / 64
    assert ds(3, 1, 3, 1003, 132) == 15        # the float64 test's shape through the backend
    assert ds(1, 1, 12, 1024, 16) == 11        # a 16-SM GPU: ceil(128 / 12)


def test_backend_splits_long_caches(emu):  # noqa: F811
    """Through the backend (Ops.attention_kv, 132 emulated SMs): a cache of 1,003 positions with 3 heads and 3
    sequences splits 15 ways (test_split_choice); the result is the float64 one, fp32 / bf16 / fp16."""
    args = _split_case([0, 256, 999], Tq=1, seed=5)
    assert emu.decode_splits(3, 1, 3, args[1].shape[1]) > 1
    want = attention_kv_reference(*args)[0]
    assert normwise(emu.Ops("cuda").attention_kv(*args)[0], want) <= 1e-5
    for cls, tol in (("OpsBF16", 2e-2), ("OpsF16", 3e-3)):
        if hasattr(emu, cls):
            assert normwise(getattr(emu, cls)("cuda").attention_kv(*args)[0], want) <= tol, cls


def test_encoder_at_and_gather_rows(emu):  # noqa: F811
    B, Tn, C, V, maxT = 3, 5, 192, 97, 40
    inp = rng.integers(0, V, (B, Tn)).astype(np.int32)
    pos = np.array([0, 11, 35], np.int32)
    wte, wpe = f32(128, C), f32(maxT, C)
    want = wte[inp] + np.stack([wpe[p:p + Tn] for p in pos])
    assert normwise(emu.Ops("cuda").encoder_forward_at(inp, wte, wpe, pos), want) <= 1e-7
    x = f32(7, C)
    rows = np.array([6, 0, 3], np.int32)
    assert np.array_equal(emu.Ops("cuda").gather_rows(x, rows), x[rows])


# ----------------------------------------------------------------------------------------------- the model
MODERN = dict(position="rope", norm="rmsnorm", qk_norm=True, activation="relu2", bias=False, tie_embeddings=False,
              logit_softcap=15.0)


def _models(emu, cls, cfg=CFG, **arch):  # noqa: F811
    cpu, gpu = emu.Model(**cfg, device="cpu", **arch), getattr(emu, cls)(**cfg, device="cuda", **arch)
    init_params(cpu, 5)
    init_params(gpu, 5)
    if cls != "Model":
        gpu.params_changed()
    return cpu, gpu


SPLIT = 256  # a cache of 256 positions: the decode attention splits (decode_splits(3, 1, 3, 256) = 4 blocks each)


@pytest.mark.parametrize("cls,tol,arch,max_len", [("Model", 1e-5, {}, 24), ("ModelBF16", 3e-2, {}, 24),
                                                  ("ModelF16", 4e-3, {}, 24), ("Model", 1e-5, MODERN, 24),
                                                  ("Model", 1e-5, {}, SPLIT), ("ModelBF16", 3e-2, {}, SPLIT)],
                         ids=["fp32", "bf16", "fp16", "fp32-modern", "fp32-split", "bf16-split"])
def test_cached_logits_match_cpu_at_every_step(emu, cls, tol, arch, max_len):  # noqa: F811
    """The modern architecture (rotary at each sequence's own position: rope_forward_at) in fp32 too; with a cache of
    256 positions the decode (and prefill) attention takes the split-key path."""
    cfg = dict(CFG, max_seq_len=max(CFG["max_seq_len"], max_len))
    cpu, gpu = _models(emu, cls, cfg, **arch)
    assert gpu.kv_supported
    if max_len == SPLIT:
        assert emu.decode_splits(3, 1, CFG["n_head"], SPLIT) > 1
    lengths = np.array([7, 13, 1], np.int32)
    slots = np.array([1, 0, 2], np.int32)
    x = rng.integers(0, CFG["vocab_size"], (3, 13)).astype(np.int32)
    for m in (cpu, gpu):
        m.kv_reserve(3, max_len)
        m.kv_prefill(x, lengths, slots)
    errs = [normwise(gpu.kv_logits(), cpu.kv_logits())]
    for step in range(6):
        live = np.array([1, 0, 2] if step % 3 else [0, 2], np.int32)  # slot 1 sits out some steps
        tok = rng.integers(0, CFG["vocab_size"], len(live)).astype(np.int32)
        for m in (cpu, gpu):
            m.kv_decode(tok, live)
        errs.append(normwise(gpu.kv_logits(), cpu.kv_logits()))
    assert [gpu.kv_pos(s) for s in range(3)] == [cpu.kv_pos(s) for s in range(3)] == [19, 11, 7]
    assert max(errs) <= tol, errs


@pytest.mark.parametrize("arch,max_len", [({}, 24), (MODERN, 24), ({}, SPLIT)], ids=["fp32", "modern", "split"])
def test_prefill_in_chunks_at_a_start_matches_cpu(emu, arch, max_len):  # noqa: F811
    """kv_prefill's start (the server's chunked prefill) and kv_free on the CUDA backend: two prompts fed in chunks
    of 4 at their slots' positions (calls mixing positions, the last one with every position's logits), then a
    decode step, give the CPU backend's logits of the same calls within fp32's 1e-5 and leave the same positions;
    a freed slot takes a new prompt from 0."""
    cfg = dict(CFG, max_seq_len=max(CFG["max_seq_len"], max_len))
    cpu, gpu = _models(emu, "Model", cfg, **arch)
    seqs = {1: rng.integers(0, CFG["vocab_size"], 11).astype(np.int32),
            0: rng.integers(0, CFG["vocab_size"], 6).astype(np.int32)}
    for m in (cpu, gpu):
        m.kv_reserve(2, max_len)
    fed, errs = {1: 0, 0: 0}, []
    while any(fed[s] < len(seqs[s]) for s in seqs):
        slots = [s for s in seqs if fed[s] < len(seqs[s])]
        chunks = [seqs[s][fed[s]:fed[s] + 4] for s in slots]
        x = np.zeros((len(slots), max(map(len, chunks))), np.int32)
        for i, c in enumerate(chunks):
            x[i, :len(c)] = c
        last = all(fed[s] + len(c) == len(seqs[s]) for s, c in zip(slots, chunks)) or len(slots) == 1
        for m in (cpu, gpu):
            m.kv_prefill(x, np.array([len(c) for c in chunks], np.int32), np.array(slots, np.int32), last,
                         np.array([fed[s] for s in slots], np.int32))
        errs.append(normwise(gpu.kv_logits(), cpu.kv_logits()))
        for s, c in zip(slots, chunks):
            fed[s] += len(c)
    tok = np.array([3, 4], np.int32)
    for m in (cpu, gpu):
        m.kv_decode(tok, np.array([1, 0], np.int32))
    errs.append(normwise(gpu.kv_logits(), cpu.kv_logits()))
    assert [gpu.kv_pos(s) for s in (0, 1)] == [cpu.kv_pos(s) for s in (0, 1)] == [7, 12]
    for m in (cpu, gpu):
        m.kv_free(1)
        m.kv_prefill(seqs[0][None, :5], np.array([5], np.int32), np.array([1], np.int32))
    errs.append(normwise(gpu.kv_logits(), cpu.kv_logits()))
    assert gpu.kv_pos(1) == 5 and max(errs) <= 1e-5, errs


def test_graphed_decode_is_bitwise_the_direct_run(emu):  # noqa: F811
    """cuda_graphs on: kv_decode's step (layers and head) is run directly once per batch size, then captured, then
    replayed, reading each step's tokens, slots and positions from device memory. Every step's logits and sampled
    ids are bitwise those of a model running the same steps directly (a stale position or token in a replay would
    change them), and the CPU's within 1e-5; the batch changes size (slot 1 sitting out), which takes a new graph.
    A 256-position cache: the split-key attention and its workspace are in the graph."""
    cfg = dict(CFG, max_seq_len=SPLIT)
    cpu, direct = _models(emu, "Model", cfg)
    _, graphed = _models(emu, "Model", cfg)
    graphed.cuda_graphs = True
    lengths, slots = np.array([7, 13, 1], np.int32), np.array([1, 0, 2], np.int32)
    x = rng.integers(0, CFG["vocab_size"], (3, 13)).astype(np.int32)
    for m in (cpu, direct, graphed):
        m.kv_reserve(3, SPLIT)
        m.kv_prefill(x, lengths, slots)
    tok = {id(m): np.array([5, 6, 7], np.int32) for m in (cpu, direct, graphed)}
    for step in range(12):
        live = np.array([1, 0, 2] if step < 5 or step >= 9 else [0, 2], np.int32)
        outs = []
        for m in (cpu, direct, graphed):
            t = tok[id(m)][:len(live)]
            m.kv_decode(t, live)
            logits = m.kv_logits()
            ids = m.kv_sample([0.9] * len(live), [20] * len(live), [0.9] * len(live), [4] * len(live),
                              list(live), [step] * len(live))
            tok[id(m)] = np.concatenate([ids, ids])[:3].astype(np.int32)
            outs.append((logits, ids))
        assert np.array_equal(outs[1][0], outs[2][0]), step  # bitwise
        assert np.array_equal(outs[1][1], outs[2][1]), step
        assert normwise(outs[2][0], outs[0][0]) <= 1e-5, step
    # batch 3 (steps 0-4): direct, captured and launched, replayed x3; batch 2 (5-8): direct, captured, replayed
    # x2; batch 3 again (9-11): direct, captured, replayed once
    assert graphed.graph_captures == 3 and graphed.graph_replays == 4 + 3 + 2, (
        graphed.graph_captures, graphed.graph_replays)
    assert direct.graph_captures == 0
    assert graphed.cuda_graphs  # no capture failed


def test_graphed_decode_of_a_rotary_model_runs_directly(emu):  # noqa: F811
    """The fallback: a rotary model's decode step is not captured (rope_forward_at reads the positions on the host
    to size its table) and runs directly, with the same logits as without graphs; graphs stay on."""
    _, direct = _models(emu, "Model", **MODERN)
    _, graphed = _models(emu, "Model", **MODERN)
    graphed.cuda_graphs = True
    x = rng.integers(0, CFG["vocab_size"], (2, 6)).astype(np.int32)
    for m in (direct, graphed):
        m.kv_reserve(2, 20)
        m.kv_prefill(x, np.array([6, 3], np.int32), np.array([0, 1], np.int32))
    for step in range(4):
        t = rng.integers(0, CFG["vocab_size"], 2).astype(np.int32)
        for m in (direct, graphed):
            m.kv_decode(t, np.array([0, 1], np.int32))
        assert np.array_equal(direct.kv_logits(), graphed.kv_logits()), step
    assert graphed.graph_captures == 0 and graphed.graph_replays == 0 and graphed.cuda_graphs


def test_generate_greedy_matches_cpu(emu):  # noqa: F811
    """Prefill, then greedy decode on each backend; the ids each backend samples on its own logits agree."""
    cpu, gpu = _models(emu, "Model")
    x = rng.integers(0, CFG["vocab_size"], (2, 9)).astype(np.int32)
    lengths, slots = np.array([9, 4], np.int32), np.array([0, 1], np.int32)
    ids = {}
    for name, m in (("cpu", cpu), ("gpu", gpu)):
        m.kv_reserve(2, 20)
        m.kv_prefill(x, lengths, slots)
        out = []
        for i in range(5):
            t = m.kv_sample([1.0, 1.0], [1, 1], [1.0, 1.0], [0, 0], [0, 1], [i, i])
            out.append(t)
            m.kv_decode(t, slots)
        ids[name] = np.array(out)
    assert np.array_equal(ids["cpu"], ids["gpu"])


# ----------------------------------------------------------------------------------------------- sampling
def _settings(n, temperature, top_k, top_p, seed=7):
    return ([temperature] * n, [top_k] * n, [top_p] * n, [seed] * n, list(range(n)), [3 * i + 1 for i in range(n)])


SETTINGS = {  # (V, Vp, temperature, top_k, top_p, logit scale)
    "all": (97, 128, 0.9, 0, 1.0, 2.0),
    "top_k": (97, 128, 1.3, 13, 1.0, 2.0),
    "top_k_top_p": (97, 128, 0.7, 50, 0.9, 2.0),
    "top_p": (97, 128, 1.0, 0, 0.6, 2.0),
    "big_nucleus_on_device": (1500, 1536, 1.0, 0, 0.8, 6.0),   # peaked: the nucleus fits the 1024 candidates
    "big_nucleus_on_host": (1500, 1536, 1.0, 0, 0.95, 0.1),    # flat: it does not (the host samples the row)
    "top_k_over_cap": (1500, 1536, 1.0, 1100, 1.0, 2.0),       # top_k above the candidates (host)
    "top_k_over_cap_top_p": (1500, 1536, 1.0, 1100, 0.7, 6.0),  # its nucleus inside them (device)
}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_device_sampler_draws_the_cpu_ids(emu, name):  # noqa: F811
    V, Vp, temp, k, p, scale = SETTINGS[name]
    n = 24
    logits = (f32(n, Vp) * scale).astype(np.float32)
    logits[:, V:] = 1e4  # padded columns are never candidates
    logits[0, 3] = logits[0, 5] = logits[0, :V].max() + 1  # a tie at the top
    args = _settings(n, temp, k, p)
    got = emu.Ops("cuda").sample_tokens(logits, V, *args)
    want = emu.Ops("cpu").sample_tokens(logits, V, *args)
    assert np.all((got >= 0) & (got < V))
    assert np.array_equal(got, want), (got, want)


def test_top_k_one_is_the_arg_max(emu):  # noqa: F811
    n, V, Vp = 16, 97, 128
    logits = f32(n, Vp)
    logits[:, V:] = 1e4
    logits[1, 10] = logits[1, 20] = logits[1, :V].max() + 1  # ties: the lower id
    for args in (_settings(n, 1.0, 1, 1.0), _settings(n, 0.0, 0, 0.5)):  # top_k 1, and temperature 0
        got = emu.Ops("cuda").sample_tokens(logits, V, *args)
        assert np.array_equal(got, np.argmax(logits[:, :V], axis=1))
    assert got[1] == 10


def test_sampled_frequencies_chi_square(emu):  # noqa: F811
    """600 draws (one row each, streams 0..599) from one row of logits with temperature, top-k and top-p, against
    inference.sample_distribution: Pearson's chi-square over the kept tokens (bins with expected count < 5 merged).
    The critical value is the chi-square quantile at 1 - 1e-6 (Wilson-Hilferty), so a correct sampler fails this
    test for one seed in a million; the draws are a fixed function of (seed, stream, step), so it is deterministic."""
    from gpt2core.inference import sample_distribution
    V, Vp, n = 97, 128, 600
    z = (f32(Vp) * 1.5).astype(np.float32)
    z[V:] = 0
    temp, k, p = 0.8, 40, 0.9
    want = sample_distribution(z[:V].astype(np.float64), temp, k, p)
    logits = np.tile(z, (n, 1))
    ids = emu.Ops("cuda").sample_tokens(logits, V, [temp] * n, [k] * n, [p] * n, [11] * n, list(range(n)), [0] * n)
    assert np.all(want[ids] > 0), "a token outside the kept set was drawn"
    counts = np.bincount(ids, minlength=V).astype(np.float64)
    exp = want * n
    order = np.argsort(-exp)
    obs_b, exp_b, o_acc, e_acc = [], [], 0.0, 0.0
    for i in order[exp[order] > 0]:
        o_acc += counts[i]
        e_acc += exp[i]
        if e_acc >= 5:
            obs_b.append(o_acc)
            exp_b.append(e_acc)
            o_acc = e_acc = 0.0
    if e_acc > 0:
        obs_b[-1] += o_acc
        exp_b[-1] += e_acc
    obs_b, exp_b = np.array(obs_b), np.array(exp_b)
    stat = float(((obs_b - exp_b) ** 2 / exp_b).sum())
    df = len(obs_b) - 1
    z6 = 4.753  # the standard normal's 1 - 1e-6 quantile
    crit = df * (1 - 2 / (9 * df) + z6 * np.sqrt(2 / (9 * df))) ** 3
    assert df >= 5 and stat < crit, (stat, crit, df)


def test_python_generate_loop_runs_on_cuda_unchanged(emu):  # noqa: F811
    """inference.generate (KVEngine: prefill, device sampling, decode, and past block_size the re-prefill of the last
    block_size tokens) over the emulated CUDA model gives the CPU model's tokens: mixed prompt lengths, top-k 50 with
    top-p, one sequence crossing block_size = 40."""
    from types import SimpleNamespace

    from gpt2core import inference

    def shim(m):
        s = SimpleNamespace(_m=m, config=SimpleNamespace(vocab_size=CFG["vocab_size"], block_size=CFG["max_seq_len"]))
        s._inference_engine = lambda batch, max_len: inference.KVEngine(s, batch, max_len)
        return s

    cpu, gpu = _models(emu, "Model")
    prompts = [list(rng.integers(0, CFG["vocab_size"], 33)), list(rng.integers(0, CFG["vocab_size"], 4))]
    outs = [inference.generate(shim(m), prompts, 10, top_k=50, top_p=0.9, seed=3) for m in (cpu, gpu)]
    for a, b in zip(*outs):
        assert len(a) == len(b) and np.array_equal(a, b)
    assert len(outs[1][0]) == 43  # past block_size: 33 + 10 tokens


def test_inference_only_cuda_forward_is_the_cpu_loss(emu):  # noqa: F811
    """forward() of an inference-only CUDA model (training=False) runs the KV path's prefill with every position's
    logits (GPT2Model::kv_forward): its loss and logits equal the CPU training model's (fp32, 1e-5)."""
    cpu = emu.Model(**CFG, device="cpu")
    gpu = emu.Model(**CFG, device="cuda", training=False)
    init_params(cpu, 8)
    init_params(gpu, 8)
    gpu.params_changed()
    idx = rng.integers(0, CFG["vocab_size"], (2, 11)).astype(np.int32)
    tgt = rng.integers(0, CFG["vocab_size"], (2, 11)).astype(np.int32)
    tgt[1, 3] = -1
    lc, lg = cpu.forward(idx, tgt), gpu.forward(idx, tgt)
    assert abs(lg - lc) <= 1e-5 * abs(lc), (lg, lc)
