"""The package's import graph has no cycle, counting function-local imports too (a cycle hidden inside a
function is still a cycle: neither module can be read, tested or replaced without the other)."""
import ast
from pathlib import Path

import gpt2core

PACKAGE = Path(gpt2core.__file__).parent


def import_graph(root: Path, package: str = "gpt2core") -> dict[str, set[str]]:
    """{module: the package's .py modules it imports anywhere in its body}. `from . import x` names module
    x when x.py or x/ exists, else the package itself, which is left out (every submodule's import runs it,
    so an edge to it says nothing about layering)."""
    files = {}
    for f in root.rglob("*.py"):
        parts = f.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        files[".".join((package, *parts))] = f
    graph = {}
    for mod, f in files.items():
        here = mod.split(".") if f.name == "__init__.py" else mod.split(".")[:-1]  # the module's package
        deps = set()
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(here[:len(here) - node.level + 1]) if node.level else ""
                base = ".".join(p for p in (base, node.module or "") if p)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            else:
                continue
            deps.update(t for t in targets if t in files and t != mod and t != package)
        graph[mod] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle [a, b, ..., a], or None."""
    state = {}  # 1: on the current path, 2: done

    def visit(m, path):
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                return path[path.index(d):] + [m, d] if d in path else [m, d]
            if d not in state:
                found = visit(d, path + [m])
                if found:
                    return found
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m, [])
            if found:
                return found
    return None


def test_find_cycle_sees_function_local_imports(tmp_path):
    pkg = tmp_path / "gpt2core"
    (pkg / "data").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .a import f\n")
    (pkg / "a.py").write_text("from . import b\ndef f():\n    pass\n")
    (pkg / "b.py").write_text("def g():\n    from .data.c import h\n")
    (pkg / "data" / "__init__.py").write_text("")
    (pkg / "data" / "c.py").write_text("def h():\n    from .. import a\n")
    graph = import_graph(pkg)
    assert graph["gpt2core.a"] == {"gpt2core.b"} and graph["gpt2core.data.c"] == {"gpt2core.a"}
    assert find_cycle(graph) == ["gpt2core.a", "gpt2core.b", "gpt2core.data.c", "gpt2core.a"]
    (pkg / "data" / "c.py").write_text("from ..config import X\n")
    assert find_cycle(import_graph(pkg)) is None


def test_package_import_graph_has_no_cycle():
    graph = import_graph(PACKAGE)
    assert {"gpt2core.model.gpt2", "gpt2core.formats.llmc", "gpt2core.formats.pretrained",
            "gpt2core.formats.checkpoint"} <= set(graph)
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_persistence_is_layered():
    """llm.c format <- training checkpoints <- any-format loading <- the model class (gpt2core.formats, then
    gpt2core.model; the groups' order as a whole: test_layout.py)."""
    g = import_graph(PACKAGE)
    model = {"gpt2core.model", "gpt2core.model.gpt2"}
    llmc, ck, pre = "gpt2core.formats.llmc", "gpt2core.formats.checkpoint", "gpt2core.formats.pretrained"
    assert "gpt2core.model" in g["gpt2core.training.trainer"]
    assert g[llmc] & ({ck, pre} | model) == set()
    assert llmc in g[ck] and not model & g[ck]
    assert {llmc, ck} <= g[pre]
    assert not model & g[pre]
    assert {"gpt2core.formats.llmc", "gpt2core.formats.pretrained"} <= g["gpt2core.model.files"]
