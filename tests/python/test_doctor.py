"""The self-check command (gpt2core.doctor): on this machine (CPU only) it reports the build, the libraries it
loaded with their paths, why there is no GPU, and checks the CPU's training steps against float64; a failing
check makes it exit 1."""
import json
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


def test_the_speed_probe_ends_after_its_seconds():
    """The probe's clock starts once, after two warm-up steps (it restarted every two steps, so the doctor never
    ended on a GPU: found on an H200). On the CPU with the tiny preset: 0.5 s of steps, then one line."""
    code = ("import time; from gpt2core import doctor; t = time.perf_counter(); "
            "n = doctor.speed_probe(print, 'cpu', 0.5, preset='tiny', B=2, T=32); "
            "print('steps', n, 'seconds', time.perf_counter() - t)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    speed, end = p.stdout.strip().splitlines()
    assert speed.startswith("speed cpu: tiny B=2 T=32 fp32:") and "tokens/s" in speed and "MFU: CPU" in speed
    steps, seconds = int(end.split()[1]), float(end.split()[3])
    assert steps >= 1 and 0.5 <= seconds < 30  # one timed step at least (a loaded machine takes ~2 s for one)


@pytest.mark.skipif(not _C.cuda_status() == "", reason="needs a GPU")
def test_doctor_checks_and_times_the_gpu():
    p = subprocess.run([sys.executable, "-m", "gpt2core.doctor", "--seconds", "3"], capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "check cuda (" in p.stdout and "speed cuda: d12" in p.stdout and "tokens/s" in p.stdout


def test_calibrate_without_a_gpu_runs_the_cpu_part_says_so_once_and_exits_0(tmp_path):
    """`--calibrate` here: the lease driver (gpt2core.runtime.calibrate; its own tests: test_calibrate.py) runs the
    doctor step (bounded, in a subprocess), skips every GPU step saying why, one line says there is no GPU, and the
    report file (the driver's exact schema) and its summary (.txt) are written."""
    if _C.cuda_status() == "":
        pytest.skip("a GPU is usable here: the GPU steps would run")
    rep = tmp_path / "cal.json"
    p = subprocess.run([sys.executable, "-m", "gpt2core.doctor", "--calibrate", "--report", str(rep)],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    assert sum("no usable GPU" in line for line in p.stdout.splitlines()) == 1
    j = json.loads(rep.read_text())
    assert set(j) == {"gpu", "commit", "steps"} and j["gpu"] is None
    steps = j["steps"]
    assert list(steps)[0] == "doctor" and steps["doctor"]["status"] == "ok"
    assert steps["doctor"]["rows"][0]["ok"] is True
    assert any("check cpu (fp32)" in line for line in steps["doctor"]["rows"][0]["lines"])
    assert len(steps) > 10 and all(st["status"] == "skipped" and "no usable GPU" in st["rows"][0]["skipped"]
                                   for n, st in steps.items() if n != "doctor")
    assert "doctor ok" in rep.with_suffix(".txt").read_text()
    assert list((tmp_path / "cal").glob("*_cpu_*.md"))  # the page beside the report: a CPU run is no GPU report
