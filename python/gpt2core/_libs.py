"""NVIDIA's libraries for the CUDA module: found, loaded and then *checked*, the way PyTorch and JAX's CUDA plugin do.

Where each library comes from, first loadable candidate wins:
  1. the PyPI package of the build's CUDA major (`pip install "gpt2core[cuda12]"` / `"gpt2core[cuda13]"`), found
     through the package's own metadata (its installed file list), never a glob over nvidia/*/lib: cuDNN and NCCL
     have the same file names in the cu12 and cu13 packages (nvidia/cudnn/lib/libcudnn.so.9), so only the
     package record says which one a file belongs to;
  2. a toolkit at $CUDA_HOME, then $CUDA_PATH (lib64/, lib/, targets/<arch>/lib);
  3. the dynamic loader's own search (ld.so.conf, LD_LIBRARY_PATH), then /usr/local/cuda.
A candidate that exists but does not load is skipped (the error lists every file tried and why). Each library is
loaded by path with RTLD_GLOBAL before the CUDA module, so the module's dependencies (by soname) resolve to it.

Then what actually loaded is asked for its version (cudaRuntimeGetVersion, cublasLtGetVersion and
cublasLtGetCudartVersion, nvrtcVersion, cudnnGetVersion and cudnnGetCudartVersion, ncclGetVersion and the CUDA
release NCCL's binary names) and checked against what the build needs (the _build_config of the CUDA backend in
use, gpt2core's own or the installed plugin's, gpt2core._plugins; written by CMake from the headers it compiled against): the same CUDA major everywhere, cuDNN and NCCL of the same major and no
older than the headers. A mismatch is a LibraryMismatch naming the library, the file, the version found, the version
needed and the command that fixes it. The driver (libcuda.so.1, installed with the NVIDIA driver, never by pip) is
checked the same way: `driver_problem()`.
"""
from __future__ import annotations

import ctypes
import os
import re
from dataclasses import dataclass, field

from . import _plugins
from .errors import Error


def _cfg():
    """The _build_config of the CUDA backend in use: this build's, or the installed plugin's (gpt2core._plugins)."""
    return _plugins.config()

# name in _build_config.CUDA_LIBRARIES -> (soname, what it is, {CUDA major: the PyPI package that ships it})
_KNOWN = {
    "cudart": ("libcudart.so.{major}", "the CUDA runtime",
               {12: "nvidia-cuda-runtime-cu12", 13: "nvidia-cuda-runtime"}),
    "cublasLt": ("libcublasLt.so.{major}", "cuBLASLt", {12: "nvidia-cublas-cu12", 13: "nvidia-cublas"}),
    "nvrtc": ("libnvrtc.so.{major}", "NVRTC", {12: "nvidia-cuda-nvrtc-cu12", 13: "nvidia-cuda-nvrtc"}),
    "cudnn": ("libcudnn.so.9", "cuDNN 9", {12: "nvidia-cudnn-cu12", 13: "nvidia-cudnn-cu13"}),
    "nccl": ("libnccl.so.2", "NCCL", {12: "nvidia-nccl-cu12", 13: "nvidia-nccl-cu13"}),
}
_SYSTEM_DIRS = ("/usr/local/cuda/lib64", "/usr/local/cuda/targets/x86_64-linux/lib",
                "/usr/local/cuda/targets/sbsa-linux/lib")


class MissingLibrary(Error, ImportError):
    """A library the CUDA module links was found nowhere (or no candidate loaded): the message lists what was tried
    and the pip command that provides it."""


class LibraryMismatch(Error, ImportError):
    """A library loaded, but it is not the version this build needs (another CUDA major, an older cuDNN/NCCL):
    the message names the file, the version found, the version needed and the command that fixes it."""


@dataclass
class Found:
    name: str       # as in _build_config.CUDA_LIBRARIES
    soname: str
    path: str       # the file loaded
    source: str     # "pip" (the build's NVIDIA package), "CUDA_HOME", "CUDA_PATH" or "system"
    version: str    # what the loaded library says of itself (e.g. cuDNN 9.19.0), checked against the build
    package: str = ""        # the PyPI package (name==version) the file belongs to, when it came from one
    cuda: str = ""           # the CUDA runtime the library was built for (cuDNN, cuBLASLt, NCCL), e.g. 12.9
    skipped: list = field(default_factory=list)  # (path, why) of candidates tried before it


