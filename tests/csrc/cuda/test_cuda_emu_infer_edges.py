"""KV-cache inference kernels at their edges (issue 39), the CPU backend's (each instruction-set variant, forced:
tests/isa.py) and the emulated CUDA backend's, against float64 numpy (attention) or inference.sample_reference (the
sampler's rule in numpy, with the same uniform numbers):

- decode attention whose scores have one huge maximum (+200 over the rest; alone, or with a second one at +150) at
  every key position, first and last included: a maximum taken over the wrong keys (a warp, a share, the new key left
  out) overflows exp; head sizes 32 / 64 / 128 (the AVX2 register paths and 1 .. 4 values per CUDA lane) and 48 (the
  portable loop), decode (Tq = 1) and prefill (Tq = 3), the one-block and the split-key CUDA kernels;
- sampling exactly on its boundaries: flat logits whose cumulative probability lands exactly on top_p (the nucleus
  is the prefix that reaches it, not one token more), ties at the top_k cut (the lower ids kept), top_k above the
  device kernel's 1,024 sorted candidates with top_p (the nucleus measured against the top_k total), all the mass
  in the first or the last id (every other probability exactly 0) in the unsorted inverse CDF;
- the model at the last position of its cache (rotary and learned positions, fp32 and bf16) and generate past
  block_size on the CUDA backend, against the CPU backend.
"""
import numpy as np
import pytest

from isa import CPU_ISAS, force_cpu_isa
from test_cuda_emu import CFG, emu, init_params, normwise  # noqa: F401  (emu: fixture)
from test_cuda_emu_infer import MODERN, _models, attention_kv_reference


@pytest.fixture(params=CPU_ISAS)
def emu_isa(emu, request):  # noqa: F811
    before = force_cpu_isa(emu, request.param)
    yield request.param
    emu.set_cpu_isa(before)


def huge_max_case(n, hs, Tq=1, NH=2, seed=0):
    """B = 2n sequences of n keys (pos = n - Tq, so the last query sees all n). Sequence b < n: the last query of each
    head scores +200 against key b, the other keys ~N(0, 1); sequence n + j: +200 against key j and +150 against key
    (j + 1) % n. Every key position holds the maximum (the last ones are the new tokens' keys, written from qkv). The
    softmax is then v of that key to e^-50 or better (the scores' own fp32 rounding, ~200 * hs * 2^-24, does not
    show). A maximum that leaves that key out overflows CUDA's expf (inf, NaN out) when the rest are far below (the
    first n); one that leaves both large keys out clamps both to the CPU fast_exp's limit (equal weights: an error of
    order 1, the second n)."""
    g = np.random.default_rng(seed)
    C = NH * hs
    B = 2 * n
    pos = n - Tq
    S, maxT = B + 1, n + 2
    slot = np.array([(b + 1) % S for b in range(B)], np.int32)
    qkv = g.standard_normal((B, Tq, 3 * C)).astype(np.float32)
    kcache = np.full((S, maxT, C), np.nan, np.float32)
    vcache = np.full((S, maxT, C), np.nan, np.float32)
    for b in range(B):
        keys = g.standard_normal((n, C)) / np.sqrt(hs)
        keys[pos:] = qkv[b, :, C:2 * C]
        big = [(b, 200.0)] if b < n else [(b - n, 200.0), ((b - n + 1) % n, 150.0)]
        for h in range(NH):
            q = qkv[b, -1, h * hs:(h + 1) * hs].astype(np.float64)
            for j, s in big:
                keys[j, h * hs:(h + 1) * hs] = q * (s * np.sqrt(hs) / (q @ q))  # q . k / sqrt(hs) = s
        kcache[slot[b], :pos] = keys[:pos]
        vcache[slot[b], :pos] = g.standard_normal((pos, C))
        qkv[b, :, C:2 * C] = keys[pos:]
    return qkv, kcache, vcache, slot, np.full(B, pos, np.int32), NH


HEADS = [(32, 9, 1), (64, 12, 1), (128, 5, 1), (48, 9, 1), (64, 9, 3)]  # (head size, keys, Tq)


@pytest.mark.parametrize("hs,n,Tq", HEADS, ids=[f"hs{h}-n{n}-Tq{t}" for h, n, t in HEADS])
def test_cpu_decode_attention_huge_maximum_at_every_key(emu, emu_isa, hs, n, Tq):  # noqa: F811
    args = huge_max_case(n, hs, Tq, seed=hs + n)
    want = attention_kv_reference(*args)[0]
    got = emu.Ops("cpu").attention_kv(*args)[0]
    assert np.all(np.isfinite(got)), emu_isa
    assert normwise(got, want) <= 1e-5, (emu_isa, normwise(got, want))


@pytest.mark.parametrize("hs,n,Tq", HEADS[:3] + HEADS[4:], ids=[f"hs{h}-n{n}-Tq{t}" for h, n, t in HEADS[:3] +
                                                                  HEADS[4:]])
