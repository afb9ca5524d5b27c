"""The shapes of the threshold table (thresholds.py) run through the emulated CUDA kernels, against float64 numpy
(the column sums, the sum of squares) or the CPU backend (the other ops, the project's reference).

    python tests/csrc/cuda/cuda_emu/threshold_ops.py build/emu-py          # every threshold case, both sides
    python tests/csrc/cuda/cuda_emu/threshold_ops.py build/emu-py --slow   # the real d12 shapes only
    ... --first reduce.pass2_row_loop --fail-fast    # that threshold's shapes first; stop at the first failing case
    ... --keep-going                                 # a shape that raises (a launch error) counts as error inf

Prints one line per case (name, shape, error, seconds) and, last, one JSON object {case: normwise error}, where
error = max|cuda - reference| / max|reference| over every output (inf when an output is not finite). The op tests
(test_cuda_emu_thresholds.py) and scripts/mutation_test.py read it; a case passes at error <= TOL.
Inputs are random normal (never zeros); outputs that accumulate start from random values (the += contract), the
reduction scratch starts poisoned (NaN).
"""
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import thresholds  # noqa: E402

# fp32 in both: the summation orders differ (chunked tree vs sequential); n * 2^-24 stays below 1e-5 of the largest
# value for the sizes here, the d12 column sums included (65,536 rows in chunks of 192: the chunk sums' rounding
# errors ~ 192 * 6e-8 relative, then 342 chunks).
TOL = 1e-5


def normwise(got, want):
    got = got if isinstance(got, (tuple, list)) else (got,)
    want = want if isinstance(want, (tuple, list)) else (want,)
    worst = 0.0
    for g, w in zip(got, want):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert g.shape == w.shape, (g.shape, w.shape)
        if not np.all(np.isfinite(g)):
            return float("inf")
        if w.size:
            worst = max(worst, float(np.max(np.abs(g - w)) / max(np.max(np.abs(w)), 1e-30)))
    return worst


