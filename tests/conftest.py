"""Shared fixtures for the model tests: tiny odd shapes, random weights and batches.

Two shapes: "padded" (vocab 97 padded to 128, B=3, T=7 < block size 11, C=48, 3 heads, 2 layers) and
"unpadded" (vocab 61 == padded, B=2, T=9 == block size, C=20, 2 heads of 10, 1 layer).
"""
import os
import sys
from types import SimpleNamespace

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))  # so tests can `import numpy_gpt2`
# test modules whose helpers other folders' tests import (`from test_emu import ROOT`, `from test_resume import
# records`), importable whichever file pytest collects first
for _sub in (("python",), ("csrc", "emu"), ("csrc", "cuda")):
    sys.path.insert(1, os.path.join(os.path.dirname(__file__), *_sub))

import numpy_gpt2 as ref  # noqa: E402
from isa import CPU_ISAS, force_cpu_isa  # noqa: E402
from gpt2core import _C  # noqa: E402

SHAPES = {
    "padded": dict(maxT=11, V=97, Vp=128, L=2, NH=3, C=48, B=3, T=7),
    "unpadded": dict(maxT=9, V=61, Vp=61, L=1, NH=2, C=20, B=2, T=9),
}


def make_problem(shape="padded", seed=0):
    """Random float64 weights (numpy_gpt2.random_params), random idx, targets with two -1 entries,
    and `model(cls)` building a _C model (Model or ModelF64) holding those weights."""
    s = SHAPES[shape]
    rng = np.random.default_rng(seed)
    arch = {k: s[k] for k in ("maxT", "V", "Vp", "L", "NH", "C")}
    params = ref.random_params(rng, **arch)
    idx = rng.integers(0, s["V"], (s["B"], s["T"])).astype(np.int32)
    targets = rng.integers(0, s["V"], (s["B"], s["T"])).astype(np.int32)
    targets[0, 1] = -1
    targets[-1, -1] = -1

    def model(cls=_C.ModelF64, p=None):
        m = cls(max_seq_len=s["maxT"], vocab_size=s["V"], padded_vocab_size=s["Vp"], n_layer=s["L"],
                n_head=s["NH"], n_embd=s["C"])
        views = m.params()
        for k, v in (params if p is None else p).items():
            views[k][...] = v
        return m

    return SimpleNamespace(shape=shape, rng=rng, params=params, idx=idx, targets=targets, model=model, **s)


@pytest.fixture(params=sorted(SHAPES))
def problem(request):
    return make_problem(request.param)


@pytest.fixture()
def padded():
    return make_problem("padded")


@pytest.fixture(params=CPU_ISAS)
def cpu_isa(request):
    """Each CPU instruction-set variant in turn (tests/isa.py; restored after the test): a test reaches every
    variant's code (the AVX2 intrinsics of x86-64-v3 / v4, the portable loops of baseline) whatever the machine's best
    one and whatever the shape."""
    before = force_cpu_isa(_C, request.param)
    yield request.param
    _C.set_cpu_isa(before)