def test_cuda_decode_attention_huge_maximum_at_every_key(emu, hs, n, Tq):  # noqa: F811
    """The one-block kernel, and the split kernel with 1 .. 4 and n + 1 shares (an empty one: m = -inf, l = 0), so
    the maximum sits in the first, a middle and the last share."""
    args = huge_max_case(n, hs, Tq, seed=hs + n + 1)
    want = attention_kv_reference(*args)[0]
    got = emu.Ops("cuda").attention_kv(*args)[0]
    assert np.all(np.isfinite(got)) and normwise(got, want) <= 1e-5, normwise(got, want)
    for splits in (2, 3, 4, n + 1):
        got = emu.k_attention_kv_splits(0, *args, splits=splits)[0]
        assert np.all(np.isfinite(got)) and normwise(got, want) <= 1e-5, (splits, normwise(got, want))


# ----------------------------------------------------------------------------------------------- sampling
def reference_ids(logits, V, temperature, top_k, top_p, seed, streams, step):
    from gpt2core.inference import sample_reference, uniform
    return np.array([sample_reference(logits[i, :V].astype(np.float64), uniform(seed, s, step), temperature, top_k,
                                      top_p) for i, s in enumerate(streams)])


def both_samplers(emu, logits, V, temperature, top_k, top_p, seed=5, step=2):  # noqa: F811
    """The CPU's and the CUDA kernel's ids for each row of logits (row i draws with stream i), and the reference's."""
    n = logits.shape[0]
    args = ([temperature] * n, [top_k] * n, [top_p] * n, [seed] * n, list(range(n)), [step] * n)
    want = reference_ids(logits, V, temperature, top_k, top_p, seed, range(n), step)
    return emu.Ops("cpu").sample_tokens(logits, V, *args), emu.Ops("cuda").sample_tokens(logits, V, *args), want


@pytest.mark.parametrize("V,top_p,kept", [(8, 0.5, 4), (4, 0.75, 3), (4, 0.25, 1), (16, 0.125, 2)])
def test_flat_logits_top_p_exactly_on_the_cumulative_boundary(emu, V, top_p, kept):  # noqa: F811
    """V equal logits: each token 1 / V, so the cumulative sum after `kept` tokens is exactly top_p (in binary); the
    nucleus is those `kept` lowest ids (sum >= top_p), never one more. 96 draws."""
    logits = np.full((96, V + 3), 1.5, np.float32)
    logits[:, V:] = 50.0  # padding columns, never candidates
    cpu, cuda, want = both_samplers(emu, logits, V, 1.0, 0, top_p)
    assert set(want.tolist()) == set(range(kept))
    np.testing.assert_array_equal(cpu, want)
    np.testing.assert_array_equal(cuda, want)


def test_ties_at_the_top_k_cut_keep_the_lower_ids(emu):  # noqa: F811
    """Four tied logits straddle the top_k = 3 cut (ids 40, 7, 95, 2 tie below the largest): the kept set is the
    largest and the two lowest tied ids; with top_p too."""
    g = np.random.default_rng(3)
    logits = (g.standard_normal((64, 101)) - 5).astype(np.float32)
    logits[:, [40, 7, 95, 2]] = 1.0
    logits[:, 60] = 1.5
    for top_k, top_p in ((3, 1.0), (3, 0.9), (2, 1.0)):
        cpu, cuda, want = both_samplers(emu, logits, 97, 1.0, top_k, top_p)
        assert set(want.tolist()) <= {60, 2, 7}, (top_k, top_p)
        np.testing.assert_array_equal(cpu, want)
        np.testing.assert_array_equal(cuda, want)
    logits[:, 60] = 1.0  # greedy (top_k 1) among five tied maxima: the lowest id
    cpu, cuda, want = both_samplers(emu, logits, 97, 1.0, 1, 1.0)
    assert set(want.tolist()) == {2}
    np.testing.assert_array_equal(cpu, want)
    np.testing.assert_array_equal(cuda, want)


def test_top_k_above_the_device_candidates_with_top_p(emu):  # noqa: F811
    """top_k = 1,100 > kSampleCap = 1,024 with top_p 0.6: the nucleus is measured against the mass of the 1,100 kept
    tokens (8 at +5, then the 1,092 lowest ids of 1,492 flat ones), not against all V or the 1,024 sorted ones; it
    ends inside the candidates (8 + ~180 tokens), so the device samples it."""
    V = 1500
    logits = np.zeros((48, V + 4), np.float32)
    logits[:, [3, 700, 1499, 10, 512, 1024, 1023, 99]] = 5.0
    logits[:, V:] = 80.0
    cpu, cuda, want = both_samplers(emu, logits, V, 1.0, 1100, 0.6)
    big = {3, 700, 1499, 10, 512, 1024, 1023, 99}
    assert all(w in big or w < 1100 for w in want) and len(set(want.tolist()) - big) > 5
    np.testing.assert_array_equal(cpu, want)
    np.testing.assert_array_equal(cuda, want)


