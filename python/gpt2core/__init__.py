"""gpt2core: pre-train GPT-2 from scratch with a C++/CUDA core and a thin Python loop."""
from __future__ import annotations


def _preload_blas() -> None:
    # The extension links against scipy-openblas32's shared library, which lives in that package's
    # directory, not on the loader's path: load it first so _C's dependency resolves by soname.
    try:
        import ctypes
        import os

        import scipy_openblas32

        lib = os.path.join(scipy_openblas32.get_lib_dir(), "libscipy_openblas.so")
        if os.path.exists(lib):
            ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
    except ImportError:
        pass  # built against a system BLAS


_preload_blas()

from . import _C  # noqa: E402
from .config import GPT2Config, PRESETS  # noqa: E402
from .model import GPT2, load_model  # noqa: E402

__version__ = _C.build_info()["version"]


def build_info() -> dict:
    """What the compiled core contains: version, backends, BLAS, CUDA archs, cuDNN, NCCL."""
    return dict(_C.build_info())


# Subpackages reachable as gpt2core.tokenizer etc. after a plain `import gpt2core`, imported on first use
# (model files and checkpoints, llmc/pretrained/checkpoint, come with GPT2).
_LAZY_SUBMODULES = ("data", "tokenizer")


def __getattr__(name: str):
    if name in _LAZY_SUBMODULES:
        import importlib
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY_SUBMODULES))


__all__ = ["GPT2", "GPT2Config", "PRESETS", "build_info", "load_model", "__version__"]
