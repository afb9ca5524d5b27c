"""CUDA graphs of the training step, on the emulated CUDA backend: GPT2Model::forward_backward (one micro-step:
forward, loss and backward) and GPT2Model::optimizer_step (global norm, clipping and AdamW, the clip scale
computed on the device), each captured once and replayed.

The emulator records work enqueued on a capturing stream instead of running it, replays it at cudaGraphLaunch,
and refuses every host synchronisation while capturing (the capture is then invalidated, naming the call). So a
capture that succeeds here proves the step's ops never wait for the host, and a replay that matches the direct
run proves the graph reads its inputs (tokens, weights, the loss count) from memory at replay time rather than
values frozen at capture.

Tolerances: none. The graph replays exactly the kernels the direct run launches, with the same arguments, so
losses, gradients and weights must be bit-identical. forward_backward against forward() + backward() is
bit-identical in the gradients too (the same dloss, computed in double on the device), and optimizer_step
against grad_norm() + adamw_update() with the host's clip scale in the weights and moments; the losses differ
only in the summation order of the mean (double on both sides: 1e-6 relative allows for the final float
rounding).
"""
import numpy as np
import pytest

from test_cuda_emu import CFG, B, T, emu, init_params  # noqa: F401  (emu: fixture)

import gpt2core


# the speed-ladder rungs whose ops differ (the CUDA backend's options, given when a model is created)
RUNGS = {"fused+flash": {}, "unfused+naive": {"fused": False, "attention": "naive"}, "cudnn": {"attention": "cudnn"}}


def models(emu, cls, n=2, seed=0, device="cuda", **options):
    out = []
    for _ in range(n):
        m = getattr(emu, cls)(**CFG, device=device, **options)
        init_params(m, seed)
        m.params_changed()
        out.append(m)
    return out


def batches(k, seed, shape=(B, T), all_ignored=False):
    rng = np.random.default_rng(seed)
    for _ in range(k):
        x = rng.integers(0, CFG["vocab_size"], shape).astype(np.int32)
        y = rng.integers(0, CFG["vocab_size"], shape).astype(np.int32)
        y[rng.random(shape) < 0.1] = -1
        if all_ignored:
            y[...] = -1
        yield x, y


# the shape of the capture tests' batches: what they check (replays bitwise, recapture, fallback) does not depend
# on it, and the emulator's time grows with it; odd sizes keep the kernels' tails (the op tests cover (B, T))
SMALL = (2, 21)


def same(a: dict, b: dict):
    for k in a:
        assert np.array_equal(a[k], b[k]), f"{k}: max diff {np.max(np.abs(a[k] - b[k]))}"


@pytest.mark.parametrize("cls", ["Model", "ModelBF16"])
def test_forward_backward_matches_forward_then_backward(emu, cls):
    direct, fb = models(emu, cls)
    loss = 0.0
    for x, y in batches(3, 1):
        loss += direct.forward(x, y) / 3
        direct.backward(1 / 3)
        fb.forward_backward(x, y, 1 / 3)
    got = fb.take_loss()
    assert abs(got - loss) <= 1e-6 * loss, (got, loss)
    assert fb.take_loss() == 0.0  # taken: the sum restarts
    same(fb.grads(), direct.grads())


@pytest.mark.parametrize("cls,rung", [("Model", "fused+flash"), ("ModelBF16", "fused+flash"),
                                      ("Model", "unfused+naive"), ("ModelBF16", "cudnn")])