def cuda_major() -> int:
    return int(_cfg().CUDA_VERSION.split(".")[0]) if _cfg().CUDA_VERSION else 0


def install_hint(major: int | None = None) -> str:
    """The command that brings the NVIDIA libraries (and the CUDA module) of CUDA `major`, the build's by default:
    the plugin gpt2core[cudaN], which pins them (beside an all-in-one build of the same major the plugin is unused
    but brings the same pinned wheels)."""
    own = cuda_major()
    major = own if major is None else major
    if major not in (12, 13):
        return "install the NVIDIA libraries of this CUDA version"
    try:
        backend = _plugins.find()
    except _plugins.PluginError:
        backend = None
    cmd = f'pip install "gpt2core[cuda{major}]"'
    if backend is not None and backend.plugin and major != own:  # the other major's plugin replaces this one
        cmd = f"pip uninstall -y {backend.dist} && " + cmd
    elif backend is not None and major != own:  # this all-in-one build is replaced by the CPU package + plugin
        cmd = f'pip install --force-reinstall "gpt2core[cuda{major}]"'
    return cmd


def soname(name: str) -> str:
    return _KNOWN[name][0].format(major=cuda_major())


def package(name: str, major: int | None = None) -> str:
    """The PyPI package that ships library `name` for CUDA `major` (the build's by default), '' if none."""
    return _KNOWN[name][2].get(cuda_major() if major is None else major, "")


def pinned(pkg: str) -> str:
    """`pkg==version` with the version this build was tested with (_build_config.NVIDIA_PINS), else `pkg`."""
    pins = getattr(_cfg(), "NVIDIA_PINS", {}) or {}
    return f"{pkg}=={pins[pkg]}" if pkg in pins else pkg


# ------------------------------------------------------------------------------------------------ candidates
def _in_package(pkg: str, so: str) -> tuple[str | None, str]:
    """(path, note): the file `so` as installed by PyPI package `pkg` (its RECORD), or (None, why not)."""
    from importlib import metadata
    if not pkg:
        return None, ""
    try:
        dist = metadata.distribution(pkg)
    except metadata.PackageNotFoundError:
        return None, f"{pkg} is not installed"
    for f in dist.files or []:
        if f.name == so:
            path = os.path.abspath(str(f.locate()))
            if os.path.exists(path):
                return path, f"{pkg}=={dist.version}"
            return None, (f"{pkg}=={dist.version} is installed but its {path} is missing (another package that "
                          f"shares the file, e.g. the other CUDA major's, removed it): "
                          f"pip install --force-reinstall --no-deps {pinned(pkg)}")
    return None, f"{pkg}=={dist.version} has no {so}"


def _home_dirs() -> list[tuple[str, str]]:
    out = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        base = os.environ.get(var)
        if base:
            for sub in ("lib64", "lib", "targets/x86_64-linux/lib", "targets/sbsa-linux/lib"):
                out.append((var, os.path.join(base, sub)))
    return out


def candidates(name: str) -> list[tuple[str, str, str]]:
    """(path or soname, source, package) in the order they are tried."""
    so = soname(name)
    out = []
    path, note = _in_package(package(name), so)
    if path:
        out.append((path, "pip", note))
    for var, d in _home_dirs():
        if os.path.exists(os.path.join(d, so)):
            out.append((os.path.join(d, so), var, ""))
    out.append((so, "system", ""))
    out += [(os.path.join(d, so), "system", "") for d in _SYSTEM_DIRS if os.path.exists(os.path.join(d, so))]
    return out


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


# ------------------------------------------------------------------------------------------------ versions
def _ver(code: int, base: int = 1000) -> str:
    """CUDA's version codes: 12090 -> 12.9 (base 1000: major*1000 + minor*10)."""
    return f"{code // base}.{code % base // 10}"


def _cudnn_ver(code: int) -> str:
    return f"{code // 10000}.{code % 10000 // 100}.{code % 100}"   # cuDNN 9: major*10000 + minor*100 + patch


