"""The CUDA backend, loaded on first use: which one (gpt2core._plugins: this build's own gpt2core._C_cuda, or the
_C_cuda of the installed plugin gpt2core-cuda12 / gpt2core-cuda13), NVIDIA's libraries (gpt2core._libs: the build's
PyPI packages, else a toolkit at CUDA_HOME/CUDA_PATH or on the system; each checked against the build's versions),
then the extension module, whose entry points the CPU core takes (_C.set_cuda_plugin). gpt2core._C calls load()
itself the first time a CUDA device, cuda_status() or NCCL is asked for, so `import gpt2core` and everything on the
CPU need no CUDA library at all."""
from __future__ import annotations

import importlib

from . import _libs, _plugins

_loaded: list[_libs.Found] | None = None
_backend: _plugins.CudaBackend | None = None


def load() -> list[_libs.Found]:
    """Load the CUDA backend once; returns the NVIDIA libraries it uses. Raises ImportError (no CUDA backend and the
    command that brings one; PluginError for plugins that cannot be used; MissingLibrary naming the library and the
    pip command that provides it; LibraryMismatch naming the file, the version found and needed and the fix; or the
    module that failed to load and why) when that cannot be done."""
    global _loaded, _backend
    if _loaded is None:
        backend = _plugins.find()
        if backend is None or not backend.config.CUDA_LIBRARIES:
            raise ImportError(_plugins.why_none())
        found = _libs.load_all()
        try:
            from . import _C
            module = importlib.import_module(backend.module)
        except ImportError as e:  # e.g. an undefined symbol: a library of another version got in first
            raise ImportError(f"gpt2core's CUDA module ({backend.describe()}) could not be loaded ({e}); the NVIDIA "
                              "libraries loaded: " + ", ".join(f"{f.name} {f.version} {f.path}" for f in found)) from e
        try:
            _C.set_cuda_plugin(module.plugin())
        except (TypeError, ValueError) as e:  # a plugin table of another build (kCudaPluginAbi)
            raise _plugins.PluginError(f"gpt2core's CUDA module ({backend.describe()}) does not fit this gpt2core "
                                       f"({_plugins.version()}): {e}") from e
        _loaded, _backend = found, backend
    return _loaded


def backend() -> _plugins.CudaBackend | None:
    """The CUDA backend loaded (None before load())."""
    return _backend