def test_graph_replays_bitwise_like_the_direct_run(emu, cls, rung):
    """Three optimizer steps of three micro-steps, new tokens every time, AdamW between steps (the graph must read
    the new weights), a step whose targets are all ignored (count 0: no gradient, no loss), and weights written
    from outside between steps (bf16: the copy is rebuilt before the replay); for the default kernels and for
    the other rungs of the speed ladder (unfused kernels with materialised attention; the cuDNN attention seam)."""
    graphed, direct = models(emu, cls, **RUNGS[rung])
    graphed.cuda_graphs = True
    assert graphed.cuda_graphs and not direct.cuda_graphs
    data = list(batches(9, 2, SMALL))
    data[4] = next(batches(1, 3, SMALL, all_ignored=True))
    for step in range(3):
        for m in (graphed, direct):
            m.zero_grad()
        for x, y in data[3 * step:3 * step + 3]:
            for m in (graphed, direct):
                m.forward_backward(x, y, 1 / 3)
        lg, ld = graphed.take_loss(), direct.take_loss()
        assert lg == ld and np.isfinite(lg) and lg > 0, (lg, ld)
        same(graphed.grads(), direct.grads())
        # a new learning rate every step, and a clip that is active at some steps: read from device memory
        norms = [m.optimizer_step(lr=1e-2 / (step + 1), step=step + 1, grad_clip=0.05) for m in (graphed, direct)]
        assert norms[0] == norms[1] and np.isfinite(norms[0])
        same(graphed.params(), direct.params())
        same(graphed.adam_v(), direct.adam_v())
        if step == 1:  # an outside write (a checkpoint load, a collective)
            for m in (graphed, direct):
                m.params()["lnfb"][:] += 0.25
                m.params_changed()
    same(graphed.params(), direct.params())
    # the first micro-step ran directly (sizing the scratch buffers), the second was captured and launched, the
    # other seven replayed; the optimizer: direct, captured, replayed
    assert graphed.graph_captures == 2 and graphed.graph_replays == 8 + 2
    assert direct.graph_captures == 0 and direct.graph_replays == 0


def test_new_shape_or_layout_recaptures(emu):
    graphed, direct = models(emu, "Model")
    graphed.cuda_graphs = True

    def run(shape, seed, k=3, scale=0.5):
        for x, y in batches(k, seed, shape):
            for m in (graphed, direct):
                m.forward_backward(x, y, scale)
        assert graphed.take_loss() == direct.take_loss()
        same(graphed.grads(), direct.grads())

    run((B, T), 4)
    assert (graphed.graph_captures, graphed.graph_replays) == (1, 2)
    run((2, 11), 5)  # another shape: a direct run, then a new capture
    assert (graphed.graph_captures, graphed.graph_replays) == (2, 4)
    run((2, 11), 6, scale=0.25)  # another grad scale is another graph
    assert (graphed.graph_captures, graphed.graph_replays) == (3, 6)
    for m in (graphed, direct):
        m.recompute_gelu = True  # a new activation layout: the old graph points into freed memory
    run((2, 11), 7, scale=0.25)
    assert (graphed.graph_captures, graphed.graph_replays) == (4, 8)
    graphed.forward(*next(batches(1, 8)))  # evaluation in between, another shape: forward() runs directly
    run((2, 11), 9, scale=0.25)
    assert (graphed.graph_captures, graphed.graph_replays) == (5, 10)
    graphed.cuda_graphs = False
    run((2, 11), 10, scale=0.25)
    assert (graphed.graph_captures, graphed.graph_replays) == (5, 10)


def test_cpu_forward_backward_matches_and_python_api():
    """The CPU backend's forward_backward (the host implementations of the counted loss ops) against forward +
    backward, through the package's GPT2 wrapper; cuda_graphs is refused on the CPU with a clear error."""
    a, b = gpt2core.GPT2("tiny", seed=3), gpt2core.GPT2("tiny", seed=3)
    rng = np.random.default_rng(0)
    V = a.config.vocab_size
    loss = 0.0
    for _ in range(2):
        x = rng.integers(0, V, (2, 16)).astype(np.int32)
        y = rng.integers(0, V, (2, 16)).astype(np.int32)
        y[0, :3] = -1
        loss += a.forward(x, y) / 2
        a.backward(0.5)
        b.forward_backward(x, y, 0.5)
    assert abs(b.take_loss() - loss) <= 1e-6 * loss
    same(b.grads, a.grads)
    with pytest.raises(ValueError, match="cuda_graphs needs device='cuda'"):
        b.cuda_graphs = True
    with pytest.raises(ValueError, match="targets"):
        b.forward_backward(x, y[:, :5])
    with pytest.raises(ValueError, match="idx"):
        b.forward_backward(x.astype(np.int64) + V, y)


