"""One model shared by threads and live streams on the emulated CUDA backend (issue 38): the GPT2 wrapper (its lock,
its KV slot pool) over the emulated CUDA core (inference-only). Each OS thread has its own current device and
emulator state, so a model used from several threads must still run every call on its device: 2 threads x mixed
calls (generate, stream, forward with logits, forward + token losses) equal the same calls run alone, and three
live streams advanced in random order (a generate between their steps, the cache growing under them as the third
joins) equal their solo runs."""
import numpy as np

from gpt2core import GPT2, GPT2Config
from test_cuda_emu import CFG, emu, init_params  # noqa: F401  (emu: fixture)
from test_sharing import hammer, interleave_streams, run_call  # the CPU test's calls, threads and stream order

CONFIG = GPT2Config(block_size=CFG["max_seq_len"], vocab_size=CFG["vocab_size"],
                    padded_vocab_size=CFG["padded_vocab_size"], n_layer=CFG["n_layer"], n_head=CFG["n_head"],
                    n_embd=CFG["n_embd"])


def emulated(emu_module, training):
    """A GPT2 whose core is the emulated CUDA backend's fp32 model (the wrapper as for device='cuda')."""
    core = emu_module.Model(**CFG, device="cuda", training=training)
    init_params(core, 5)
    core.params_changed()
    return GPT2.__new__(GPT2)._adopt(core, CONFIG, "cuda", "fp32", training)


def test_threads_and_streams_share_an_emulated_cuda_model(emu):  # noqa: F811
    rng = np.random.default_rng(3)
    V = CFG["vocab_size"]
    per_thread = []  # the emulator is slow: 2 threads x 3 short calls (test_sharing.py runs the big mix on the CPU)
    for kinds in (["generate", "forward", "losses"], ["stream", "losses", "generate"]):
        cs = []
        for kind in kinds:
            x = rng.integers(0, V, (int(rng.integers(1, 3)), int(rng.integers(2, 6)))).astype(np.int32)
            cs.append((kind, x, rng.integers(0, V, x.shape).astype(np.int32), int(rng.integers(1, 4)),
                       int(rng.integers(0, 2**63))))
        per_thread.append(cs)
    for training in (False,):
        want = [[run_call(emulated(emu, training), c) for c in cs] for cs in per_thread]
        results = hammer(emulated(emu, training), per_thread, 7)
        for i in range(len(per_thread)):
            for c, g, w in zip(per_thread[i], results[i], want[i]):
                np.testing.assert_array_equal(g, w, err_msg=f"training={training} thread {i} {c[0]}")

    # live streams in random order, a generate between steps, later streams longer (the cache grows under them)
    specs = [([list(rng.integers(0, V, n))], new, int(rng.integers(0, 2**63))) for n, new in ((3, 3), (4, 4), (2, 7))]
    alone = emulated(emu, False)
    solo = [np.stack(list(alone.generate(p, n, seed=s, stream=True))) for p, n, s in specs]
    m = emulated(emu, False)

    def between():  # a generate between steps
        if rng.random() < 0.3:
            m.generate(rng.integers(0, V, (1, 3)), 1)
    # the longest joins late: the cache grows under the others
    got = interleave_streams(m, specs, rng, 2, lambda got: sum(map(len, got)) >= 3, between)
    for g, w in zip(got, solo):
        np.testing.assert_array_equal(np.stack(g), w)
