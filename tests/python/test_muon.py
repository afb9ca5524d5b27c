"""Muon (csrc/model/optimizer.h) on the CPU backend: one step against a float64 numpy reference of the published
algorithm (KellerJordan/Muon: Nesterov momentum, 5 Newton-Schulz quintic iterations with (3.4445, -4.7750,
2.0315), the max(1, rows/cols)^0.5 scale, decoupled weight decay); the orthogonalised update's singular values for
square, tall and wide matrices; the parameter groups by name; data parallel over 2 and 3 processes, with and
without ZeRO-1, bit-identical to one process; the WSD schedule and the momentum warm-up."""
import os
import socket
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from gpt2core import _C
from gpt2core.config import GPT2Config
from gpt2core.model import GPT2
from gpt2core.schedule import lr_at, muon_momentum_at

# odd sizes: C = 24 (3 heads), so the matrices are 24 x 24 (q, k, v, attproj), 96 x 24 (fcw, tall), 24 x 96 (wide)
CFG = GPT2Config(block_size=16, vocab_size=100, padded_vocab_size=128, n_layer=2, n_head=3, n_embd=24)
A, B_, C_ = 3.4445, -4.7750, 2.0315


def ns5(G, steps=5):
    """The reference's zeropower_via_newtonschulz5, in float64 (on X^T when the matrix is tall)."""
    X = G.astype(np.float64)
    tall = X.shape[0] > X.shape[1]
    if tall:
        X = X.T
    X = X / (np.linalg.norm(X) + 1e-7)
    for _ in range(steps):
        Am = X @ X.T
        Bm = B_ * Am + C_ * Am @ Am
        X = A * X + Bm @ X
    return X.T if tall else X


def muon_ref(W, G, mom, lr, beta, wd, steps=5):
    """One Muon update of W (rows, cols) from gradient G and momentum mom (KellerJordan/Muon muon_update + step)."""
    mom = mom + (1 - beta) * (G - mom)          # momentum.lerp_(grad, 1 - beta)
    U = G + beta * (mom - G)                    # grad.lerp_(momentum, beta): Nesterov
    X = ns5(U, steps) * max(1.0, W.shape[0] / W.shape[1]) ** 0.5
    return W * (1 - lr * wd) - lr * X, mom


def matrices(model, flat):
    return [flat[off:off + r * c].reshape(r, c) for off, r, c, _, _ in model.muon_matrix_list()]


def random_grads(model, rng, scale=1.0):
    g = model.flat_grads()
    g[:] = rng.standard_normal(g.size) * scale
    return g.copy()


@pytest.mark.parametrize("dtype,tol", [("float64", 1e-9),
                                       # fp32: five NS iterations of fp32 GEMMs (~1e-6 each, a few ulps grown)
                                       ("float32", 2e-4)])
