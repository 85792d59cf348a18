"""The CPU stand-in of the NCCL library (tests/common/fake_nccl.py) has the real binding's
interface: the same classes, methods, argument names, order and defaults (read from the
signatures pybind11 writes into each method's ``__doc__``), properties and module names, so the
native-path tests on CPU cannot drift from ``flcomm._C``."""

from __future__ import annotations

import ast
import inspect

import pytest

from flcomm import _native
from tests.common import fake_nccl

pytestmark = pytest.mark.skipif(not _native.available(), reason=f"flcomm._C not built: {_native.unavailable_reason()}")


def _split_top(s: str) -> list[str]:
    """``s`` split at the commas outside brackets."""
    parts, depth, cur = [], 0, ""
    for ch in s:
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        parts.append(cur.strip())
    return parts


def binding_params(doc: str) -> list[tuple[str, object]]:
    """[(name, default or inspect.Parameter.empty)] from a pybind11 signature line, without self."""
    line = doc.strip().splitlines()[0]
    inner = line[line.index("(") + 1: line.rindex(") ->")]
    out = []
    for arg in _split_top(inner):
        name, _, rest = arg.partition(":")
        default = ast.literal_eval(rest.split("=", 1)[1].strip()) if "=" in rest else inspect.Parameter.empty
        out.append((name.strip(), default))
    return [p for p in out if p[0] != "self"]


def stand_in_params(fn) -> list[tuple[str, object]]:
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values() if p.name != "self"]


def _public(cls) -> dict[str, object]:
    return {n: v for n, v in vars(cls).items() if not n.startswith("_")}


@pytest.mark.parametrize("cls", ["NcclComm", "NcclWork"])
def test_stand_in_has_the_bindings_methods_and_properties(cls):
    real, fake = getattr(_native.native(), cls), getattr(fake_nccl, cls)
    real_names = {n for n in dir(real) if not n.startswith("_")}
    fake_names = set(_public(fake))
    assert fake_names >= real_names, f"{cls}: the stand-in lacks {sorted(real_names - fake_names)}"
    # NOTE: the stand-in may add test-only state (launches), never a method the binding lacks
    extra = {n for n in fake_names - real_names if callable(getattr(fake, n)) or isinstance(getattr(fake, n), property)}
    assert not extra, f"{cls}: the stand-in has {sorted(extra)}, which flcomm._C.{cls} does not"
    for name in sorted(real_names):
        r = getattr(real, name)
        f = getattr(fake, name)
        if isinstance(r, property):
            assert isinstance(f, property), f"{cls}.{name} is a property of the binding"
            continue
        assert binding_params(r.__doc__) == stand_in_params(f), f"{cls}.{name}: {r.__doc__.splitlines()[0]}"


def test_stand_in_constructor_and_module_names():
    C = _native.native()
    assert binding_params(C.NcclComm.__init__.__doc__) == stand_in_params(fake_nccl.NcclComm.__init__)
    assert fake_nccl.NCCL_UNIQUE_ID_BYTES == C.NCCL_UNIQUE_ID_BYTES
    if C.NCCL_CTA_POLICIES:  # NOTE: empty where the compiled NCCL predates 2.27
        assert fake_nccl.NCCL_CTA_POLICIES == C.NCCL_CTA_POLICIES
    assert issubclass(C.NcclTimeoutError, TimeoutError) and issubclass(fake_nccl.NcclTimeoutError, TimeoutError)
    for name in ("nccl_unique_id", "nccl_group_depth"):
        assert binding_params(getattr(C, name).__doc__) == stand_in_params(getattr(fake_nccl, name)), name
    assert len(fake_nccl.nccl_unique_id()) == C.NCCL_UNIQUE_ID_BYTES


def test_signature_parser_reads_defaults_and_nesting():
    doc = "f(self: X, a: int, b: dict[str, int] = {'x': 1}, c: float = -1.0) -> None\n\nhelp"
    assert binding_params(doc) == [("a", inspect.Parameter.empty), ("b", {"x": 1}), ("c", -1.0)]
