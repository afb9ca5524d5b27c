"""KV-cache inference at its edges (issue 39): every CPU instruction-set variant with every weight type, shapes at the
kernels' exact multiples and one past them, the ends of the training context, and stop strings that span tokens.

- Every variant (baseline / x86-64-v3 / x86-64-v4, forced in-process by the cpu_isa fixture: tests/conftest.py) with
  every weight type (fp32, bf16, fp16, int8): the decode logits of 1, 2, 3, 5 and 8 sequences at once equal the full
  forward's on the same (rounded) weights. C = 44 is no multiple of 8 (the portable loops everywhere), C = 56 is (the
  AVX2 GEMV; int8 blocks of 32 end with a short one of 24) and C = 64 has head size 32 (the AVX2 decode attention's
  register path) and whole int8 blocks; padded_vocab_size 101 leaves the head's GEMV a partial block of 16 output rows
  ending in a row that is no multiple of 4.
- Decode and generate at the end of the cache and past block_size with 16-bit and 8-bit weights (the window is
  re-prefilled) against the uncached path on the same weights.
- Stop strings: several at once (the earliest occurrence wins, whatever their order in the list), and stop strings of
  4-byte characters made of single-byte tokens (12 tokens for 3 characters) that end generation at the token that
  completes them, in `generate` and in the server (its text never shows a stop string or half a character). The
  tokens come from a real model whose greedy continuation is a fixed chain (`chain_model`), through the real KV path.
"""
import json

import numpy as np
import pytest

from gpt2core import GPT2, GPT2Config, inference, tokenizer
from test_inference import full_last_logits, make_model, q8_reference, rel

WEIGHTS = ["fp32", "bf16", "fp16", "int8"]
# (C, NH): 44 -> the portable GEMV loops (C % 8 != 0); 56 -> the AVX2 GEMV, int8's last block 24 wide; 64 with head
# size 32 -> attend_one_avx2<4>, whole int8 blocks
SHAPES = [(44, 2), (56, 4), (64, 2)]


def rounded_pair(C, NH, weights, Vp=101, block=13, seed=0, arch=None):
    """(inference-only model decoding from `weights`, float32 training model holding the same rounded weights)."""
    ref_m = make_model("float32", C=C, NH=NH, Vp=Vp, block=block, seed=seed, arch=arch)
    m = GPT2(ref_m.config, dtype="float32", init=False, training=False)
    for k, v in ref_m.params.items():
        m.params[k][...] = v
    m.params_changed()
    m.inference_weights = weights
    if weights == "int8":
        m._m.q8_int_dot = False  # the widening GEMV: the fp32 model's weights exactly (the integer dot: below)
    for k, v in m.params.items():
        ref_m.params[k][...] = v
    ref_m.params_changed()
    return m, ref_m


@pytest.mark.parametrize("C,NH", SHAPES, ids=[f"C{c}" for c, _ in SHAPES])
@pytest.mark.parametrize("weights", WEIGHTS)
def test_every_variant_every_weight_type_decodes_the_full_forward(cpu_isa, weights, C, NH):
    """Batches of 1, 2, 3, 5 and 8 sequences (the GEMV's groups of 4 input rows and their remainders), two decode
    steps each, every row against the full forward of its own sequence on the same weights (fp32 tolerance 2e-5)."""
    m, ref_m = rounded_pair(C, NH, weights)
    rng = np.random.default_rng(C)
    m._m.kv_reserve(8, 13)
    for B in (1, 2, 3, 5, 8):
        lengths = rng.integers(1, 7, B)
        seqs = [list(rng.integers(0, 97, n)) for n in lengths]
        x = rng.integers(0, 97, (B, max(lengths))).astype(np.int32)
        for i, q in enumerate(seqs):
            x[i, :len(q)] = q
        m._m.kv_prefill(x, lengths.astype(np.int32), np.arange(B, dtype=np.int32)[::-1].copy())
        for _ in range(2):
            nxt = rng.integers(0, 97, B).astype(np.int32)
            m._m.kv_decode(nxt, np.arange(B, dtype=np.int32)[::-1].copy())
            lg = m._m.kv_logits()
            assert lg.shape == (B, 101)
            for i in range(B):
                seqs[i].append(int(nxt[i]))
                assert rel(lg[i], full_last_logits(ref_m, seqs[i])) < 2e-5, (cpu_isa, weights, B, i)


