"""Which CUDA backend this gpt2core uses, found without loading anything.

gpt2core ships the way JAX ships jax[cuda12] / jax[cuda13]: the CPU package `gpt2core`, and one plugin distribution
per CUDA major, `gpt2core-cuda12` / `gpt2core-cuda13` (import names gpt2core_cuda12 / gpt2core_cuda13), each holding
the module _C_cuda built for that major and a _build_config.py saying what it was built with, and pinning (==) the
NVIDIA wheels it was built and tested with (plugins/cuda12/pyproject.toml, plugins/cuda13/pyproject.toml). The
extras `gpt2core[cuda12]` / `gpt2core[cuda13]` install the plugin. A source build with a CUDA compiler
(`pip install .`) is all-in-one instead: its own gpt2core._C_cuda, described by gpt2core._build_config.

find() picks one:
  - this build's own CUDA module when it has one (a plugin installed beside it is ignored, and the doctor says so);
  - else the one plugin installed, whose release must be gpt2core's own (the two are built from one source: the
    table of entry points between _C and _C_cuda is plain C++, see csrc/model/cuda_plugin.h);
  - two plugins (two CUDA majors) together are refused: their NVIDIA wheels share file names (libcudnn.so.9,
    libnccl.so.2 in nvidia/cudnn/lib, nvidia/nccl/lib), so only one of them can be whole.
Finding imports the plugin's _build_config only (plain Python); NVIDIA's libraries load in gpt2core._cuda.load().
"""
from __future__ import annotations

import ctypes
import importlib
import importlib.util
import os
from dataclasses import dataclass
from types import ModuleType

from . import _build_config
from .errors import Error

MAJORS = (12, 13)


class PluginError(Error, ImportError):
    """The installed CUDA plugins cannot be used: two CUDA majors together, or a plugin from another release of
    gpt2core. The message names the packages, their versions and the pip command that fixes it."""


@dataclass(frozen=True)
class CudaBackend:
    module: str          # the extension module to import: gpt2core._C_cuda or gpt2core_cuda12._C_cuda
    config: ModuleType   # the _build_config of the build that compiled it
    dist: str            # "gpt2core" (built in) or the plugin's distribution, "gpt2core-cuda12"
    path: str            # the folder it is installed in

    @property
    def major(self) -> int:
        return int(self.config.CUDA_VERSION.split(".")[0])

    @property
    def plugin(self) -> bool:
        return self.dist != "gpt2core"

    def describe(self) -> str:
        return f"{self.dist} {getattr(self.config, 'VERSION', '?')} (CUDA {self.config.CUDA_VERSION}, {self.path})"


def version() -> str:
    """This gpt2core's release (a plugin must be the same)."""
    v = getattr(_build_config, "VERSION", "")
    if v:
        return v
    from . import _C
    return _C.build_info()["version"]


def plugin_name(major: int) -> str:
    return f"gpt2core_cuda{major}"


def dist_name(major: int) -> str:
    return f"gpt2core-cuda{major}"


def installed() -> list[tuple[int, str]]:
    """(CUDA major, folder) of each plugin package importable here, whatever its state."""
    out = []
    for major in MAJORS:
        try:
            spec = importlib.util.find_spec(plugin_name(major))
        except (ImportError, ValueError):
            spec = None
        if spec is not None and spec.submodule_search_locations:
            out.append((major, list(spec.submodule_search_locations)[0]))
    return out