def test_two_steps_match_float64_reference(dtype, tol):
    rng = np.random.default_rng(0)
    m = GPT2(CFG, seed=1, dtype=dtype)
    W = [x.astype(np.float64) for x in matrices(m, m.flat_params().copy())]
    mom = [np.zeros_like(w) for w in W]
    # the core takes the step's settings as float32 (as AdamW's lr): the reference uses the same rounded values
    f32 = lambda v: float(np.float32(v))  # noqa: E731
    lr, wd, clip = f32(0.05), f32(0.1), 1.0
    for step, beta in enumerate((f32(0.85), f32(0.9))):
        g = random_grads(m, rng)
        norm = np.sqrt(np.sum(g.astype(np.float64) ** 2))
        factor = float(np.float32(clip / (norm + 1e-6)))  # the clip rule (optimizer.h), rounded once to float
        got = m.step(lr=1e-3, weight_decay=0.1, grad_clip=clip, optimizer="muon", muon_lr=lr, muon_momentum=beta,
                     muon_weight_decay=wd)
        assert got == pytest.approx(norm, rel=1e-6)
        G = matrices(m, g.astype(np.float64) * factor)
        for k in range(len(W)):
            W[k], mom[k] = muon_ref(W[k], G[k], mom[k], lr, beta, wd)
        for k, w in enumerate(matrices(m, m.flat_params())):
            np.testing.assert_allclose(w, W[k], rtol=0, atol=tol * np.abs(W[k]).max(), err_msg=f"matrix {k}")
        # the momentum sits in adam_m's slots of the Muon tensors
        mm = np.concatenate([m.opt_state()[0][t].reshape(-1) for t in GPT2.muon_params()])
        want = np.concatenate([mom[k].reshape(-1) for k in range(len(mom))])
        order = np.argsort([off for off, *_ in m.muon_matrix_list()], kind="stable")
        assert order.tolist() == list(range(len(mom)))
        np.testing.assert_allclose(mm, want, rtol=0, atol=tol * np.abs(want).max())


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_orthogonalised_update_has_singular_values_near_one(dtype):
    """Square (24 x 24), tall (96 x 24) and wide (24 x 96) random matrices with singular values spread over two
    orders of magnitude come out with every singular value in the quintic's band around 1 (Keller Jordan's
    write-up: roughly U S' V^T with S' in (0.5, 1.5); for these shapes and five steps [0.68, 1.14] in float64
    numpy). Five steps do not lift much smaller singular values (a factor ~3.4445 per step) into the band, as
    the published algorithm intends: it trades exactness for speed."""
    rng = np.random.default_rng(3)
    m = GPT2(CFG, seed=1, dtype=dtype)
    g = m.flat_grads()
    g[:] = 0
    for off, r, c, _, _ in m.muon_matrix_list():
        k = min(r, c)
        U, _ = np.linalg.qr(rng.standard_normal((r, k)))
        V, _ = np.linalg.qr(rng.standard_normal((c, k)))
        s = np.logspace(0, -2, k)
        g[off:off + r * c] = (U * s @ V.T).reshape(-1)
    before = [np.linalg.svd(x, compute_uv=False) for x in matrices(m, g.astype(np.float64))]
    assert all(s.max() / s.min() > 50 for s in before)
    m.step(lr=0.0, grad_clip=0, optimizer="muon", muon_lr=0.0, muon_momentum=0.0)  # beta 0: the update is g
    shapes = set()
    for (off, r, c, _, _), x in zip(m.muon_matrix_list(), matrices(m, m.flat_grads().astype(np.float64))):
        s = np.linalg.svd(x, compute_uv=False)
        assert s.min() > 0.6 and s.max() < 1.25, (r, c, s.min(), s.max())
        shapes.add("tall" if r > c else "wide" if r < c else "square")
    assert shapes == {"tall", "wide", "square"}


def test_parameter_groups_by_name():
    """Muon: qkvw (as q, k, v), attprojw, fcw, fcprojw; AdamW: everything else. The AdamW tensors' update is
    exactly an AdamW step's, the Muon tensors' is not; Muon leaves their second-moment slots untouched."""
    assert GPT2.muon_params() == ("qkvw", "attprojw", "fcw", "fcprojw")
    a, b = GPT2(CFG, seed=2), GPT2(CFG, seed=2)
    mats = a.muon_matrix_list()
    L, C = CFG.n_layer, CFG.n_embd
    assert [(t, r, c) for _, r, c, t, _ in mats] == ([("qkvw", C, C)] * 3 * L + [("attprojw", C, C)] * L +
                                                      [("fcw", 4 * C, C)] * L + [("fcprojw", C, 4 * C)] * L)
    rng = np.random.default_rng(1)
    g = rng.standard_normal(a.num_parameters).astype(np.float32)
    for x in (a, b):
        x.flat_grads()[:] = g
    a.step(lr=1e-2, optimizer="muon", muon_lr=0.02)
    b.step(lr=1e-2)
    pa, pb = a.params, b.params
    for name in _C.param_names():
        if name in GPT2.muon_params():
            assert not np.array_equal(pa[name], pb[name]), name
            assert not np.any(a.opt_state()[1][name]), name  # v unused
        else:
            np.testing.assert_array_equal(pa[name], pb[name], err_msg=name)


def test_bad_muon_arguments_name_themselves():
    m = GPT2(CFG, seed=0)
    m.flat_grads()[:] = 0.5
    for kw, name in [({"muon_lr": float("nan")}, "muon_lr"), ({"muon_momentum": 1.0}, "muon_momentum"),
                     ({"muon_weight_decay": -1.0}, "muon_weight_decay"), ({"muon_ns_steps": 2.5}, "muon_ns_steps")]:
        with pytest.raises(ValueError, match=name):
            m.step(lr=1e-3, optimizer="muon", **kw)
    with pytest.raises(ValueError, match="optimizer"):
        m.step(lr=1e-3, optimizer="sgd")