@pytest.mark.parametrize("weights", ["bf16", "fp16", "int8"])
def test_reduced_weights_follow_params_changed(weights):
    """The 16-bit / 8-bit copy is rebuilt after params_changed(): weights doubled (exact in bf16, fp16 and int8: the
    same codes, twice the scale) give the full forward's logits on the doubled weights at the next decode."""
    m, ref_m = rounded_pair(56, 4, weights, seed=4)
    seq = [5, 17, 3]
    m._m.kv_reserve(1, 13)
    for step in range(2):
        m._m.kv_prefill(np.array([seq], np.int32), np.array([3], np.int32), np.array([0], np.int32))
        m._m.kv_decode(np.array([9], np.int32), np.array([0], np.int32))
        assert rel(m._m.kv_logits()[0], full_last_logits(ref_m, seq + [9])) < 2e-5, (weights, step)
        for mm in (m, ref_m):
            for k in ("qkvw", "fcw", "wte"):
                mm.params[k][...] *= 2
            mm.params_changed()


@pytest.mark.parametrize("C,NH", SHAPES, ids=[f"C{c}" for c, _ in SHAPES])
def test_fp16_weights_in_the_subnormal_range(cpu_isa, C, NH):
    """Matrices scaled to std 2e-5 (nearly all below fp16's smallest normal, 2^-14): their fp16 copy is numpy's
    float16 rounding (subnormals included, bit for bit), and decode (F16C on x86-64-v3 for C % 8 == 0, the portable
    decode elsewhere) widens those subnormals exactly: its logits equal the full forward's on the rounded weights."""
    ref_m = make_model("float32", C=C, NH=NH, Vp=101, seed=7)
    mats = ["wte", "qkvw", "attprojw", "fcw", "fcprojw"]
    for k in mats:
        ref_m.params[k][...] *= 2e-5 / ref_m.params[k].std()
    ref_m.params_changed()
    before = {k: ref_m.params[k].copy() for k in mats}
    m = GPT2(ref_m.config, dtype="float32", init=False, training=False)
    for k, v in ref_m.params.items():
        m.params[k][...] = v
    m.params_changed()
    m.inference_weights = "fp16"
    for k in mats:
        want = before[k].astype(np.float16)
        assert np.mean(np.abs(want) < 2.0 ** -14) > 0.8, k
        np.testing.assert_array_equal(m.params[k], want.astype(np.float32), err_msg=k)
        ref_m.params[k][...] = m.params[k]
    ref_m.params_changed()
    rng = np.random.default_rng(C)
    seqs = [list(rng.integers(0, 97, n)) for n in (4, 1, 6)]
    x = np.zeros((3, 6), np.int32)
    for i, q in enumerate(seqs):
        x[i, :len(q)] = q
    m._m.kv_reserve(3, 13)
    m._m.kv_prefill(x, np.array([4, 1, 6], np.int32), np.arange(3, dtype=np.int32))
    for B in (1, 3):  # one sequence (the one-row GEMV), then all three
        nxt = rng.integers(0, 97, B).astype(np.int32)
        m._m.kv_decode(nxt, np.arange(B, dtype=np.int32))
        lg = m._m.kv_logits()
        for i in range(B):
            seqs[i].append(int(nxt[i]))
            assert rel(lg[i], full_last_logits(ref_m, seqs[i])) < 2e-5, (cpu_isa, B, i)


