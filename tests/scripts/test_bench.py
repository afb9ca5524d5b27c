"""scripts/bench.py in data-parallel mode on the CPU (Gloo): --nproc 2 --scaling runs 1 and 2 processes and
prints the scaling efficiency; --zero 1 and gradient accumulation run; a bad --total-batch-tokens is refused
before any process starts. The figures are not checked against a target: 2 processes on a shared 2-core box
say little about scaling, only that the tool measures."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gpt2core import _C

BENCH = Path(__file__).resolve().parents[2] / "scripts" / "bench.py"
TINY = ["--preset", "tiny", "--steps", "2", "--warmup", "1", "-B", "2", "-T", "16", "--threads", "1"]
needs_gloo = pytest.mark.skipif(not _C.build_info().get("gloo"), reason="gpt2core built without Gloo")


def bench(*args, check=True, env=None):
    p = subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=120, env=env)
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


def test_one_process_takes_recompute_and_gradient_accumulation():
    """One process measures the memory options too: --recompute layer, and --total-batch-tokens' micro-steps (tokens/s
    over the whole optimizer step); --no-prefetch without --offload is a usage error."""
    out = bench(*TINY, "--recompute", "layer", "--total-batch-tokens", "64").stdout
    assert "grad_accum 2 | recompute layer | offload False" in out, out
    ms, tps = re.search(r"^ms/step ([0-9.]+) .*\| tokens/s ([0-9,]+)", out, re.M).groups()
    tps = float(tps.replace(",", ""))
    assert abs(64 / (float(ms) / 1e3) - tps) <= 0.1 * tps  # the step's 64 tokens, not one micro-step's 32 (ms rounded)
    p = bench(*TINY, "--no-prefetch", check=False)
    assert p.returncode == 2 and "--no-prefetch needs --offload" in p.stderr, p.stderr
    p = bench(*TINY, "--total-batch-tokens", "50", check=False)
    assert p.returncode != 0 and "not a multiple of B*T = 32" in p.stderr, p.stderr


def test_ladder_runs_every_rung_this_device_has_side_by_side():
    """--ladder: one row per rung in one run; on the CPU the CUDA-only rungs are listed, not measured."""
    out = bench(*TINY, "--ladder").stdout
    rows = {m.group(1).strip(): m.group(2) for m in re.finditer(r"^([a-z0-9 ]+?)\s+\|\s+([0-9.,-]+) \|", out, re.M)}
    assert list(rows) == ["baseline", "tf32", "fp16", "bf16", "fused", "flash", "vocab 50304", "cuda graphs",
                          "tuned gemms", "fp8"], out
    for rung, ms in rows.items():
        if rung in ("baseline", "vocab 50304"):
            assert float(ms) > 0, out
        else:
            assert ms == "-" and "(CUDA only)" in out, out
    assert re.search(r"^baseline .*\|\s+1\.00x \|", out, re.M), out


def test_matmul_matches_float64_reference():
    """_C.matmul, the core's GEMM that bench times for the CPU peak, against numpy in float64."""
    rng = np.random.default_rng(0)
    for M, K, N in [(1, 1, 1), (67, 129, 35), (300, 257, 190)]:    # the last is split over the threads
        a = rng.standard_normal((M, K), dtype=np.float32)
        b = rng.standard_normal((K, N), dtype=np.float32)
        # fp32 sums of K products of unit normals: errors grow about like K * 2^-24 * |terms|
        np.testing.assert_allclose(_C.matmul(a, b), a.astype(np.float64) @ b, rtol=0, atol=1e-6 * K)
    with pytest.raises(ValueError, match=r"^a must be .*float32"):
        _C.matmul(a.astype(np.float64), b)
    with pytest.raises(ValueError, match=r"^b must be .*C-contiguous"):
        _C.matmul(a, np.asfortranarray(b))
    with pytest.raises(ValueError, match="a has K=257 columns but b has 256 rows"):
        _C.matmul(a, b[:-1].copy())


def test_cpu_peak_is_measured_then_cached(tmp_path):
    """The CPU peak is one large sgemm through the core's GEMM, measured once per CPU, thread count and BLAS,
    kept under the user's cache directory; the output says which."""
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path))
    line = re.compile(r"^CPU fp32 peak ([0-9.]+) GFLOP/s \((measured|cached): sgemm 2048\^3 through (.+?) on 1 "
                      r"thread.*\) \| utilisation ([0-9.]+)%$", re.M)
    first = line.search(bench(*TINY, env=env).stdout)
    assert first and first.group(2) == "measured" and first.group(3) == _C.build_info()["blas"]
    cache = json.loads((tmp_path / "gpt2core" / "cpu_peak.json").read_text())
    [entry] = cache.values()
    assert entry["gflops"] == pytest.approx(float(first.group(1)), abs=0.06) and entry["gflops"] > 0
    second = line.search(bench(*TINY, env=env).stdout)
    assert second and second.group(2) == "cached" and second.group(1) == first.group(1)
    again = line.search(bench(*TINY, "--measure-peak", env=env).stdout)
    assert again and again.group(2) == "measured"


