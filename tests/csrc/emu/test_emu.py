"""The CUDA-on-CPU emulator (csrc/emu): its test programs (tests/csrc/emu) under several schedules, the memory
checker's reports (tests/csrc/emu/racecheck.cu), the launch trace, the ucontext fallback, an ASan + UBSan build,
and the real-nvcc compile check.

Builds csrc/emu as its own CMake project into build/emu (and build/emu-asan, build/emu-ucontext);
the build directories are reused, so reruns are incremental. Needs cmake, g++ and NVIDIA's CUDA
headers (cuda_bf16.h); the compile check also needs nvcc and is skipped without it.
"""
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
EMU_SRC = ROOT / "csrc" / "emu"
TEST_DIR = ROOT / "tests" / "csrc" / "emu"
KERNEL_FILES = sorted(TEST_DIR.glob("*.cu"))
PROGRAMS = sorted(p.stem for p in KERNEL_FILES) + sorted(p.stem for p in TEST_DIR.glob("*.cpp"))
# lock-step (every runnable thread once per round) and run-ahead (one warp as far as it gets) schedules
SCHEDULES = ["fwd", "rev", "random:1234", "low", "high", "ahead:1234"]
RACECHECK_CASES = ["war", "raw", "lane", "global_ww", "plain_rmw", "oob", "uninit_static", "smem_oob", "freed"]
JOBS = str(max(2, os.cpu_count() or 2))


def _cuda_include():
    for base in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if base and (Path(base) / "include" / "cuda_bf16.h").exists():
            return Path(base) / "include"
    return None


def _seam_cuda_include():
    """The toolkit whose headers and libraries the vendor-seam tests (cuBLASLt descriptors, cuDNN graph) compile and
    link against: GPT2CORE_SEAM_CUDA_HOME, a test knob (CI points it at the CUDA 12 tree assembled from NVIDIA's cu12
    wheels, .ci/cuda_pypi.sh), else the toolkit the emulator compiles against. The emulator itself never changes."""
    base = os.environ.get("GPT2CORE_SEAM_CUDA_HOME")
    if base:
        return Path(base) / "include" if (Path(base) / "include" / "cuda_bf16.h").exists() else None
    return _cuda_include()


def _nvcc():
    found = shutil.which("nvcc")
    if found:
        return found
    for base in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if base and (Path(base) / "bin" / "nvcc").exists():
            return str(Path(base) / "bin" / "nvcc")
    return None