@pytest.mark.parametrize("isa", ["baseline", "x86-64-v3"])
def test_float64_decode_with_huge_attention_scores_matches_numpy(isa):
    """A float64 model whose q and k weights are scaled up 40x (attention scores of hundreds: each softmax one far
    maximum, so a maximum taken over the wrong keys overflows exp in double) decodes the float64 numpy oracle's
    logits (tests/numpy_gpt2.py) at every step to 1e-9, on each variant."""
    import numpy_gpt2 as ref
    from gpt2core import _C
    from isa import force_cpu_isa
    before = force_cpu_isa(_C, isa)
    try:
        m = make_model("float64", C=48, NH=3, seed=9)
    finally:
        _C.set_cpu_isa(before)
    m.params["qkvw"][:, :96] *= 40.0  # the q and k rows of every layer's (3C, C) matrix
    m.params_changed()
    rng = np.random.default_rng(10)
    x = rng.integers(0, 97, (2, 9)).astype(np.int32)
    m._m.kv_reserve(2, 13)
    m._m.kv_prefill(np.ascontiguousarray(x[:, :5]), np.array([5, 5], np.int32), np.array([0, 1], np.int32))
    for t in range(5, 9):
        m._m.kv_decode(x[:, t].copy(), np.array([0, 1], np.int32))
        _, want, _ = ref.forward(dict(m.params), x[:, :t + 1], None, V=97, NH=3)
        assert rel(m._m.kv_logits(), np.asarray(want)[:, -1]) < 1e-9, t


@pytest.mark.parametrize("C,OC", [(56, 101), (64, 101), (64, 48), (96, 33)])
def test_int8_integer_dot_every_variant_with_mass_at_the_edges(cpu_isa, C, OC):
    """The integer-dot GEMV (q8_int_dot) on each variant against float64 over numpy's quantised inputs, with each
    row's whole mass in one input at an edge (the first, the last, the last of a short block) and random rows: the
    block sums are exact integers, so the result is within a few fp32 roundings of the reference."""
    from gpt2core import _C
    rng = np.random.default_rng(C * OC)
    w = (rng.standard_normal((OC, C)) * 0.1).astype(np.float32)
    q, s, deq = _C.quantize_q8(w)
    nb = -(-C // 32)
    for N in (1, 2, 3, 5, 8):
        x = rng.standard_normal((N, C)).astype(np.float32)
        x[0] = 0
        x[0, -1] = 3.0   # all mass at the last input
        if N > 1:
            x[1] = 0
            x[1, 0] = -2.0  # ... at the first
        if N > 2:
            x[2] = 0
            x[2, 32 * (nb - 1)] = 1.5  # ... at the first of the last block
        got = _C.gemv_q8(x, q, s, None, int_dot=True)
        xq, xs, _ = q8_reference(x)
        want = np.zeros((N, OC))
        asum = np.zeros((N, OC))
        for j in range(nb):
            blk = slice(32 * j, 32 * j + 32)
            sp = (s[None, :, j] * xs[:, j:j + 1]).astype(np.float64)  # the fp32 scale product, as the kernels form it
            want += (xq[:, blk].astype(np.int64) @ q[:, blk].T.astype(np.int64)) * sp
            asum += (np.abs(xq[:, blk]).astype(np.int64) @ np.abs(q[:, blk]).T.astype(np.int64)) * sp
        bound = (nb + 5) * 2.0 ** -24 * asum + 1e-30
        assert np.all(np.abs(got - want) <= bound), (cpu_isa, N, float(np.max(np.abs(got - want) / bound)))


@pytest.mark.parametrize("weights", ["bf16", "int8"])
def test_decode_to_the_last_cache_position_and_generate_past_block_size(weights):
    """A sequence decoded until its cache is full (position block_size - 1, the last row of wpe) equals the full
    forward at every step; then generate runs past block_size (each step re-prefills the last block_size tokens)
    and gives the uncached path's ids on the same weights, for a rotary model too."""
    for arch in (None, dict(position="rope")):
        m, ref_m = rounded_pair(56, 4, weights, Vp=101, block=11, seed=3, arch=arch)
        rng = np.random.default_rng(5)
        seq = list(rng.integers(0, 97, 3))
        m._m.kv_reserve(1, 11)
        m._m.kv_prefill(np.array([seq], np.int32), np.array([3], np.int32), np.array([0], np.int32))
        while len(seq) < 11:
            t = int(rng.integers(0, 97))
            m._m.kv_decode(np.array([t], np.int32), np.array([0], np.int32))
            seq.append(t)
            assert rel(m._m.kv_logits()[0], full_last_logits(ref_m, seq)) < 2e-5, (weights, arch, len(seq))
        with pytest.raises(IndexError, match="full"):
            m._m.kv_decode(np.array([1], np.int32), np.array([0], np.int32))
        prompts = [[3, 1, 4, 1, 5, 9, 2, 6, 5], [7]]
        got = m.generate(prompts, 8, top_k=20, top_p=0.9, seed=4)
        eng = m._inference_engine
        m._inference_engine = lambda b, n: inference.ForwardEngine(ref_m, b, n)
        try:
            want = m.generate(prompts, 8, top_k=20, top_p=0.9, seed=4)
        finally:
            m._inference_engine = eng
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w, err_msg=f"{weights} {arch}")
        assert [len(g) for g in got] == [17, 9]


