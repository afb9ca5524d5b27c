"""KV-cache inference (csrc/model/gpt2_infer.h, cpu/ops_infer.h, gpt2core.inference) against the full forward.

At every decode step the cached path's logits must equal the full forward's last-position logits over the same
window: float64 to ~1e-12 relative, float32 to ~1e-5 (GEMV vs GEMM summation order), for odd prompt lengths,
batches of mixed lengths, and across the block_size boundary (where generation re-prefills the last block_size
tokens). The sampler against numpy's reference (gpt2core.inference.sample_distribution / sample_reference).

Every architecture the config describes runs the KV path (GPT2Config's modern fields, issue 26): each field alone
and all together (rotary positions at each sequence's own position, RMSNorm, QK-norm, ReLU^2, no biases, an untied
head, soft-capped logits), against the full forward and, in float64, the numpy oracle (tests/numpy_gpt2.py).
"""
import math

import numpy as np
import pytest

import numpy_gpt2 as ref
from bf16 import round_bf16
from gpt2core import GPT2, GPT2Config, inference, load_model, tokenizer

# fp32: the decode GEMV sums each dot product in another order than the prefill / forward GEMM (8 lanes, then a
# horizontal sum): a few ulps per dot product, ~1e-6 relative on these logits; 2e-5 leaves room.
TOL = {"float64": 1e-12, "float32": 2e-5}

# GPT2Config's architecture fields: each alone (rope_base: an odd base; zero_init_proj: an init choice the KV path
# must accept, the weights here are random), and all together
MODERN = dict(position="rope", norm="rmsnorm", qk_norm=True, activation="relu2", bias=False, tie_embeddings=False,
              zero_init_proj=True, logit_softcap=3.0)
ARCHS = [None, dict(position="rope"), dict(position="rope", rope_base=37.0), dict(norm="rmsnorm"),
         dict(qk_norm=True), dict(activation="relu2"), dict(bias=False), dict(tie_embeddings=False),
         dict(zero_init_proj=True), dict(logit_softcap=3.0), MODERN]


def tol(dtype, arch):
    """TOL, relative to the largest logit. Soft-capped logits (cap 3) have their largest near the cap while the raw
    ones reach ~16: the fp32 summation error is of the raw scale (tanh only shrinks it), so 5x TOL's room."""
    return TOL[dtype] * (5 if dtype == "float32" and arch and arch.get("logit_softcap") else 1)


def arch_id(a):
    return "gpt2" if not a else ",".join(f"{k}={v}" for k, v in a.items())


def make_model(dtype="float64", C=48, NH=3, L=2, block=13, V=97, Vp=128, seed=0, arch=None):
    cfg = GPT2Config(block_size=block, vocab_size=V, padded_vocab_size=Vp, n_layer=L, n_head=NH, n_embd=C,
                     **(arch or {}))
    m = GPT2(cfg, dtype=dtype, init=False)
    rng = np.random.default_rng(seed)
    params = ref.random_params(rng, maxT=block, V=V, Vp=Vp, L=L, NH=NH, C=C, arch=arch)
    assert sorted(params) == sorted(m.params)
    for k, v in params.items():
        m.params[k][...] = v
    m.params_changed()
    return m


def full_last_logits(m, ids):
    """The full forward's logits at the last position of the window the model sees (the last block_size ids)."""
    x = np.asarray(ids, dtype=np.int32)[-m.config.block_size:][None]
    _, lg = m.forward(x, return_logits=True)
    return lg[0, -1].astype(np.float64)


def rel(a, b):
    return float(np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max())


# on x86-64-v3 / v4 both C=48 and C=64 take the AVX2 GEMV (C % 8 == 0); float64 is always portable. Every variant
# with every weight type, and C not a multiple of 8: test_inference_edges.py (the cpu_isa fixture forces each)
@pytest.mark.parametrize("arch", ARCHS, ids=arch_id)
@pytest.mark.parametrize("dtype,C,NH", [("float64", 48, 3), ("float32", 48, 3), ("float32", 64, 4)])
def test_cached_logits_equal_full_forward_every_step(dtype, C, NH, arch):
    m = make_model(dtype, C=C, NH=NH, arch=arch)
    rng = np.random.default_rng(1)
    lengths = [5, 1, 9, 3]  # odd, mixed, one single-token prompt
    prompts = [rng.integers(0, 97, n).astype(np.int32) for n in lengths]
    B, Tq = len(prompts), max(lengths)
    m._m.kv_reserve(B, m.config.block_size)
    x = rng.integers(0, 97, (B, Tq)).astype(np.int32)  # padding: random ids, never attended
    for i, p in enumerate(prompts):
        x[i, :len(p)] = p
    m._m.kv_prefill(x, np.array(lengths, np.int32), np.arange(B, dtype=np.int32))
    lg = m._m.kv_logits()
    assert lg.shape == (B, 128)
    seqs = [list(p) for p in prompts]
    for i in range(B):
        assert rel(lg[i], full_last_logits(m, seqs[i])) < tol(dtype, arch)
    # decode until every cache is full, live sequences in shuffled slot order
    while True:
        live = [i for i in range(B) if len(seqs[i]) < m.config.block_size]
        if not live:
            break
        rng.shuffle(live)
        nxt = rng.integers(0, 97, len(live)).astype(np.int32)
        m._m.kv_decode(nxt, np.array(live, np.int32))
        lg = m._m.kv_logits()
        for j, i in enumerate(live):
            seqs[i].append(int(nxt[j]))
            assert m._m.kv_pos(i) == len(seqs[i])
            assert rel(lg[j], full_last_logits(m, seqs[i])) < tol(dtype, arch), (i, len(seqs[i]))
    with pytest.raises(IndexError, match="full"):  # past the cache: a clear error, not a write out of bounds
        m._m.kv_decode(np.array([1], np.int32), np.array([0], np.int32))