def test_non_finite_gradient_writes_nothing():
    m = GPT2(CFG, seed=0)
    m.flat_grads()[:] = 1.0
    m.flat_grads()[5] = np.inf
    before = m.flat_params().copy()
    with pytest.raises(FloatingPointError):
        m.step(lr=1e-3, optimizer="muon")
    np.testing.assert_array_equal(m.flat_params(), before)
    assert not np.any(m.opt_state()[0]["qkvw"])


def test_wsd_schedule_and_momentum_warmup():
    kw = dict(max_lr=1.0, warmup_steps=10, total_steps=100, min_lr=0.0, kind="wsd", cooldown_frac=0.4)
    assert lr_at(0, **kw) == pytest.approx(0.1)
    assert [lr_at(s, **kw) for s in (10, 59, 60)] == [1.0, 1.0, 1.0]
    assert lr_at(61, **kw) == pytest.approx(39 / 40) and lr_at(99, **kw) == pytest.approx(1 / 40)
    assert lr_at(100, **kw) == 0.0
    assert lr_at(99, **dict(kw, min_lr=0.1)) == pytest.approx(0.1 + 0.9 / 40)
    with pytest.raises(ValueError, match="cooldown_frac"):
        lr_at(50, **dict(kw, cooldown_frac=1.5))
    assert muon_momentum_at(0, 0.95, 300) == pytest.approx(0.85)
    assert muon_momentum_at(150, 0.95, 300) == pytest.approx(0.90)
    assert muon_momentum_at(300, 0.95, 300) == 0.95 and muon_momentum_at(3, 0.95, 0) == 0.95


# ---------------------------------------------------------------------------------------------- data parallel
DP_SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np
    from gpt2core import _C
    from gpt2core.config import GPT2Config
    from gpt2core.distributed import DataParallel
    from gpt2core.model import GPT2
    rank, world, port, zero, clip, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), \\
        float(sys.argv[5]), sys.argv[6]
    _C.set_num_threads(1)
    cfg = GPT2Config(block_size=16, vocab_size=100, padded_vocab_size=128, n_layer=2, n_head=2, n_embd=32)
    m = GPT2(cfg, seed=5)
    net = m if world == 1 else DataParallel(m, _C.dist.init_gloo(rank, world, "127.0.0.1", port, timeout=60),
                                            zero=zero, overlap=False)
    rng = np.random.default_rng(7)
    for step in range(3):
        net.zero_grad()
        # the same gradients on every rank, with 12 significant bits: their mean over 2 or 3 ranks is exact
        g = np.round(rng.standard_normal(m.num_parameters) * 1024) / 4096
        m.flat_grads()[:] = g
        net.step(lr=1e-2, grad_clip=clip, optimizer="muon", muon_lr=0.03, muon_momentum=0.9 + 0.02 * step,
                 muon_weight_decay=0.05)
    if world > 1:
        print("share", rank, net.muon_share())
    np.save(f"{out}/params{rank}.npy", m.flat_params())
