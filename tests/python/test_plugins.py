"""gpt2core._plugins: which CUDA backend gpt2core uses, its own (an all-in-one source build) or the plugin
gpt2core-cuda12 / gpt2core-cuda13. Fake plugin packages in a temporary site folder (a gpt2core_cudaN package with the
_build_config.py a plugin build writes) stand in for installed plugins; the CPU package is this build with its
_build_config emptied of CUDA. The real plugin wheels are built and checked with NVIDIA's libraries in
.ci/cuda_pypi.sh."""
import importlib
import re
import sys
from pathlib import Path

import pytest

import gpt2core
from gpt2core import _build_config, _libs, _plugins, doctor
from gpt2core.errors import DeviceUnavailable
from gpt2core.model import DeviceError

ROOT = Path(__file__).resolve().parents[2]
MINE = _plugins.version()


def fake_plugin(site, major, version=MINE, cuda=None, libs=("cublasLt",)):
    """An installed gpt2core-cuda<major> as gpt2core sees it before loading: the package and its _build_config."""
    pkg = site / f"gpt2core_cuda{major}"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text('"""fake plugin"""\n')
    cuda = cuda or {12: "12.9", 13: "13.0"}[major]
    (pkg / "_build_config.py").write_text(
        f'VERSION = "{version}"\nDIST = "gpt2core-cuda{major}"\nCUDA_VERSION = "{cuda}"\n'
        f"CUDA_LIBRARIES = {list(libs)!r}\nCUDNN_VERSION = \"9.19.0\"\nNCCL_VERSION = \"2.28.9\"\n"
        f'NVIDIA_PINS = {{"nvidia-cublas-cu12": "12.9.1.4"}}\nCUDA_SKIPPED = ""\nCUDA_ARCHS = "75,90"\n'
        "HAS_CUDNN = True\nHAS_CUDNN_SDPA = True\nHAS_NCCL = False\n")
    importlib.invalidate_caches()
    return pkg


@pytest.fixture()
def cpu_package(tmp_path, monkeypatch):
    """This gpt2core as the CPU package (no CUDA module of its own), with an empty site folder on sys.path."""
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.setattr(sys, "path", [str(site), *sys.path])
    monkeypatch.setattr(_build_config, "CUDA_VERSION", "")
    monkeypatch.setattr(_build_config, "CUDA_LIBRARIES", [])
    monkeypatch.setattr(_build_config, "CUDA_SKIPPED", "GPT2CORE_CUDA=OFF at build time", raising=False)
    monkeypatch.setattr(_plugins, "_driver_major", lambda: None)  # no NVIDIA driver asked (the machine's varies)
    from gpt2core import _cuda
    monkeypatch.setattr(_cuda, "_loaded", None)  # as in a new process (another test may have loaded this build's)
    for var in ("CUDA_HOME", "CUDA_PATH"):
        monkeypatch.delenv(var, raising=False)
    yield site
    for name in [n for n in sys.modules if n.startswith("gpt2core_cuda")]:
        del sys.modules[name]
    importlib.invalidate_caches()


def test_no_backend_and_no_plugin_names_the_plugins_to_install(cpu_package):
    assert _plugins.find() is None
    why = _plugins.why_none()
    assert why.startswith("this build of gpt2core has no CUDA backend (GPT2CORE_CUDA=OFF at build time) and no CUDA "
                          "plugin is installed: "), why
    assert 'pip install "gpt2core[cuda12]"' in why and 'pip install "gpt2core[cuda13]"' in why
    with pytest.raises(DeviceError, match=re.escape(why)):
        gpt2core.GPT2("tiny", device="cuda")
    from gpt2core import cli
    with pytest.raises(DeviceUnavailable, match=r"--device cuda: this build of gpt2core has no CUDA backend"):
        cli.check_device_available("cuda", "--device")
    info = gpt2core.build_info()  # (its "cuda" flag is _C's, compiled in: this test's build may have one)
    assert info["cuda_version"] == "" and "cuda_plugin" not in info