@pytest.mark.parametrize("device,cls", [("cpu", "Model"), ("cuda", "Model"), ("cuda", "ModelBF16")])
def test_optimizer_step_is_norm_clip_and_adamw(emu, device, cls):
    """optimizer_step (norm, clip scale and AdamW in the backend) writes the bits grad_norm() + adamw_update()
    with the clip scale computed on the host write, clip active or not; non-finite gradients leave weights,
    moments and the bf16 rounding seed untouched and return the norm."""
    def model():
        m = getattr(emu, cls)(**CFG, device=device)
        init_params(m, 5)
        m.params_changed()
        return m

    x, y = next(batches(1, 11))
    for clip in (0.0, 0.05, 1e9):
        a, b = model(), model()
        for m in (a, b):
            m.forward_backward(x, y, 1.0)
        norm = a.grad_norm()
        scale = clip / (norm + 1e-6) if clip > 0 and norm > clip else 1.0
        a.adamw_update(lr=3e-3, step=4, grad_scale=scale)
        assert b.optimizer_step(lr=3e-3, step=4, grad_clip=clip) == norm
        same(b.params(), a.params())
        same(b.adam_m(), a.adam_m())
        assert b.param_round_seed == 4
    b.grads()["ln2b"][0, 1] = np.nan
    before = {k: v.copy() for k, v in b.params().items()}
    m_before = {k: v.copy() for k, v in b.adam_m().items()}
    assert np.isnan(b.optimizer_step(lr=3e-3, step=5))
    same(b.params(), before)
    same(b.adam_m(), m_before)
    assert b.param_round_seed == 4


# work the emulator pretends it cannot capture (knob, work), and the graphs (captures, replays) made before the
# failure: the micro-step's matmul seam or memsets fail its first capture; the optimizer's norm kernel fails only the
# optimizer's capture, after the micro-step graph was captured and replayed. UNCAPTURABLE refuses the call itself;
# UNJOINED lets every op succeed and fails only cudaStreamEndCapture (a library that forked onto an internal stream
# without joining it back), whose error CUDA keeps as the thread's last error until someone reads it
UNCAPTURABLE = {("UNCAPTURABLE", "matmul"): (0, 0), ("UNCAPTURABLE", "cudaMemsetAsync"): (0, 0),
                ("UNCAPTURABLE", "kernel 'sum_squares_partial_kernel'"): (1, 5),
                ("UNJOINED", "matmul"): (0, 0), ("UNJOINED", "kernel 'sum_squares_final_kernel'"): (1, 5)}


@pytest.mark.parametrize("knob,uncapturable", sorted(UNCAPTURABLE))
def test_a_step_that_cannot_be_captured_runs_directly(emu, monkeypatch, capfd, knob, uncapturable):
    """If part of a step cannot be recorded (the emulator pretends so for the named work; on a GPU, a library call
    that refuses stream capture), the model turns graphs off with a message and runs the ops directly: same bits
    as a model that never tried, and training goes on."""
    monkeypatch.setenv("GPT2CORE_EMU_" + knob, uncapturable)
    graphed, direct = models(emu, "Model")
    graphed.cuda_graphs = True
    for step in range(2):
        for x, y in batches(3, 20 + step, SMALL):
            for m in (graphed, direct):
                m.forward_backward(x, y, 1 / 3)
        norms = [m.optimizer_step(lr=1e-2, step=step + 1) for m in (graphed, direct)]
        assert norms[0] == norms[1] and graphed.take_loss() == direct.take_loss()
        same(graphed.params(), direct.params())
    assert not graphed.cuda_graphs
    assert (graphed.graph_captures, graphed.graph_replays) == UNCAPTURABLE[knob, uncapturable]
    err = capfd.readouterr().err
    assert err.count("gpt2core: CUDA graphs turned off, the step could not be captured") == 1, err
    assert uncapturable in err and "GPT2CORE_EMU_" + knob in err, err


# ----------------------------------------------------------------------------------------- dynamic loss scaling
def scaler(m):
    s = m.loss_scaler
    return s["scale"], s["clean"], s["skipped"]


