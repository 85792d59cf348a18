"""Import graphs of the repository's Python modules, parsed (nothing imported): what the layer
and circle tests read, for flcomm/ (tests/unit/test_layering.py) and bench/
(tests/unit/test_bench_imports.py)."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]

#: flcomm's deprecated modules (kept one release), each the module of flcomm.ops it is now: what
#: nothing may import (tests/unit/test_layering.py) and what still imports, with a warning
#: (tests/unit/test_exports.py)
SHIMS = {"flcomm.kernels": "flcomm.ops.quant", "flcomm.sparse": "flcomm.ops.topk", "flcomm.apply": "flcomm.ops.apply"}


def module_name(path: pathlib.Path) -> str:
    if not path.is_relative_to(ROOT):
        return path.stem
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def is_module(name: str) -> bool:
    rel = pathlib.Path(*name.split("."))
    return (ROOT / rel).with_suffix(".py").exists() or (ROOT / rel / "__init__.py").exists()


def imports_of(path: pathlib.Path, top_level_only: bool = False) -> set[str]:
    """Every module ``path`` imports (``from a import b`` counts as ``a.b`` when that is a
    module). ``top_level_only``: only what runs at import time (no function bodies, no
    ``if TYPE_CHECKING:`` blocks)."""
    tree = ast.parse(path.read_text(), str(path))
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if top_level_only and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if top_level_only and isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    up = package.split(".")
                    up = up[: len(up) - (child.level - 1)]
                    base = ".".join([*up, base] if base else up)
                for a in child.names:  # `from a import b`: module a.b, or name b of module a
                    found.add(f"{base}.{a.name}" if is_module(f"{base}.{a.name}") else base)
            visit(child)

    visit(tree)
    return found


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The circles of ``graph`` (module -> the modules it imports): its strongly connected
    components of more than one module, or of one that imports itself (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.get(v, ()):
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out
