"""The native NCCL path on one GPU (skipped without one; see tests/conftest.py).

* A one-rank native mesh, ``init_fed_mesh(Strategy.FSDP.topology(1, 1), "cuda", transport="native")``:
  its tiers are NcclTransports split from one root (the exchange's with the CTA cap), their
  collectives give torch's results, and the hierarchical and replicate hooks on one FSDP2 model
  give the gradients of ``transport="torch"`` and of plain FSDP2, bit for bit. NOTE: on one rank
  the hierarchy's stages are a local copy (collectives/hierarchical.py, P == 1), so the
  replicate all-reduce hook is what puts an NCCL call of the native mesh inside FSDP's backward.
* The per-communicator CTA cap taking effect: NCCL's own init log (NCCL_DEBUG=INFO, subsystems
  INIT and ENV) of a split with ``max_ctas=2`` reports the configured cap ("Comm config Max CTAs
  set to 2", src/init.cc parseCommConfig) and a channel count within it ("<n> coll channels",
  initTransportsRank), where the root, forced to more channels by NCCL_MIN_CTAS, reports more.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from flcomm import _native
from flcomm.federated.mesh import init_fed_mesh
from tests.common.dist import run_distributed
from tests.common.gpu_figures import figure

pytestmark = pytest.mark.skipif(
    not (_native.available() and _native.native().compiled_with_nccl()),
    reason="flcomm built without NCCL")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIERS = ("shard", "replicate", "fed", "group", "shard_intra", "shard_inter")


STEPS = 2  # backward passes of _grads


def _param_groups(model: torch.nn.Module) -> int:
    """FSDP param groups of ``model``'s FSDP modules: each gets one all-reduce hook call per
    backward. NOTE: a module that owns no parameter of its own (the root Sequential here) has
    none, and ``set_all_reduce_hook`` is then a no-op on it (review N10). Counted from FSDP's
    state, as torch 2.11-2.13 (``_fsdp_param_group``, optional) and 2.14 (``_fsdp_param_groups``)
    keep it."""
    from torch.distributed.fsdp import FSDPModule

    n = 0
    for m in model.modules():
        if isinstance(m, FSDPModule):
            state = m._get_fsdp_state()
            groups = getattr(state, "_fsdp_param_groups", None)
            n += len(groups) if groups is not None else int(getattr(state, "_fsdp_param_group", None) is not None)
    return n


def _grads(fm, hooks: bool, device: str = "cuda") -> tuple[list[torch.Tensor], int]:
    """Gradients of STEPS steps of a small FSDP2 model on the mesh's shard dim (hooks: the
    hierarchical reduce-scatter / all-gather of the mesh and its replicate all-reduce hook), and
    the model's FSDP param groups (:func:`_param_groups`)."""
    from torch.distributed.fsdp import fully_shard

    from flcomm.fsdp.fsdp2 import apply_all_reduce_hook, apply_hierarchical_collectives

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)]).to(device)
    for layer in model:
        fully_shard(layer, mesh=fm.device_mesh["shard"])
    fully_shard(model, mesh=fm.device_mesh["shard"])
    if hooks:
        apply_hierarchical_collectives(model, fm.hierarchy("shard"))
        apply_all_reduce_hook(model, fm.transport("replicate"))
    gen = torch.Generator(device).manual_seed(1)
    x = torch.randn(32, 256, device=device, generator=gen)
    for _ in range(STEPS):
        model.zero_grad()
        model(x).pow(2).mean().backward()
    if device == "cuda":
        torch.cuda.synchronize()
    return [p.grad.full_tensor().cpu() for p in model.parameters()], _param_groups(model)


def _hook_calls_on_cpu(rank: int, world: int) -> dict:
    """The CPU twin's child (one gloo rank): a torch mesh, the same model and hooks as on the
    GPU; the replicate hook's calls against the param groups."""
    from flcomm.federated.strategy import Strategy

    fm = init_fed_mesh(Strategy.FSDP.topology(1, 1), "cpu")
    fm.stats.reset()
    _, groups = _grads(fm, hooks=True, device="cpu")
    calls = sum(s["calls"] for s in fm.stats.snapshot().values())
    fm.close()
    return {"calls": calls, "param_groups": groups}


@pytest.mark.timeout(120)
def test_replicate_hook_calls_per_param_group_on_cpu():
    """The CPU twin of the hook count below: one call per FSDP param group and backward, and the
    root (no parameters of its own) has no param group: 4 layers, 4 groups, not 5."""
    (res,) = run_distributed(_hook_calls_on_cpu, 1, timeout=90)
    assert res["param_groups"] == 4, res
    assert res["calls"] == STEPS * res["param_groups"], res