def test_the_drivers_major_picks_the_plugin_to_suggest(cpu_package, monkeypatch):
    monkeypatch.setattr(_plugins, "_driver_major", lambda: 12)
    assert _plugins.install_hint() == 'pip install "gpt2core[cuda12]" (this machine\'s NVIDIA driver runs CUDA 12)'


@pytest.mark.parametrize("major", [12, 13])
def test_the_one_installed_plugin_is_the_backend_and_its_build_config_is_used(cpu_package, major):
    path = fake_plugin(cpu_package, major)
    b = _plugins.find()
    assert (b.module, b.dist, b.major, b.plugin, Path(b.path)) == (
        f"gpt2core_cuda{major}._C_cuda", f"gpt2core-cuda{major}", major, True, path)
    # the libraries are looked for with the plugin's facts: the sonames and packages of its CUDA major
    assert _libs.cuda_major() == major and _libs.soname("cublasLt") == f"libcublasLt.so.{major}"
    assert _libs.package("cudnn") == f"nvidia-cudnn-cu{major}"
    info = gpt2core.build_info()
    assert info["cuda"] and "cuda" in info["backends"] and info["cuda_archs"] == ["75", "90"]
    assert (info["cudnn"], info["cudnn_sdpa"], info["nccl"]) == (True, True, False)
    assert info["cuda_version"] == b.config.CUDA_VERSION
    assert info["cuda_plugin"].startswith(f"gpt2core-cuda{major} {MINE} (CUDA {b.config.CUDA_VERSION}, {path}")


def test_a_plugin_of_another_release_is_refused_with_the_command_that_fixes_it(cpu_package):
    fake_plugin(cpu_package, 12, version="0.0.9")
    with pytest.raises(_plugins.PluginError) as e:
        _plugins.find()
    msg = str(e.value)
    assert msg.startswith(f"the CUDA plugin gpt2core-cuda12 0.0.9 at {cpu_package / 'gpt2core_cuda12'} is not from "
                          f"this release of gpt2core ({MINE})"), msg
    assert msg.endswith(f'Fix: pip install gpt2core-cuda12=={MINE} (or pip install "gpt2core[cuda12]=={MINE}")')
    # every entry point says the same, none with a traceback of its own
    with pytest.raises(DeviceError, match="device='cuda': the CUDA plugin gpt2core-cuda12 0.0.9"):
        gpt2core.GPT2("tiny", device="cuda")
    assert gpt2core.build_info()["cuda_error"] == msg
    from gpt2core import _cuda
    with pytest.raises(ImportError, match="is not from this release of gpt2core"):
        _cuda.load()


def test_a_plugin_built_with_another_cuda_major_than_its_name_is_refused(cpu_package):
    fake_plugin(cpu_package, 13, cuda="12.9")
    with pytest.raises(_plugins.PluginError, match=r"gpt2core-cuda13 at .* was built with CUDA 12\.9, not 13: "
                                                   r"pip install --force-reinstall --no-deps gpt2core-cuda13=="):
        _plugins.find()


@pytest.mark.parametrize("driver, keep", [(None, 13), (12, 12), (13, 13)])
def test_two_majors_installed_together_are_refused(cpu_package, monkeypatch, driver, keep):
    fake_plugin(cpu_package, 12)
    fake_plugin(cpu_package, 13)
    monkeypatch.setattr(_plugins, "_driver_major", lambda: driver)
    with pytest.raises(_plugins.PluginError) as e:
        _plugins.find()
    msg = str(e.value)
    drop = 25 - keep
    assert msg.startswith("gpt2core's CUDA plugins for two CUDA majors are installed together: gpt2core-cuda12 ("
                          f"{cpu_package / 'gpt2core_cuda12'}) and gpt2core-cuda13 ({cpu_package / 'gpt2core_cuda13'})"
                          ". Only one can work"), msg
    assert msg.endswith(f'pip uninstall -y gpt2core-cuda{drop} && pip install --force-reinstall '
                        f'"gpt2core[cuda{keep}]=={MINE}"'), msg
    if driver:
        assert f"this machine's NVIDIA driver runs CUDA {driver}: keep gpt2core-cuda{keep}" in msg
    # the library search falls back to this package's (empty) facts: nothing CUDA is attempted from a conflict
    assert _plugins.config() is _build_config and _libs.cuda_major() == 0
    # the doctor: a failed check, with the same words
    lines = []
    info = gpt2core.build_info()
    assert doctor.report_libraries(lines.append, info) == "not loaded"
    assert any(ln == f"  CUDA     not loaded: {msg}" for ln in lines), lines


