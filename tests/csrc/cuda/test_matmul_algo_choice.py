"""The matmul algorithm choice (csrc/cuda/matmul_algo_choice.h: fastest of timed candidates, cached per problem,
the heuristic's first while a CUDA graph captures) with made-up candidates and timings on the CPU:
tests/csrc/cuda/cublaslt/algo_choice.cpp, compiled with g++ and run."""
import re
import shutil
import subprocess

import pytest

from test_emu import ROOT


def test_algo_choice_policy(tmp_path):
    if shutil.which("g++") is None:
        pytest.skip("needs g++")
    exe = tmp_path / "algo_choice"
    cmd = ["g++", "-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror", f"-I{ROOT / 'csrc'}",
           str(ROOT / "tests" / "csrc" / "cuda" / "cublaslt" / "algo_choice.cpp"), "-o", str(exe)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]
    r = subprocess.run([str(exe)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    done = re.search(r"checks (\d+) failed 0$", r.stdout.strip())
    assert done and int(done.group(1)) >= 25, r.stdout
