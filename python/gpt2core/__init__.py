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

from . import _build_config, _C, _cuda, _plugins  # noqa: E402  (_C: no CUDA library; _cuda loads it on use)
from .config import GPT2Config, PRESETS  # noqa: E402
from .model import GPT2, load_model  # noqa: E402
from .planning.memplan import plan  # noqa: E402  (the memory plan: bytes per GPU by part, allocating nothing)

__version__ = _C.build_info()["version"]


def build_info() -> dict:
    """What was compiled (version, backends, BLAS, CPU code, CUDA archs and version, cuDNN, NCCL, Gloo) and, in a
    build with the CUDA backend, the NVIDIA libraries it loaded ("cuda_libraries", name -> path) or why it could
    not ("cuda_error"). The CUDA facts are those of the CUDA backend in use: this build's own, or the installed
    plugin's ("cuda_plugin": gpt2core-cuda12 / gpt2core-cuda13, its version and folder; gpt2core._plugins)."""
    info = dict(_C.build_info())
    try:
        backend = _plugins.find()
    except _plugins.PluginError as e:  # two CUDA majors' plugins, or a plugin of another release
        backend = None
        info["cuda_error"] = str(e)
    cfg = backend.config if backend else _build_config
    if backend is not None and backend.plugin:
        info.update(cuda=True, cuda_toolkit=True, cuda_archs=[a for a in cfg.CUDA_ARCHS.split(",") if a],
                    cudnn=bool(cfg.HAS_CUDNN), cudnn_sdpa=bool(cfg.HAS_CUDNN_SDPA), nccl=bool(cfg.HAS_NCCL),
                    backends=[*info["backends"], "cuda"], cuda_plugin=backend.describe())
    info["cuda_version"] = cfg.CUDA_VERSION
    if not info["cuda"]:
        info["cuda_skipped"] = getattr(_build_config, "CUDA_SKIPPED", "")  # why the build has no CUDA backend
    if info["cuda"]:
        info.update(cudnn_version=getattr(cfg, "CUDNN_VERSION", ""), nccl_version=getattr(cfg, "NCCL_VERSION", ""))
        try:
            found = _cuda.load()
            info["cuda_libraries"] = {f.name: f.path for f in found}
            info["cuda_library_versions"] = {f.name: f.version for f in found}  # as each loaded library says
        except (ImportError, OSError) as e:  # never a traceback from a library that exists but does not load
            info["cuda_error"] = str(e)
        from . import _libs
        problem = _libs.driver_problem()
        if problem:
            info["cuda_driver"] = problem
    return info


def fp8_cast(x, kind: str):
    """x (a float32 numpy array) rounded to FP8 -- kind "e4m3" (largest finite value 448) or "e5m2" (57344) -- as the
    GPU's cvt.rn.satfinite rounds it: to nearest even, subnormals kept, beyond the largest finite value (infinities
    included) saturated to it, NaN kept. Returns the rounded values as a new float32 array of x's shape. The
    conversion the FP8 matmuls quantise with (csrc/model/fp8.h). ValueError names a bad x or kind."""
    return _C.fp8_cast(x, kind)


# Subpackages reachable as gpt2core.tokenizer etc. after a plain `import gpt2core`, imported on first use
# (model files and checkpoints, gpt2core.formats, come with GPT2).
_LAZY_SUBMODULES = ("data", "tokenizer")


def __getattr__(name: str):
    if name in _LAZY_SUBMODULES or name in MOVED:  # MOVED (below): gpt2core.checkpoint is the module at its new place
        import importlib
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY_SUBMODULES) | set(MOVED))


# Module paths from before the package was grouped by job (CHANGELOG.md, 0.2.0): `import gpt2core.train`,
# `from gpt2core import checkpoint` and `python -m gpt2core.train` still work and give the module at its new place,
# the same object (patching one patches the other). gpt2core.model, .inference and .distributed are packages now
# that re-export their old public names.
MOVED = {
    "_io": "formats.atomic", "runlock": "formats.runlock", "llmc": "formats.llmc",
    "checkpoint": "formats.checkpoint", "pretrained": "formats.pretrained",
    "memplan": "planning.memplan", "batchfit": "planning.batchfit", "perf": "planning.perf",
    "generate": "inference.generate_cli", "chat_cli": "inference.chat_cli", "scheduler": "inference.scheduler",
    "serve": "inference.serve", "launch": "distributed.launch",
    "evaluate": "evaluation.evaluate", "core_eval": "evaluation.core_eval", "lm_eval": "evaluation.lm_eval",
    "scoring": "evaluation.scoring",
    "train": "training.train", "schedule": "training.schedule", "runfolder": "training.runfolder",
    "preemption": "training.preemption", "outliers": "training.outliers", "trackers": "training.trackers",
    "plot": "training.plot",
    "doctor": "runtime.doctor", "calibrate": "runtime.calibrate",
}


def _install_moved_finder() -> None:
    import importlib
    import importlib.abc
    import importlib.machinery
    import importlib.util
    import sys

    class MovedLoader(importlib.abc.Loader):
        """Loads an old path as the module at its new place. The spec carries the new name, so that the module runs
        in its own package (its relative imports resolve) when `python -m gpt2core.<old>` executes it as __main__."""

        def __init__(self, old: str, spec):
            self.old, self.spec = old, spec

        def create_module(self, spec):
            return importlib.import_module(self.spec.name)  # the one module object, imported at its new name

        def exec_module(self, module):
            module.__spec__ = self.spec  # the import system stamped the alias's spec on it: give back its own
            sys.modules[self.old] = module

        def get_code(self, fullname):  # runpy (python -m): the new module's code
            return self.spec.loader.get_code(self.spec.name)

        def is_package(self, fullname):
            return False

    class MovedFinder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path=None, target=None):
            prefix, _, old = fullname.rpartition(".")
            if prefix != __name__ or old not in MOVED:
                return None
            spec = importlib.util.find_spec(f"{__name__}.{MOVED[old]}")
            return importlib.machinery.ModuleSpec(spec.name, MovedLoader(fullname, spec), origin=spec.origin)

    if not any(type(f).__name__ == "MovedFinder" for f in sys.meta_path):
        sys.meta_path.append(MovedFinder())


_install_moved_finder()

__all__ = ["GPT2", "GPT2Config", "PRESETS", "build_info", "fp8_cast", "load_model", "plan", "__version__"]