def bf16_bits(x):
    """float32 -> bf16 bits, round to nearest even (finite inputs)."""
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_values(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


class Runner:
    def __init__(self, E, seed=1234):
        self.E = E
        self.rng = np.random.default_rng(seed)
        self.cpu = E.Ops("cpu")
        self.cuda = E.Ops("cuda")
        self.cuda_misaligned = E.Ops("cuda", misalign=True)

    def f32(self, *shape, scale=1.0):
        return (self.rng.standard_normal(shape) * scale).astype(np.float32)

    def dev(self, case):
        return self.cuda_misaligned if case.get("misalign") else self.cuda

    # ------------------------------------------------------------------ reduce.cuh, called directly
    def column_sum(self, N, C, bf16=False, misalign=False):
        x = self.f32(N, C) + 0.25  # a mean: a lost or doubled chunk shows in every column
        out0 = self.f32(C)
        if bf16:
            bits = bf16_bits(x)
            got, R = self.E.column_sum(out0, bits, misalign)
            x = bf16_values(bits)
        else:
            got, R = self.E.column_sum(out0, x, misalign)
        assert R == thresholds.column_chunks(N, C), (R, N, C)  # the table's replica of the launcher's chunking
        return normwise(got, out0.astype(np.float64) + x.astype(np.float64).sum(axis=0))

    def column_reduce(self, R, C):
        p, out0 = self.f32(R, C) + 0.25, self.f32(C)
        return normwise(self.E.column_reduce(out0, p), out0.astype(np.float64) + p.astype(np.float64).sum(axis=0))

    # ------------------------------------------------------------------ backend ops against the CPU backend
    def layernorm_forward(self, N, C, misalign=False, residual=True):
        x, w, b = self.f32(N, C, scale=2.0) + 0.5, self.f32(C), self.f32(C)
        want = self.cpu.layernorm_forward(x, w, b)
        e = normwise(self.dev(dict(misalign=misalign)).layernorm_forward(x, w, b), want)
        if not residual:
            return e
        a2 = self.f32(N, C)  # the fused residual variant: the same paths
        return max(e, normwise(self.cuda.residual_layernorm_forward(x, a2, w, b),
                               self.cpu.residual_layernorm_forward(x, a2, w, b)))

    def layernorm_backward(self, N, C):
        """Against float64 (the CPU backend's sequential fp32 sums over N rows are themselves off by ~1e-5 at
        d12's N = 65,536): the inputs, mean and rstd as given, the formula of layernorm.cuh's header."""
        x, w = self.f32(N, C, scale=2.0) + 0.5, self.f32(C)
        _, mean, rstd = self.cpu.layernorm_forward(x, w, self.f32(C))
        dinp0, dw0, db0, dout = self.f32(N, C), self.f32(C), self.f32(C), self.f32(N, C) + 0.25
        got = self.cuda.layernorm_backward(dinp0, dw0, db0, dout, x, w, mean, rstd)
        f = np.float64
        norm = (x.astype(f) - mean.astype(f)[:, None]) * rstd.astype(f)[:, None]
        dnorm = w.astype(f) * dout
        dinp = dinp0 + (dnorm - dnorm.mean(1, keepdims=True) - norm * (dnorm * norm).mean(1, keepdims=True)) * \
            rstd.astype(f)[:, None]
        want = (dinp, dw0 + (norm * dout).sum(0), db0 + dout.astype(f).sum(0))
        return normwise(got, want)

    def targets(self, N, V, tail=False):
        t = self.rng.integers(0, V, N).astype(np.int32)
        if tail:  # targets in the ragged columns [K * (V / K), V)
            t[:] = V - 1 - self.rng.integers(0, V % 4 or 1, N)
        t[::5] = -1  # ignored rows
        return t

    def crossentropy(self, N, V, Vp, target_tail=False):
        lg, t = self.f32(N, Vp, scale=3.0), self.targets(N, V, target_tail)
        got, want = self.cuda.crossentropy_forward(lg, t, V), self.cpu.crossentropy_forward(lg, t, V)
        assert got[2] == want[2], (got[2], want[2])  # the count of non-ignored rows
        e = normwise(got[:2], want[:2])
        lse = want[1]
        return max(e, normwise(self.cuda.crossentropy_backward_inplace(lg, lse, t, 0.37, V),
                               self.cpu.crossentropy_backward_inplace(lg, lse, t, 0.37, V)))

    def crossentropy_fused(self, N, V, Vp):
        lg, t = self.f32(N, Vp, scale=3.0), self.targets(N, V)
        got = self.cuda.crossentropy_counted(lg, t, V, 0.5, 1.25, fused=True)
        want = self.cpu.crossentropy_counted(lg, t, V, 0.5, 1.25, fused=True)
        assert got[2] == want[2] == int((t >= 0).sum()), (got[2], want[2])
        return normwise((got[0], got[1], np.array([got[3]]), got[4]), (want[0], want[1], np.array([want[3]]), want[4]))

    def loss_count(self, N):
        """The one-block row loops of the classifier (count of valid targets, then the loss mean) at N rows."""
        t = self.targets(N, 50257)
        losses = np.abs(self.f32(N)) + 1.0
        count, acc = self.E.loss_count_accumulate(t, losses, 0.25, 1.5)
        want_count = int((t >= 0).sum())
        if count != want_count:
            return float("inf")
        return normwise(np.array([acc]), np.array([1.5 + 0.25 * losses.astype(np.float64).sum() / want_count]))

    def encoder_backward(self, B, T, C, U):
        Vp = ((U + 63) // 64) * 64
        inp = self.rng.integers(0, U, (B, T)).astype(np.int32)
        inp.flat[:U] = self.rng.permutation(U)  # exactly U distinct tokens, the rest repeats
        args = (self.f32(Vp, C), self.f32(T, C), self.f32(B, T, C), inp)
        return normwise(self.cuda.encoder_backward(*args), self.cpu.encoder_backward(*args))

    def encoder_forward(self, B, T, C):
        inp = self.rng.integers(0, 50, (B, T)).astype(np.int32)
        wte, wpe = self.f32(64, C), self.f32(T, C)
        return normwise(self.cuda.encoder_forward(inp, wte, wpe), self.cpu.encoder_forward(inp, wte, wpe))

    def gelu(self, n, misalign=False):
        x, d, g = self.f32(n, scale=2.0), self.f32(n), self.f32(n)
        dev = self.dev(dict(misalign=misalign))
        return max(normwise(dev.gelu_forward(x), self.cpu.gelu_forward(x)),
                   normwise(dev.gelu_backward(g, x, d), self.cpu.gelu_backward(g, x, d)))

    def residual(self, n, misalign=False):
        a, b = self.f32(n), self.f32(n)
        return normwise(self.dev(dict(misalign=misalign)).residual_forward(a, b), self.cpu.residual_forward(a, b))

    def adamw(self, n, misalign=False):
        p, g, m, v = self.f32(n), self.f32(n), self.f32(n, scale=0.1), np.abs(self.f32(n, scale=0.01))
        args = (p, g, m, v, 1e-3, 0.9, 0.95, 1e-8, 0.1, 0.5, 1 - 0.9 ** 3, 1 - 0.95 ** 3)
        return normwise(self.dev(dict(misalign=misalign)).adamw(*args), self.cpu.adamw(*args))

    def sum_squares(self, n):
        x = self.f32(n) + 0.25
        return normwise(np.array([self.cuda.sum_squares(x)]), np.array([np.sum(x.astype(np.float64) ** 2)]))

    def attention(self, B, T, C, NH):
        qkv, dout, dqkv = self.f32(B, T, 3 * C), self.f32(B, T, C), self.f32(B, T, 3 * C)
        return normwise(self.cuda.attention(qkv, dout, dqkv, NH), self.cpu.attention(qkv, dout, dqkv, NH))

    def attention_kv(self, pos, C, NH, Tq=1, maxT=None, splits=None):
        """infer.cuh's cache write + decode attention: one sequence at position pos of slot 1 (of 2), Tq new tokens,
        a cache of maxT positions (default pos + Tq + 2); through the backend (its decode_splits), or with `splits`
        blocks per head (1: the one-block kernel whatever the cache)."""
        maxT = maxT or pos + Tq + 2
        kc, vc = self.f32(2, maxT, C), self.f32(2, maxT, C)
        args = (self.f32(1, Tq, 3 * C), kc, vc, np.array([1], np.int32), np.array([pos], np.int32), NH)
        got = self.cuda.attention_kv(*args) if splits is None else self.E.k_attention_kv_splits(0, *args, splits)
        return normwise(got, self.cpu.attention_kv(*args))

    def sample(self, V, top_k, top_p, scale=4.0, n=4):
        """infer.cuh's sampler against the CPU backend's on the same logits: the fraction of ids that differ."""
        logits = self.f32(n, V + 3, scale=scale)
        args = ([1.0] * n, [top_k] * n, [top_p] * n, [3] * n, list(range(n)), [1] * n)
        return float(np.mean(self.cuda.sample_tokens(logits, V, *args) != self.cpu.sample_tokens(logits, V, *args)))

    def infer_rows(self, C, NH):
        """The row kernels of KV inference: encoder_forward_at (at the last positions of wpe) and gather_rows against
        numpy (exact), kv_write through attention_kv against the CPU backend."""
        B, Tn, maxT = 3, 2, 9
        inp = self.rng.integers(0, 50, (B, Tn)).astype(np.int32)
        pos = np.array([maxT - Tn, 0, 4], np.int32)
        wte, wpe = self.f32(64, C), self.f32(maxT, C)
        want = wte[inp].astype(np.float64) + np.stack([wpe[p:p + Tn] for p in pos])
        e = normwise(self.cuda.encoder_forward_at(inp, wte, wpe, pos), want)
        x, rows = self.f32(7, C), np.array([6, 0, 3, 6], np.int32)
        e = max(e, normwise(self.cuda.gather_rows(x, rows), x[rows]))
        return max(e, self.attention_kv(pos=4, C=C, NH=NH, Tq=2))

    def rope(self, B, T, C, NH, pos0, maxT, misalign=False):
        """rope.cuh's table and rotation (forward and backward) against float64 angles and rotations."""
        qkv = self.f32(B, T, 3 * C)
        hs, h = C // NH, C // NH // 2
        f = 10000.0 ** (-np.arange(h) / h)
        ang = (pos0 + np.arange(T))[:, None] * f[None, :]
        c, s = np.cos(ang)[None, :, None, :], np.sin(ang)[None, :, None, :]
        worst = 0.0
        for backward, sign in ((False, 1.0), (True, -1.0)):
            got, _ = self.E.k_rope(0, qkv, NH, maxT, pos0, 10000.0, backward, misalign=misalign)
            want = qkv.astype(np.float64).copy()
            for part in (0, 1):  # q, then k
                x = want[:, :, part * C:(part + 1) * C].reshape(B, T, NH, hs)
                x1, x2 = x[..., :h].copy(), x[..., h:].copy()
                x[..., :h] = x1 * c - sign * x2 * s
                x[..., h:] = x2 * c + sign * x1 * s
                want[:, :, part * C:(part + 1) * C] = x.reshape(B, T, C)
            worst = max(worst, normwise(got, want))
        return worst

    def rope_at(self, pos, T, maxT, C=64, NH=2):
        """rope_forward_at: row (b, t) at position pos[b] + t (up to maxT - 1), the CUDA backend against the CPU's."""
        qkv = self.f32(len(pos), T, 3 * C)
        p = np.array(pos, np.int32)
        assert p.max() + T <= maxT
        return normwise(self.cuda.rope_at(qkv, p, NH), self.cpu.rope_at(qkv, p, NH))

    def relu2(self, n, misalign=False):
        """relu2.cuh forward, backward accumulating, writing (dinp NaN-poisoned) and writing in place over dout (the
        MLP backward's use), against float64."""
        x, d, g0 = self.f32(n, scale=2.0), self.f32(n), self.f32(n)
        x64 = x.astype(np.float64)
        grad = 2 * np.maximum(x64, 0) * d
        return max(normwise(self.E.k_relu2_forward(0, x, misalign=misalign), np.maximum(x64, 0) ** 2),
                   normwise(self.E.k_relu2_backward(0, g0, x, d, True, misalign=misalign), g0 + grad),
                   normwise(self.E.k_relu2_backward(0, np.full_like(x, np.nan), x, d, False, misalign=misalign), grad),
                   normwise(self.E.k_relu2_backward(0, np.full_like(x, np.nan), x, d, False, inplace=True,
                                                    misalign=misalign), grad))

    def rmsnorm(self, N, C, misalign=False):
        """rmsnorm.cuh forward (plain and with the residual add) and backward (accumulating) against the CPU backend."""
        dev = self.dev(dict(misalign=misalign))
        x, a2 = self.f32(N, C, scale=2.0) + 0.5, self.f32(N, C)
        out, rstd = self.cpu.rmsnorm_forward(x)
        e = normwise(dev.rmsnorm_forward(x), (out, rstd))
        e = max(e, normwise(dev.residual_rmsnorm_forward(x, a2), self.cpu.residual_rmsnorm_forward(x, a2)))
        args = (self.f32(N, C), self.f32(N, C), x, rstd, False)
        return max(e, normwise(dev.rmsnorm_backward(*args), self.cpu.rmsnorm_backward(*args)))

    def qk_norm(self, B, T, C, NH):
        """QK-norm (rmsnorm.cuh over the q and k heads of qkv, in place) forward and backward against the CPU."""
        qkv = self.f32(B, T, 3 * C, scale=2.0)
        normed, rstd = self.cpu.qk_norm_forward(qkv, NH)
        e = normwise(self.cuda.qk_norm_forward(qkv, NH), (normed, rstd))
        d = self.f32(B, T, 3 * C)
        return max(e, normwise(self.cuda.qk_norm_backward(d, normed, rstd, NH),
                               self.cpu.qk_norm_backward(d, normed, rstd, NH)))

    def run(self, th, case):
        return getattr(self, th.op)(**case)


def cases(slow=False):
    """(case name, threshold, case) of the table: the small shapes, or (slow) the real d12 ones."""
    for th in thresholds.TABLE:
        for i, c in enumerate(th.slow if slow else th.cases):
            yield f"{th.name}[{'d12-' if slow else ''}{i}]", th, c


def main(argv):
    build, slow, fail_fast, keep_going = argv[1], "--slow" in argv, "--fail-fast" in argv, "--keep-going" in argv
    first = argv[argv.index("--first") + 1] if "--first" in argv else None
    sys.path.insert(0, build)
    import gpt2core_cuda_emu as E

    r = Runner(E)
    errors = {}
    todo = sorted(cases(slow), key=lambda x: x[1].name != first)  # stable: the table's order otherwise
    for name, th, c in todo:
        t0, c0 = time.time(), time.process_time()
        try:
            errors[name] = r.run(th, c)
        except Exception as e:  # noqa: BLE001 - an emulator report or launch error of this shape
            if not keep_going:
                raise
            errors[name] = float("inf")
            print(f"{name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
        print(f"{name:48s} {json.dumps(c):52s} error {errors[name]:.2e}  {time.time() - t0:6.1f} s "
              f"({time.process_time() - c0:.1f} s CPU)", flush=True)
        if fail_fast and not errors[name] <= TOL:
            break
    print(json.dumps(errors))


if __name__ == "__main__":
    main(sys.argv)
