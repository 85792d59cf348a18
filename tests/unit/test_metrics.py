"""train/metrics.py: the JSONL file, per-step byte deltas and FSDP2's traffic count."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from flcomm.comm.base import CommStats, LinkTier
from flcomm.federated.strategy import Strategy
from flcomm.train.metrics import FsdpTraffic, MetricsWriter, TierCounter, perplexity, read_metrics


def test_jsonl_round_trip_keeps_the_last_record_of_a_step(tmp_path):
    path = tmp_path / "sub" / "m.jsonl"
    with MetricsWriter(str(path)) as w:
        w.write({"config": {"strategy": "fl-fsdp", "sync_every": 4, "codec": "int8"}})
        for s in (1, 2, 3):
            w.write({"step": s, "loss": float(10 - s)})
    # NOTE: a resumed run appends from its checkpoint: step 3 again, then on
    with MetricsWriter(str(path), append=True) as w:
        w.write({"step": 3, "loss": 1.5, "eval_loss": 2.0})
        w.write({"step": 4, "loss": 1.0})
        w.write({"summary": {"steps": 4}})
    m = read_metrics(str(path))
    assert [r["step"] for r in m.steps] == [1, 2, 3, 4]
    assert m.steps[2]["loss"] == 1.5
    assert m.evals() == [m.steps[2]]
    assert m.summary == {"steps": 4}
    assert m.label == "fl-fsdp E=4 int8"
    assert len(path.read_text().splitlines()) == 7


def test_writer_without_a_path_writes_nothing(tmp_path):
    w = MetricsWriter(None)
    w.write({"step": 1})
    w.close()
    assert list(tmp_path.iterdir()) == []


def test_a_broken_line_names_the_file_and_line(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps({"config": {}}) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"m\.jsonl:2: not a JSON line"):
        read_metrics(str(path))


def test_a_binary_file_names_the_file(tmp_path):
    path = tmp_path / "m.png"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe" * 10)
    with pytest.raises(ValueError, match=r"m\.png is not a metrics file: it is not UTF-8 text \(invalid start byte\)"):
        read_metrics(str(path))


def test_perplexity():
    assert perplexity(0.0) == 1.0
    assert perplexity(math.log(7.0)) == pytest.approx(7.0)
    assert perplexity(1e4) == math.inf


def test_tier_counter_deltas_and_exclusion():
    stats = CommStats()
    c = TierCounter(stats)
    stats.record_issue(LinkTier.INTER_NODE, 100)
    stats.record_issue(LinkTier.INTER_GROUP, 7)
    d = c.delta()
    assert d[LinkTier.INTER_NODE] == 100 and d[LinkTier.INTER_GROUP] == 7 and d[LinkTier.INTRA_NODE] == 0
    assert all(v == 0 for v in c.delta().values())
    out = c.excluding(lambda: (stats.record_issue(LinkTier.INTER_NODE, 50), "eval")[1])
    stats.record_issue(LinkTier.INTER_NODE, 3)
    assert out == "eval"
    assert c.delta()[LinkTier.INTER_NODE] == 3  # the excluded 50 bytes are not training traffic


def _fake_mesh(strategy: str, P: int, L: int, G=None, S=None):
    topo = Strategy.parse(strategy).topology(P, L, G, S)
    tiers = {"shard": LinkTier.INTER_NODE, "replicate": LinkTier.INTRA_NODE}
    return SimpleNamespace(topology=topo, stats=CommStats(), tier=lambda name: tiers[name])


def test_fsdp_traffic_matches_hand_counted_bytes():
    """Linear(3, 5) sharded over S = 2: weight [5, 3] pads to 6 rows (18 elements), bias [5]
    to 6: B = 24 fp32 elements = 96 bytes. Resharding unit: two all-gathers and one
    reduce-scatter of (S-1)/S * B = 48 bytes each. HSDP with R = 2 adds an all-reduce of the
    shard: 2 (R-1)/R * B/S = 48 bytes."""
    lin = nn.Linear(3, 5)
    mesh = _fake_mesh("fsdp", 2, 2)
    t = FsdpTraffic([(lin, True)], mesh)
    assert t.bytes_per_step[LinkTier.INTER_NODE] == 3 * 48
    assert t.bytes_per_step[LinkTier.INTRA_NODE] == 0

    hsdp = _fake_mesh("hsdp", 4, 2)  # R = 2 replicas of S = 2 shards
    t = FsdpTraffic([(lin, False)], hsdp, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    # bf16 all-gather once (the unit keeps its parameters), fp32 reduce-scatter, fp32 all-reduce
    assert t.bytes_per_step[LinkTier.INTER_NODE] == 24 + 48
    assert t.bytes_per_step[LinkTier.INTRA_NODE] == 48
    t.record_step()
    t.record_step()
    assert hsdp.stats.bytes(LinkTier.INTRA_NODE) == 96

    t = FsdpTraffic([(lin, True)], hsdp, count_shard_dim=False)
    assert t.bytes_per_step[LinkTier.INTER_NODE] == 0 and t.bytes_per_step[LinkTier.INTRA_NODE] == 48


def test_fsdp_traffic_counts_a_shared_parameter_once():
    inner = nn.Linear(4, 4, bias=False)  # 16 elements, S = 2: no padding, B = 64 bytes
    outer = nn.Sequential(inner, nn.Linear(4, 4, bias=False))
    t = FsdpTraffic([(inner, True), (outer, False)], _fake_mesh("fsdp", 2, 2))
    # inner: 2 AG + RS of 32 bytes; outer owns only its second layer: 1 AG + RS of 32 bytes
    assert t.bytes_per_step[LinkTier.INTER_NODE] == 3 * 32 + 2 * 32