""")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_dp(tmp_path, world, zero, clip):
    script = tmp_path / "dp.py"
    script.write_text(DP_SCRIPT)
    out = tmp_path / f"w{world}z{zero}"
    out.mkdir()
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(world), str(port), str(zero), str(clip),
                               str(out)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    logs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * world, "".join(logs)
    return [np.load(out / f"params{r}.npy") for r in range(world)], "".join(logs)


@pytest.mark.skipif(not _C.build_info().get("gloo"), reason="gpt2core built without Gloo")
@pytest.mark.parametrize("world,zero,clip", [(2, 0, 1.0), (3, 0, 1.0), (2, 1, 0.0), (3, 1, 0.0)])
def test_data_parallel_is_bit_identical_to_one_process(tmp_path, world, zero, clip):
    """Each rank orthogonalises its share of the matrices (uneven: 9 + 3 with 2 ranks, 8 + 2 + 2 with 3), the
    results all-gathered; ZeRO-1 keeps the momentum of its shard only. With ZeRO-1 the global sum of squares
    is summed over shards in another order than one process sums it, so the clip is off there (plain data
    parallel clips: every rank computes the norm of the same averaged gradients)."""
    (one,), _ = _run_dp(tmp_path, 1, 0, clip)
    got, logs = _run_dp(tmp_path, world, zero, clip)
    shares = sorted(tuple(int(v) for v in line.split("(")[1].rstrip(")").split(","))
                    for line in logs.splitlines() if line.startswith("share"))
    counts = [hi - lo for lo, hi in shares]
    assert sum(counts) == 12 and len(set(counts)) > 1, shares
    for r, p in enumerate(got):
        np.testing.assert_array_equal(p, one, err_msg=f"rank {r}")


class ThreadComm:
    """The Comm interface DataParallel uses (size, rank, shard, allreduce, reduce_scatter, all_gather, broadcast),
    for ranks that are threads of this process: every collective deposits each rank's buffer, then computes what
    Gloo computes (a sum over ranks in rank order in float32, "avg" multiplied by float32(1 / world); shards as
    Comm::shard_lo/hi). Lets the data-parallel Muon logic run where gpt2core has no Gloo."""
    backend = "threads"

    def __init__(self, rank, world, box, barrier):
        self.rank, self.size, self.box, self.barrier = rank, world, box, barrier

    def shard(self, n, rank=-1):
        rank = self.rank if rank < 0 else rank
        S = (n + self.size - 1) // self.size
        lo = min(S * rank, n)
        return lo, min(lo + S, n)

    def _exchange(self, buf):
        self.box[self.rank] = np.array(buf, copy=True)
        self.barrier.wait()
        bufs = list(self.box)
        self.barrier.wait()
        return bufs

    def _reduce(self, bufs, op):
        s = bufs[0].astype(np.float32, copy=True)
        for b in bufs[1:]:
            s += b
        if op == "avg":
            s *= np.float32(1.0 / self.size)
        return s

    def allreduce(self, buf, op):
        buf[:] = self._reduce(self._exchange(buf), op)

    def reduce_scatter(self, buf, op):
        lo, hi = self.shard(buf.size)
        buf[lo:hi] = self._reduce(self._exchange(buf), op)[lo:hi]

    def all_gather(self, buf):
        bufs = self._exchange(buf)
        for r in range(self.size):
            lo, hi = self.shard(buf.size, r)
            buf[lo:hi] = bufs[r][lo:hi]

    def broadcast(self, buf, root=0):
        buf[:] = self._exchange(buf)[root]


def _dp_params(world, zero, clip, steps=3):
    """DP_SCRIPT's run with `world` thread ranks (world 1: the plain model): each rank's final weights."""
    import threading
    from gpt2core.distributed import DataParallel
    cfg = GPT2Config(block_size=16, vocab_size=100, padded_vocab_size=128, n_layer=2, n_head=2, n_embd=32)
    box, barrier = [None] * world, threading.Barrier(world)
    out, shares, errors = [None] * world, [None] * world, []

    def rank_main(rank):
        try:
            m = GPT2(cfg, seed=5)
            net = m if world == 1 else DataParallel(m, ThreadComm(rank, world, box, barrier), zero=zero,
                                                    overlap=False)
            rng = np.random.default_rng(7)
            for step in range(steps):
                net.zero_grad()
                m.flat_grads()[:] = np.round(rng.standard_normal(m.num_parameters) * 1024) / 4096
                net.step(lr=1e-2, grad_clip=clip, optimizer="muon", muon_lr=0.03, muon_momentum=0.9 + 0.02 * step,
                         muon_weight_decay=0.05)
            out[rank] = m.flat_params().copy()
            shares[rank] = net.muon_share() if world > 1 else None
            if zero:
                assert net.m.size == net.hi - net.lo < m.num_parameters  # the momentum is sharded
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    if errors:
        raise errors[0]
    return out, shares


@pytest.mark.parametrize("world,zero,clip", [(2, 0, 1.0), (3, 0, 1.0), (2, 1, 0.0), (3, 1, 0.0)])
def test_data_parallel_over_thread_ranks_is_bit_identical_to_one_process(world, zero, clip):
    """DataParallel's Muon (shares, packed all-gather; ZeRO-1's two phases with the momentum sharded) over ranks
    that are threads with a Gloo-like comm (ThreadComm): every rank's weights equal one process's, bit for bit.
    The shares are uneven (9 + 3 matrices with 2 ranks, 8 + 2 + 2 with 3)."""
    (one,), _ = _dp_params(1, 0, clip)
    got, shares = _dp_params(world, zero, clip)
    counts = [hi - lo for lo, hi in shares]
    assert sum(counts) == 12 and len(set(counts)) > 1 and shares[0][0] == 0, shares
    assert all(shares[r][1] == shares[r + 1][0] for r in range(world - 1))
    for r, p in enumerate(got):
        np.testing.assert_array_equal(p, one, err_msg=f"rank {r}")


# ---------------------------------------------------------------------------------------------- resume
def test_resume_mid_run_with_muon_state_is_bit_identical(tmp_path):
    """gpt2core-train --optimizer muon (WSD schedule, momentum warm-up, AdamW's three group LRs on an untied head,
    LayerNorm gains and biases): 6 steps straight == 3 steps, then a resume from the step-3 checkpoint (Muon's
    momentum in its AdamW-moment slots), bit for bit. The group LRs are in the checkpoint's arguments and the
    metrics header."""
    import json
    from gpt2core import train
    from gpt2core.data import shakespeare
    data = shakespeare.ensure(tmp_path / "data")
    n = _C.get_num_threads()

    def run(out, *extra):
        try:
            train.main(["--preset", "tiny", "-B", "2", "-T", "32", "--val-every", "0", "--steps", "6", "--threads",
                        "1", "--sample-tokens", "2", "--lr", "3e-3", "--warmup", "2", "--optimizer", "muon",
                        "--muon-lr", "0.02", "--muon-momentum-warmup", "4", "--schedule", "wsd", "--cooldown-frac",
                        "0.5", "--untied", "--embedding-lr", "0.01", "--head-lr", "1e-3", "--scalar-lr", "2e-3",
                        "--data-dir", str(data), "--output-dir", str(out), *extra])
        finally:
            _C.set_num_threads(n)
        return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]

    straight = run(tmp_path / "straight", "--checkpoint-every", "3")
    resumed = run(tmp_path / "resumed", "--resume", str(tmp_path / "straight" / "checkpoints" / "step_000003"))
    key = lambda r: (r["step"], r["loss"], r["lr"], r["grad_norm"])  # noqa: E731
    assert [key(r) for r in resumed if r["step"] > 3] == [key(r) for r in straight[3:]]
    assert len(straight) == 6
    assert (tmp_path / "resumed" / "model.bin").read_bytes() == (tmp_path / "straight" / "model.bin").read_bytes()
    assert straight[-1]["loss"] < straight[0]["loss"]
    groups = {"embedding_lr": 0.01, "head_lr": 1e-3, "scalar_lr": 2e-3}
    state = json.loads((tmp_path / "straight" / "checkpoints" / "step_000003" / "state.json").read_text())
    head = json.loads((tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()[0])["run"]["config"]
    assert {k: state["args"][k] for k in groups} == groups == {k: head[k] for k in groups}


# ---------------------------------------------------------------------------------------------- --recipe
def test_recipe_sets_its_values_and_explicit_flags_override():
    """--recipe modern sets the optimizer's values and the architecture's own field flags (no separate --arch);
    any flag given explicitly overrides it, the switches included (--no-qk-norm, --bias, --no-untied, ...)."""
    from gpt2core import config, train
    base = ["--steps", "3", "--preset", "s2"]
    c = train.parse_args(base)
    assert c.recipe == "gpt2" and c.optimizer == "adamw" and c.schedule == "cosine" and c.lr == 1e-3
    assert c.model_config() == config.get_preset("s2")
    assert not hasattr(c, "arch")
    modern = config.RECIPES["modern"]
    c = train.parse_args([*base, "--recipe", "modern"])
    for k, v in modern.items():
        assert getattr(c, k) == v, k
    # the architecture fields the recipe sets are GPT2Config.modern's, on the preset's shape
    assert c.model_config() == config.get_preset("s2").replace(**config.MODERN_ARCH)
    assert c.model_config() == GPT2Config.modern(2, 128, n_head=2, block_size=128)
    c = train.parse_args([*base, "--recipe", "modern", "--lr", "1e-4", "--schedule", "cosine", "--muon-lr", "0.01"])
    assert (c.lr, c.schedule, c.muon_lr, c.optimizer) == (1e-4, "cosine", 0.01, "muon")
    # every architecture field overridden back to GPT-2's by its own flag: the GPT-2 architecture, Muon kept
    c = train.parse_args([*base, "--recipe", "modern", "--position", "learned", "--norm", "layernorm",
                          "--no-qk-norm", "--activation", "gelu", "--bias", "--no-untied", "--no-zero-init-proj",
                          "--logit-softcap", "0"])
    assert c.model_config() == config.get_preset("s2") and c.optimizer == "muon"
    # one at a time: only that field changes
    for flag, field, value in [(["--no-qk-norm"], "qk_norm", False), (["--bias"], "bias", True),
                               (["--no-untied"], "tie_embeddings", True), (["--position", "learned"], "position",
                                                                           "learned")]:
        m = train.parse_args([*base, "--recipe", "modern", *flag]).model_config()
        assert m == GPT2Config.modern(2, 128, n_head=2, block_size=128).replace(**{field: value}), flag
    # the off-switches exist only for what a recipe turns on, and say what they undo
    helptext = train.build_parser().format_help()
    flat = " ".join(helptext.split())
    for k, v in modern.items():
        assert f"{k}={v}" in flat, k
        if isinstance(v, bool):
            assert config.negated_flag(k) in flat
    assert "--arch" not in helptext and "muon-lr" in helptext and "wsd" in helptext
    assert config.negated_flag("no_bias") == "--bias" and config.negated_flag("qk_norm") == "--no-qk-norm"


def test_metrics_header_shows_the_recipe_values(tmp_path):
    """The run's metrics.jsonl header: every value the recipe sets, and the ones a flag overrode."""
    import json
    from gpt2core import config, train
    from gpt2core.data import shakespeare
    data = shakespeare.ensure(tmp_path / "data")
    n = _C.get_num_threads()
    try:
        train.main(["--recipe", "modern", "--preset", "tiny", "-B", "1", "-T", "16", "--steps", "1", "--val-every",
                    "0", "--threads", "1", "--sample-tokens", "0", "--no-qk-norm", "--lr", "1e-3", "--data-dir",
                    str(data), "--output-dir", str(tmp_path / "out")])
    finally:
        _C.set_num_threads(n)
    head = json.loads((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()[0])["run"]
    assert head["recipe"] == "modern" and head["recipe_values"] == config.RECIPES["modern"]
    assert head["recipe_overridden"] == ["lr", "qk_norm"]
    assert head["config"]["qk_norm"] is False and head["config"]["lr"] == 1e-3
    assert head["model"]["qk_norm"] is False and head["model"]["position"] == "rope"
    assert head["model"]["tie_embeddings"] is False and head["model"]["logit_softcap"] == 15.0
    for k in ("embedding_lr", "head_lr", "scalar_lr", "warmup"):  # AdamW's group LRs and the warm-up it sets
        assert head["config"][k] == config.RECIPES["modern"].get(k), k


def test_group_lrs_belong_to_muon():
    """--embedding-lr / --head-lr / --scalar-lr are AdamW's group LRs under --optimizer muon: refused with AdamW
    alone (every tensor takes --lr there), unless --recipe modern set them and --optimizer adamw overrides; out
    of range refused naming the flag; GPT2.step refuses them without optimizer="muon"."""
    from gpt2core import train
    from gpt2core.errors import ArgError
    with pytest.raises((ArgError, SystemExit)):
        train.parse_args(["--embedding-lr", "0.1"])
    c = train.parse_args(["--recipe", "modern", "--optimizer", "adamw"])
    assert train.step_kwargs(c, 0).keys().isdisjoint({"embedding_lr", "head_lr"})
    with pytest.raises((ArgError, SystemExit)):
        train.parse_args(["--optimizer", "muon", "--head-lr", "-1"])
    m = GPT2(CFG, seed=1)
    m.flat_grads()[:] = 1.0
    with pytest.raises(ValueError, match="embedding_lr"):
        m.step(lr=1e-3, embedding_lr=1e-2)
    with pytest.raises(ValueError, match="head_lr"):
        m.step(lr=1e-3, optimizer="muon", head_lr=float("nan"))