def _nccl_cuda(path: str) -> str:
    """The CUDA release NCCL was built for, from its banner ("NCCL version 2.27.3+cuda12.9") in the file."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return ""
    m = re.search(rb"\+cuda(\d+)\.(\d+)", data)
    return f"{int(m.group(1))}.{int(m.group(2))}" if m else ""


def loaded_version(name: str, lib: ctypes.CDLL, path: str) -> tuple[str, str]:
    """(version, CUDA release it was built for) of a loaded library, from its own API."""
    v = ctypes.c_int()
    if name == "cudart":
        lib.cudaRuntimeGetVersion(ctypes.byref(v))
        return _ver(v.value), _ver(v.value)
    if name == "cublasLt":
        lib.cublasLtGetVersion.restype = ctypes.c_size_t
        lib.cublasLtGetCudartVersion.restype = ctypes.c_size_t
        code = lib.cublasLtGetVersion()
        return f"{code // 10000}.{code % 10000 // 100}.{code % 100}", _ver(lib.cublasLtGetCudartVersion())
    if name == "nvrtc":
        mi = ctypes.c_int()
        lib.nvrtcVersion(ctypes.byref(v), ctypes.byref(mi))
        return f"{v.value}.{mi.value}", f"{v.value}.{mi.value}"
    if name == "cudnn":
        lib.cudnnGetVersion.restype = ctypes.c_size_t
        lib.cudnnGetCudartVersion.restype = ctypes.c_size_t
        return _cudnn_ver(lib.cudnnGetVersion()), _ver(lib.cudnnGetCudartVersion())
    if name == "nccl":
        lib.ncclGetVersion(ctypes.byref(v))
        c = v.value  # 2.19+: major*10000 + minor*100 + patch
        return f"{c // 10000}.{c % 10000 // 100}.{c % 100}", _nccl_cuda(path)
    return "", ""


def _vtuple(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v))


def needed(name: str) -> str:
    """What this build needs of library `name`, in words, from _build_config."""
    cuda = _cfg().CUDA_VERSION
    if name == "cudnn":
        return f"cuDNN >= {getattr(_cfg(), 'CUDNN_VERSION', '9')} built for CUDA {cuda_major()}"
    if name == "nccl":
        return f"NCCL >= {getattr(_cfg(), 'NCCL_VERSION', '2')} built for CUDA {cuda_major()}"
    return f"{_KNOWN[name][1]} of CUDA {cuda_major()} (built with {cuda})"


def check_version(f: Found) -> str:
    """'' when loaded library `f` is what the build needs, else why not."""
    major = cuda_major()
    if f.cuda and _vtuple(f.cuda)[:1] != (major,):
        return f"it is built for CUDA {f.cuda}, this build of gpt2core is CUDA {_cfg().CUDA_VERSION}"
    if f.name in ("cudart", "nvrtc") and _vtuple(f.version)[:1] != (major,):
        return f"it is CUDA {f.version}, this build of gpt2core is CUDA {_cfg().CUDA_VERSION}"
    if f.name == "cublasLt" and _vtuple(f.version)[:1] != (major,):
        return f"it is cuBLAS {f.version}, this build needs cuBLAS {major}.x"
    want = {"cudnn": getattr(_cfg(), "CUDNN_VERSION", ""), "nccl": getattr(_cfg(), "NCCL_VERSION", "")}
    w = want.get(f.name, "")
    if w and (_vtuple(f.version)[:1] != _vtuple(w)[:1] or _vtuple(f.version)[:2] < _vtuple(w)[:2]):
        return f"it is {f.version}, this build was compiled against {w} (needs {_vtuple(w)[0]}.x, >= {w})"
    return ""


def fix_command(name: str) -> str:
    """The pip command that puts the right file in place for this build, whatever is installed now."""
    pkg = package(name)
    if not pkg:
        return install_hint()
    other = [p for m, p in _KNOWN[name][2].items() if m != cuda_major()]
    cmd = f"pip install --force-reinstall --no-deps {pinned(pkg)}"
    from importlib import metadata
    clashing = []
    for p in other:
        try:
            metadata.distribution(p)
            clashing.append(p)
        except metadata.PackageNotFoundError:
            pass
    if clashing and name in ("cudnn", "nccl"):  # same file names in both packages: one must go first
        cmd = f"pip uninstall -y {' '.join(clashing)} && " + cmd
    return cmd


# ------------------------------------------------------------------------------------------------ loading
def find(name: str) -> Found | None:
    """Load library `name` (see _KNOWN) from the first candidate that loads; None when none does (the skipped
    candidates are in `last_skipped[name]`). The version is read but not judged here (see load_all)."""
    so = soname(name)
    skipped = []
    for path, source, pkg in candidates(name):
        try:
            lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError as e:
            if source != "system" or os.path.isabs(path):
                skipped.append((path, str(e).split(": ", 1)[-1] or str(e)))
            continue
        real = path if os.path.isabs(path) else _loaded_path(so)
        try:
            version, cuda = loaded_version(name, lib, real)
        except (AttributeError, OSError) as e:
            version, cuda = "", ""
            skipped.append((real, f"loaded, but its version could not be read ({e})"))
        return Found(name, so, real, source, version, pkg, cuda, skipped)
    last_skipped[name] = skipped
    return None


last_skipped: dict[str, list] = {}


def load_all() -> list[Found]:
    """Load and check every library the CUDA module links; MissingLibrary or LibraryMismatch otherwise."""
    found = []
    for name in _cfg().CUDA_LIBRARIES:
        f = find(name)
        what = _KNOWN[name][1]
        if f is None:
            pkg = package(name)
            tried = "; ".join(f"{p}: {why}" for p, why in last_skipped.get(name, []))
            _, note = _in_package(pkg, soname(name))
            raise MissingLibrary(
                f"gpt2core's CUDA backend (built with CUDA {_cfg().CUDA_VERSION}) needs {what} "
                f"({soname(name)}), found neither in NVIDIA's PyPI wheels nor on this system"
                + (f" [tried: {tried}]" if tried else "") + (f" [{note}]" if note else "")
                + f": {install_hint()}" + (f" (or pip install {pinned(pkg)})" if pkg else ""))
        why = check_version(f)
        if why:
            raise LibraryMismatch(
                f"{what} at {f.path} does not fit this build of gpt2core: {why} (found {what} {f.version}"
                + (f" for CUDA {f.cuda}" if f.cuda else "") + (f", from {f.package}" if f.package else "")
                + f"; needed: {needed(name)}). Fix: {fix_command(name)}")
        found.append(f)
    return found


# ------------------------------------------------------------------------------------------------ the driver
def driver() -> str | None:
    """The path of the NVIDIA driver's CUDA library (libcuda.so.1, installed with the driver, never by pip), or
    None on a machine without an NVIDIA driver."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    return _loaded_path("libcuda.so.1")


