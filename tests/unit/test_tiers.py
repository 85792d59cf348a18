"""The layout of tests/ (tests/README.md): every test file is in a tier folder, a test file imports
no other test file (what tests share is in tests/common/), and unit tests start no ranks."""

from __future__ import annotations

import ast
import pathlib

TESTS = pathlib.Path(__file__).resolve().parents[1]
TIERS = ("unit", "dist", "system", "gpu")


def _imports(path: pathlib.Path) -> set[str]:
    """Every module ``path`` imports, at any depth (lazy imports included)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


def test_test_files_are_in_a_tier_and_import_only_the_shared_harness():
    assert not sorted(p.name for p in TESTS.glob("test_*.py")), "a test file outside the tier folders"
    assert {p.name for p in TESTS.iterdir() if p.is_dir() and (p / "__init__.py").exists()} >= {*TIERS, "common"}
    bad = {}
    for path in sorted(TESTS.glob("*/*.py")):
        mods = {m for m in _imports(path) if m.startswith("tests.")}
        others = sorted(m for m in mods if not m.startswith("tests.common"))
        if others:
            bad[str(path.relative_to(TESTS))] = others
    assert not bad, f"test files import other test files (move the shared part to tests/common/): {bad}"


def test_unit_tests_start_no_ranks():
    spawn = {"tests.common.dist", "tests.common.dist.run_distributed", "torch.multiprocessing"}
    bad = {str(p.relative_to(TESTS)): sorted(_imports(p) & spawn) for p in sorted((TESTS / "unit").glob("*.py"))}
    bad = {k: v for k, v in bad.items() if v}
    assert not bad, f"unit tests that spawn ranks belong in tests/dist/: {bad}"


def test_the_linter_sees_every_tier():
    """``ruff check .`` (CI's lint) reads a file of every tier: ruff's default exclude holds
    "dist", which pyproject.toml takes out so that tests/dist/ is linted too."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--show-files", "."], cwd=TESTS.parent,
                         capture_output=True, text=True, timeout=120, check=True).stdout
    for tier in TIERS:
        assert f"/tests/{tier}/" in out, f"ruff does not read tests/{tier}/"
