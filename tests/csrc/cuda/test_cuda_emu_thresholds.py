"""The CUDA kernels on both sides of every code-path threshold of the table in cuda_emu/thresholds.py (chunk counts
against block rows, grid caps and grid-stride loops, vector paths and ragged tails, partial tiles, one block against
several), emulated, against float64 numpy or the CPU backend (cuda_emu/threshold_ops.py), with the emulator's memory
checker on; and, marked slow (CI runs them as their own step, printing their time), the real d12 training shapes:
N = B * T = 65,536 rows of C = 768 for the column sums and LayerNorm, the classifier's row loop over 65,536 rows,
the wte gradient of a 64 x 1024 batch, attention at T = 1024.
"""
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "cuda_emu"))
import thresholds  # noqa: E402
import threshold_ops  # noqa: E402

from test_cuda_emu import emu  # noqa: E402,F401  (the session fixture that builds gpt2core_cuda_emu)


@pytest.fixture(scope="module")
def runner(emu):  # noqa: F811
    return threshold_ops.Runner(emu)


def test_every_threshold_is_crossed():
    """Each threshold has shapes on both sides (computed from the launchers' constants, so a changed constant that
    leaves the shapes on one side fails here), names are unique, and the table covers every kernel family with a
    size-dependent launcher."""
    names = [t.name for t in thresholds.TABLE]
    assert len(names) == len(set(names))
    for t in thresholds.TABLE:
        below, above = t.sides()
        assert below and above, (t.name, [t.quantity(c) for c in t.cases], t.at)
    families = {t.family for t in thresholds.TABLE}
    assert {"reduce", "layernorm", "classifier", "encoder", "gelu", "residual", "adamw", "global_norm",
            "attention"} <= families
    # the real sizes: N = 65,536 rows for the reductions, LayerNorm and the classifier's row loop
    slow = {t.family: t.slow for t in thresholds.TABLE if t.slow}
    assert any(c.get("N") == thresholds.D12_N for c in slow["reduce"])
    assert any(c.get("N") == thresholds.D12_N for c in slow["layernorm"])
    assert any(c.get("N") == thresholds.D12_N for c in slow["classifier"])


def test_the_chunking_replica_matches_the_launcher_at_d12():
    """thresholds.column_chunks is the launcher's arithmetic (the runner asserts it against the emulated launcher's
    R on every column_sum case); at d12 the pass-2 row-threads loop many times."""
    R = thresholds.column_chunks(thresholds.D12_N, thresholds.D12_C)
    assert R > 4 * thresholds.REDUCE_ROWS and thresholds.column_chunk_rows(thresholds.D12_N, thresholds.D12_C) >= 32


CASES = list(threshold_ops.cases())
SLOW = list(threshold_ops.cases(slow=True))


@pytest.mark.parametrize("name,th,case", CASES, ids=[c[0] for c in CASES])
def test_threshold_case(runner, name, th, case):
    err = runner.run(th, case)
    assert err <= threshold_ops.TOL, f"{name} {case}: normwise error {err:.3g} (at {th.where})"


@pytest.mark.slow
@pytest.mark.parametrize("name,th,case", SLOW, ids=[c[0] for c in SLOW])
def test_d12_shape(runner, name, th, case):
    t0, c0 = time.time(), time.process_time()
    err = runner.run(th, case)
    print(f"\n{name} {case}: {time.time() - t0:.1f} s ({time.process_time() - c0:.1f} s CPU), normwise error {err:.2e}")
    assert err <= threshold_ops.TOL, f"{name} {case}: normwise error {err:.3g}"