def _one_rank_native_mesh(rank: int, world: int) -> dict:
    from flcomm.comm.base import EXCHANGE_MAX_CTAS
    from flcomm.comm.nccl import NcclTransport
    from flcomm.federated.strategy import Strategy

    torch.cuda.set_device(0)
    meshes = {t: init_fed_mesh(Strategy.FSDP.topology(1, 1), "cuda", transport=t) for t in ("torch", "native")}
    native = meshes["native"]
    out: dict = {"cap": EXCHANGE_MAX_CTAS, "tiers": {}, "collectives_differ": []}
    for name in TIERS:
        t = native.transport(name)
        out["tiers"][name] = (type(t) is NcclTransport, getattr(getattr(t, "comm", None), "max_ctas", None))
        x = torch.randn(1024, device="cuda", generator=torch.Generator("cuda").manual_seed(2))
        a, b = x.clone(), x.clone()
        t.all_reduce(a, "sum")
        meshes["torch"].transport(name).all_reduce(b, "sum")
        torch.cuda.synchronize()
        if not torch.equal(a, b):
            out["collectives_differ"].append(name)
    hier = native.hierarchy("shard")
    out["hierarchy"] = (type(hier.intra) is NcclTransport, type(hier.inter) is NcclTransport)
    native.stats.reset()
    got = {}
    for t, fm in meshes.items():
        got[t], out[f"{t}_param_groups"] = _grads(fm, hooks=True)
    out["native_hook_calls"] = sum(s["calls"] for s in native.stats.snapshot().values())
    plain, _ = _grads(meshes["torch"], hooks=False)
    out["params"] = len(plain)
    out["native_vs_torch"] = [i for i, (a, b) in enumerate(zip(got["native"], got["torch"])) if not torch.equal(a, b)]
    out["native_vs_plain"] = [i for i, (a, b) in enumerate(zip(got["native"], plain)) if not torch.equal(a, b)]
    for fm in meshes.values():
        fm.close()
    return out


@pytest.mark.gpu
@pytest.mark.timeout(180)
def test_one_rank_native_mesh_and_hooks_match_torch():
    (res,) = run_distributed(_one_rank_native_mesh, 1, timeout=150, backend="nccl")
    figure("test_one_rank_native_mesh_and_hooks_match_torch", params=res["params"], tiers=str(res["tiers"]),
           hook_calls=res["native_hook_calls"], param_groups=res["native_param_groups"])
    for name, (native, max_ctas) in res["tiers"].items():
        assert native, f"transport {name!r} of a native mesh is not an NcclTransport: {res['tiers']}"
        # NOTE: only the exchange's communicator holds few CTAs; the group's keep NCCL's default
        assert max_ctas == (res["cap"] if name == "fed" else 0), (name, max_ctas, res["cap"])
    assert res["hierarchy"] == (True, True), res["hierarchy"]
    assert res["collectives_differ"] == [], res
    assert res["params"] == 8 and res["native_vs_torch"] == [] and res["native_vs_plain"] == [], res
    # NOTE: one replicate all-reduce per FSDP param group and backward; the root Sequential owns no
    # parameter, so it has no param group and no hook (review N10): 4 layers x 2, counted, not assumed
    assert res["native_param_groups"] > 0, res
    assert res["native_hook_calls"] == STEPS * res["native_param_groups"], \
        f"the replicate hook's calls on the native mesh against its FSDP param groups: {res}"


# ---- the CTA cap in NCCL's init log ----

_CTA_CHILD = r"""
import json, sys
import torch
from flcomm import _native
C = _native.native()
policy = 1 if C.nccl_version_loaded() >= 22700 and C.NCCL_CTA_POLICIES else -1
root = C.NcclComm(C.nccl_unique_id(), 1, 0, 0, 60.0)
child = root.split(0, 0, max_ctas=2, cta_policy=policy)
x = torch.ones(1 << 20, device="cuda")
child.all_reduce(x, "sum").wait()
res = {"root": [root.max_ctas, root.cta_policy], "child": [child.max_ctas, child.cta_policy],
       "sum": float(x.sum().item()), "repr": repr(child), "policy": policy}
child.destroy()
root.destroy()
sys.stdout.flush()
print("FLCOMM-RESULT " + json.dumps(res), flush=True)
"""

MIN_CTAS = 8  # NCCL_MIN_CTAS for the run: the root's channels, above the split's cap


def _coll_channels(log: str) -> list[int]:
    """The "<n> coll channels, ..." lines of NCCL's init log (initTransportsRank), in order."""
    return [int(n) for n in re.findall(r"NCCL INFO (\d+) coll channels", log)]


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_split_cta_cap_in_nccl_init_log():
    env = dict(os.environ, NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,ENV", NCCL_MIN_CTAS=str(MIN_CTAS),
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("NCCL_MAX_CTAS", None)
    env.pop("NCCL_DEBUG_FILE", None)
    import json

    proc = subprocess.run([sys.executable, "-c", _CTA_CHILD], env=env, capture_output=True, text=True, timeout=100,
                          cwd=ROOT)
    log = proc.stdout + proc.stderr
    tail = log[-4000:]
    assert proc.returncode == 0, tail
    (line,) = [ln for ln in log.splitlines() if ln.startswith("FLCOMM-RESULT ")]
    res = json.loads(line.split(" ", 1)[1])
    assert res["root"] == [0, -1] and res["child"] == [2, res["policy"]], res
    assert res["sum"] == float(1 << 20), res  # NOTE: the capped communicator still reduces
    assert "max_ctas=2" in res["repr"], res
    # NCCL's report of the configured cap: only the split set it (the root keeps the default)
    assert len(re.findall(r"Comm config Max CTAs set to 2\b", log)) == 1, tail
    channels = _coll_channels(log)
    figure("test_split_cta_cap_in_nccl_init_log", coll_channels=str(channels), cta_policy=res["policy"])
    assert len(channels) == 2, (channels, tail)
    root, child = channels
    # NOTE: NCCL_MIN_CTAS raises every communicator's channels; the split's maxCTAs caps its own
    assert root >= MIN_CTAS and child <= 2, (channels, tail)
    if res["policy"] >= 0:
        assert re.search(rf"Comm config CTA policy flags set to {res['policy']}\b", log), tail