def test_loss_scaling_captured_matches_direct_and_cpu(emu):
    """Loss scaling (interval 2) with the step captured: 5 optimizer steps, an overflow forced (an inf in one
    gradient before backward accumulates into it) at step 3, a replay of the captured optimizer step, between clean
    ones (growth at steps 2 and 5, the latter a replay too). The graphed model takes the decisions the direct one
    takes, with the same bits (losses, scaled gradients, norms, weights, moments), so the captured backward reads
    each step's scale and the captured update skips, backs off and grows on the device. The CUDA backend's scaler
    kernel and unscaling against the CPU backend's: the same (scale, clean, skipped) after every step, and the
    same unscaled norms within the op tests' 1e-5 (summation order). (The weights: the next test shows the scaled
    CUDA update bit-identical to the unscaled one, which test_cuda_emu.py compares with the CPU.)"""
    graphed, direct = models(emu, "Model")
    (cpu,) = models(emu, "Model", n=1, device="cpu")
    graphed.cuda_graphs = True
    for m in (graphed, direct, cpu):
        m.set_loss_scaling(True, scale=2.0**16, interval=2)
    want = [(2.0**16, 1, 0), (2.0**17, 0, 0), (2.0**16, 0, 1), (2.0**16, 1, 1), (2.0**17, 0, 1)]
    for step, (x, y) in enumerate(batches(5, 30)):
        overflow = step == 2
        for m in (graphed, direct, cpu):
            m.zero_grad()
            if overflow:
                m.flat_grads()[11] = np.inf
            m.forward_backward(x, y, 1.0)
        assert graphed.take_loss() == direct.take_loss()
        cpu.take_loss()
        same(graphed.grads(), direct.grads())
        before = graphed.flat_params().copy()
        norms = [m.optimizer_step(lr=1e-2, step=step + 1, grad_clip=0.05) for m in (graphed, direct, cpu)]
        assert norms[0] == norms[1] and np.isinf(norms[0]) == overflow
        if overflow:
            assert np.array_equal(graphed.flat_params(), before) and np.isinf(norms[2])
        else:
            assert abs(norms[2] - norms[0]) <= 1e-5 * norms[2]
        same(graphed.params(), direct.params())
        same(graphed.adam_m(), direct.adam_m())
        assert scaler(graphed) == scaler(direct) == scaler(cpu) == want[step], step
    assert graphed.graph_captures == 2 and graphed.graph_replays == 4 + 4


@pytest.mark.parametrize("cls", ["Model", "ModelBF16"])
def test_power_of_two_loss_scale_is_exact_on_the_cuda_backend(emu, cls):
    """The emulated CUDA backend with scale 2^16 against itself without scaling: the scaled loss gradient (2^16 x,
    exact in fp32 and bf16 alike: same exponent range), every backward kernel linear in it, and the update dividing
    2^16 out exactly, so gradients are exactly 2^16 x and weights, moments and norms bit-identical; the growth
    stops below fp32's overflow (2^127 x 2 is inf) exactly as on the CPU."""
    on, off = models(emu, cls)
    on.set_loss_scaling(True, scale=2.0**16, interval=1000)
    for step, (x, y) in enumerate(batches(2, 40)):
        for m in (on, off):
            m.zero_grad()
            m.forward_backward(x, y, 1.0)
        assert np.array_equal(on.flat_grads(), off.flat_grads() * np.float32(2.0**16))
        assert on.optimizer_step(lr=1e-2, step=step + 1, grad_clip=0.05) == \
            off.optimizer_step(lr=1e-2, step=step + 1, grad_clip=0.05)
        same(on.params(), off.params())
        same(on.adam_v(), off.adam_v())
    cpu = models(emu, "Model", n=1, device="cpu")[0]
    for m in (on, cpu):
        m.set_loss_scaling(True, scale=2.0**127, interval=1)
        m.zero_grad()
        m.forward_backward(*next(batches(1, 41)), 1.0)
        assert np.isfinite(m.optimizer_step(lr=1e-2, step=3))
        assert scaler(m) == (2.0**127, 0, 0)
