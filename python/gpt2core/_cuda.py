"""The CUDA backend, loaded on first use: NVIDIA's libraries (gpt2core._libs: the build's PyPI packages, else a
toolkit at CUDA_HOME/CUDA_PATH or on the system; each checked against the build's versions), then the extension
module gpt2core._C_cuda, whose entry points the CPU core takes (_C.set_cuda_plugin). gpt2core._C calls load() itself
the first time a CUDA device, cuda_status() or NCCL is asked for, so `import gpt2core` and everything on the CPU
need no CUDA library at all."""
from __future__ import annotations

from . import _build_config, _libs

_loaded: list[_libs.Found] | None = None


def load() -> list[_libs.Found]:
    """Load the CUDA backend once; returns the NVIDIA libraries it uses. Raises ImportError (MissingLibrary naming
    the library and the pip command that provides it, LibraryMismatch naming the file, the version found and
    needed and the fix, or the module that failed to load and why) when that cannot be done."""
    global _loaded
    if _loaded is None:
        if not _build_config.CUDA_LIBRARIES:
            raise ImportError("this build of gpt2core has no CUDA backend")
        found = _libs.load_all()
        try:
            from . import _C, _C_cuda
        except ImportError as e:  # e.g. an undefined symbol: a library of another version got in first
            raise ImportError(f"gpt2core's CUDA module could not be loaded ({e}); the NVIDIA libraries loaded: "
                              + ", ".join(f"{f.name} {f.version} {f.path}" for f in found)) from e
        _C.set_cuda_plugin(_C_cuda.plugin())
        _loaded = found
    return _loaded