@pytest.mark.parametrize("arch", [None, MODERN], ids=arch_id)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_prefill_in_chunks_into_running_slots(dtype, arch):
    """kv_prefill's start (the server's chunked prefill): prompts fed in chunks of 4 at each slot's position, in calls
    that mix slots at different positions (and one slot decoding between its chunks) give the full forward's logits,
    each chunk's every position with all_logits too. kv_free forgets a slot (a decode there is refused; a prefill
    from 0 takes it again); a start past the slot's tokens or running past the cache is refused."""
    m = make_model(dtype, arch=arch, block=24)
    rng = np.random.default_rng(4)
    core = m._m
    core.kv_reserve(3, 24)
    seqs = {0: list(rng.integers(0, 97, 11)), 2: list(rng.integers(0, 97, 6))}
    fed = {0: 0, 2: 0}
    while any(fed[s] < len(seqs[s]) for s in seqs):
        slots = [s for s in seqs if fed[s] < len(seqs[s])]
        chunks = [seqs[s][fed[s]:fed[s] + 4] for s in slots]
        Tq = max(map(len, chunks))
        x = rng.integers(0, 97, (len(slots), Tq)).astype(np.int32)  # padding: random ids, never attended
        for i, c in enumerate(chunks):
            x[i, :len(c)] = c
        core.kv_prefill(x, np.array([len(c) for c in chunks], np.int32), np.array(slots, np.int32), True,
                        np.array([fed[s] for s in slots], np.int32))
        lg = core.kv_logits().reshape(len(slots), Tq, -1)
        for i, (s, c) in enumerate(zip(slots, chunks)):
            for t in range(len(c)):
                assert rel(lg[i, t], full_last_logits(m, seqs[s][:fed[s] + t + 1])) < tol(dtype, arch), (s, t)
            fed[s] += len(c)
            assert core.kv_pos(s) == fed[s]
        if fed[2] == len(seqs[2]) and len(seqs[2]) < 8:  # slot 2 decodes while slot 0 is still in its prompt
            seqs[2].append(5)
            core.kv_decode(np.array([5], np.int32), np.array([2], np.int32))
            assert rel(core.kv_logits()[0], full_last_logits(m, seqs[2])) < tol(dtype, arch)
            fed[2] += 1
    core.kv_free(0)
    assert core.kv_pos(0) == 0 and core.kv_pos(2) == fed[2]
    with pytest.raises(Exception, match="never prefilled"):
        core.kv_decode(np.array([1], np.int32), np.array([0], np.int32))
    with pytest.raises(ValueError, match="start"):  # past the tokens in the slot
        core.kv_prefill(np.ones((1, 2), np.int32), np.array([2], np.int32), np.array([0], np.int32), False,
                        np.array([1], np.int32))
    with pytest.raises(ValueError, match="max_len"):  # the padded rows would run past the cache
        core.kv_prefill(np.ones((1, 25 - fed[2]), np.int32), np.array([1], np.int32), np.array([2], np.int32),
                        False, np.array([fed[2]], np.int32))
    with pytest.raises(ValueError, match="slot"):
        core.kv_free(3)
    core.kv_prefill(np.array([seqs[0][:3]], np.int32), np.array([3], np.int32), np.array([0], np.int32))
    assert rel(core.kv_logits()[0], full_last_logits(m, seqs[0][:3])) < tol(dtype, arch)


@pytest.mark.parametrize("arch", [None, MODERN], ids=arch_id)
@pytest.mark.parametrize("dtype,C,NH,weights", [("float64", 48, 3, "fp32"), ("float32", 48, 3, "fp32"),
                                                ("float32", 64, 4, "fp32"), ("float32", 48, 3, "bf16"),
                                                ("float32", 64, 4, "bf16"), ("float32", 64, 4, "fp16"),
                                                ("float32", 64, 4, "int8"), ("float32", 48, 3, "int8"),
                                                ("float64", 48, 3, "int8"),
                                                # head sizes 64 and 32: the AVX2 decode attention's register paths
                                                ("float32", 128, 2, "fp32"), ("float32", 96, 3, "bf16")])
