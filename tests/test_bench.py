"""scripts/bench.py in data-parallel mode on the CPU (Gloo): --nproc 2 --scaling runs 1 and 2 processes and
prints the scaling efficiency; --zero 1 and gradient accumulation run; a bad --total-batch-tokens is refused
before any process starts. The figures are not checked against a target: 2 processes on a shared 2-core box
say little about scaling, only that the tool measures."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gpt2core import _C

BENCH = Path(__file__).resolve().parents[1] / "scripts" / "bench.py"
TINY = ["--preset", "tiny", "--steps", "2", "--warmup", "1", "-B", "2", "-T", "16", "--threads", "1"]
needs_gloo = pytest.mark.skipif(not _C.build_info().get("gloo"), reason="gpt2core built without Gloo")


def bench(*args, check=True):
    p = subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=120)
    if check:
        assert p.returncode == 0, p.stdout + p.stderr
    return p


@needs_gloo
def test_scaling_prints_the_efficiency_of_2_processes_against_1():
    out = bench(*TINY, "--nproc", "2", "--scaling").stdout
    m = re.search(r"^scaling efficiency 1 -> 2 processes: ([0-9.]+) \(", out, re.M)
    assert m, out
    assert 0 < float(m.group(1)) < 2, out
    assert "2 processes (gloo)" in out and "overlapped with the last micro-step's backward" in out
    rows = re.findall(r"^\s+([12]) \|\s+1 \|.*\|\s+([0-9.]+)%$", out, re.M)
    assert [r[0] for r in rows] == ["1", "2"] and float(rows[0][1]) == 100.0, out


@needs_gloo
def test_zero1_with_gradient_accumulation():
    out = bench(*TINY, "--nproc", "2", "--zero", "1", "--total-batch-tokens", "128").stdout
    assert "ZeRO-1 over 2 ranks (gloo)" in out, out
    assert "grad_accum 2 | 128 tokens/step" in out, out
    assert re.search(r"tokens/s [0-9,]+ \([0-9,]+ per process\) \| comm [0-9.]+ ms/step", out), out


def test_total_batch_tokens_must_divide_before_launching():
    p = bench(*TINY, "--nproc", "2", "--total-batch-tokens", "100", check=False)
    assert p.returncode != 0 and "not a multiple of B*T*processes = 64" in p.stderr
    assert "gpt2core.launch" not in p.stderr  # refused up front, no process started


def test_ladder_runs_every_rung_this_device_has_side_by_side():
    """--ladder: one row per rung in one run; on the CPU the CUDA-only rungs are listed, not measured."""
    out = bench(*TINY, "--ladder").stdout
    rows = {m.group(1).strip(): m.group(2) for m in re.finditer(r"^([a-z0-9 ]+?)\s+\|\s+([0-9.,-]+) \|", out, re.M)}
    assert list(rows) == ["baseline", "tf32", "bf16", "fused", "flash", "vocab 50304", "cuda graphs"], out
    for rung, ms in rows.items():
        if rung in ("baseline", "vocab 50304"):
            assert float(ms) > 0, out
        else:
            assert ms == "-" and "(CUDA only)" in out, out
    assert re.search(r"^baseline .*\|\s+1\.00x \|", out, re.M), out


def test_compare_native_alternates_the_two_builds():
    """--compare-native runs the installed package and the same package over another _C in alternating child
    processes and prints both medians and their ratio. Here the "native" module is the installed one (building
    the -march=native core would cost CI minutes); the real comparison is in the README's figures."""
    out = bench(*TINY, "--compare-native", "--rounds", "2", "--native-module", _C.__file__).stdout
    rounds = re.findall(r"^round ([12]) (portable|native)\s+\((\S+)\): ([0-9.]+) ms/step$", out, re.M)
    assert [(r[0], r[1]) for r in rounds] == [("1", "portable"), ("1", "native"), ("2", "portable"), ("2", "native")], out
    assert {r[2] for r in rounds} == {_C.cpu_isa()}
    m = re.search(r"^portable ([0-9.]+) ms/step \| native ([0-9.]+) ms/step .* portable / native = ([0-9.]+)$", out, re.M)
    assert m and float(m.group(1)) > 0 and float(m.group(2)) > 0 and float(m.group(3)) > 0, out
