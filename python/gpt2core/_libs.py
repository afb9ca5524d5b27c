"""NVIDIA's libraries for the CUDA module, found at run time the way PyTorch, JAX's CUDA plugin and CuPy find them.

Where each library comes from, first found wins:
  1. NVIDIA's PyPI wheels (`pip install "gpt2core[cuda12]"` or `"gpt2core[cuda13]"`): <sys.path entry>/nvidia/*/lib/
     (nvidia/cublas/lib, nvidia/cudnn/lib, ... for CUDA 12; nvidia/cu13/lib for CUDA 13);
  2. a system install: the dynamic loader's own search (ld.so.conf, LD_LIBRARY_PATH), then /usr/local/cuda.
Each one is loaded by path with RTLD_GLOBAL before the CUDA module, so that the module's dependencies (by soname)
resolve to it. What the module needs comes from the build (gpt2core._build_config, written by CMake).
"""
from __future__ import annotations

import ctypes
import glob
import os
import sys
from dataclasses import dataclass

from . import _build_config
from .errors import Error

# name in _build_config.CUDA_LIBRARIES -> (soname, what it is, PyPI package for CUDA 12, for CUDA 13)
_KNOWN = {
    "cudart": ("libcudart.so.{major}", "the CUDA runtime", "nvidia-cuda-runtime-cu12", "nvidia-cuda-runtime"),
    "cublasLt": ("libcublasLt.so.{major}", "cuBLASLt", "nvidia-cublas-cu12", "nvidia-cublas"),
    "nvrtc": ("libnvrtc.so.{major}", "NVRTC", "nvidia-cuda-nvrtc-cu12", "nvidia-cuda-nvrtc"),
    "cudnn": ("libcudnn.so.9", "cuDNN 9", "nvidia-cudnn-cu12", "nvidia-cudnn-cu13"),
    "nccl": ("libnccl.so.2", "NCCL", "nvidia-nccl-cu12", "nvidia-nccl-cu13"),
}
_SYSTEM_DIRS = ("/usr/local/cuda/lib64", "/usr/local/cuda/targets/x86_64-linux/lib",
                "/usr/local/cuda/targets/sbsa-linux/lib")


class MissingLibrary(Error, ImportError):
    """A library the CUDA module links was found neither in NVIDIA's PyPI wheels nor on the system."""


@dataclass
class Found:
    name: str       # as in _build_config.CUDA_LIBRARIES
    soname: str
    path: str       # the file loaded
    source: str     # "pip" (an NVIDIA wheel) or "system"
    version: str    # from the file's real name (libcudnn.so.9.19.0 -> 9.19.0) or its wheel's version


def cuda_major() -> int:
    return int(_build_config.CUDA_VERSION.split(".")[0]) if _build_config.CUDA_VERSION else 0


def install_hint() -> str:
    major = cuda_major()
    return (f'pip install "gpt2core[cuda{major}]"' if major in (12, 13)
            else "install the NVIDIA libraries of this CUDA version")


def soname(name: str) -> str:
    return _KNOWN[name][0].format(major=cuda_major())


def _wheel_version(path: str) -> str:
    """The version of the NVIDIA wheel that installed `path`, or ''."""
    from importlib import metadata
    for pkg in _KNOWN[next(n for n in _KNOWN if soname(n) == os.path.basename(path))][2:]:
        try:
            dist = metadata.distribution(pkg)
        except metadata.PackageNotFoundError:
            continue
        if any(os.path.basename(str(f)) == os.path.basename(path) for f in dist.files or []):
            return dist.version
    return ""


def _version(path: str, so: str) -> str:
    real = os.path.basename(os.path.realpath(path))
    if real.startswith(so) and len(real) > len(so) + 1:
        return so.rsplit(".so.", 1)[1] + real[len(so):]   # libcudnn.so.9 -> libcudnn.so.9.19.0: 9.19.0
    return _wheel_version(path) or so.rsplit(".so.", 1)[1]


def _in_wheels(so: str) -> str | None:
    for entry in sys.path:
        hits = sorted(glob.glob(os.path.join(entry or ".", "nvidia", "*", "lib", so)))
        if hits:
            return hits[0]
    return None


def _loaded_path(so: str) -> str:
    """Where the dynamic loader found `so` (after loading it by name)."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1]
                if os.path.basename(path).startswith(so):
                    return path
    except OSError:
        pass
    return so


def find(name: str) -> Found | None:
    """Load library `name` (see _KNOWN) from the wheels, else the system; None when it is nowhere."""
    so = soname(name)
    path = _in_wheels(so)
    if path:
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        return Found(name, so, path, "pip", _version(path, so))
    for candidate in (so, *(os.path.join(d, so) for d in _SYSTEM_DIRS)):
        try:
            ctypes.CDLL(candidate, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        path = _loaded_path(so)
        return Found(name, so, path, "system", _version(path, so))
    return None


def driver() -> str | None:
    """The path of the NVIDIA driver's CUDA library (libcuda.so.1, installed with the driver, never by pip), or
    None on a machine without an NVIDIA driver."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    return _loaded_path("libcuda.so.1")


def load_all() -> list[Found]:
    """Load every library the CUDA module links, or raise MissingLibrary naming the first missing one and the
    pip command that provides it."""
    found = []
    for name in _build_config.CUDA_LIBRARIES:
        f = find(name)
        if f is None:
            so, what, pkg12, pkg13 = _KNOWN[name]
            pkg = {12: pkg12, 13: pkg13}.get(cuda_major(), "")
            raise MissingLibrary(
                f"gpt2core's CUDA backend (built with CUDA {_build_config.CUDA_VERSION}) needs {what} "
                f"({soname(name)}), found neither in NVIDIA's PyPI wheels nor on this system: {install_hint()}"
                + (f" (or pip install {pkg})" if pkg else ""))
        found.append(f)
    return found