def test_decode_batches_up_to_nine_rows(dtype, C, NH, weights, arch):
    """Decode of 1 .. 9 sequences at once (the GEMV takes up to 8 rows, in groups of 4 against each block of weight
    rows; with fp32 weights 9 goes to the GEMM, with 16/8-bit ones to the GEMV too), fp32 and 16-bit weights:
    every row's logits equal the full forward's of its own sequence (float32 full forward on the rounded weights
    for 16-bit and 8-bit)."""
    m = refm = make_model(dtype, C=C, NH=NH, arch=arch)
    if weights != "fp32":  # the inference-only model decodes; the training model (rounded weights) is the reference
        m = GPT2(refm.config, dtype=dtype, init=False, training=False)
        for k, v in refm.params.items():
            m.params[k][...] = v
        m.params_changed()
        m.inference_weights = weights
        if weights == "int8":  # the GEMV that widens the int8 weights (the integer dot's inputs are rounded too)
            m._m.q8_int_dot = False
        for k, v in m.params.items():
            refm.params[k][...] = v
        refm.params_changed()
    rng = np.random.default_rng(7)
    for B in (1, 3, 4, 5, 8, 9):
        lengths = rng.integers(1, 6, B)
        seqs = [list(rng.integers(0, 97, n)) for n in lengths]
        x = np.zeros((B, max(lengths)), np.int32)
        for i, q in enumerate(seqs):
            x[i, :len(q)] = q
        m._m.kv_reserve(B, 13)
        m._m.kv_prefill(x, lengths.astype(np.int32), np.arange(B, dtype=np.int32))
        for _ in range(2):
            nxt = rng.integers(0, 97, B).astype(np.int32)
            m._m.kv_decode(nxt, np.arange(B, dtype=np.int32))
            lg = m._m.kv_logits()
            for i in range(B):
                seqs[i].append(int(nxt[i]))
                assert rel(lg[i], full_last_logits(refm, seqs[i])) < tol(dtype, arch), (B, i)


@pytest.mark.parametrize("arch", ARCHS, ids=arch_id)
def test_prefill_and_decode_match_numpy_reference(arch):
    """Cached prefill logits (every position) and then decode logits against the float64 numpy model
    (tests/numpy_gpt2.py, written from the papers' math), not only against our own forward: rows stay in call
    order whatever their slots; a decode after the prefill is the oracle's last position of the longer input."""
    m = make_model("float64", arch=arch)
    rng = np.random.default_rng(2)
    x = rng.integers(0, 97, (2, 7)).astype(np.int32)
    m._m.kv_reserve(2, 13)
    m._m.kv_prefill(x, np.array([7, 7], np.int32), np.array([1, 0], np.int32), all_logits=True)
    _, want, _ = ref.forward(dict(m.params), x, None, V=97, NH=3, arch=arch)
    got = m._m.kv_logits().reshape(2, 7, 128)
    assert rel(got, np.asarray(want)) < 1e-12
    nxt = rng.integers(0, 97, 2).astype(np.int32)
    m._m.kv_decode(nxt, np.array([0, 1], np.int32))  # slot 0 holds row 1, slot 1 row 0
    x2 = np.concatenate([x[[1, 0]], nxt[:, None]], axis=1)
    _, want, _ = ref.forward(dict(m.params), x2, None, V=97, NH=3, arch=arch)
    assert rel(m._m.kv_logits(), np.asarray(want)[:, -1]) < 1e-12


@pytest.mark.parametrize("arch", [None, dict(position="rope"), MODERN], ids=arch_id)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_generate_matches_uncached_path_across_block_size(dtype, arch):
    """generate through the KV cache gives the ids of the uncached path (the full forward per step, sampled by
    sample_reference) for mixed prompt lengths, top-k / top-p / greedy, past block_size (13). With rotary positions
    too: past block_size the window (the last block_size tokens) is re-prefilled from position 0, as the full
    forward of that window sees it."""
    m = make_model(dtype, arch=arch)
    assert m._inference_engine(1, 13).__class__ is inference.KVEngine
    prompts = [[3, 1, 4, 1, 5], [9], [2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3]]  # 12 + 20 tokens crosses 13 early
    for kw in (dict(top_k=50), dict(top_k=0, temperature=0.8), dict(top_k=7, top_p=0.6), dict(top_k=1)):
        got = m.generate(prompts, 20, seed=11, **kw)
        eng = m._inference_engine
        m._inference_engine = lambda b, n: inference.ForwardEngine(m, b, n)
        try:
            want = m.generate(prompts, 20, seed=11, **kw)
        finally:
            m._inference_engine = eng
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w, err_msg=str(kw))
        assert [len(g) for g in got] == [len(p) + 20 for p in prompts]