driver_version = _plugins.driver_version  # the driver's CUDA version (gpt2core._plugins asks it too)


def driver_problem() -> str:
    """'' when the NVIDIA driver can run this build's CUDA code, else the sentence a user sees (the same words from
    GPT2(device='cuda'), gpt2core-train --device cuda and the doctor)."""
    if not _cfg().CUDA_VERSION:
        return ""
    v = driver_version()
    if v is None:
        return ("no NVIDIA driver (libcuda.so.1 not found)" if driver() is None
                else "the NVIDIA driver (libcuda.so.1) does not answer cuDriverGetVersion")
    need = cuda_major()
    if v // 1000 < need:  # CUDA minor-version compatibility: any driver of the build's major runs it
        have = _ver(v)
        fits = [m for m in (12, 13) if m <= v // 1000]
        hint = (f"; install the CUDA {fits[-1]} build: {install_hint(fits[-1])}" if fits
                else "; update the NVIDIA driver")
        return (f"this build of gpt2core needs a driver for CUDA >= {need}.0 (yours: CUDA {have}, driver "
                f"{driver() or 'libcuda.so.1'}){hint}")
    return ""


def describe(f: Found) -> str:
    """One line for the doctor: the version verified by asking the library itself."""
    extra = f" for CUDA {f.cuda}" if f.cuda and f.name not in ("cudart", "nvrtc") else ""
    src = f.package or f.source
    return f"{f.name:<8} {f.version + extra:<22} {src:<28} {f.path}"