def test_a_build_with_its_own_cuda_module_ignores_a_plugin_and_the_doctor_says_so(cpu_package, monkeypatch):
    fake_plugin(cpu_package, 12)
    monkeypatch.setattr(_build_config, "CUDA_VERSION", "13.0")
    b = _plugins.find()
    assert (b.module, b.dist, b.plugin, b.config) == ("gpt2core._C_cuda", "gpt2core", False, _build_config)
    assert _plugins.ignored() == [f"gpt2core-cuda12 ({cpu_package / 'gpt2core_cuda12'})"]
    # the other major's plugin does not help this build: the driver advice replaces the build
    assert _libs.install_hint(12) == 'pip install --force-reinstall "gpt2core[cuda12]"'


def test_a_plugins_driver_advice_replaces_the_plugin(cpu_package):
    fake_plugin(cpu_package, 13)
    assert _libs.install_hint(12) == 'pip uninstall -y gpt2core-cuda13 && pip install "gpt2core[cuda12]"'
    assert _libs.install_hint() == 'pip install "gpt2core[cuda13]"'


def test_the_missing_library_of_a_plugin_names_the_plugins_package(cpu_package):
    """With the plugin's facts, a library found nowhere names the cu12 package and the plugin's extra (the CUDA 12
    libraries are not installed here)."""
    fake_plugin(cpu_package, 12)
    from importlib import metadata
    try:
        metadata.distribution("nvidia-cublas-cu12")
        pytest.skip("nvidia-cublas-cu12 is installed here")
    except metadata.PackageNotFoundError:
        pass
    info = gpt2core.build_info()
    assert re.search(r"needs cuBLASLt \(libcublasLt\.so\.12\), found neither in NVIDIA's PyPI wheels nor on this "
                     r"system.*: pip install \"gpt2core\[cuda12\]\" \(or pip install nvidia-cublas-cu12==12\.9\.1\.4\)",
                     info["cuda_error"]), info["cuda_error"]


def test_plugins_are_gpt2cores_release_and_pin_their_nvidia_wheels():
    """Each plugin's version is gpt2core's, gpt2core's extras pin the plugin of that version, and every NVIDIA wheel
    a plugin depends on is pinned with ==, the CUDA major's own packages only."""
    text = (ROOT / "pyproject.toml").read_text()
    version = re.search(r'^version = "([^"]+)"', text, re.M).group(1)
    for major in (12, 13):
        extra = re.search(r"^cuda%d = \[(.*?)\]$" % major, text, re.M | re.S).group(1)
        assert re.findall(r'"([a-z0-9-]+)==([0-9.]+)', extra) == [(f"gpt2core-cuda{major}", version)], extra
        plug = (ROOT / "plugins" / f"cuda{major}" / "pyproject.toml").read_text()
        assert re.search(r'^name = "([^"]+)"', plug, re.M).group(1) == f"gpt2core-cuda{major}"
        assert re.search(r'^version = "([^"]+)"', plug, re.M).group(1) == version
        assert f'GPT2CORE_CUDA_MAJOR = "{major}"' in plug and 'GPT2CORE_PLUGIN = "ON"' in plug
        deps = re.search(r"^dependencies = \[(.*?)\]$", plug, re.M | re.S).group(1)
        reqs = re.findall(r'"(nvidia-[a-z0-9-]+)([^;"]*)', deps)
        assert len(reqs) == 5 and all(spec.startswith("==") for _, spec in reqs), reqs
        for pkg, _ in reqs:
            assert pkg in {p[major] for p in (v[2] for v in _libs._KNOWN.values())}, pkg
