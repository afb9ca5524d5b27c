"""gpt2core._libs: where the CUDA module's NVIDIA libraries come from. NVIDIA's PyPI wheels (a fake
site-packages with nvidia/<pkg>/lib/<soname>, holding a tiny shared object built here) win over the system; a
library found nowhere raises MissingLibrary naming it and the pip command for the build's CUDA major."""
import ctypes
import os
import shutil
import subprocess
import sys

import pytest

from gpt2core import _build_config, _libs


def _cc():
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    return cc


def fake_so(path, body="int gpt2core_fake(void) { return 42; }"):
    """A tiny shared object at `path` (no SONAME, so it never stands in for a real library loaded by name later)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([_cc(), "-shared", "-fPIC", "-o", str(path), "-x", "c", "-"], input=body, text=True, check=True)
    return path


def cudnn_body(version, cudart):
    return (f"#include <stddef.h>\nsize_t cudnnGetVersion(void) {{ return {version}; }}\n"
            f"size_t cudnnGetCudartVersion(void) {{ return {cudart}; }}\n")


def fake_package(site, name, version, files):
    """A pip-installed package as importlib.metadata sees it: <name>-<version>.dist-info with METADATA and RECORD
    listing `files` (paths relative to `site`)."""
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "RECORD").write_text("".join(f"{f},,\n" for f in files) + f"{info.name}/RECORD,,\n")


@pytest.fixture()
def site(tmp_path, monkeypatch):
    s = tmp_path / "site"
    s.mkdir()
    monkeypatch.setattr(sys, "path", [str(s), *sys.path])
    for var in ("CUDA_HOME", "CUDA_PATH"):
        monkeypatch.delenv(var, raising=False)
    return s


def build(monkeypatch, cuda, libs, **extra):
    monkeypatch.setattr(_build_config, "CUDA_VERSION", cuda)
    monkeypatch.setattr(_build_config, "CUDA_LIBRARIES", libs)
    for k, v in {"CUDNN_VERSION": "9.19.0", "NCCL_VERSION": "2.28.9", "NVIDIA_PINS": {}, **extra}.items():
        monkeypatch.setattr(_build_config, k, v, raising=False)


CUDNN = "nvidia/cudnn/lib/libcudnn.so.9"


def test_a_wheel_library_is_found_by_its_packages_record_and_its_version_asked(site, monkeypatch):
    fake_so(site / CUDNN, cudnn_body(91902, 13000))
    fake_package(site, "nvidia-cudnn-cu13", "9.19.1.2", [CUDNN])
    build(monkeypatch, "13.0", ["cudnn"])
    (found,) = _libs.load_all()
    assert (found.name, found.source, found.path) == ("cudnn", "pip", str(site / CUDNN))
    assert (found.version, found.cuda, found.package) == ("9.19.2", "13.0", "nvidia-cudnn-cu13==9.19.1.2")


def test_the_other_majors_package_is_never_taken_for_this_builds(site, monkeypatch):
    """cu12 and cu13 cuDNN share nvidia/cudnn/lib/libcudnn.so.9: a glob would load the cu12 file into a CUDA 13
    build; the package record says it belongs to nvidia-cudnn-cu12, so it is not a candidate."""
    fake_so(site / CUDNN, cudnn_body(91900, 12090))
    fake_package(site, "nvidia-cudnn-cu12", "9.19.0.56", [CUDNN])
    build(monkeypatch, "13.0", ["cudnn"], NVIDIA_PINS={"nvidia-cudnn-cu13": "9.19.0.56"})
    monkeypatch.setattr(_libs, "_SYSTEM_DIRS", ())
    monkeypatch.setitem(_libs._KNOWN, "cudnn", ("libgpt2core_absent_cudnn.so.9", "cuDNN 9",
                                                 {12: "nvidia-cudnn-cu12", 13: "nvidia-cudnn-cu13"}))
    with pytest.raises(_libs.MissingLibrary) as e:
        _libs.load_all()
    assert "nvidia-cudnn-cu13 is not installed" in str(e.value)
    assert str(e.value).endswith('pip install "gpt2core[cuda13]" (or pip install nvidia-cudnn-cu13==9.19.0.56)')


def test_both_extras_installed_the_overwritten_file_is_a_clear_mismatch(site, monkeypatch):
    """pip install gpt2core[cuda13] over [cuda12]: both packages list libcudnn.so.9 and the file is whichever was
    installed last. What loaded says it is built for CUDA 12.9: refused with the file, versions and the fix."""
    fake_so(site / CUDNN, cudnn_body(91900, 12090))
    fake_package(site, "nvidia-cudnn-cu13", "9.19.0.56", [CUDNN])
    fake_package(site, "nvidia-cudnn-cu12", "9.19.0.56", [CUDNN])
    build(monkeypatch, "13.0", ["cudnn"], NVIDIA_PINS={"nvidia-cudnn-cu13": "9.19.0.56"})
    with pytest.raises(_libs.LibraryMismatch) as e:
        _libs.load_all()
    msg = str(e.value)
    assert f"cuDNN 9 at {site / CUDNN} does not fit this build of gpt2core" in msg
    assert "it is built for CUDA 12.9, this build of gpt2core is CUDA 13.0" in msg
    assert "found cuDNN 9 9.19.0 for CUDA 12.9, from nvidia-cudnn-cu13==9.19.0.56" in msg
    assert msg.endswith("Fix: pip uninstall -y nvidia-cudnn-cu12 && "
                        "pip install --force-reinstall --no-deps nvidia-cudnn-cu13==9.19.0.56")
    assert isinstance(e.value, ImportError)


def test_an_older_cudnn_than_the_headers_is_refused(site, monkeypatch):
    fake_so(site / CUDNN, cudnn_body(91000, 13000))
    fake_package(site, "nvidia-cudnn-cu13", "9.10.0.1", [CUDNN])
    build(monkeypatch, "13.0", ["cudnn"])
    with pytest.raises(_libs.LibraryMismatch, match=r"it is 9\.10\.0, this build was compiled against 9\.19\.0"):
        _libs.load_all()


def test_the_other_majors_uninstall_deleting_the_file_says_how_to_restore_it(site, monkeypatch):
    """pip uninstall nvidia-cudnn-cu12 deletes the file both packages list; the cu13 package is still installed,
    so 'pip install' would answer 'already satisfied': the message says --force-reinstall."""
    fake_package(site, "nvidia-cudnn-cu13", "9.19.0.56", [CUDNN])
    build(monkeypatch, "13.0", ["cudnn"], NVIDIA_PINS={"nvidia-cudnn-cu13": "9.19.0.56"})
    monkeypatch.setattr(_libs, "_SYSTEM_DIRS", ())
    monkeypatch.setitem(_libs._KNOWN, "cudnn", ("libcudnn.so.9", "cuDNN 9",
                                                 {12: "nvidia-cudnn-cu12", 13: "nvidia-cudnn-cu13"}))
    monkeypatch.setattr(_libs, "candidates", lambda name: [(p, s, k) for p, s, k in _real_candidates(name)
                                                           if s != "system"])
    with pytest.raises(_libs.MissingLibrary) as e:
        _libs.load_all()
    assert (f"nvidia-cudnn-cu13==9.19.0.56 is installed but its {site / CUDNN} is missing" in str(e.value)
            and "pip install --force-reinstall --no-deps nvidia-cudnn-cu13==9.19.0.56" in str(e.value))


_real_candidates = _libs.candidates


def test_a_broken_candidate_is_skipped_and_cuda_home_and_cuda_path_are_honoured(tmp_path, site, monkeypatch):
    """A libnvrtc.so.13 that exists but does not load (first on the path, at CUDA_HOME) is skipped with its reason;
    the one at CUDA_PATH loads; the doctor lists what was skipped."""
    broken = tmp_path / "home" / "lib64" / "libnvrtc.so.13"
    broken.parent.mkdir(parents=True)
    broken.write_bytes(b"not an ELF file " * 256)
    good = fake_so(tmp_path / "path" / "lib64" / "libnvrtc.so.13",
                   "int nvrtcVersion(int* a, int* b) { *a = 13; *b = 0; return 0; }")
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("CUDA_PATH", str(tmp_path / "path"))
    build(monkeypatch, "13.0", ["nvrtc"])
    (found,) = _libs.load_all()
    assert (found.path, found.source, found.version) == (str(good), "CUDA_PATH", "13.0")
    assert found.skipped and found.skipped[0][0] == str(broken) and "header" in found.skipped[0][1], found.skipped


def test_no_candidate_loads_lists_every_file_tried(tmp_path, site, monkeypatch):
    broken = tmp_path / "home" / "lib64" / "libgpt2core_nothing.so.13"
    broken.parent.mkdir(parents=True)
    broken.write_bytes(b"\x7fELF garbage")
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "home"))
    monkeypatch.setitem(_libs._KNOWN, "fake", ("libgpt2core_nothing.so.{major}", "FakeLib",
                                                {12: "fake-cu12", 13: "fake-cu13"}))
    build(monkeypatch, "13.0", ["fake"])
    with pytest.raises(_libs.MissingLibrary) as e:
        _libs.load_all()
    assert f"[tried: {broken}: " in str(e.value) and "fake-cu13 is not installed" in str(e.value)


@pytest.mark.parametrize("cuda, pip", [("12.8", 'pip install "gpt2core[cuda12]" (or pip install fake-cu12)'),
                                       ("13.0", 'pip install "gpt2core[cuda13]" (or pip install fake-cu13)')])
def test_a_missing_library_names_itself_and_the_pip_command(site, monkeypatch, cuda, pip):
    monkeypatch.setitem(_libs._KNOWN, "fake", ("libgpt2core_absent.so.{major}", "FakeLib",
                                                {12: "fake-cu12", 13: "fake-cu13"}))
    build(monkeypatch, cuda, ["fake"])
    with pytest.raises(_libs.MissingLibrary) as e:
        _libs.load_all()
    major = cuda.split(".")[0]
    assert f"needs FakeLib (libgpt2core_absent.so.{major})" in str(e.value) and str(e.value).endswith(pip)
    assert isinstance(e.value, ImportError)


DRIVER = "int cuDriverGetVersion(int* v) {{ *v = {v}; return 0; }}\nint cuInit(unsigned f) {{ return 100; }}\n"


@pytest.mark.parametrize("driver, build_cuda, want", [
    (12040, "13.0", "this build of gpt2core needs a driver for CUDA >= 13.0 (yours: CUDA 12.4, driver "),
    (12040, "12.9", ""),
    (13000, "12.9", ""),
    (11080, "12.9", "this build of gpt2core needs a driver for CUDA >= 12.0 (yours: CUDA 11.8, driver "),
    (None, "13.0", "no NVIDIA driver (libcuda.so.1 not found)"),
])
def test_the_driver_is_checked_against_the_build(tmp_path, driver, build_cuda, want):
    """A stub libcuda.so.1 reporting an older CUDA (the only way to have a driver on a machine without a GPU), or
    none at all: the same sentence the model, train and the doctor show."""
    env = dict(os.environ)
    if driver is not None:
        fake_so(tmp_path / "drv" / "libcuda.so.1", DRIVER.format(v=driver))
        env["LD_LIBRARY_PATH"] = str(tmp_path / "drv")
    elif subprocess.run([sys.executable, "-c", "import ctypes; ctypes.CDLL('libcuda.so.1')"],
                        capture_output=True).returncode == 0:
        pytest.skip("this machine has an NVIDIA driver")
    code = (f"from gpt2core import _build_config, _libs; _build_config.CUDA_VERSION = {build_cuda!r}; "
            "print(_libs.driver_problem())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert out.startswith(want) if want else out.strip() == "", out
    if want and driver == 12040:
        assert out.strip().endswith('; install the CUDA 12 build: pip install --force-reinstall "gpt2core[cuda12]"'), out


def test_device_cuda_without_a_driver_says_so_not_insufficient_driver(tmp_path):
    from gpt2core import _C
    if "cuda" not in _C.build_info()["backends"]:
        pytest.skip("no CUDA backend in this build")
    if subprocess.run([sys.executable, "-c", "import ctypes; ctypes.CDLL('libcuda.so.1')"],
                      capture_output=True).returncode == 0:
        pytest.skip("this machine has an NVIDIA driver")
    p = subprocess.run([sys.executable, "-c", "import gpt2core; gpt2core.GPT2('tiny', device='cuda')"],
                       capture_output=True, text=True)
    assert p.returncode != 0
    assert "DeviceError: device='cuda': no NVIDIA driver (libcuda.so.1 not found)" in p.stderr, p.stderr
    stub = fake_so(tmp_path / "drv" / "libcuda.so.1", DRIVER.format(v=11080))
    p = subprocess.run([sys.executable, "-c", "import gpt2core; gpt2core.GPT2('tiny', device='cuda')"],
                       capture_output=True, text=True, env=dict(os.environ, LD_LIBRARY_PATH=str(stub.parent)))
    assert "needs a driver for CUDA >= " in p.stderr and "(yours: CUDA 11.8" in p.stderr, p.stderr


def test_extras_are_exact_pins_and_ci_installs_the_same():
    """Each CUDA plugin (plugins/cuda<major>/pyproject.toml, installed by the extra gpt2core[cuda<major>]) pins every
    NVIDIA wheel with ==, and .ci/cuda_pypi.sh installs those same versions (no other)."""
    import re
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    ci = "\n".join(ln for ln in (root / ".ci" / "cuda_pypi.sh").read_text().splitlines() if "grep" not in ln)
    for major in (12, 13):
        text = (root / "plugins" / f"cuda{major}" / "pyproject.toml").read_text()
        block = re.search(r"^dependencies = \[(.*?)\]$", text, re.M | re.S).group(1)
        reqs = re.findall(r'"(nvidia-[a-z0-9-]+)([^;"]*)', block)
        assert len(reqs) == 5 and all(spec.startswith("==") for _, spec in reqs), reqs
        for pkg, spec in reqs:
            used = re.findall(re.escape(pkg) + r"(==[0-9.]+)?(?=[\s\\\"]|$)", ci)
            assert used and all(u == spec for u in used), (pkg, spec, used)


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
from gpt2core import _cuda
try:
    _cuda.load()
except ImportError as e:
    print("libraries:", e)
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
        if not _libs.driver():
            assert "DeviceError: device='cuda': no NVIDIA driver (libcuda.so.1 not found)" in p.stdout, p.stdout
        if hidden and _libs.candidates(_build_config.CUDA_LIBRARIES[0])[0][1] != "pip":
            assert "found neither in NVIDIA's PyPI wheels nor on this system" in p.stdout, p.stdout
            assert f": {_libs.install_hint()} (or pip install " in p.stdout, p.stdout


def test_train_with_device_cuda_says_the_drivers_problem_in_one_line_exit_2(tmp_path):
    """gpt2core-train --device cuda on a machine without a usable driver: one line, exit 2, the words the model and
    the doctor use (here: a stub driver too old for this build, or none)."""
    from gpt2core import _C
    if "cuda" not in _C.build_info()["backends"] or _libs.driver():
        pytest.skip("needs a CUDA build on a machine without an NVIDIA driver")
    stub = fake_so(tmp_path / "drv" / "libcuda.so.1", DRIVER.format(v=(_libs.cuda_major() - 1) * 1000 + 40))
    for env, want in (({}, "no NVIDIA driver (libcuda.so.1 not found)"),
                      ({"LD_LIBRARY_PATH": str(stub.parent)}, "this build of gpt2core needs a driver for CUDA >= ")):
        p = subprocess.run([sys.executable, "-m", "gpt2core.train", "--device", "cuda", "--steps", "1"],
                           capture_output=True, text=True, env=dict(os.environ, **env), cwd=tmp_path, timeout=120)
        assert p.returncode == 2, p.stderr
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and want in lines[0] and "Traceback" not in p.stderr, p.stderr
