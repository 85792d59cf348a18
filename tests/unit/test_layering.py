"""The import rules of ``flcomm/__init__.py``'s docstring, checked by parsing every module.

Every import counts (module level, inside functions, under ``TYPE_CHECKING``): a lazy or a
type-only import of a higher layer is still a dependency on it.
"""

from __future__ import annotations

import pathlib

import pytest

from tests.common.imports import ROOT, SHIMS, import_cycles, imports_of, is_module, module_name

PKG = ROOT / "flcomm"

# layer -> the flcomm layers it may import (besides itself)
ALLOWED: dict[str, set[str]] = {
    "enums": set(),
    "_lazy": set(),
    "validate": set(),  # the numeric checks every layer shares (flcomm.validate)
    "_native": {"enums"},
    "info": {"_native", "enums"},
    "comm": {"_native", "info", "enums"},
    "ops": {"_native", "enums"},  # NOTE: the wrappers of csrc/ (quant, topk, apply)
    # NOTE: the deprecated names of ops.quant, ops.topk and ops.apply (one release); see SHIMS
    "kernels": {"ops"},
    "sparse": {"ops"},
    "apply": {"ops"},
    "codecs": {"ops", "_native", "enums"},
    "collectives": {"comm", "codecs", "ops", "_native", "enums", "info"},
    "fsdp": {"collectives", "comm", "codecs", "ops", "_native", "enums", "info"},
    "federated": {"collectives", "comm", "codecs", "ops", "_native", "enums", "info"},
    "costmodel": {"federated", "comm", "codecs", "ops", "_native", "enums", "info"},
    "__main__": {"info", "_native", "enums", "comm"},  # NOTE: `python -m flcomm info` names the transports
    "__init__": {"info", "_native", "enums"},
    "train": None,  # everything
}


def _layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "__init__"
    return parts[1]


def _sources() -> list[pathlib.Path]:
    return sorted(PKG.rglob("*.py"))


def test_every_module_has_a_layer():
    missing = {_layer(module_name(p)) for p in _sources()} - set(ALLOWED)
    assert not missing, f"modules in layers the rules do not name: {missing}"


def _upward_imports(path: pathlib.Path, me: str) -> tuple[list[str], set[str] | None]:
    """The flcomm imports of ``path`` (module ``me``) that its layer may not make, and what the
    layer may import (None: everything)."""
    layer = _layer(me)
    allowed = ALLOWED[layer]
    if allowed is None:
        return [], None
    allowed = allowed | {"enums", "_lazy", "validate"}
    bad = []
    for imp in sorted(imports_of(path)):
        if imp != "flcomm" and not imp.startswith("flcomm."):
            continue
        other = _layer(imp)
        if other != layer and other not in allowed:
            bad.append(imp)
    return bad, allowed


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_go_down(path: pathlib.Path):
    me = module_name(path)
    bad, allowed = _upward_imports(path, me)
    assert not bad, f"{me} (layer {_layer(me)!r}) imports {bad}; it may import only {sorted(allowed)}"


def test_an_upward_import_is_found(tmp_path: pathlib.Path):
    """The rule check itself fails on a violation: a kernel wrapper that reaches up to the
    collectives, and a collective that reaches up to FedAvg (a lazy import)."""
    src = tmp_path / "m.py"
    src.write_text("from flcomm.collectives import bucketing\n")
    assert _upward_imports(src, "flcomm.ops.quant")[0] == ["flcomm.collectives.bucketing"]
    src.write_text("def f():\n    from flcomm.federated.fedavg import FedAvg\n")
    assert _upward_imports(src, "flcomm.collectives.bucketing")[0] == ["flcomm.federated.fedavg"]
    assert _upward_imports(src, "flcomm.train.loop")[0] == []