def test_compare_native_alternates_the_two_builds():
    """--compare-native runs the installed package and the same package over another _C in alternating child
    processes and prints both medians and their ratio. Here the "native" module is the installed one (building
    the -march=native core would cost CI minutes); the real comparison is in docs/measurements/cpu.md."""
    out = bench(*TINY, "--compare-native", "--rounds", "2", "--native-module", _C.__file__).stdout
    rounds = re.findall(r"^round ([12]) (portable|native)\s+\((\S+)\): ([0-9.]+) ms/step$", out, re.M)
    assert [(r[0], r[1]) for r in rounds] == [("1", "portable"), ("1", "native"), ("2", "portable"), ("2", "native")], out
    assert {r[2] for r in rounds} == {_C.cpu_isa()}
    m = re.search(r"^portable ([0-9.]+) ms/step \| native ([0-9.]+) ms/step .* portable / native = ([0-9.]+)$", out, re.M)
    assert m and float(m.group(1)) > 0 and float(m.group(2)) > 0 and float(m.group(3)) > 0, out


def test_profile_splits_each_recipes_step_by_op():
    """--recipe gpt2 modern --profile: both recipes' steps in alternating rounds, one row per op (the modern one's
    rotary, QK-norm, soft-capped loss, untied head's AdamW and Muon's Newton-Schulz among them) with each recipe's ms
    per step, the phases' sums adding up to the ops, and the time per token of modern against gpt2."""
    out = bench(*TINY, "--recipe", "gpt2", "modern", "--profile", "--rounds", "2").stdout
    found = re.findall(r"^--recipe (\w+) .*\| (\d+) tokens per step \(grad_accum \d+\) \| ms/step ([0-9.]+) "
                       r"\(median of 4\)", out, re.M)
    ms = {r: float(v) / int(tok) for r, tok, v in found}  # ms per token: each recipe's own tokens per step
    assert set(ms) == {"gpt2", "modern"}, out
    lines = out[out.index("op (ms per optimizer step)"):].splitlines()
    assert lines[0].split()[-2:] == ["gpt2", "modern"], out
    # fixed width: the op in 40 characters, then one 18-character cell per recipe ("ms share%", or "-")
    cell = lambda c: None if c.strip() == "-" else float(c.split()[0])  # noqa: E731
    rows = {ln[:40].strip(): (cell(ln[40:58]), cell(ln[58:76])) for ln in lines[2:] if ln[:40].strip()
            and not ln.startswith("time per token")}
    for op in ("forward.rope", "forward.qk_norm", "backward.rope", "backward.qk_norm", "forward.matmul_fc+relu2",
               "loss.crossentropy_softcap_backward", "optimizer.adamw.head", "optimizer.muon_newton_schulz"):
        assert rows[op][0] is None and rows[op][1] is not None, (op, out)
    for op in ("forward.matmul_fc+gelu", "forward.layernorm", "optimizer.adamw.rest"):
        assert rows[op][0] is not None and rows[op][1] is None, (op, out)
    for col in (0, 1):  # each recipe's phase sums are the sums of its ops (each rounded to 0.01 ms)
        for phase in ("forward", "loss", "backward", "optimizer"):
            ops = [v[col] for k, v in rows.items() if k.startswith(phase + ".") and v[col] is not None]
            assert rows[f"= {phase}"][col] == pytest.approx(sum(ops), abs=0.006 * len(ops) + 0.01), (phase, out)
    ratio = float(re.search(r"^time per token, --recipe modern / --recipe gpt2: ([0-9.]+)x", out, re.M).group(1))
    assert ratio == pytest.approx(ms["modern"] / ms["gpt2"], rel=0.01)


def test_newton_schulz_times_the_three_ways():
    """--newton-schulz: one line per way (the unbatched op, batched fp32, batched bf16) with ms per optimizer step,
    GFLOP/s and the speed-up over the first; the header counts the preset's Muon matrices (tiny: 2 layers, C=64)."""
    out = bench("--preset", "tiny", "--newton-schulz", "--rounds", "1", "--threads", "1").stdout
    assert "12 matrices in runs 6 x (64, 64), 2 x (64, 64), 2 x (256, 64), 2 x (64, 256)" in out, out
    rows = re.findall(r"^\s*(unbatched fp32 \(before\)|batched fp32|batched bf16): +([0-9.]+) ms per optimizer step "
                      r"\| +([0-9.]+) GFLOP/s \| ([0-9.]+)x$", out, re.M)
    assert [r[0] for r in rows] == ["unbatched fp32 (before)", "batched fp32", "batched bf16"], out
    assert float(rows[0][3]) == 1.0 and all(float(r[1]) > 0 for r in rows)