def _build(build_dir, *defines, targets=()):
    """Configure (first time only picks the generator) and build csrc/emu into build_dir."""
    if shutil.which("cmake") is None or _cuda_include() is None:
        pytest.skip("needs cmake and NVIDIA's CUDA headers (cuda_bf16.h)")
    build_dir = Path(build_dir)
    cfg = ["cmake", "-S", str(EMU_SRC), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=RelWithDebInfo", *defines]
    if not (build_dir / "CMakeCache.txt").exists() and shutil.which("ninja"):
        cfg += ["-G", "Ninja"]
    for cmd in (cfg, ["cmake", "--build", str(build_dir), "-j", JOBS, *(["--target", *targets] if targets else [])]):
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.fail(f"{' '.join(cmd)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return build_dir


def _run(build_dir, program, sched, *args, **env_extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPT2CORE_EMU_")}
    env.update(GPT2CORE_EMU_SCHED=sched, **env_extra)
    return subprocess.run([str(Path(build_dir) / f"emu_{program}"), *args], capture_output=True, text=True, env=env,
                          timeout=300)


def _assert_ok(proc, what):
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "FAIL" not in proc.stdout, f"{what} failed (exit {proc.returncode}):\n{out[-4000:]}"
    assert "ok " in proc.stdout, f"{what} printed no passing check:\n{out[-4000:]}"


def _values(stdout):
    return {line.split()[1]: int(line.split()[2]) for line in stdout.splitlines() if line.startswith("value ")}


@pytest.fixture(scope="module")
def emu_build():
    return _build(ROOT / "build" / "emu")


@pytest.mark.parametrize("sched", SCHEDULES)
@pytest.mark.parametrize("program", [p for p in PROGRAMS if p != "missing_sync"])
def test_program(emu_build, program, sched):
    _assert_ok(_run(emu_build, program, sched), f"emu_{program} under {sched}")


def test_missing_syncthreads_is_reported_under_every_schedule(emu_build):
    for sched in SCHEDULES:
        proc = _run(emu_build, "missing_sync", sched)
        _assert_ok(proc, f"emu_missing_sync under {sched}")
        values = _values(proc.stdout)
        assert values["fixed_mismatches"] == 0 and values["racy_reported"] == 1, (sched, proc.stdout)
        # the read, after the write of a warp-mate (lock-step orders) or before it (reversed, random)
        assert "reads static __shared__" in proc.stdout and "at missing_sync.cu:15 (shift_racy_kernel)" in proc.stdout
        assert ("which no thread of this block has written" in proc.stdout or
                "wrote at missing_sync.cu:13 (shift_racy_kernel) with no __syncwarp between" in proc.stdout), proc.stdout


def test_without_the_checker_missing_syncthreads_is_exposed_by_some_schedule(emu_build):
    """fwd happens to order the racy writes before the reads; rev and random schedules do not."""
    results = {}
    for sched in ["fwd", "rev", "random:1", "random:2", "random:3"]:
        proc = _run(emu_build, "missing_sync", sched, GPT2CORE_EMU_RACECHECK="0")
        _assert_ok(proc, f"emu_missing_sync under {sched}")
        values = _values(proc.stdout)
        assert values["fixed_mismatches"] == 0 and values["racy_reported"] == 0, sched
        results[sched] = values["racy_mismatches"]
    assert results["fwd"] == 0, results
    assert results["rev"] > 0, results
    assert sum(results[s] > 0 for s in results if s.startswith("random")) >= 2, results


def test_run_ahead_schedules_expose_a_missing_barrier_between_warps(emu_build):
    """block_sum without its first __syncthreads (tests/csrc/emu/racecheck.cu war_kernel), checker off: lock-step
    schedules read every warp's slot before any warp writes the next pass, run-ahead ones do not."""
    for sched in SCHEDULES:
        proc = _run(emu_build, "racecheck", sched, "war_values", GPT2CORE_EMU_RACECHECK="0")
        _assert_ok(proc, f"emu_racecheck war_values under {sched}")
        bad = _values(proc.stdout)["war_mismatches"]
        assert (bad > 0) == (sched in ("low", "high") or sched.startswith("ahead")), (sched, bad)


@pytest.mark.parametrize("case", RACECHECK_CASES)
def test_memory_checker_reports_with_the_source_line(emu_build, case):
    """Each buggy kernel of tests/csrc/emu/racecheck.cu fails its launch with a report naming the access's line
    (the program checks the message); run-ahead and lock-step schedules alike."""
    for sched in ["fwd", "ahead:5"]:
        proc = _run(emu_build, "racecheck", sched, case)
        _assert_ok(proc, f"emu_racecheck {case} under {sched}")
        # under fwd the write runs first: a race, not an uninitialised read
        if sched == "fwd" and case in ("raw", "lane"):
            sync = "__syncthreads" if case == "raw" else "__syncwarp"
            assert "shared-memory race: reads static __shared__" in proc.stdout, proc.stdout
            assert f"with no {sync} between" in proc.stdout, proc.stdout


CP_ASYNC_CASES = ["no_wait", "no_barrier", "no_reuse_barrier", "young_group", "uncommitted", "misaligned", "not_shared",
                  "source_oob"]


@pytest.mark.parametrize("case", CP_ASYNC_CASES)
def test_cp_async_misuse_fails_naming_the_line(emu_build, case):
    """Each planted cp.async bug of tests/csrc/emu/cp_async.cu (a missing cp.async.wait_group, a missing barrier
    after the wait or before a double buffer is refilled, a read of a group still in flight or of an uncommitted
    copy, bad addresses) fails its launch with a message naming the line (the program checks it), under lock-step
    and run-ahead schedules."""
    for sched in ["fwd", "rev", "high", "ahead:5"]:
        _assert_ok(_run(emu_build, "cp_async", sched, case), f"emu_cp_async {case} under {sched}")


def test_cp_async_destination_reads_as_poison_until_the_wait(emu_build):
    """With the checker off, a read before the wait sees the poison pattern (NaN in every float type), not the data:
    a missing wait still shows in the values."""
    proc = _run(emu_build, "cp_async", "fwd", "poison_values", GPT2CORE_EMU_RACECHECK="0")
    _assert_ok(proc, "emu_cp_async poison_values")
    assert _values(proc.stdout)["poisoned_reads"] == 32, proc.stdout


def test_schedules_are_reproducible(emu_build):
    a = _values(_run(emu_build, "missing_sync", "random:42", GPT2CORE_EMU_RACECHECK="0").stdout)
    b = _values(_run(emu_build, "missing_sync", "random:42", GPT2CORE_EMU_RACECHECK="0",
                     GPT2CORE_EMU_THREADS="1").stdout)
    assert a == b and a["racy_mismatches"] > 0


def test_single_worker_thread(emu_build):
    for program in ["atomics", "block_reduce", "divergent_sync"]:
        _assert_ok(_run(emu_build, program, "random:5", GPT2CORE_EMU_THREADS="1"), f"emu_{program} on one thread")


def test_launch_trace_lists_every_kernel(emu_build, tmp_path):
    trace = tmp_path / "trace.txt"
    trace.write_text("earlier_kernel\n")
    _assert_ok(_run(emu_build, "block_reduce", "fwd", GPT2CORE_EMU_TRACE=str(trace)), "traced run")
    lines = trace.read_text().splitlines()
    assert lines[0] == "earlier_kernel"  # appended, not overwritten
    assert lines[1:] == ["row_sum_kernel"] * 3 + ["row_sum_2d_kernel", "barrier_pred_kernel", "coords_kernel"]


def test_captured_kernels_are_traced_when_a_graph_runs_them(emu_build, tmp_path):
    """A captured kernel is traced when a graph launch runs it, not when it is captured: graph_capture
    captures square_accumulate_kernel once and replays it 3 times, and trap_kernel once, replayed once."""
    trace = tmp_path / "trace.txt"
    _assert_ok(_run(emu_build, "graph_capture", "fwd", GPT2CORE_EMU_TRACE=str(trace)), "traced graph_capture")
    lines = trace.read_text().splitlines()
    assert lines.count("square_accumulate_kernel") == 3
    assert lines.count("trap_kernel") == 1


def test_bad_schedule_falls_back_to_fwd_with_a_warning(emu_build):
    proc = _run(emu_build, "block_reduce", "sideways")
    _assert_ok(proc, "bad schedule")
    assert "GPT2CORE_EMU_SCHED" in proc.stderr


def test_ucontext_fallback():
    build = _build(ROOT / "build" / "emu-ucontext", "-DGPT2CORE_EMU_UCONTEXT=ON",
                   targets=["emu_warp_reduce", "emu_divergent_sync", "emu_block_reduce"])
    for program in ["warp_reduce", "divergent_sync", "block_reduce"]:
        for sched in ["fwd", "random:9"]:
            _assert_ok(_run(build, program, sched), f"ucontext emu_{program} under {sched}")


@pytest.mark.slow
def test_asan_ubsan_build():
    """Every program under AddressSanitizer + UBSan (fiber switches annotated for ASan)."""
    build = _build(ROOT / "build" / "emu-asan", "-DGPT2CORE_EMU_SANITIZE=ON")
    env = {"ASAN_OPTIONS": "detect_leaks=1:abort_on_error=0:detect_stack_use_after_return=1",
           "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1"}
    for program in PROGRAMS:
        for sched in ["rev", "random:3"]:
            proc = _run(build, program, sched, **env)
            _assert_ok(proc, f"ASan emu_{program} under {sched}")
            assert "Sanitizer" not in proc.stderr and "runtime error" not in proc.stderr, proc.stderr[-4000:]


@pytest.mark.parametrize("probe, kernel", [("oob_probe", "oob_kernel"), ("smem_oob_probe", "smem_oob_kernel")])
def test_asan_catches_out_of_bounds_in_a_kernel(probe, kernel):
    """The sanitizer build really checks kernel accesses to global and dynamic shared memory."""
    build = _build(ROOT / "build" / "emu-asan", "-DGPT2CORE_EMU_SANITIZE=ON", targets=[f"emu_{probe}"])
    proc = _run(build, probe, "fwd", ASAN_OPTIONS="detect_leaks=0")
    assert proc.returncode != 0
    assert "heap-buffer-overflow" in proc.stderr, proc.stderr[-4000:]
    assert kernel in proc.stderr, proc.stderr[-4000:]


def _load_check_script():
    spec = importlib.util.spec_from_file_location("check_cuda_compile", ROOT / "scripts" / "check_cuda_compile.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_compile_check_parses_ptxas_spills_and_smem():
    mod = _load_check_script()
    text = """ptxas info    : Compiling entry function '_Z3fooPf' for 'sm_80'
ptxas info    : Function properties for _Z3fooPf
    8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 49152 bytes smem, 360 bytes cmem[0]
ptxas info    : Compiling entry function '_Z3fooPf' for 'sm_90'
ptxas info    : Function properties for _Z3fooPf
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 40 registers, used 0 barriers, 360 bytes cmem[0]
"""
    funcs = {f["arch"]: f for f in mod.parse_ptxas(text)}
    assert funcs["80"]["spill_stores"] == 4 and funcs["80"]["spill_loads"] == 12
    assert funcs["80"]["regs"] == 255 and funcs["80"]["smem"] == 49152
    assert funcs["90"]["spill_stores"] == 0 and funcs["90"]["smem"] == 0 and funcs["90"]["entry"]


def test_kernels_compile_with_nvcc_for_sm80_sm90():
    """Every emulator test kernel is ordinary CUDA: nvcc -Werror, no spills, shared memory in limits.

    Incremental like the builds: a stamp in build/emu records the hash of the inputs (kernel files, the
    headers they include from csrc/emu and tests/csrc/emu, the script, nvcc's version) of the last passing run."""
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found")
    inputs = [*KERNEL_FILES, TEST_DIR / "emu_test.h", TEST_DIR / "check.h", ROOT / "csrc" / "cuda" / "portable.h",
              ROOT / "csrc" / "cuda" / "mma.cuh", ROOT / "csrc" / "cuda" / "cp_async.cuh",
              ROOT / "scripts" / "check_cuda_compile.py"]
    digest = hashlib.sha256(subprocess.run([nvcc, "--version"], capture_output=True).stdout)
    for path in inputs:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    stamp = ROOT / "build" / "emu" / "nvcc-check.stamp"
    if stamp.exists() and stamp.read_text() == digest.hexdigest():
        return
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "check_cuda_compile.py"), "-q", "--archs", "80,90",
                           *map(str, KERNEL_FILES)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    assert "OK:" in proc.stdout
    stamp.parent.mkdir(parents=True, exist_ok=True)
    stamp.write_text(digest.hexdigest())
