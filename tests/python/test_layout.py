"""The package's rooms and the arrows between them (issue 47).

python/gpt2core is grouped by job; the groups import downward only. ORDER names every group and top-level module,
lowest first: a module may import from its own group and from those before it, never from one after it. The test
reads every import statement of the package's source (module level and inside functions alike) with `ast`, so an
arrow that runs back up fails here with the file and line that draws it.

The same file checks what the regroup promised users: the old module paths still import (the same module object),
`python -m gpt2core.<old>` still runs, and the top level stays small.
"""
import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import gpt2core

SRC = Path(__file__).resolve().parents[2] / "python" / "gpt2core"

# Lowest first. The top-level modules are the public face (errors, tokenizer, the argument layer, the configs and
# the chat format) and the extension with the loaders of its CUDA libraries (_C, _plugins, _libs, _cuda): everything
# stands on them. The model stands on formats (it reads and writes checkpoints) and above the data and the plan; the
# inference, distributed, evaluation and training groups use the model; __init__ gathers the public names; runtime
# (the doctor, the lease driver) uses everything, the public face included, as a user's script would.
ORDER = ["errors", "tokenizer", "progress", "_C", "_C_cuda", "_build_config", "_plugins", "_libs", "_cuda", "cli",
         "chat", "config", "formats", "data", "planning", "model", "inference", "distributed", "evaluation",
         "training", "__init__", "runtime", "__main__"]


def _module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _node(module: str) -> str:
    """gpt2core.training.train -> "training"; gpt2core.cli -> "cli"; gpt2core (the package) -> "__init__"."""
    parts = module.split(".")
    assert parts[0] == "gpt2core", module
    return parts[1] if len(parts) > 1 else "__init__"


def _is_module(name: str) -> bool:
    rel = Path(*name.split(".")[1:])
    return (SRC / rel).with_suffix(".py").exists() or (SRC / rel / "__init__.py").exists() \
        or name in ("gpt2core._C", "gpt2core._C_cuda", "gpt2core._build_config")


def imports(path: Path):
    """(line, imported module) for every import of a gpt2core module in one source file."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "gpt2core":
                    yield node.lineno, a.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            elif (node.module or "").split(".")[0] == "gpt2core":
                mod = node.module
            else:
                continue
            for a in node.names:  # `from . import cli` imports the module gpt2core.cli; `from .. import X` an attribute
                sub = f"{mod}.{a.name}"
                yield node.lineno, sub if _is_module(sub) else mod


def arrows():
    for path in sorted(SRC.rglob("*.py")):
        src = _node(_module_name(path)) if path.parent != SRC else path.stem
        for line, mod in imports(path):
            yield path, line, src, _node(mod)


def test_every_room_is_in_the_order():
    rooms = {p.stem for p in SRC.glob("*.py")} | {p.parent.name for p in SRC.glob("*/__init__.py")}
    assert rooms <= set(ORDER), f"add to ORDER: {sorted(rooms - set(ORDER))}"


def test_arrows_point_down():
    up = [f"{p.relative_to(SRC.parent)}:{line}: {src} imports {dst}"
          for p, line, src, dst in arrows() if src != dst and ORDER.index(dst) > ORDER.index(src)]
    assert not up, "imports that run back up the order (tests/python/test_layout.py ORDER):\n" + "\n".join(up)


def test_the_check_sees_an_upward_arrow(tmp_path, monkeypatch):
    """The check itself: a planted import of training from the model group is reported."""
    fake = tmp_path / "gpt2core"
    (fake / "model").mkdir(parents=True)
    (fake / "training").mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "training" / "__init__.py").write_text("")
    (fake / "training" / "train.py").write_text("")
    (fake / "model" / "__init__.py").write_text("")
    (fake / "model" / "gpt2.py").write_text("def f():\n    from ..training import train\n")
    monkeypatch.setattr(sys.modules[__name__], "SRC", fake)
    found = [(src, dst) for _, _, src, dst in arrows() if src != dst]
    assert ("model", "training") in found


def test_top_level_is_small_and_grouped():
    modules = sorted(p.name for p in SRC.glob("*.py"))
    packages = sorted(p.parent.name for p in SRC.glob("*/__init__.py"))
    assert len(modules) <= 12, modules
    assert len(packages) >= 5, packages


@pytest.mark.parametrize("old,new", sorted(gpt2core.MOVED.items()))
def test_old_module_paths_import_the_same_module(old, new):
    assert importlib.import_module(f"gpt2core.{old}") is importlib.import_module(f"gpt2core.{new}")


def test_old_paths_of_packages_keep_their_names():
    from gpt2core.distributed import DataParallel, setup  # noqa: F401
    from gpt2core.inference import KVCacheFull, SlotPool, truncate_at_stop  # noqa: F401
    from gpt2core.model import GPT2, load_model, pick_precision  # noqa: F401
    from gpt2core import checkpoint, train  # noqa: F401  (old modules as attributes of the package)
    assert train.Trainer is importlib.import_module("gpt2core.training.train").Trainer


# every `python -m gpt2core.X` the README, the docs and the notebooks use, at its old path
@pytest.mark.parametrize("mod", ["train", "evaluate", "doctor", "launch", "checkpoint", "lm_eval", "generate",
                                 "serve", "chat_cli", "plot", "data"])
def test_python_m_old_paths_run(mod):
    r = subprocess.run([sys.executable, "-m", f"gpt2core.{mod}", "--help"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "usage" in r.stdout.lower(), r.stdout[:500]


def test_no_submodule_shadows_a_name_its_package_exports():
    """A package's name and a submodule's file name must differ: importing gpt2core.inference.generate (a file)
    would set the package's attribute `generate` to the module, over the function `__init__` exported under that
    name, and `inference.generate(...)` would then fail only after some other test imported the file. Every
    package's exported names are checked against its files here, and again after importing every submodule."""
    import pkgutil
    for init in sorted(SRC.rglob("__init__.py")):
        pkg = importlib.import_module(_module_name(init))
        exported = {k: v for k, v in vars(pkg).items() if not k.startswith("__") and not isinstance(v, type(sys))}
        files = {m.name for m in pkgutil.iter_modules([str(init.parent)])} - {"__main__"}
        assert not set(exported) & files, f"{pkg.__name__}: {sorted(set(exported) & files)} are files and names"
        for m in files:
            importlib.import_module(f"{pkg.__name__}.{m}")
        assert all(getattr(pkg, k) is v for k, v in exported.items()), pkg.__name__