def driver_version() -> int | None:
    """The CUDA version the driver supports (cuDriverGetVersion: 12040 = 12.4), None without a driver."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    v = ctypes.c_int()
    try:
        if lib.cuDriverGetVersion(ctypes.byref(v)) != 0:
            return None
    except AttributeError:
        return None
    return v.value


def _driver_major() -> int | None:
    v = driver_version()
    return None if v is None else v // 1000


def _plugin_config(major: int, path: str) -> ModuleType:
    name = plugin_name(major)
    try:
        cfg = importlib.import_module(f"{name}._build_config")
    except ImportError as e:
        raise PluginError(f"the CUDA plugin {dist_name(major)} at {path} is incomplete ({e}): "
                          f"pip install --force-reinstall --no-deps {dist_name(major)}=={version()}") from e
    mine = version()
    theirs = getattr(cfg, "VERSION", "?")
    if theirs != mine:
        raise PluginError(
            f"the CUDA plugin {dist_name(major)} {theirs} at {path} is not from this release of gpt2core ({mine}): "
            f"the two are built together and must be the same version. Fix: "
            f"pip install {dist_name(major)}=={mine} (or pip install \"gpt2core[cuda{major}]=={mine}\")")
    cuda = getattr(cfg, "CUDA_VERSION", "")
    if not cuda.startswith(f"{major}."):
        raise PluginError(f"the CUDA plugin {dist_name(major)} at {path} was built with CUDA {cuda or 'none'}, not "
                          f"{major}: pip install --force-reinstall --no-deps {dist_name(major)}=={mine}")
    return cfg


def find() -> CudaBackend | None:
    """The CUDA backend to use; None when there is none (why_none() says why and what to install); PluginError when
    the installed plugins cannot be used."""
    if _build_config.CUDA_VERSION:
        return CudaBackend("gpt2core._C_cuda", _build_config, "gpt2core", os.path.dirname(os.path.abspath(__file__)))
    plugins = installed()
    if len(plugins) > 1:
        names = " and ".join(f"{dist_name(m)} ({p})" for m, p in plugins)
        driver = _driver_major()
        if driver in MAJORS:
            keep = driver
            how = f"this machine's NVIDIA driver runs CUDA {driver}: keep {dist_name(keep)}"
        else:
            keep = max(m for m, _ in plugins)
            how = (f"keep the one for your NVIDIA driver (nvidia-smi shows its CUDA version); for CUDA {keep}"
                   + ("" if driver is None else f" (this driver: CUDA {driver})"))
        drop = [dist_name(m) for m, _ in plugins if m != keep]
        raise PluginError(
            f"gpt2core's CUDA plugins for two CUDA majors are installed together: {names}. Only one can work (their "
            f"NVIDIA wheels share file names such as libcudnn.so.9 and libnccl.so.2); {how}: "
            f"pip uninstall -y {' '.join(drop)} && pip install --force-reinstall \"gpt2core[cuda{keep}]=={version()}\"")
    if not plugins:
        return None
    major, path = plugins[0]
    cfg = _plugin_config(major, path)
    return CudaBackend(f"{plugin_name(major)}._C_cuda", cfg, dist_name(major), path)


def config() -> ModuleType:
    """The _build_config describing the CUDA backend in use (this package's when there is none or the plugins
    cannot be used: then CUDA_LIBRARIES is empty and nothing CUDA is attempted from it)."""
    try:
        b = find()
    except PluginError:
        return _build_config
    return b.config if b else _build_config


def ignored() -> list[str]:
    """Plugins installed beside a build that has its own CUDA module (which wins): for the doctor."""
    if not _build_config.CUDA_VERSION:
        return []
    return [f"{dist_name(m)} ({p})" for m, p in installed()]


def install_hint() -> str:
    """The commands that bring a CUDA backend: the plugin matching the driver's CUDA major when there is one."""
    driver = _driver_major()
    if driver in MAJORS:
        return f'pip install "gpt2core[cuda{driver}]" (this machine\'s NVIDIA driver runs CUDA {driver})'
    return ('pip install "gpt2core[cuda12]" (NVIDIA driver for CUDA 12) or pip install "gpt2core[cuda13]" '
            '(driver for CUDA 13; nvidia-smi shows which)')


def why_none() -> str:
    """Why find() found no CUDA backend, with the command that brings one."""
    skipped = getattr(_build_config, "CUDA_SKIPPED", "")
    return ("this build of gpt2core has no CUDA backend" + (f" ({skipped})" if skipped else "")
            + f" and no CUDA plugin is installed: {install_hint()}; from a source checkout: pip install "
            "./plugins/cuda12 or ./plugins/cuda13")
