"""--batch-size auto (gpt2core.batchfit): the micro-batch chosen for given free memory and measurements, against an
independent calculation; the total batch kept through gradient accumulation; `auto` on the CPU; the flag's parsing.
The GPU side (free memory read from the device, the probe steps, the refusal of an explicit B) runs on the emulated
device in tests/csrc/cuda/test_cuda_emu_batchfit.py."""
import math

import numpy as np
import pytest

from gpt2core import batchfit, train
from gpt2core.config import TrainConfig
from gpt2core.data import shakespeare
from gpt2core.errors import ArgError


@pytest.fixture(scope="module")
def shakespeare_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("shakespeare")
    return d, shakespeare.prepare(d)


def brute_force_B(seqs, free, r1, r2, used1, used2, safety):
    """Independent: the memory after the probe grows linearly in B through (1, used1) and (2, used2), never below
    memory_report's line through (1, r1) and (2, r2) (whose measured excess may not shrink); the largest divisor
    of seqs whose line value fits within free * (1 - safety)."""
    budget = math.floor(free * (1 - safety))
    ex1 = max(0, used1 - r1)
    ex2 = max(ex1, used2 - r2)
    best = None
    for B in range(1, seqs + 1):
        if seqs % B:
            continue
        report = r1 + (B - 1) * (r2 - r1)
        if report + ex1 + (B - 1) * (ex2 - ex1) <= budget:
            best = B
    return best


@pytest.mark.parametrize("seed", range(40))
def test_chosen_B_matches_an_independent_calculation(seed):
    rng = np.random.default_rng(seed)
    fixed = int(rng.integers(1, 4 << 30))
    per_seq = int(rng.integers(1 << 20, 2 << 30))
    r1, r2 = fixed + per_seq, fixed + 2 * per_seq
    m1 = int(rng.integers(-(1 << 26), 1 << 28))  # measured excess at B = 1 (may be below the report: clamped)
    growth = int(rng.integers(-(1 << 24), 1 << 26))
    used1, used2 = r1 + m1, r2 + m1 + growth
    seqs = int(rng.choice([1, 6, 8, 12, 64, 96, 97, 512]))
    free = int(rng.integers(r1 // 2, r1 + 80 * per_seq))
    mem = batchfit.from_measurements(r1, r2, fixed, used1, used2)
    got = batchfit.largest_fitting(seqs, batchfit.budget_of(free), mem.need)
    assert got == brute_force_B(seqs, free, r1, r2, used1, used2, batchfit.SAFETY)
    if got is not None:  # the accumulation keeps the total batch
        accum = seqs // got
        assert got * accum == seqs


def test_chosen_B_is_the_largest_divisor_under_the_budget():
    # 1 GiB fixed, 100 MiB per sequence, a measured margin of 50 MiB + 10 MiB per sequence; 2000 MiB free
    M = 2**20
    mem = batchfit.from_measurements(1024 * M + 100 * M, 1024 * M + 200 * M, 1024 * M,
                                     1024 * M + 100 * M + 50 * M, 1024 * M + 200 * M + 60 * M)
    assert (mem.margin1, mem.margin_per_seq) == (50 * M, 10 * M)
    budget = batchfit.budget_of(2000 * M)  # 1900 MiB: need(B) = 1024 + 100 B + 50 + 10 (B - 1) <= 1900 -> B <= 7.6
    assert mem.need(7) <= budget < mem.need(8)
    assert batchfit.largest_fitting(64, budget, mem.need) == 4   # divisors of 64: 8 does not fit, 4 does
    assert batchfit.largest_fitting(7, budget, mem.need) == 7
    assert batchfit.largest_fitting(96, budget, mem.need) == 6
    assert batchfit.largest_fitting(64, 1000 * M, mem.need) is None


def test_sequences_per_step_and_divisors():
    assert batchfit.sequences_per_step(524288, 1024, 8) == 64
    with pytest.raises(ValueError, match="not a multiple of T"):
        batchfit.sequences_per_step(1000, 64, 1)
    assert batchfit.divisors_descending(12) == [12, 6, 4, 3, 2, 1]
    assert batchfit.divisors_descending(97) == [97, 1]
    assert batchfit.cpu_auto(64) == 8 and batchfit.cpu_auto(12) == 6 and batchfit.cpu_auto(7) == 7


def test_batch_size_flag_parses_auto_and_integers(tmp_path):
    assert train.parse_args(["--output-dir", str(tmp_path)]).batch_size == "auto"
    assert train.parse_args(["-B", "AUTO", "--output-dir", str(tmp_path)]).batch_size == "auto"
    assert train.parse_args(["-B", "16", "--output-dir", str(tmp_path)]).batch_size == 16
    with pytest.raises(ArgError, match="--batch-size must be auto or"):
        TrainConfig(batch_size="most", output_dir=str(tmp_path))
    with pytest.raises(ArgError, match="--batch-size must be auto or"):
        TrainConfig(batch_size=0, output_dir=str(tmp_path))


@pytest.mark.parametrize("total,want_B,want_accum", [(None, 8, 1), (4 * 32, 4, 1), (24 * 32, 8, 3),
                                                     (12 * 32, 6, 2)])
def test_auto_on_the_cpu_is_the_default_micro_batch(shakespeare_dir, tmp_path, total, want_B, want_accum, capsys):
    d, _ = shakespeare_dir
    args = ["--preset", "tiny", "--data-dir", str(d), "-T", "32", "--steps", "1", "--val-every", "0",
            "--sample-tokens", "0", "--output-dir", str(tmp_path), "--threads", "1"]
    if total:
        args += ["--total-batch-tokens", str(total)]
    train.main(args)
    out = capsys.readouterr().out
    tokens = total or 8 * 32
    assert f"batch: B={want_B} T=32 world=1 grad_accum={want_accum} -> {tokens:,} tokens/step" in out, out


def test_auto_refuses_a_total_that_is_not_whole_sequences(shakespeare_dir, tmp_path):
    d, _ = shakespeare_dir
    with pytest.raises(SystemExit) as e:
        train.main(["--preset", "tiny", "--data-dir", str(d), "-T", "32", "--total-batch-tokens", "100",
                    "--output-dir", str(tmp_path)])
    assert e.value.code == 2
