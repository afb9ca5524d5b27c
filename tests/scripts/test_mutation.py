"""scripts/mutation_test.py: the injected kernel bugs still apply to csrc/cuda, and a sample of them is
killed by an emulator report naming the mutated line (the full run: python scripts/mutation_test.py).

The sample (one shared-memory race, one out-of-bounds write, one plain read-modify-write across blocks)
builds the test module once more into build/emu-mut (a few minutes the first time, then only
backend_cuda.cu per mutant) and runs the op comparison under the fwd schedule."""
import json
import os
import runpy
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _script():
    """scripts/mutation_test.py's globals (MUTATIONS, main)."""
    return SimpleNamespace(**runpy.run_path(str(ROOT / "scripts" / "mutation_test.py"), run_name="mutation_test"))


def test_every_mutation_applies_once():
    mod = _script()
    names = [m.name for m in mod.MUTATIONS]
    assert len(names) == len(set(names))
    for m in mod.MUTATIONS:
        path, where = mod.source_file(m)
        text = path.read_text()
        assert text.count(m.old) == 1, f"{m.name}: the snippet must occur once in {where}"
        assert m.old != m.new


def test_inference_mutants_name_their_exposing_tests():
    """Issue 39: at least 20 mutants over the inference, sampling and modern-op files, each naming the test nodes
    that expose it; every node's file and test function exist (a node pytest cannot find would be a harness error,
    never a kill)."""
    import re
    mod = _script()
    judged = [m for m in mod.MUTATIONS if m.tests]
    assert len(judged) >= 20
    # the server's stop strings live in scheduler.TextStream
    files = {"infer.cuh", "rope.cuh", "relu2.cuh", "muon.cuh", "../cpu/ops_infer.h", "../model/sampling.h",
             "../model/gpt2_infer.h", "../cpu/backend_cpu.cpp", "py:model/engine.py", "py:inference/scheduler.py"}
    assert files <= {m.file for m in judged}, files - {m.file for m in judged}
    for m in judged:
        assert not m.unreachable and not m.threshold, m.name
        for node in m.tests:
            path, _, test = node.partition("::")
            func = re.sub(r"\[.*\]$", "", test)
            assert (ROOT / path).exists() and re.search(rf"\ndef {func}\(", (ROOT / path).read_text()), (m.name, node)


@pytest.mark.slow
def test_sample_of_the_inference_mutants_is_killed_by_its_tests(tmp_path):
    """Issue 39's mutants in CI: two of the Python stop-string handling (a copy of the installed package, no build:
    ~4 s each), each killed by its exposing test. (Its C++ mutants each need a rebuild of the emulator module, 25 s to
    minutes: they run in the full `python scripts/mutation_test.py --judged-by-tests`; here their snippets and test
    nodes are checked statically, above.)"""
    mod = _script()
    out = tmp_path / "results.json"
    sample = ["stop_window_in_characters", "text_stream_first_listed_stop"]
    mod.main(["--only", *sample, "--build-dir", str(tmp_path / "build"), "--json", str(out)])
    results = {r["name"]: r for r in json.loads(out.read_text())}
    for name in sample:
        assert results[name]["verdict"] == "tests", results[name]


@pytest.mark.slow
def test_sample_mutants_are_killed_by_a_report_naming_the_line(tmp_path):
    if shutil.which("cmake") is None or not any(
            (Path(b) / "include" / "cuda_bf16.h").exists()
            for b in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda") if b):
        pytest.skip("needs cmake and NVIDIA's CUDA headers")
    mod = _script()
    out = tmp_path / "results.json"
    sample = ["block_sum_first_barrier", "gelu_tail_guard", "classifier_plain_rmw"]
    env_before = os.environ.pop("GPT2CORE_EMU_RACECHECK", None)
    try:
        mod.main(["--only", *sample, "--schedules", "fwd", "--stop-early", "--json", str(out)])
    finally:
        if env_before is not None:
            os.environ["GPT2CORE_EMU_RACECHECK"] = env_before
    results = {r["name"]: r for r in json.loads(out.read_text())}
    for name in sample:
        assert results[name]["verdict"] == "report (line)", results[name]


def test_threshold_mutants_name_a_threshold_and_nvcc_only_ones_say_why():
    """Each threshold mutant points at an entry of the threshold table (tests/csrc/cuda/cuda_emu/thresholds.py); the
    mutants of code the emulator never compiles carry the reason no emulator test reaches them, and sit in lines
    tests/csrc/cuda/test_one_code_path.py lists as nvcc-only (or in functions only those lines call)."""
    import sys
    sys.path.insert(0, str(ROOT / "tests" / "csrc" / "cuda" / "cuda_emu"))
    import thresholds
    names = {t.name for t in thresholds.TABLE}
    mod = _script()
    threshold_mutants = [m for m in mod.MUTATIONS if m.threshold]
    assert len(threshold_mutants) >= 10
    for m in threshold_mutants:
        assert m.threshold in names, m.name
    listed = (ROOT / "tests" / "csrc" / "cuda" / "nvcc_only_lines.txt").read_text()
    unreachable = [m for m in mod.MUTATIONS if m.unreachable]
    assert unreachable and all(len(m.unreachable) > 20 for m in unreachable)
    for m in unreachable:
        first = m.old.strip().splitlines()[0].strip()
        assert first in listed or "only called below sm_80" in m.unreachable, m.name