@pytest.mark.parametrize("V", [97, 513, 1000])
def test_all_the_mass_in_the_first_or_last_id(emu, V):  # noqa: F811
    """Nothing cut (top_k 0, top_p 1: the unsorted inverse CDF over per-thread chunks of ids): one logit 800 above
    the rest (every other probability exactly 0 in double), at id 0, at id V - 1, or at both (half the draws each)."""
    for hot in ([0], [V - 1], [0, V - 1]):
        logits = np.random.default_rng(V).standard_normal((40, V + 2)).astype(np.float32)
        logits[:, hot] = 800.0
        logits[:, V:] = 900.0
        cpu, cuda, want = both_samplers(emu, logits, V, 1.0, 0, 1.0)
        assert set(want.tolist()) == set(hot), hot
        np.testing.assert_array_equal(cpu, want)
        np.testing.assert_array_equal(cuda, want)


# ----------------------------------------------------------------------------------------------- the model
@pytest.mark.parametrize("cls,tol,arch", [("Model", 1e-5, {}), ("Model", 1e-5, MODERN), ("ModelBF16", 3e-2, MODERN),
                                          ("ModelF16", 4e-3, {})], ids=["fp32", "fp32-modern", "bf16-modern", "fp16"])
def test_decode_to_the_last_position_of_the_context(emu, cls, tol, arch):  # noqa: F811
    """Two sequences decoded until their caches are full (the last learned position / the rotary table's last row,
    max_seq_len - 1 = 39): the CUDA backend's logits at every step against the CPU backend's."""
    cpu, gpu = _models(emu, cls, **arch)
    maxT = CFG["max_seq_len"]
    g = np.random.default_rng(9)
    x = g.integers(0, CFG["vocab_size"], (2, 30)).astype(np.int32)
    lengths = np.array([30, 25], np.int32)
    for m in (cpu, gpu):
        m.kv_reserve(2, maxT)
        m.kv_prefill(x, lengths, np.array([1, 0], np.int32))
    errs = []
    while True:
        live = np.array([s for s in (1, 0) if cpu.kv_pos(s) < maxT], np.int32)
        if not len(live):
            break
        tok = g.integers(0, CFG["vocab_size"], len(live)).astype(np.int32)
        for m in (cpu, gpu):
            m.kv_decode(tok, live)
        errs.append(normwise(gpu.kv_logits(), cpu.kv_logits()))
    assert [gpu.kv_pos(s) for s in (0, 1)] == [cpu.kv_pos(s) for s in (0, 1)] == [maxT, maxT]
    assert max(errs) <= tol, errs


def test_generate_past_block_size_rotary_on_cuda(emu):  # noqa: F811
    """inference.generate over the emulated CUDA model of the modern architecture (rotary positions) gives the CPU
    model's ids past block_size (the window re-prefilled from position 0 at every step)."""
    from types import SimpleNamespace

    from gpt2core import inference

    def shim(m):
        s = SimpleNamespace(_m=m, config=SimpleNamespace(vocab_size=CFG["vocab_size"], block_size=CFG["max_seq_len"]))
        s._inference_engine = lambda batch, max_len: inference.KVEngine(s, batch, max_len)
        return s

    cpu, gpu = _models(emu, "Model", **MODERN)
    g = np.random.default_rng(12)
    prompts = [list(g.integers(0, CFG["vocab_size"], 38)), list(g.integers(0, CFG["vocab_size"], 3))]
    outs = [inference.generate(shim(m), prompts, 5, top_k=0, top_p=0.95, seed=8) for m in (cpu, gpu)]
    for a, b in zip(*outs):
        np.testing.assert_array_equal(a, b)
    assert len(outs[1][0]) == 43


# ----------------------------------------------------------------------------------------------- Muon
def test_muon_step_with_a_zero_gradient_matrix(emu):  # noqa: F811
    """A Muon matrix whose gradient is exactly zero (an unused block): Newton-Schulz normalises by its norm + eps, so
    its update is the weight decay alone, finite, on the CUDA backend as on the CPU's (w (1 - lr wd), fp32)."""
    cfg = dict(CFG, n_embd=32, n_head=2, n_layer=1)  # small matrices: the emulated elementwise kernels are slow
    ref = emu.Model(**cfg, device="cpu")
    dev = emu.Model(**cfg, device="cuda")
    init_params(ref, 1)
    for k, v in dev.params().items():
        v[...] = ref.params()[k]
    dev.params_changed()
    off, rows, cols, name, layer = ref.muon_matrices[1]
    sl = slice(off, off + rows * cols)
    g = np.random.default_rng(6).standard_normal(ref.num_parameters).astype(np.float32)
    g[sl] = 0
    before = ref.flat_params().copy()
    for m in (ref, dev):
        m.flat_grads()[:] = g
        m.muon_optimizer_step(lr=1e-3, weight_decay=0.1, step=1, grad_clip=1.0, muon_lr=0.02, muon_momentum=0.9,
                              muon_weight_decay=0.01)
    d, r = dev.flat_params(), ref.flat_params()
    assert np.all(np.isfinite(d)), name
    want = before[sl].astype(np.float64) * (1 - 0.02 * 0.01)
    assert normwise(r[sl], want) <= 1e-6 and normwise(d[sl], want) <= 1e-6, (name, layer)
    assert normwise(d, r) <= 1e-1  # the other matrices: bf16 Newton-Schulz (test_cuda_emu_muon.py's tolerance)
