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