def test_nothing_imports_the_deprecated_modules():
    """flcomm, its tests, benchmarks, examples and tools import the new names (flcomm.ops.*),
    never the shims kept for users (tests/unit/test_exports.py imports those by their name)."""
    paths = [p for d in ("flcomm", "tests", "bench", "examples", "tools") for p in sorted((ROOT / d).rglob("*.py"))]
    users = {module_name(p): sorted(set(SHIMS) & imports_of(p)) for p in paths if module_name(p) not in SHIMS}
    users = {m: s for m, s in users.items() if s}
    assert not users, f"modules that import a deprecated module (import flcomm.ops.* instead): {users}"


def _import_time_closure(module: str) -> set[str]:
    """Every module (flcomm's and third-party) imported when ``module`` is first imported,
    following flcomm's own modules and the packages around them."""
    seen: set[str] = set()
    out: set[str] = set()
    todo = [module]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        parts = m.split(".")
        for i in range(1, len(parts)):  # importing a.b.c runs a/__init__ and a/b/__init__
            todo.append(".".join(parts[:i]))
        rel = pathlib.Path(*parts)
        path = (ROOT / rel).with_suffix(".py")
        if not path.exists():
            path = ROOT / rel / "__init__.py"
        for imp in imports_of(path, top_level_only=True):
            out.add(imp)
            if imp == "flcomm" or imp.startswith("flcomm."):
                todo.append(imp)
    return out


@pytest.mark.parametrize("module", ["flcomm.costmodel.model", "flcomm.costmodel.search"])
def test_cost_model_is_pure(module: str):
    direct = {i for i in imports_of(ROOT / pathlib.Path(*module.split(".")).with_suffix(".py"))}
    closure = _import_time_closure(module)
    for imports, how in ((direct, "imports"), (closure, "imports at import time (through flcomm modules)")):
        bad = sorted(i for i in imports if i == "torch.distributed" or i.startswith("torch.distributed."))
        assert not bad, f"{module} {how} {bad}: the analytic cost model must not touch torch.distributed"


def test_the_rules_can_fail(tmp_path: pathlib.Path):
    """The parser sees lazy and type-only imports (so a violation cannot hide in them)."""
    src = tmp_path / "m.py"
    src.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from flcomm.federated import topology\n"
                   "def f():\n    import flcomm.train.loop\n")
    got = imports_of(src)
    assert {"flcomm.federated.topology", "flcomm.train.loop"} <= got
    assert imports_of(src, top_level_only=True) == {"typing"}


def test_no_module_level_import_circle():
    """No circle among flcomm's modules through what they import at import time (a function-level
    import is lazy and may point up a layer's own modules; test_imports_go_down rules the layers)."""
    graph = {}
    for path in _sources():
        me = module_name(path)
        graph[me] = {m for m in imports_of(path, top_level_only=True)
                     if m.startswith("flcomm.") and m != me and is_module(m)}
    assert not import_cycles(graph), f"module-level import circles: {import_cycles(graph)}"


def test_circles_are_found():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_cycles({"a": {"a"}}) == [["a"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


# NOTE: the circles through any import (function-level and type-only included) that stand today,
# each with why; a new one fails the test below, and a known one that goes must leave this list
KNOWN_CIRCLES = {
    # the deprecated alias Topology.build (its one function-level import of the runtime half)
    # calls flcomm.init_fed_mesh, whose FedMesh names Topology; goes with the alias, one release on
    ("flcomm.federated.mesh", "flcomm.federated.topology"),
}


def test_circles_through_any_import_are_only_the_known_ones():
    """The circles of the full import graph (every import, lazy and type-only too: a type-level
    circle is a dependency both ways all the same) are exactly :data:`KNOWN_CIRCLES`."""
    graph = {}
    for path in _sources():
        me = module_name(path)
        graph[me] = {m for m in imports_of(path) if m.startswith("flcomm.") and m != me and is_module(m)}
    got = {tuple(c) for c in import_cycles(graph)}
    assert got - KNOWN_CIRCLES == set(), f"new import circles: {sorted(got - KNOWN_CIRCLES)}"
    assert KNOWN_CIRCLES - got == set(), f"gone, so drop them from KNOWN_CIRCLES: {sorted(KNOWN_CIRCLES - got)}"
