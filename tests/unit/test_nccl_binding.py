"""The interface of ``flcomm._C.NcclComm`` as the binding declares it, checked without a GPU.

pybind11 writes each method's signature into the first line of its ``__doc__``; the CPU stand-in
of the communicator is checked against the same lines, so these tests pin what it is checked
against: split's per-communicator configuration (``max_ctas``, ``cta_policy``), the properties
that report it, a docstring on every method and property, and the host-side refusals of a bad
configuration (``_testing.unattached_comm``: a communicator with no ncclComm behind it, so a check
that ran after the ncclCommSplit call would fail differently).
"""

from __future__ import annotations

import re

import pytest

from flcomm import _native

pytestmark = pytest.mark.skipif(
    not (_native.available() and _native.native().compiled_with_nccl()),
    reason="flcomm._C " + ("built without NCCL" if _native.available()
                           else f"not built: {_native.unavailable_reason()}"))

# pybind11 2.x writes `int`, 3.x `typing.SupportsInt | typing.SupportsIndex` for an int argument
PARAM = re.compile(r"(\w+): ([^=,]+?)(?: = ([^,]+))?(?:, |$)")


def C():
    return _native.native()


def signature(fn) -> tuple[list[tuple[str, str, str | None]], str]:
    """([(name, type, default)], return type) from the first line of a pybind11 ``__doc__``."""
    first = fn.__doc__.splitlines()[0]
    m = re.fullmatch(r"\w+\((.*)\) -> (.+)", first)
    assert m, f"not a pybind11 signature line: {first!r}"
    return [(n, t.strip(), d or None) for n, t, d in PARAM.findall(m.group(1))], m.group(2)


def test_split_signature():
    params, ret = signature(C().NcclComm.split)
    names = [(n, d) for n, _, d in params]
    assert names == [("self", None), ("color", None), ("key", None), ("timeout_s", "-1.0"), ("max_ctas", "0"),
                     ("cta_policy", "-1")], names
    kinds = {n: t for n, t, _ in params}
    for n in ("color", "key", "max_ctas", "cta_policy"):
        assert "int" in kinds[n].lower(), (n, kinds[n])
    assert "float" in kinds["timeout_s"].lower(), kinds["timeout_s"]
    # NOTE: a rank with no color gets None: `NcclComm | None` (pybind11 3) or `Optional[NcclComm]` (2)
    assert re.fullmatch(r"(flcomm\._C\.NcclComm \| None|Optional\[flcomm\._C\.NcclComm\])", ret), ret


def test_every_method_and_property_is_documented():
    cls = C().NcclComm
    methods = ["__init__", "split", "all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast",
               "group_start", "group_end", "abort", "destroy"]
    for name in methods:
        doc = getattr(cls, name).__doc__ or ""
        lines = [line for line in doc.splitlines()[1:] if line.strip()]
        assert lines, f"NcclComm.{name} has a signature but no description: {doc!r}"
    props = ["rank", "size", "device", "timeout", "max_ctas", "cta_policy", "is_aborted", "is_destroyed"]
    for name in props:
        p = cls.__dict__[name]
        assert isinstance(p, property) and p.fset is None, f"NcclComm.{name} must be a read-only property"
        assert (p.__doc__ or "").strip(), f"NcclComm.{name} has no docstring"


def test_a_root_carries_nccl_defaults():
    comm = C()._testing.unattached_comm(0, 1)
    assert (comm.max_ctas, comm.cta_policy) == (0, -1)


def test_negative_max_ctas_is_refused_before_nccl():
    comm = C()._testing.unattached_comm(0, 2)
    with pytest.raises(RuntimeError, match=r"max_ctas must be >= 0 .* got -1"):
        comm.split(0, 0, max_ctas=-1)
    assert not comm.is_aborted  # NOTE: refused before anything ran: the communicator is untouched


def test_cta_policy_is_checked_against_the_compiled_nccl():
    """cta_policy: one of the header's NCCL_CTA_POLICY_* values (NCCL >= 2.27), else refused with
    the values it accepts, or with the NCCL version that lacks ncclConfig_t.CTAPolicy."""
    comm = C()._testing.unattached_comm(0, 2)
    policies = dict(C().NCCL_CTA_POLICIES)
    compiled = C().nccl_version_compiled()
    if compiled >= 22700:
        assert policies.get("default") == 0 and policies.get("efficiency") == 1, policies
        if compiled >= 22800:
            assert policies.get("zero") == 2, policies
        bad = max(policies.values()) + 5
        with pytest.raises(RuntimeError, match=rf"cta_policy must be -1 .* 1 \(efficiency\).*got {bad}"):
            comm.split(0, 0, cta_policy=bad)
    else:
        assert policies == {}, policies
        with pytest.raises(RuntimeError, match=r"cta_policy needs NCCL >= 2\.27.*compiled against NCCL 2\."):
            comm.split(0, 0, cta_policy=1)
    assert not comm.is_aborted