# ----------------------------------------------------------------------------------------------- stop strings
# 4-byte characters whose 12 bytes are all different, each generated as its own single-byte token: 3 characters,
# 12 tokens (more tokens than characters + 8)
WIDE = bytes([0xF0, 0x90, 0x81, 0x82, 0xF1, 0x83, 0x84, 0x85, 0xF2, 0x86, 0x87, 0x88]).decode("utf-8")


def byte_token(b: int) -> int:
    """GPT-2's token for the single byte b."""
    enc = tokenizer.get_encoding()
    return enc.encode_single_token(bytes([b]))


def chain_model(chain, C=32):
    """A real GPT-2-vocabulary model (1 layer) whose greedy continuation of chain[i] is chain[i + 1], and of the last
    id <|endoftext|>: the block is the identity (zero output projections), wte[chain[i]] is the unit vector e_i, so the
    final LayerNorm's output is a fixed direction per token, and the untied head's row chain[i + 1] points along e_i.
    The ids in chain must differ."""
    assert len(set(chain)) == len(chain) and len(chain) <= C
    cfg = GPT2Config(block_size=64, vocab_size=50257, padded_vocab_size=50304, n_layer=1, n_head=2, n_embd=C,
                     tie_embeddings=False)
    m = GPT2(cfg, dtype="float32", init=False, training=False)
    for v in m.params.values():
        v[...] = 0
    for k in ("ln1w", "ln2w", "lnfw"):
        m.params[k][...] = 1
    nxt = list(chain[1:]) + [tokenizer.EOT]
    for i, (t, n) in enumerate(zip(chain, nxt)):
        m.params["wte"][t, i] = 1.0
        m.params["lm_head"][n, i] = 10.0
    m.params_changed()
    return m


def text_chain(prefix: str, middle: bytes, suffix: str):
    """Distinct token ids whose bytes are prefix, then middle one byte per token, then suffix (one token per
    character: ASCII letters)."""
    ids = [byte_token(c) for c in prefix.encode()] + [byte_token(b) for b in middle] + \
          [byte_token(c) for c in suffix.encode()]
    assert len(set(ids)) == len(ids), "the chain's bytes must differ"
    return ids