def test_generate_shapes_seed_stream_and_arguments():
    m = make_model("float32")
    x = np.array([[1, 2, 3], [4, 5, 6]])
    a = m.generate(x, 6, seed=5)
    assert a.shape == (2, 9) and a.dtype == np.int32
    np.testing.assert_array_equal(a[:, :3], x)
    np.testing.assert_array_equal(a, m.generate(x, 6, seed=5))           # a fixed seed reproduces the ids
    assert not np.array_equal(a, m.generate(x, 6, seed=6))
    steps = list(m.generate(x, 6, seed=5, stream=True))                  # streaming yields the same tokens
    np.testing.assert_array_equal(np.stack(steps, axis=1), a[:, 3:])
    # one seed per sequence: a sequence's ids do not depend on the batch around it
    alone = m.generate([[4, 5, 6]], 6, seed=[9])
    both = m.generate([[1, 2], [4, 5, 6]], 6, seed=[3, 9])
    np.testing.assert_array_equal(alone[0], both[1])
    g = m.generate(x, 4, top_k=1)
    np.testing.assert_array_equal(g, m.generate(x, 4, top_k=1, seed=99, temperature=3.0))  # greedy: no randomness
    assert m.generate(x, 0).shape == (2, 3)
    for bad, kw in (("temperature", dict(temperature=-1)), ("temperature", dict(temperature=0)), ("top_p", dict(top_p=0)), ("top_p", dict(top_p=1.5)),
                    ("top_k", dict(top_k=-2)), ("max_new_tokens", dict(max_new_tokens=-1)), ("seed", dict(seed=-1))):
        kw.setdefault("max_new_tokens", 3)
        with pytest.raises(ValueError, match=bad):
            m.generate(x, **kw)
    with pytest.raises(ValueError, match="idx"):
        m.generate([[1, 2], []], 3)
    with pytest.raises(ValueError, match="idx"):
        m.generate([[1, 200]], 3)


def test_stop_at_endoftext_and_stop_strings():
    """A GPT-2-vocabulary model whose head always prefers one token: EOT ends a sequence (rest padded with EOT);
    a stop string ends it once the generated text contains it."""
    cfg = GPT2Config(block_size=16, vocab_size=50257, padded_vocab_size=50304, n_layer=1, n_head=2, n_embd=16)
    m = GPT2(cfg, seed=0, dtype="float32")
    target = tokenizer.encode(" stop")[0]
    for tok, out_len in ((tokenizer.EOT, 1), (target, 1)):
        m.params["wte"][...] = 0
        m.params["wte"][tok] = 5.0  # its logit is 5 * sum(lnf(x)) ... make lnf constant and positive:
        m.params["lnfw"][...] = 0
        m.params["lnfb"][...] = 1.0
        m.params_changed()
        if tok == tokenizer.EOT:
            out = m.generate(np.array([[10, 11]]), 5, top_k=1)
            np.testing.assert_array_equal(out[0], [10, 11, tokenizer.EOT] + [tokenizer.EOT] * 4)
            ragged = m.generate([[10, 11]], 5, top_k=1)
            np.testing.assert_array_equal(ragged[0], [10, 11, tokenizer.EOT])
        else:
            out = m.generate([[10]], 5, top_k=1, stop=" stop")
            assert list(out[0]) == [10, target]
            assert inference.truncate_at_stop("hello stop here", [" stop", "x"]) == "hello"


def wilson_hilferty_p(stat, dof):
    """Upper tail of the chi-square distribution (Wilson-Hilferty normal approximation, good to ~1e-3 here)."""
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.mark.parametrize("kw", [dict(temperature=1.0, top_k=0), dict(temperature=0.7, top_k=10),
                                dict(temperature=1.3, top_k=0, top_p=0.8), dict(temperature=1.0, top_k=20, top_p=0.9)])
