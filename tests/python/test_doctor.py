"""The self-check command (gpt2core.doctor): on this machine (CPU only) it reports the build, the libraries it
loaded with their paths, why there is no GPU, and checks the CPU's training steps against float64; a failing
check makes it exit 1."""
import json
import subprocess
import sys
import time
from pathlib import Path

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
    assert steps >= 2 and 0.5 <= seconds < 30


@pytest.mark.skipif(not _C.cuda_status() == "", reason="needs a GPU")
def test_doctor_checks_and_times_the_gpu():
    p = subprocess.run([sys.executable, "-m", "gpt2core.doctor", "--seconds", "3"], capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "check cuda (" in p.stdout and "speed cuda: d12" in p.stdout and "tokens/s" in p.stdout


def test_calibrate_without_a_gpu_runs_the_cpu_part_says_so_once_and_exits_0(tmp_path):
    """`--calibrate` here: the doctor step runs (bounded, in a subprocess), every GPU step is skipped, one line says
    why, and the report file (JSON) and its summary (.txt) are written."""
    if _C.cuda_status() == "":
        pytest.skip("a GPU is usable here: the GPU steps would run")
    rep = tmp_path / "cal.json"
    p = subprocess.run([sys.executable, "-m", "gpt2core.doctor", "--calibrate", "--report", str(rep)],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    assert sum("no usable GPU" in line for line in p.stdout.splitlines()) == 1
    j = json.loads(rep.read_text())
    assert j["gpu"] is False and j["steps"]["doctor"]["status"] == "ok"
    assert j["steps"]["doctor"]["result"]["ok"] is True
    assert any("check cpu (fp32)" in line for line in j["steps"]["doctor"]["result"]["lines"])
    from gpt2core.calibrate import GPU_STEPS, STEPS
    assert [s[0] for s in STEPS][0] == "doctor" and all(j["steps"][s]["status"] == "skipped" for s in GPU_STEPS)
    assert "doctor" in rep.with_suffix(".txt").read_text()


def test_calibrate_bounds_each_step_in_time(tmp_path):
    """A step past its limit is killed and reported as a timeout (and the command's status says a step failed)."""
    from gpt2core import calibrate
    lines = []
    t0 = time.perf_counter()
    status = calibrate.calibrate(tmp_path / "r.json", lines.append, steps=[("doctor", "checks", 0.01)], gpu=False)  # a new Python process alone takes longer
    assert time.perf_counter() - t0 < 30
    j = json.loads((tmp_path / "r.json").read_text())
    assert status == 1 and j["steps"]["doctor"]["status"] == "timeout" and j["steps"]["doctor"]["limit_s"] == 0.01


def test_calibrate_d12_step_keeps_its_timings_when_the_model_side_times_out(monkeypatch):
    """On the first H100 the d12_step's modelled side (scripts/gpu_model.py, which compiles the CUDA emulator first)
    ran past the step's bound, and the kill took the measured rows with it. The measured rows must survive a model
    timeout, and the report must say why the model is missing."""
    from gpt2core import calibrate

    monkeypatch.setattr(calibrate, "_d12_timing", lambda att: {"attention": att, "ms_per_step": 1.0})
    monkeypatch.setattr(calibrate, "ROOT", Path(__file__).resolve().parents[2])  # the checkout: scripts/gpu_model.py

    def slow(cmd, **kw):
        assert kw["timeout"] == calibrate.MODEL_SECONDS
        raise subprocess.TimeoutExpired(cmd, kw["timeout"])

    monkeypatch.setattr(calibrate.subprocess, "run", slow)
    out = calibrate.step_d12_step()
    assert [r["attention"] for r in out["runs"]] == ["cudnn", "flash"]
    assert out["model"].startswith("skipped:") and "gpu_model.py" in out["model"]
