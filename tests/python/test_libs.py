"""gpt2core._libs: where the CUDA module's NVIDIA libraries come from. NVIDIA's PyPI wheels (a fake
site-packages with nvidia/<pkg>/lib/<soname>, holding a tiny shared object built here) win over the system; a
library found nowhere raises MissingLibrary naming it and the pip command for the build's CUDA major."""
import ctypes
import shutil
import subprocess
import sys

import pytest

from gpt2core import _build_config, _libs


@pytest.fixture()
def fake_lib(tmp_path):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    so = tmp_path / "fake.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(so), "-x", "c", "-"], input="int gpt2core_fake(void) { return 42; }",
                   text=True, check=True)
    return so


def test_a_wheel_library_is_loaded_from_site_packages(fake_lib, tmp_path, monkeypatch):
    site = tmp_path / "site"
    lib = site / "nvidia" / "cudnn" / "lib"
    lib.mkdir(parents=True)
    real = lib / "libcudnn.so.9.27.0"
    shutil.copy(fake_lib, real)
    (lib / "libcudnn.so.9").symlink_to(real.name)
    monkeypatch.setattr(sys, "path", [str(site), *sys.path])
    monkeypatch.setattr(_build_config, "CUDA_VERSION", "12.8")
    monkeypatch.setattr(_build_config, "CUDA_LIBRARIES", ["cudnn"])
    (found,) = _libs.load_all()
    assert (found.name, found.source, found.path, found.version) == ("cudnn", "pip", str(lib / "libcudnn.so.9"), "9.27.0")
    assert ctypes.CDLL(None).gpt2core_fake() == 42  # loaded with RTLD_GLOBAL: its symbols are visible to all


def test_cuda13_wheels_share_one_lib_directory(fake_lib, tmp_path, monkeypatch):
    lib = tmp_path / "site" / "nvidia" / "cu13" / "lib"
    lib.mkdir(parents=True)
    shutil.copy(fake_lib, lib / "libcublasLt.so.13")
    monkeypatch.setattr(sys, "path", [str(tmp_path / "site"), *sys.path])
    monkeypatch.setattr(_build_config, "CUDA_VERSION", "13.0")
    found = _libs.find("cublasLt")
    assert found.source == "pip" and found.path == str(lib / "libcublasLt.so.13")


@pytest.mark.parametrize("cuda, pip", [("12.8", 'pip install "gpt2core[cuda12]" (or pip install fake-cu12)'),
                                       ("13.0", 'pip install "gpt2core[cuda13]" (or pip install fake-cu13)')])
def test_a_missing_library_names_itself_and_the_pip_command(monkeypatch, cuda, pip):
    monkeypatch.setitem(_libs._KNOWN, "fake", ("libgpt2core_absent.so.{major}", "FakeLib", "fake-cu12", "fake-cu13"))
    monkeypatch.setattr(_build_config, "CUDA_VERSION", cuda)
    monkeypatch.setattr(_build_config, "CUDA_LIBRARIES", ["fake"])
    with pytest.raises(_libs.MissingLibrary) as e:
        _libs.load_all()
    major = cuda.split(".")[0]
    assert f"needs FakeLib (libgpt2core_absent.so.{major})" in str(e.value) and str(e.value).endswith(pip)
    assert isinstance(e.value, ImportError)


NVIDIA = ("libcublas", "libcudnn", "libnccl", "libnvrtc", "libcudart", "libcuda.")


def test_the_cpu_core_links_no_nvidia_library():
    from gpt2core import _C
    needed = subprocess.run(["readelf", "-d", _C.__file__], capture_output=True, text=True, check=True).stdout
    assert "NEEDED" in needed and not [n for n in NVIDIA if n in needed], needed


CPU_ONLY = """
import sys, numpy as np, gpt2core
m = gpt2core.GPT2("tiny", seed=0)
x = np.arange(16, dtype=np.int32).reshape(2, 8)
m.forward(x, x); m.backward(); m.step(lr=1e-3)
maps = open("/proc/self/maps").read()
assert "gpt2core._C_cuda" not in sys.modules, "the CUDA module was imported for CPU work"
assert not [n for n in %r if n in maps], [ln for ln in maps.splitlines() if "lib" in ln and "nv" in ln]
try:
    gpt2core.GPT2("tiny", device="cuda")
except gpt2core.model.DeviceError as e:
    print("DeviceError:", e)
""" % (NVIDIA,)


def test_import_and_cpu_training_load_no_cuda_library_and_cuda_says_why(tmp_path):
    """With the system toolkit hidden (a private mount namespace, as root) or not: the CPU core imports and
    trains without touching a CUDA library; device='cuda' then fails with a DeviceError that says why (here: a
    missing library and its pip command, or no GPU)."""
    import os
    cmd = [sys.executable, "-c", CPU_ONLY]
    hidden = os.geteuid() == 0 and shutil.which("unshare") and os.path.isdir("/usr/local/cuda")
    if hidden:  # every /usr/local/cuda-* replaced by an empty directory, for this process only
        script = "for d in /usr/local/cuda-*; do mount --bind \"$0\" \"$d\"; done; exec \"$@\""
        cmd = ["unshare", "-m", "sh", "-c", script, str(tmp_path), *cmd]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    from gpt2core import _build_config
    if _build_config.CUDA_LIBRARIES:
        assert "DeviceError: device='cuda':" in p.stdout, p.stdout
        if hidden and not _libs._in_wheels(_libs.soname(_build_config.CUDA_LIBRARIES[0])):
            assert "found neither in NVIDIA's PyPI wheels nor on this system: pip install" in p.stdout, p.stdout
