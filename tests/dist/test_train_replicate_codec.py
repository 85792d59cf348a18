"""The driver's ``--replicate-codec int8 --replicate-error-feedback`` on HSDP (4 gloo ranks, 2
emulated nodes of 2, R = 2 replicas of S = 2 shards): flcomm's replicate all-reduce hook trains
like FSDP2's own all-reduce, keeps the replicas equal, and its inter-node bytes (the replicate
dim's, counted by the hook's transport) are the int8 encoding's: about a quarter of the fp32
all-reduce's, plus one fp32 scale per block."""

from __future__ import annotations

import math
import os

import pytest
import torch

from flcomm.codecs import get_codec
from flcomm.federated.config import FedAvgConfig
from flcomm.train.config import TrainConfig
from flcomm.train.metrics import read_metrics
from tests.common.dist import run_distributed

torch.set_num_threads(1)

SMALL = dict(model="tiny", steps=6, batch_size=2, seq_len=32, lr=3e-3, warmup=1, eval_batches=1,
             eval_fraction=0.05, max_tokens=300_000, progress=False, seed=0)


def _runs(rank: int, world: int, out_dir: str) -> dict:
    from flcomm.train.loop import train

    res = {}
    hook = dict(replicate_codec="int8", replicate_error_feedback=True)
    # NOTE: FL+HSDP: 2 groups of R = 2 replicas x S = 1 on one-rank nodes (the replicate dim
    # crosses nodes); verify=True checks the replicas' shards hash-equal at every sync start
    fl = dict(strategy="fl-hsdp", ranks_per_node=1, group_size=2, shard_size=1,
              fedavg=FedAvgConfig(sync_every=2, codec="int8", verify=True))
    for name, kw in (("exact", {}), ("int8", hook), ("fl-exact", fl), ("fl-int8", {**fl, **hook})):
        kw = {"strategy": "hsdp", "ranks_per_node": 2, "shard_size": 2, **kw}
        cfg = TrainConfig(metrics=os.path.join(out_dir, f"{name}.jsonl"), **SMALL, **kw)
        r = train(cfg, return_params=True)
        res[name] = {"losses": r.losses, "params": r.params}
    return res


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("replicate"))
    return run_distributed(_runs, 4, out, timeout=300), out


@pytest.mark.parametrize("kind", ["", "fl-"])
def test_int8_replicate_all_reduce_trains_like_the_exact_one(runs, kind):
    """HSDP, and FL+HSDP (where FedAvg's sharding check takes the hook as the replication)."""
    res, _ = runs
    exact, coded = res[0][f"{kind}exact"]["losses"], res[0][f"{kind}int8"]["losses"]
    assert all(math.isfinite(v) for v in coded), coded
    assert coded[-1] < coded[0] - 0.5, coded  # NOTE: the exact run falls by ~1.5 nats over these steps
    for a, b in zip(exact, coded):
        assert b == pytest.approx(a, abs=0.02), (exact, coded)
    # the replicas (ranks 0 and 2 hold the same shards) end bit for bit equal: the two-hop
    # all-gather hands both the same averaged gradient
    peer = 2 if kind == "" else 1  # NOTE: the rank holding the same shards in the other replica
    for name, p in res[0][f"{kind}int8"]["params"].items():
        assert torch.equal(p, res[peer][f"{kind}int8"]["params"][name]), name


@pytest.mark.parametrize("kind", ["", "fl-"])
def test_int8_replicate_bytes_are_a_quarter_plus_the_scales(runs, kind):
    _, out = runs
    exact = read_metrics(os.path.join(out, f"{kind}exact.jsonl"))
    coded = read_metrics(os.path.join(out, f"{kind}int8.jsonl"))
    assert coded.config["replicate_codec"] == "int8" and coded.config["replicate_error_feedback"] is True
    assert coded.config["transport"] == exact.config["transport"] == "torch"
    # NOTE: the shard group is one node (intra-node), the replicate group spans the two nodes:
    # inter-node bytes are the replicate all-reduce's alone, and the intra-node ones do not change
    bs = get_codec("int8").block_size
    want = (1 + 4 / bs) / 4  # 1 B per element for 4, and a 4 B scale per block
    for e, c in zip(exact.steps, coded.steps):
        if kind and e["step"] % 2 == 0:
            continue  # NOTE: a sync step also carries the sharded exchange's slices over the replicas
        assert c["intranode_bytes"] == e["intranode_bytes"]
        assert c["internode_bytes"] / e["internode_bytes"] == pytest.approx(want, rel=0.02)
