"""``import flcomm`` exports what a training script touches, lazily, each name from the module
that defines it."""

from __future__ import annotations

import importlib
import subprocess
import sys
import types

import pytest

import flcomm
from tests.common.imports import SHIMS

SCRIPT_NAMES = {"Strategy", "Topology", "FedAvg", "FedAvgConfig", "Federation", "apply_hierarchical_collectives",
                "ReplicaMismatchError",
                "apply_all_reduce_hook", "register_hierarchical_comm_hook", "NonFiniteAverageError",
                "GroupLostError", "TooFewGroupsError", "EngineError", "EngineTimeout"}


def test_every_export_resolves_to_its_defining_module():
    assert SCRIPT_NAMES <= set(flcomm.__all__)
    for name, module in flcomm._LAZY.items():
        obj = getattr(flcomm, name)
        assert obj is getattr(importlib.import_module(module), name)
        assert obj.__module__ == module, (name, obj.__module__, module)
    assert dir(flcomm) == sorted(flcomm.__all__)


def test_import_flcomm_loads_none_of_the_heavy_modules():
    code = ("import sys, flcomm; heavy = [m for m in ('flcomm.federated.fedavg', 'flcomm.fsdp.fsdp2', "
            "'torch.distributed.fsdp') if m in sys.modules]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def _packages() -> list[str]:
    import pkgutil

    return ["flcomm"] + [m.name for m in pkgutil.walk_packages(flcomm.__path__, "flcomm.") if m.ispkg]


def test_every_package_export_resolves():
    """Every package's ``__all__`` (and its lazy table, where it has one) names objects that
    exist; a lazy name comes from the module its table says, which defines it (the
    ``flcomm.federated.FedMesh`` of an earlier table pointed at a module without it)."""
    pkgs = _packages()
    assert {"flcomm.federated", "flcomm.comm", "flcomm.fsdp", "flcomm.train"} <= set(pkgs), pkgs
    for pkg in pkgs:
        mod = importlib.import_module(pkg)
        names = getattr(mod, "__all__", None)
        assert names, f"{pkg} has no __all__"
        missing = [n for n in names if not hasattr(mod, n)]
        assert not missing, f"{pkg}.__all__ names what it does not have: {missing}"
        for name, where in getattr(mod, "_LAZY", {}).items():
            obj = getattr(mod, name)
            assert obj is getattr(importlib.import_module(where), name), (pkg, name, where)
            if isinstance(obj, type) or callable(obj):
                assert obj.__module__ == where, (pkg, name, obj.__module__, where)


# NOTE: the names kept one release after a rename: (module, old name, new name)
RENAMED = [
    ("flcomm.costmodel.model", "PRESETS", "CLUSTER_PRESETS"),
    ("flcomm.costmodel", "PRESETS", "CLUSTER_PRESETS"),
    ("flcomm.train.model", "PRESETS", "MODEL_PRESETS"),
    ("flcomm.train", "PRESETS", "MODEL_PRESETS"),
    ("flcomm.federated.shards", "Slot", "AveragedTensor"),
]


@pytest.mark.parametrize(("module", "old", "new"), RENAMED, ids=lambda x: str(x))
def test_a_renamed_attribute_still_resolves_with_a_warning(module: str, old: str, new: str):
    mod = importlib.import_module(module)
    with pytest.warns(DeprecationWarning, match=rf"{module}\.{old} is deprecated: use {module}\.{new}"):
        obj = getattr(mod, old)
    assert obj is getattr(mod, new)
    names = vars(mod).get("__all__")  # (not getattr: the module's __getattr__ is the one under test)
    assert names is None or (old not in names and new in names)


def test_a_renamed_method_still_works_with_a_warning():
    """``DeltaExchange.add_own`` (overlap's apply step) is ``add_correction`` now: it adds the
    correction the unpack left in the local-at-sync buffer."""
    from flcomm.federated.exchange import DeltaExchange

    got: list = []
    ex = types.SimpleNamespace(add_correction=got.append)
    with pytest.warns(DeprecationWarning, match=r"DeltaExchange\.add_own\(\) is deprecated: use add_correction\(\)"):
        DeltaExchange.add_own(ex, ["local"])
    assert got == [["local"]]


@pytest.mark.parametrize(("old", "new"), sorted(SHIMS.items()))
def test_a_moved_module_still_imports_with_a_warning(old: str, new: str, monkeypatch):
    """``flcomm.kernels`` / ``sparse`` / ``apply`` warn once on import and are the module of
    ``flcomm.ops`` itself, so a name, or a patch of one, reaches the code."""
    monkeypatch.delitem(sys.modules, old, raising=False)
    with pytest.warns(DeprecationWarning, match=rf"{old} is deprecated: it moved to {new}"):
        mod = importlib.import_module(old)
    assert mod is importlib.import_module(new) is sys.modules[old]
    assert getattr(flcomm, old.rpartition(".")[2]) is mod
