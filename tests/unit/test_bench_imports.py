"""No import circle among the benchmarks' modules (bench/), through any import: module level,
inside functions and under ``TYPE_CHECKING`` alike, parsed as tests/unit/test_layering.py
parses flcomm/ (tests/common/imports.py). What two benchmarks share lives in a module of its own
(bench/common.py, bench/tft_common.py), not in one of them that the other imports back."""

from __future__ import annotations

import pathlib

from tests.common.imports import ROOT, import_cycles, imports_of, is_module, module_name

BENCH = ROOT / "bench"


def _graph() -> dict[str, set[str]]:
    """bench's modules -> the bench modules each imports (itself left out)."""
    graph = {}
    for path in sorted(BENCH.rglob("*.py")):
        if "results" in path.relative_to(BENCH).parts:
            continue
        me = module_name(path)
        graph[me] = {m for m in imports_of(path) if m.startswith("bench.") and m != me and is_module(m)}
    return graph


def test_the_parser_sees_the_benchmarks_imports():
    """bench/ has no ``__init__.py``: its ``from bench import x`` and ``from bench.x import y`` still
    name modules (else the check below would pass on an empty graph)."""
    graph = _graph()
    assert {"bench.peers", "bench.recovery", "bench.tft_common"} <= set(graph)
    assert "bench.tft_common" in graph["bench.peers"] and "bench.tft_common" in graph["bench.recovery"]
    assert "bench.recovery" in graph["bench.peers"]  # --recovery: its runs and table


def test_no_import_circle_among_the_benchmarks():
    circles = import_cycles(_graph())
    assert not circles, f"import circles among bench/'s modules (move what both use to a shared module): {circles}"


def test_a_circle_is_found(tmp_path: pathlib.Path):
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("def f():\n    import b\n")
    b.write_text("import a\n")
    assert import_cycles({"a": imports_of(a), "b": imports_of(b)}) == [["a", "b"]]
