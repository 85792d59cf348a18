"""The two-hop design in a single process: the error of an int8 average through the two hops stays
within its bound and flat in the world size, where re-quantizing along a ring grows with it."""

from __future__ import annotations

import pytest
import torch

from flcomm.codecs import get_codec
from tests.common.two_hop import BLOCK, rank_input, round_trip, simulate_two_hop, two_hop_bound


def simulate_ring(xs: list[torch.Tensor], name: str) -> torch.Tensor:
    """A ring reduce that re-quantizes the partial sum at every hop (what the two-hop design
    avoids): returns the average."""
    partial = xs[0].clone()
    for x in xs[1:]:
        partial = round_trip(partial, name, BLOCK) + x
    partial = round_trip(partial, name, BLOCK)
    return partial / len(xs)


def _run_plans(xs: list[torch.Tensor], name: str) -> list[torch.Tensor]:
    """flcomm's two-hop plan (``TwoHopPlan``) on ``len(xs)`` ranks in one process, stage by
    stage in lockstep (tests/common/lockstep.py): each rank's AVG result."""
    from flcomm.collectives.compressed import TwoHopPlan
    from flcomm.comm.base import ReduceOp
    from tests.common.lockstep import LockstepWorld

    world = LockstepWorld(len(xs))
    plans = [TwoHopPlan(t, xs[0].numel(), get_codec(name), ReduceOp.AVG, torch.device("cpu")) for t in world.ranks]
    outs = [x.clone() for x in xs]
    for plan, out in zip(plans, outs):
        plan.encode_scatter(out, None)
    for plan in plans:
        plan.reduce_gather()
    for plan in plans:
        plan.decode_result()
    return outs


def test_error_does_not_grow_with_world_size():
    """AVG of W i.i.d. inputs through int8, up to 32 ranks: flcomm's two-hop plan gives every
    rank the same result, bit for bit the independent simulation's (tests/common/two_hop.py),
    within its bound and with an error flat in W, while re-quantizing along a ring grows with W
    (the dist grid of tests/dist/test_compressed.py checks the same on real process groups, to
    4 ranks)."""
    n = 4096
    two_hop, ring = {}, {}
    for W in (2, 8, 32):
        xs = [rank_input(r, 77, n, 1.0) for r in range(W)]
        exact = sum(xs) / W
        outs = _run_plans(xs, "int8")
        sim, reduced, _ = simulate_two_hop(xs, "int8", "avg")
        for r, out in enumerate(outs):
            assert torch.equal(out, sim), (W, r, float((out - sim).abs().max()))
        bound = two_hop_bound(xs, reduced, "int8", "avg")
        assert bool(((outs[0] - exact).abs() <= bound).all()), W
        two_hop[W] = float((outs[0] - exact).abs().mean())
        ring[W] = float((simulate_ring(xs, "int8") - exact).abs().mean())
    assert two_hop[32] <= 1.5 * two_hop[2], two_hop
    assert ring[32] >= 2 * two_hop[32], (ring, two_hop)


def test_the_lockstep_stand_in_refuses_a_wait_a_real_transport_would_block_on():
    """tests/common/lockstep.py fails loudly where a real transport would hang."""
    from flcomm.collectives.compressed import TwoHopPlan
    from flcomm.comm.base import ReduceOp
    from tests.common.lockstep import LockstepWorld

    world = LockstepWorld(3)
    plans = [TwoHopPlan(t, 1024, get_codec("int8"), ReduceOp.AVG, torch.device("cpu")) for t in world.ranks]
    plans[0].encode_scatter(torch.ones(1024), None)
    with pytest.raises(RuntimeError, match=r"all_to_all #0 waited for before ranks \[1, 2\] issued it"):
        plans[0].reduce_gather()


def test_two_hop_plan_stages_are_named_and_ordered():
    """The plan's three stages by what they do: each refuses to run out of order, naming the
    stage it needs, and the idle plan reports its stage."""
    from types import SimpleNamespace

    from flcomm.collectives.compressed import TwoHopPlan
    from flcomm.comm.base import ReduceOp

    plan = TwoHopPlan(SimpleNamespace(size=2, rank=0), 512, get_codec("int8"), ReduceOp.AVG, torch.device("cpu"))
    assert plan.stage == "idle"
    with pytest.raises(RuntimeError, match=r"reduce_gather\(\) needs encode_scatter\(\)"):
        plan.reduce_gather()
    with pytest.raises(RuntimeError, match=r"decode_result\(\) needs reduce_gather\(\)"):
        plan.decode_result()
    plan.finish()  # NOTE: nothing in flight: nothing to run
    assert plan.stage == "idle"


def test_gather_plan_stages_are_named_and_its_buffers_counted():
    """The sparse codec's plan: the same stages (its one hop is issued by encode_scatter), its
    buffers one encoding sent and W gathered, and no two-hop chunking (whole blocks only)."""
    from types import SimpleNamespace

    from flcomm.collectives.compressed import GatherPlan, make_plan
    from flcomm.comm.base import ReduceOp

    c = get_codec("topk:k=4:bits=2:block=256")
    plan = make_plan(SimpleNamespace(size=3, rank=1), 1000, c, ReduceOp.AVG, torch.device("cpu"))
    assert isinstance(plan, GatherPlan) and plan.padded_numel == 1024 and plan.stage == "idle"
    assert plan.nbytes() == 4 * c.encoded_nbytes(1024)
    with pytest.raises(RuntimeError, match=r"reduce_gather\(\) needs encode_scatter\(\)"):
        plan.reduce_gather()
    with pytest.raises(RuntimeError, match=r"decode_result\(\) needs encode_scatter\(\)"):
        plan.decode_result()
    assert type(make_plan(SimpleNamespace(size=3, rank=1), 1000, get_codec("int8"), ReduceOp.AVG,
                          torch.device("cpu"))).__name__ == "TwoHopPlan"


def test_the_plan_gathers_on_two_ranks_and_a_sparse_codec():
    """The documented choice (flcomm.collectives.compressed.gathers): one all-gather for a sparse
    codec on any world, and for a dense one on two ranks without replicas gathering its result;
    two hops otherwise; no plan for a lossless codec or one rank."""
    from types import SimpleNamespace

    from flcomm.collectives.compressed import gathers, make_plan
    from flcomm.comm.base import ReduceOp

    topk = get_codec("topk:k=4:bits=2:block=256")
    for name in ("bf16", "fp16", "int8", "fp8"):
        c = get_codec(name)
        assert gathers(c, 2) and not gathers(c, 2, replicas=2) and not gathers(c, 3) and not gathers(c, 1), name
    assert gathers(topk, 2) and gathers(topk, 3) and gathers(topk, 2, replicas=2)
    assert not gathers(get_codec("none"), 2)
    for world, replicas, want in ((2, 1, "GatherPlan"), (2, 2, "TwoHopPlan"), (3, 1, "TwoHopPlan")):
        plan = make_plan(SimpleNamespace(size=world, rank=0), 1000, get_codec("int8"), ReduceOp.AVG,
                         torch.device("cpu"), replicas)
        assert type(plan).__name__ == want, (world, replicas)
