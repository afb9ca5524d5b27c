"""The self-check command (gpt2core.doctor): on this machine (CPU only) it reports the build, the libraries it
loaded with their paths, why there is no GPU, and checks the CPU's training steps against float64; a failing
check makes it exit 1."""
import subprocess
import sys

import pytest

from gpt2core import _C, doctor


def test_doctor_reports_and_passes_here():
    p = subprocess.run([sys.executable, "-m", "gpt2core.doctor", "--seconds", "0"], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    out = p.stdout
    assert "compiled: backends cpu" in out and f"CPU code: {_C.cpu_isa()}" in out
    lib = next(ln for ln in out.splitlines() if ln.strip().startswith("BLAS"))
    assert "/" in lib and "openblas" in lib.lower(), lib          # the path of the library actually loaded
    assert "OpenMP" in out and "libgomp" in out
    from gpt2core import _libs
    why = _libs.driver_problem() or _C.cuda_status()
    if why:  # the driver's problem first, in the words GPT2(device='cuda') uses
        assert any(f"GPU: {w}" in out for w in (f"none usable ({why})", "this build has no CUDA backend")), out
    if _C.build_info()["cuda"] and not _libs.driver():  # no GPU here: a library problem is reported, not failed
        assert "FAIL: an NVIDIA GPU is present" not in out
    assert "check cpu (fp32): 4 training steps" in out and ": OK" in out
    assert out.rstrip().endswith("all checks passed")


def test_a_failing_check_exits_1(monkeypatch, capsys):
    monkeypatch.setitem(doctor.LOSS_RTOL, "fp32", 0.0)  # no fp32 run matches float64 exactly
    assert doctor.main(["--seconds", "0"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and out.rstrip().endswith("SOME CHECKS FAILED")


@pytest.mark.skipif(not _C.cuda_status() == "", reason="needs a GPU")
def test_doctor_checks_and_times_the_gpu():
    p = subprocess.run([sys.executable, "-m", "gpt2core.doctor", "--seconds", "3"], capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "check cuda (" in p.stdout and "speed cuda: d12" in p.stdout and "tokens/s" in p.stdout
