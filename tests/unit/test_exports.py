"""``import flcomm`` exports what a training script touches, lazily, each name from the module
that defines it."""

from __future__ import annotations

import importlib
import subprocess
import sys

import flcomm

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
