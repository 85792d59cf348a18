"""One Strategy: the driver, the cost model and the strategy benchmark resolve every strategy
and default to the same topology (or all refuse it)."""

from __future__ import annotations

import itertools
import os
import sys

import pytest

from flcomm.costmodel import Cluster, Link, Plan, predict
from flcomm.costmodel.model import _resolve
from flcomm.federated.strategy import Strategy, one_node
from flcomm.federated.topology import Topology
from flcomm.train.__main__ import _config, _train_parser
from flcomm.train.config import TrainConfig, resolve_topology

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bench.strategies import RunSpec  # noqa: E402

WORLDS = [(2, 1), (4, 2), (4, 4), (8, 2), (8, 4), (16, 4)]
SIZES = [None, 1, 2, 4, 8]


def _shape(fn):
    try:
        return fn().mesh_shape
    except ValueError:
        return "refused"


def _cases():
    for st, (P, L), G, S in itertools.product(Strategy, WORLDS, SIZES, SIZES):
        if (G is None or G <= P) and (S is None or S <= P):
            yield st, P, L, G, S


@pytest.mark.parametrize("st", list(Strategy), ids=str)
def test_driver_costmodel_and_benchmark_agree(st):
    n = 0
    for _, P, L, G, S in (c for c in _cases() if c[0] is st):
        want = _shape(lambda: st.topology(P, L, G, S))
        driver = _shape(lambda: resolve_topology(TrainConfig(strategy=st.value, ranks_per_node=L, group_size=G,
                                                             shard_size=S), P))
        cluster = Cluster(P // L, L, Link(1e10), Link(1e9))

        def cost():
            g, s = _resolve(Plan(st, G, S), cluster)
            return Topology(P, L, g, s)

        spec = RunSpec(st, group_size=G, shard_size=S)
        argv = spec.driver_args() + ["--ranks-per-node", str(L)]
        bench = _shape(lambda: resolve_topology(_config(_train_parser().parse_args(argv)), P))
        assert driver == want and _shape(cost) == want and bench == want, (st, P, L, G, S, want, driver, bench)
        n += want != "refused"
    assert n > 0


def test_defaults_follow_the_table():
    # 4 nodes of 2: one node per shard / group; fl-hsdp two nodes per group
    assert Strategy.FSDP.topology(8, 2).mesh_shape == (1, 1, 8)
    assert Strategy.HSDP.topology(8, 2).mesh_shape == (1, 4, 2)
    assert Strategy.FL_FSDP.topology(8, 2).mesh_shape == (4, 1, 2)
    assert Strategy.FL_HSDP.topology(8, 2).mesh_shape == (2, 2, 2)
    # all on one node: halves, so there are still two groups / replicas
    assert Strategy.FL_FSDP.topology(4, 4).mesh_shape == (2, 1, 2)
    assert Strategy.HSDP.topology(4, 4).mesh_shape == (1, 2, 2)
    assert one_node(4, 4) == 2 and one_node(2, 8) == 2


@pytest.mark.parametrize("st, P, L, G, S, match", [
    (Strategy.FL_FSDP, 4, 2, 4, None, "at least two federation groups"),
    (Strategy.HSDP, 4, 2, None, 4, "at least two replicas"),
    (Strategy.FSDP, 4, 2, 2, None, "group_size is for the fl-"),
    (Strategy.FL_FSDP, 8, 2, 4, 2, "shards over the whole group"),
    (Strategy.FSDP, 6, 4, None, None, "whole nodes"),
])
def test_refusals_name_the_numbers(st, P, L, G, S, match):
    with pytest.raises(ValueError, match=match):
        st.topology(P, L, G, S)


def test_parse_and_properties():
    assert Strategy.parse("FL_HSDP") is Strategy.FL_HSDP and Strategy.parse("fl+fsdp") is Strategy.FL_FSDP
    assert [s.federated for s in Strategy] == [False, False, True, True]
    assert [s.hybrid for s in Strategy] == [False, True, False, True]
    assert Strategy.of(Strategy.FL_HSDP.topology(8, 2)) is Strategy.FL_HSDP
    with pytest.raises(ValueError, match="strategy must be one of fsdp, hsdp, fl-fsdp, fl-hsdp, got 'ddp'"):
        Strategy.parse("ddp")


def test_the_cost_model_predicts_the_default_plans():
    cluster = Cluster(4, 2, Link.gbit(100), Link.gbit(1))
    from flcomm.costmodel import Workload, predict_strategies

    wl = Workload(params=1e8, tokens_per_rank=1024, compute_s=0.5)
    got = {p.plan.strategy: (p.world_size // p.group_size, p.group_size // p.shard_size, p.shard_size)
           for p in predict_strategies(cluster, wl)}
    assert got == {st: st.topology(8, 2).mesh_shape for st in Strategy}
    assert predict(cluster, wl, Plan("fl-fsdp")).group_size == 2