def test_generate_stops_at_a_stop_string_of_four_byte_characters():
    """The stop string WIDE is 3 characters of 12 single-byte tokens: generation ends at the token that completes it
    (a window of len(stop) + 8 tokens never holds all 12), and the text up to it is the prefix."""
    chain = text_chain("ab", WIDE.encode(), "cdef")
    m = chain_model(chain)
    full = m.generate([chain[:1]], 40, top_k=1)[0]
    np.testing.assert_array_equal(full[:len(chain)], chain)  # the chain model continues as built
    out = m.generate([chain[:1]], 40, top_k=1, stop=WIDE)[0]
    assert list(out) == chain[:2 + 12], tokenizer.decode(out[1:])
    assert inference.truncate_at_stop(tokenizer.decode(out[1:]), WIDE) == "b"
    # a 4-byte character split across the stop's start: the stop is its last 2 characters (8 tokens)
    out = m.generate([chain[:1]], 40, top_k=1, stop=WIDE[1:])[0]
    assert list(out) == chain[:2 + 12]


def test_several_stop_strings_the_earliest_occurrence_wins():
    """Generation ends at the first token that completes any of the stop strings, and the text is cut before the one
    that starts first (OpenAI's rule), whatever their order in the list or the order they complete in."""
    chain = text_chain("xhelo wrd", b"", "")  # distinct letters: "xhelo wrd"
    m = chain_model(chain)
    for stops, n_tokens, text in (([" wr", "lo w"], 6, "he"),   # "lo w" completes first (token 6: "w")
                                  (["o w", "elo w"], 6, "h"),   # both complete at "w": "elo w" starts first
                                  (["elo w", "o w"], 6, "h"),   # ... in either order
                                  (["rd", "elo"], 4, "h")):     # "elo" at token 4, long before "rd"
        out = m.generate([chain[:1]], 20, top_k=1, stop=stops)[0]
        assert len(out) - 1 == n_tokens, (stops, tokenizer.decode(out[1:]))
        assert inference.truncate_at_stop(tokenizer.decode(out[1:]), stops) == text, stops


@pytest.mark.filterwarnings("ignore:Using `httpx` with `starlette.testclient`")
def test_server_stops_at_multibyte_stop_strings_and_the_earliest_wins():
    """gpt2core-serve's app (Starlette, in-process) over the chain model, greedy: the completion is cut before the
    stop string of 4-byte characters spanning 8 single-byte tokens, streamed chunks never hold half a character or
    a piece of a stop string, and of several stop strings the one that starts first wins."""
    pytest.importorskip("starlette")
    from starlette.testclient import TestClient
    from gpt2core.serve import create_app
    chain = text_chain("ab", WIDE.encode(), "cd")
    m = chain_model(chain)
    prompt = tokenizer.decode(chain[:1])
    with TestClient(create_app(m)) as client:
        def complete(stop, stream=False):
            body = dict(prompt=prompt, max_tokens=30, temperature=0, stop=stop, stream=stream)
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return r
        r = complete(None).json()["choices"][0]
        assert r["text"] == "b" + WIDE + "cd" and r["finish_reason"] == "stop"  # then <|endoftext|>
        for stop, want in (([WIDE[1:]], "b" + WIDE[0]), ([WIDE[2] + "c", WIDE[1:]], "b" + WIDE[0]),
                           ([WIDE[2] + "c", WIDE[1:] + "c"], "b" + WIDE[0]),  # both complete at "c"
                           (["d", "b" + WIDE[0]], ""), ([WIDE[1] + "x"], "b" + WIDE + "cd")):
            r = complete(stop).json()["choices"][0]
            assert r["text"] == want, (stop, r)
            chunks = []
            with client.stream("POST", "/v1/completions", json=dict(prompt=prompt, max_tokens=30, temperature=0,
                                                                  stop=stop, stream=True)) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        ch = json.loads(line[6:])["choices"]
                        if ch:
                            chunks.append(ch[0]["text"])
            assert "".join(chunks) == want, (stop, chunks)
            assert all("\ufffd" not in c for c in chunks)