def test_sampling_frequencies_match_reference_distribution(kw):
    """20,000 draws of the core's sampler (steps 0..19999 of one seeded stream) from one row of logits against
    sample_distribution's probabilities: a chi-square test over the tokens with expected count >= 5 (the rest
    pooled), failing at p < 1e-4. The draws are seeded, so the test is deterministic; for a correct sampler a
    random seed would fail it with probability 1e-4 (the stated false-failure rate). Every draw must also be
    the id sample_reference picks for the same uniform number."""
    m = make_model("float64")
    R = 2000  # rows of the same prompt, each a draw: 10 calls of the sampler make the 20,000 draws
    m._m.kv_reserve(R, 13)
    m._m.kv_prefill(np.tile(np.array([[5, 7, 11]], np.int32), (R, 1)), np.full(R, 3, np.int32),
                    np.arange(R, dtype=np.int32))
    raw = m._m.kv_logits()[0, :97]
    p = inference.sample_distribution(raw, kw["temperature"], kw["top_k"], kw.get("top_p"))
    n = 20000
    top_p = kw.get("top_p", 1.0)
    ids = np.concatenate([m._m.kv_sample([kw["temperature"]] * R, [kw["top_k"]] * R, [top_p] * R, [123] * R, [0] * R,
                                         list(range(c * R, (c + 1) * R))) for c in range(n // R)])
    for i in range(300):
        assert ids[i] == inference.sample_reference(raw, inference.uniform(123, 0, i), kw["temperature"],
                                                    kw["top_k"], kw.get("top_p"))
    counts = np.bincount(ids, minlength=97)
    assert counts[p == 0].sum() == 0  # nothing outside top-k / top-p
    exp = p * n
    big = exp >= 5
    obs = np.append(counts[big], counts[~big].sum())
    e = np.append(exp[big], exp[~big].sum())
    if e[-1] == 0:
        obs, e = obs[:-1], e[:-1]
    stat = float(((obs - e) ** 2 / e).sum())
    dof = len(e) - 1
    assert dof >= 3 and wilson_hilferty_p(stat, dof) > 1e-4, (stat, dof)


def test_inference_only_model(tmp_path):
    m = make_model("float32")
    path = m.save(tmp_path / "m.bin")
    inf = load_model(path)  # training=False by default
    assert not inf.training and inf.grads == {}
    x = np.array([[1, 2, 3, 4, 5, 6, 7]], np.int32)
    y = np.array([[2, 3, 4, 5, 6, 7, 8]], np.int32)
    l1, lg1 = m.forward(x, y, return_logits=True)
    l2, lg2 = inf.forward(x, y, return_logits=True)  # through the KV-cache prefill, every position's logits
    assert abs(l1 - l2) < 1e-5 and rel(lg2, lg1.astype(np.float64)) < TOL["float32"]
    np.testing.assert_allclose(inf.token_losses(), m.token_losses(), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(inf.generate(x, 5, seed=1), m.generate(x, 5, seed=1))
    for call in (lambda: inf.backward(), lambda: inf.step(lr=1e-3), lambda: inf.zero_grad(),
                 lambda: inf.forward_backward(x, y)):
        with pytest.raises(RuntimeError, match="inference-only"):
            call()
    mem = inf.memory_report(1, 7)
    assert mem["grads"] == 0 and mem["optimizer"] == 0
    assert load_model(path, training=True).training


def test_d12_inference_memory_is_a_third_of_training():
    """d12: the inference-only model (weights + a KV cache for one 1024-token sequence + one decode row's
    activations) against the training model (weights, gradients, AdamW moments, activations at B=1, T=1024),
    from the core's own counts. (A 1024-token prefill adds ~55 MB of one-layer activations: still far below.)"""
    inf = GPT2("d12", init=False, training=False)
    inf._m.kv_reserve(1, 1024)
    inf._m.kv_prefill(np.zeros((1, 1), np.int32), np.array([1], np.int32), np.array([0], np.int32))
    infer = inf.memory_report(1, 1024)["total"]
    del inf
    train = GPT2("d12", init=False).memory_report(1, 1024)["total"]
    assert infer * 3 <= train, (infer, train)


@pytest.mark.parametrize("kind,C,NH,arch", [("bf16", 64, 4, None), ("fp16", 64, 4, None), ("bf16", 48, 3, None),
                                            ("fp16", 64, 4, MODERN)])
def test_16bit_weights_decode_equals_full_forward_on_the_rounded_weights(kind, C, NH, arch):
    """inference_weights='bf16'/'fp16' rounds the matrices (in params too; the untied lm_head as well) and decode
    reads the 16-bit copy (on x86-64-v3 the AVX2 widening: C=48 and 64 are multiples of 8): its logits equal the
    fp32 full forward on those rounded weights (fp32 tolerance), and the rounding is the round-to-nearest-even of the
    numpy reference."""
    m = make_model("float32", C=C, NH=NH, arch=arch)
    m2 = GPT2(m.config, dtype="float32", init=False, training=False)
    for k, v in m.params.items():
        m2.params[k][...] = v
    m2.params_changed()
    before = m2.params["qkvw"].copy()
    m2.inference_weights = kind
    assert m2.inference_weights == kind
    want = before.astype(np.float16).astype(np.float32) if kind == "fp16" else round_bf16(before)
    np.testing.assert_array_equal(m2.params["qkvw"], want)
    assert not np.array_equal(m2.params["qkvw"], before)
    if arch and not arch.get("tie_embeddings", True):
        assert not np.array_equal(m2.params["lm_head"], m.params["lm_head"])
        r = m.params["lm_head"]
        np.testing.assert_array_equal(m2.params["lm_head"], r.astype(np.float16).astype(np.float32) if kind == "fp16"
                                      else round_bf16(r))
    rng = np.random.default_rng(4)
    seq = list(rng.integers(0, 97, 6))
    m2._m.kv_reserve(1, 13)
    m2._m.kv_prefill(np.array([seq], np.int32), np.array([6], np.int32), np.array([0], np.int32))
    for _ in range(6):
        t = int(rng.integers(0, 97))
        m2._m.kv_decode(np.array([t], np.int32), np.array([0], np.int32))
        seq.append(t)
        got = m2._m.kv_logits()[0]
        # (the inference model's forward is a prefill of the window into slot 0: the same state decode left)
        assert rel(got, full_last_logits(m2, seq)) < tol("float32", arch)
    with pytest.raises(ValueError, match="inference-only"):
        m.inference_weights = kind


def test_generate_cli_prompts_file_stdin_stop_and_stats(tmp_path, capsys, monkeypatch):
    import io
    from gpt2core import generate as gen_cli
    path = GPT2("tiny", seed=3).save(tmp_path / "m.bin")
    f = tmp_path / "prompts.txt"
    f.write_text("Hello\n\nThe cat\\nsat\n")
    texts = gen_cli.main(["--model", str(path), "--prompts-file", str(f), "--max-new-tokens", "4", "--seed", "1"])
    assert len(texts) == 2 and texts[0].startswith("Hello") and texts[1].startswith("The cat\nsat")
    out, err = capsys.readouterr()
    assert out.count("-" * 40) == 2 and "tokens/s" in err
    # the same prompts from stdin give the same texts (one batch, seeded); one prompt streams the same text
    monkeypatch.setattr("sys.stdin", io.StringIO(f.read_text()))
    assert gen_cli.main(["--model", str(path), "--prompts-file", "-", "--max-new-tokens", "4", "--seed", "1",
                         "--no-stats"]) == texts
    capsys.readouterr()
    one = gen_cli.main(["Hello", "--model", str(path), "--max-new-tokens", "4", "--seed", "1", "--no-stats"])
    out, err = capsys.readouterr()
    assert out.startswith(one[0]) and err == ""
    with pytest.raises(SystemExit):
        gen_cli.main(["Hello", "--model", str(path), "--prompts-file", str(f)])


# ---------------------------------------------------------------------------------------------- 8-bit weights (int8)
def q8_reference(w):
    """numpy's int8 quantisation of w (rows, C), float32 or float64: per block of 32 inputs of a row, scale =
    max|w| / 127 (computed in w's type, stored as float32), q = w / scale rounded to nearest even (np.rint), clipped
    to [-127, 127] (scale 0: q = 0); the dequantised weights q * scale in w's type."""
    rows, C = w.shape
    nb = -(-C // 32)
    q = np.zeros((rows, C), np.int8)
    s = np.zeros((rows, nb), np.float32)
    deq = np.zeros_like(w)
    for b in range(nb):
        blk = w[:, 32 * b:32 * b + 32]
        sc = (np.abs(blk).max(axis=1) / w.dtype.type(127)).astype(np.float32)
        s[:, b] = sc
        scw = sc.astype(w.dtype)[:, None]
        with np.errstate(divide="ignore", invalid="ignore"):
            v = np.where(scw > 0, np.rint(blk / scw), 0)
        qb = np.clip(v, -127, 127).astype(np.int8)
        q[:, 32 * b:32 * b + 32] = qb
        deq[:, 32 * b:32 * b + 32] = qb.astype(w.dtype) * scw
    return q, s, deq


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("C", [45, 64, 104])
def test_quantize_q8_equals_numpy(cpu_isa, dtype, C):
    """The backend's quantisation gives numpy's int8 values and scales exactly, and the dequantised weights bit for
    bit: C=45 and 104 end each row with a short block, a row of zeros has scale 0, a row with one large weight
    squeezes the rest of its block toward 0, ties (w / scale = k + 1/2) round to even."""
    from gpt2core import _C
    rng = np.random.default_rng(11)
    w = (rng.standard_normal((7, C)) * 0.05).astype(dtype)
    w[2] = 0
    w[3, 5] = 9.0
    w[4, :32] = np.arange(32) - 16.0  # max 16 -> scale 16/127: w / scale = 127 k / 16 (a few land on halves)
    w[4, 1] = 127 / 2 * (16 / 127)  # exactly 63.5 scales (in float64; in float32 near it)
    q, s, deq = _C.quantize_q8(w)
    rq, rs, rdeq = q8_reference(w)
    assert q.dtype == np.int8 and s.dtype == np.float32 and s.shape == (7, -(-C // 32))
    np.testing.assert_array_equal(s, rs)
    np.testing.assert_array_equal(q, rq)
    np.testing.assert_array_equal(deq, rdeq)
    assert np.all(q[2] == 0) and np.all(s[2] == 0) and np.abs(q).max() == 127
    # round-to-nearest: each weight within half a step of its dequantised value
    step = np.repeat(s.astype(np.float64), 32, axis=1)[:, :C]
    assert np.all(np.abs(w.astype(np.float64) - deq) <= 0.5 * step * (1 + 1e-6) + 1e-300)


@pytest.mark.parametrize("int_dot", [False, True], ids=["widen", "int_dot"])
@pytest.mark.parametrize("C,OC", [(45, 37), (64, 40), (104, 21), (768, 19), (96, 48)])
def test_gemv_q8_against_float64(cpu_isa, C, OC, int_dot):
    """The 8-bit GEMVs against float64 numpy, batches of 1 .. 9 rows, with and without bias, the output NaN-poisoned
    before they run. x86-64-v3: AVX2 (widen: C % 8 == 0, a short last block for C=104, odd OC's tail rows; int_dot:
    C % 32 == 0 and whole blocks of 16 output rows, the rest portable); baseline / C=45: the portable loops.
    widen: against the dequantised weights; rounding of fp32 dot products of C terms, at most C * 2^-24 relative to
    sum |x_i w_i|. int_dot: the inputs quantised by numpy (q8_reference) too, each block's integer sum exact, then
    fp32 scale products and a sum over the blocks: at most (blocks + 5) * 2^-24 relative to the sum of the blocks'
    sum |q_w q_x| s_w s_x -- an input value off by one step moves the result by ~1e-3 of that, far outside."""
    from gpt2core import _C
    rng = np.random.default_rng(C + OC)
    w = (rng.standard_normal((OC, C)) * 0.1).astype(np.float32)
    q, s, deq = _C.quantize_q8(w)
    bias = rng.standard_normal(OC).astype(np.float32)
    nb = -(-C // 32)
    for N in range(1, 10):
        x = rng.standard_normal((N, C)).astype(np.float32)
        for b in (None, bias):
            got = _C.gemv_q8(x, q, s, b, int_dot=int_dot)
            assert got.shape == (N, OC) and np.isfinite(got).all()
            b64 = 0 if b is None else b.astype(np.float64)
            if int_dot:
                xq, xs, _ = q8_reference(x)
                # scale products rounded to fp32 as the kernels form them
                sprod = (s[None, :, :] * xs[:, None, :]).astype(np.float64)  # (N, OC, nb)
                isum = np.zeros((N, OC, nb))
                asum = np.zeros((N, OC, nb))
                for j in range(nb):
                    xa, wa = xq[:, 32 * j:32 * j + 32].astype(np.int64), q[:, 32 * j:32 * j + 32].astype(np.int64)
                    isum[:, :, j] = xa @ wa.T
                    asum[:, :, j] = np.abs(xa) @ np.abs(wa).T
                want = (isum * sprod).sum(axis=2) + b64
                bound = (nb + 5) * 2.0 ** -24 * (asum * sprod).sum(axis=2) + 2.0 ** -24 * np.abs(want)
            else:
                want = x.astype(np.float64) @ deq.astype(np.float64).T + b64
                bound = C * 2.0 ** -24 * (np.abs(x.astype(np.float64)) @ np.abs(deq.astype(np.float64)).T) + \
                    2.0 ** -24 * np.abs(want)
            assert np.all(np.abs(got - want) <= bound), float(np.max(np.abs(got - want) / bound))
            if int_dot:  # and close to the float product: the inputs' rounding, ~1/254 of each block's max
                xf = x.astype(np.float64) @ deq.astype(np.float64).T + b64
                assert np.abs(got - xf).max() < 0.02 * np.abs(xf).max()
    x64 = rng.standard_normal((3, C))  # float64 models: the portable loop in float64
    q64, s64, deq64 = _C.quantize_q8(w.astype(np.float64))
    if int_dot:
        xq64, xs64, _ = q8_reference(x64)
        want64 = sum((xq64[:, 32 * j:32 * j + 32].astype(np.float64) @ q64[:, 32 * j:32 * j + 32].T.astype(np.float64)) *
                     (xs64[:, j:j + 1].astype(np.float64) * s64[None, :, j].astype(np.float64)) for j in range(nb))
    else:
        want64 = x64 @ deq64.T
    np.testing.assert_allclose(_C.gemv_q8(x64, q64, s64, int_dot=int_dot), want64, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="scales"):
        _C.gemv_q8(x, q, s[:, :1])
    with pytest.raises(ValueError, match="q must"):
        _C.gemv_q8(x, q.astype(np.int16), s)
    with pytest.raises(ValueError, match="^w must"):
        _C.quantize_q8(np.zeros((2, 3, 4), np.float32))


@pytest.mark.parametrize("C,NH,arch", [(64, 4, None), (48, 3, None), (64, 4, MODERN)], ids=["C64", "C48",
                                                                                          "modern"])
def test_int8_weights_decode(C, NH, arch):
    """inference_weights='int8' quantises the matrices (params too, the untied lm_head as well) as numpy does.
    With q8_int_dot=False decode widens the int8 weights against fp32 inputs: its logits equal the fp32 full forward
    on the dequantised weights (fp32 tolerance). With the default integer dot products the GEMV inputs are rounded
    too, and against the fp32 model's own logits the tolerance is argued, not guessed: rounding to nearest leaves
    each weight within half a step of itself (~0.5% relative error per matrix here), and these small random models
    amplify any weight error of that size to a few % of the largest logit (measured: 2.0-3.2% with the weights
    rounded, 2.8-3.4% with the inputs too; 2-11% for the weights' own rounding errors shuffled across each matrix).
    So the widened path must stay within 2x, the integer path (two roundings of the same size) within 3x of the
    median error of the shuffled errors -- quantisation that acts like noise of its size -- and both below 15% of
    the largest logit; a wrong scale or a block read off by one moves the logits by ~100%."""
    m = make_model("float32", C=C, NH=NH, arch=arch)
    m2 = GPT2(m.config, dtype="float32", init=False, training=False)
    for k, v in m.params.items():
        m2.params[k][...] = v
    m2.params_changed()
    before = {k: v.copy() for k, v in m2.params.items()}
    m2.inference_weights = "int8"
    assert m2.inference_weights == "int8"
    mats = ["wte", "qkvw", "attprojw", "fcw", "fcprojw"] + (["lm_head"] if "lm_head" in before else [])
    werr = 0.0
    for k in mats:
        w = before[k]
        w2 = w.reshape(-1, w.shape[-1])
        np.testing.assert_array_equal(m2.params[k].reshape(w2.shape), q8_reference(w2)[2])
        werr = max(werr, float(np.linalg.norm(m2.params[k] - w) / np.linalg.norm(w)))
    for k in set(before) - set(mats):  # biases, norms, wpe: as they were
        np.testing.assert_array_equal(m2.params[k], before[k])
    assert 1e-3 < werr < 1e-2, werr
    rng = np.random.default_rng(4)
    seq0 = list(rng.integers(0, 97, 6))
    steps = [int(t) for t in rng.integers(0, 97, 6)]
    m2._m.kv_reserve(1, 13)

    def decode(int_dot):
        m2._m.q8_int_dot = int_dot
        seq = list(seq0)
        m2._m.kv_prefill(np.array([seq], np.int32), np.array([6], np.int32), np.array([0], np.int32))
        out = []
        for t in steps:
            m2._m.kv_decode(np.array([t], np.int32), np.array([0], np.int32))
            seq.append(t)
            out.append((list(seq), m2._m.kv_logits()[0].astype(np.float64)))
        return out

    widened = decode(False)
    for seq, lg in widened:  # the same weights as the fp32 full forward on the dequantised weights
        assert rel(lg, full_last_logits(m2, seq)) < tol("float32", arch)
    integer = decode(True)
    assert m2._m.q8_int_dot
    seq = widened[-1][0]
    want = full_last_logits(m, seq)
    err = rel(widened[-1][1], want)
    err_int = rel(integer[-1][1], want)
    noise = []
    for _ in range(3):  # the same rounding errors, shuffled within each matrix
        mn = GPT2(m.config, dtype="float32", init=False)
        for k, v in m.params.items():
            d = (m2.params[k] - v).reshape(-1)
            mn.params[k][...] = v + rng.permutation(d).reshape(v.shape) if k in mats else v
        mn.params_changed()
        noise.append(rel(full_last_logits(mn, seq), want))
    print(f"int8 logits vs fp32: weights rounded {err:.4f}, inputs too {err_int:.4f}; shuffled {noise}")
    assert err < min(2 * float(np.median(noise)), 0.15), (err, noise)
    assert err_int < min(3 * float(np.median(noise)), 0.15), (err_int, noise)
    with pytest.raises(ValueError, match="inference-only"):
        m.inference_weights = "int8"


def test_int8_generate_end_to_end_and_bad_values(tmp_path, capsys):
    """generate with int8 weights gives the greedy ids of the fp32 model holding the dequantised weights (same
    weights, fp32 rounding only), streams, gpt2core-generate --weights int8 runs, and wrong values name the
    argument."""
    from gpt2core import generate as gen_cli
    m = make_model("float32", C=64, NH=4, block=32)
    path = m.save(tmp_path / "m.bin")
    q = load_model(path, inference_weights="int8")
    assert q.inference_weights == "int8" and not q.training
    ref_m = load_model(path, training=True)
    for k, v in q.params.items():
        ref_m.params[k][...] = v
    ref_m.params_changed()
    prompts = [[5, 9, 2], [7], [1, 2, 3, 4, 5, 6, 7]]
    want = ref_m.generate(prompts, 12, top_k=1)
    q._m.q8_int_dot = False  # the widening GEMV: the reference's weights, so its greedy ids
    for g, w in zip(q.generate(prompts, 12, top_k=1), want):
        np.testing.assert_array_equal(g, w)
    q._m.q8_int_dot = True  # the default (inputs rounded too: a near tie may go the other way; the logits are
    got = q.generate(prompts, 12, top_k=1)  # bounded in test_int8_weights_decode)
    assert [len(g) for g in got] == [len(w) for w in want] and all(np.all((g >= 0) & (g < 97)) for g in got)
    streamed = np.array(list(q.generate(prompts, 12, top_k=1, stream=True)))
    np.testing.assert_array_equal(streamed.T, np.array([g[-12:] for g in got]))
    sampled = q.generate(prompts, 12, top_k=50, seed=5)
    assert all(np.array_equal(a, b) for a, b in zip(sampled, q.generate(prompts, 12, top_k=50, seed=5)))
    with pytest.raises(ValueError, match="inference_weights"):
        load_model(path, inference_weights="q8")
    with pytest.raises(ValueError, match="inference_weights"):
        q.inference_weights = "int4"
    tiny = GPT2("tiny", seed=3).save(tmp_path / "t.bin")
    out = gen_cli.main(["Hello", "--model", str(tiny), "--max-new-tokens", "5", "--weights", "int8", "--seed", "1"])
    assert out[0].startswith("Hello") and len(out[0]) > len("Hello")
    _, err = capsys.readouterr()
    assert "tokens/s" in err
    with pytest.raises(SystemExit):
        gen_cli.main(["Hello", "--model", str(tiny), "--weights", "int4"])
    assert "--weights" in capsys.readouterr().err
