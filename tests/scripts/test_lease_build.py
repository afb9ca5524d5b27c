"""scripts/lease_build.sh (issue 48), the lease's wheel: its arguments (each mistake a one-line error, exit 2; --plan
shows what a good command line would build), and, opt-in, the whole CPU-only path: `pip wheel` (build isolation, so
PyPI), auditwheel's repair, the dependency wheels, an import in a fresh venv and the commit file. That path takes
minutes on 2 cores, which .ci/wheel.sh already spends on the same repair in CI, so it runs only with
GPT2CORE_TEST_LEASE_BUILD=1 (a test-tool knob)."""
import os
import subprocess
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "lease_build.sh"
PY = subprocess.run(["bash", "-c", "command -v python3"], capture_output=True, text=True).stdout.strip()


def run(*args, timeout=60):
    return subprocess.run([str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("args, msg", [
    ([], "ARCH is required"),
    (["abc"], "ARCH must be a CUDA architecture (75, 80, 86, 89, 90, 100, 120, sm_90) or cpu; got 'abc'"),
    (["sm_9x"], "got 'sm_9x'"),
    (["90a"], "got '90a'"),
    (["9"], "got '9'"),
    (["1000"], "got '1000'"),
    (["90", "80"], "one ARCH only (got 90 and 80)"),
    (["90", "--bogus"], "unknown option --bogus"),
    (["90", "--python"], "--python needs a path"),
    (["90", "--out"], "--out needs a folder"),
    (["90", "--python", "/nonexistent/python3"], "--python /nonexistent/python3: not an executable"),
    (["90", "--python", "/bin/false"], "--python /bin/false: could not run it"),
])
def test_bad_arguments_are_one_line_errors(args, msg):
    r = run(*args)
    assert r.returncode == 2 and r.stdout == "", (r.stdout, r.stderr)
    assert r.stderr.strip().splitlines()[-1].startswith("lease_build.sh: ") and msg in r.stderr, r.stderr


@pytest.mark.parametrize("arch, switches", [("90", "GPT2CORE_CUDA=ON GPT2CORE_CUDA_ARCHS=90"),
                                            ("sm_90", "GPT2CORE_CUDA=ON GPT2CORE_CUDA_ARCHS=90"),
                                            ("75", "GPT2CORE_CUDA=ON GPT2CORE_CUDA_ARCHS=75"),
                                            ("120", "GPT2CORE_CUDA=ON GPT2CORE_CUDA_ARCHS=120"),
                                            ("cpu", "GPT2CORE_CUDA=OFF")])
def test_plan_of_good_command_lines(arch, switches, tmp_path):
    r = run(arch, "--python", PY, "--out", tmp_path / "w", "--no-deps", "--plan")
    assert r.returncode == 0, r.stderr
    tag = subprocess.run([PY, "-c", "import sys; print(f'cp{sys.version_info[0]}{sys.version_info[1]}')"],
                         capture_output=True, text=True).stdout.strip()
    a = arch.removeprefix("sm_")
    assert r.stdout.strip() == (f"python {PY} ({tag}); {switches}; build folder {ROOT}/build/lease-{tag}-{a}; "
                                f"wheels {tmp_path / 'w'}; dependency wheels no; import check yes")
    assert not (tmp_path / "w").exists()  # --plan builds nothing


def test_help_prints_the_usage():
    r = run("--help")
    assert r.returncode == 0 and "scripts/lease_build.sh ARCH" in r.stderr and "--plan" in r.stderr


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("GPT2CORE_TEST_LEASE_BUILD") != "1",
                    reason="minutes of compiling and PyPI: set GPT2CORE_TEST_LEASE_BUILD=1")
def test_cpu_build_is_repaired_imports_and_records_the_commit(tmp_path):
    from gpt2core.runtime.calibrate import code_commit
    out = tmp_path / "w"
    r = run("cpu", "--python", PY, "--out", out, timeout=3000)
    assert r.returncode == 0, r.stderr[-4000:]
    whl = Path(r.stdout.strip().splitlines()[-1])
    assert whl.parent == out and whl.exists() and "manylinux" in whl.name
    names = zipfile.ZipFile(whl).namelist()
    if "Gloo True" in r.stderr:  # a build with Gloo carries it (the fourth lease's wheel did not)
        assert any(n.startswith("gpt2core.libs/libgloo") for n in names), names
    assert "lease_build: imports: backends ['cpu']" in r.stderr
    assert any(p.name.startswith("scipy_openblas32-") for p in (out / "deps").iterdir())
    assert (out / "COMMIT").read_text().strip() == code_commit(ROOT)
