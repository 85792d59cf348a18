"""Cost model: exact hand-computed step times, monotonicity, crossovers, recommendations and the
CLI (``--measure`` on gloo is in tests/dist/test_costmodel_measure.py)."""

from __future__ import annotations

import argparse
import json
import math
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flcomm import costmodel as cm
from flcomm.costmodel import Cluster, Link, Plan, Strategy, Workload, codec_nbytes, predict
from flcomm.federated.config import FedAvgConfig

# 2 nodes x 2 ranks; intra 1 GB/s per rank, 10 us; inter 100 MB/s per node, 100 us.
AI, BI, AE, BE = 1e-5, 1e9, 1e-4, 1e8
N = 1_000_000


def cluster(nodes: int = 2, L: int = 2, be: float = BE) -> Cluster:
    return Cluster(nodes, L, Link(BI, AI), Link(be, AE))


def workload(**kw) -> Workload:
    base = dict(params=N, tokens_per_rank=1000, compute_s=0.1, param_bytes=2, grad_bytes=4)
    base.update(kw)
    return Workload(**base)


# ---------------------------------------------------------------- exact formulas ----

def test_fsdp_flat_two_nodes_matches_hand_formula():
    # ring over 4 ranks on 2 nodes: 3 steps of the inter latency; one ring flow per node NIC.
    ag = 3 * AE + max(0.75 * 2e6 / BE, 0.75 * 2e6 / BI)
    rs = 3 * AE + max(0.75 * 4e6 / BE, 0.75 * 4e6 / BI)
    p = predict(cluster(), workload(), Plan("fsdp"))
    assert p.inner_comm_s == pytest.approx(2 * ag + rs, rel=1e-12)
    assert p.step_time_s == pytest.approx(0.1 + 2 * ag + rs, rel=1e-12)
    assert p.tokens_per_s == pytest.approx(4 * 1000 / (0.1 + 2 * ag + rs), rel=1e-12)
    # CommStats convention: wire bytes one rank sends
    assert p.internode_bytes_per_step == 2 * (3 * 2_000_000 // 4) + 3 * 4_000_000 // 4
    assert p.intergroup_bytes_per_step == 0
    assert p.fed_comm_s == 0


def test_gloo_reduce_scatter_costs_an_all_reduce():
    c = Cluster(2, 2, Link(BI, AI), Link(BE, AE), reduce_scatter_as_all_reduce=True)
    ag = 3 * AE + 0.75 * 2e6 / BE
    rs = 6 * AE + 2 * 0.75 * 4e6 / BE  # the ring all-reduce of the whole gradient buffer
    p = predict(c, workload(), Plan("fsdp"))
    assert p.inner_comm_s == pytest.approx(2 * ag + rs, rel=1e-12)
    assert p.internode_bytes_per_step == 2 * 1_500_000 + 6_000_000
    m = {"nodes": 2, "ranks_per_node": 2, "backend": "gloo", "intra_node": {"bandwidth_Bps": BI},
         "inter_node": {"bandwidth_Bps": BE, "latency_s": AE}}
    assert Cluster.from_measurement(m).reduce_scatter_as_all_reduce
    assert not Cluster.from_measurement({**m, "backend": "nccl"}).reduce_scatter_as_all_reduce


def test_fsdp_hierarchical_matches_hand_formula():
    # intra ring over 2 on B, then inter ring over 2 nodes on B/2 with the NIC shared by 2 ranks
    def stage(B: float) -> float:
        return (AI + 0.5 * B / BI) + (AE + 0.5 * (B / 2) / (BE / 2))

    p = predict(cluster(), workload(), Plan("fsdp", hierarchical=True))
    assert p.inner_comm_s == pytest.approx(2 * stage(2e6) + stage(4e6), rel=1e-12)
    assert p.bytes_per_step["intra_node"] == 2 * 1_000_000 + 2_000_000
    assert p.bytes_per_step["inter_node"] == 2 * 500_000 + 1_000_000


def test_hsdp_matches_hand_formula():
    ag = AI + 0.5 * 2e6 / BI
    rs = AI + 0.5 * 4e6 / BI
    # replica all-reduce of the 2 MB gradient shard over 2 nodes; both ranks of a node share the NIC
    ar = 2 * AE + 2 * 0.5 * 2e6 / (BE / 2)
    p = predict(cluster(), workload(), Plan("hsdp"))
    assert (p.group_size, p.shard_size) == (4, 2)
    assert p.inner_comm_s == pytest.approx(2 * ag + rs + ar, rel=1e-12)
    assert p.internode_bytes_per_step == 2_000_000


@pytest.mark.parametrize("overlap", [False, True])
def test_fl_fsdp_int8_matches_hand_formula(overlap: bool):
    ag = AI + 0.5 * 2e6 / BI
    rs = AI + 0.5 * 4e6 / BI
    enc = _a16(500_000) + _a16(4 * math.ceil(500_000 / 256))  # int8 payload + fp32 scale per 256-block
    fed = 2 * AE + 2 * 0.5 * enc / (BE / 2)       # all-reduce over F = 2 groups, NIC shared by 2
    fed_cfg = FedAvgConfig(sync_every=4, codec="int8", overlap_steps=int(overlap))
    p = predict(cluster(), workload(), Plan("fl-fsdp", group_size=2, fedavg=fed_cfg))
    assert p.fed_comm_s == pytest.approx(fed, rel=1e-12)
    exposed = max(0.0, fed - 0.1) if overlap else fed
    assert p.step_time_s == pytest.approx(0.1 + 2 * ag + rs + exposed / 4, rel=1e-12)
    assert p.intergroup_bytes_per_step == pytest.approx(enc / 4)
    assert p.internode_bytes_per_step == 0


def test_fl_hsdp_and_units_and_overlap_formula():
    # 4 nodes x 2: FL+HSDP with G = 4 (2 nodes), S = 2; 3 FSDP units; half the inner comm hidden
    c, U = cluster(nodes=4), 3
    wl = workload(fsdp_units=U, fsdp_overlap=0.5)
    ag = AI + 0.5 * (2e6 / U) / BI
    rs = AI + 0.5 * (4e6 / U) / BI
    ar = 2 * AE + 2 * 0.5 * (2e6 / U) / (BE / 2)
    inner = U * (2 * ag + rs + ar)
    fed = 2 * AE + 2 * 0.5 * codec_nbytes("bf16", 500_000) / (BE / 2)
    p = predict(c, wl, Plan("fl-hsdp", group_size=4, shard_size=2,
                            fedavg=FedAvgConfig(sync_every=2, codec="bf16", sharded_exchange=False)))
    assert p.inner_comm_s == pytest.approx(inner, rel=1e-12)
    assert p.step_time_s == pytest.approx(0.1 + inner - min(0.5 * inner, 0.1) + fed / 2, rel=1e-12)


def test_sharded_fl_hsdp_exchange_formula():
    """FL+HSDP, F = 2 groups of R = 2 replicas x S = 2 shards on 4 nodes x 2: each replica
    all-reduces half of the N / S shard over the groups, then the replicas all-gather the
    averaged halves as encoded: inter-group bytes / R, plus (R-1)/R of the encoded shard inside
    the group."""
    c = cluster(nodes=4)
    enc = codec_nbytes("bf16", 250_000)                    # half of the 500k-element shard
    ar = 2 * AE + 2 * 1.0 * enc / BE                        # F = 2, two groups share each NIC
    ag = AE + 2 * 0.5 * (2 * enc) / BE                      # R = 2 at stride 2, the encoded shard
    plan = Plan("fl-hsdp", group_size=4, shard_size=2, fedavg=FedAvgConfig(sync_every=2, codec="bf16"))
    p = predict(c, workload(), plan)
    assert p.fed_comm_s == pytest.approx(ar + ag, rel=1e-12)
    plain = predict(c, workload(), Plan("fl-hsdp", group_size=4, shard_size=2,
                                        fedavg=FedAvgConfig(sync_every=2, codec="bf16", sharded_exchange=False)))
    assert p.intergroup_bytes_per_step == pytest.approx(enc / 2)
    assert plain.intergroup_bytes_per_step == pytest.approx(2 * p.intergroup_bytes_per_step)
    # (R-1)/R of the encoded shard (2 enc), once every E = 2 steps
    assert p.internode_bytes_per_step - plain.internode_bytes_per_step == pytest.approx(0.5 * 2 * enc / 2)


def test_fragments_move_a_kth_every_e_over_k_steps():
    enc = codec_nbytes("int8", 250_000)  # half of the N / S = 500k shard
    frag = 2 * AE + 2 * 0.5 * enc / (BE / 2)
    p = predict(cluster(), workload(), Plan("fl-fsdp", group_size=2,
                                            fedavg=FedAvgConfig(sync_every=4, codec="int8", fragments=2)))
    ag = AI + 0.5 * 2e6 / BI
    rs = AI + 0.5 * 4e6 / BI
    assert p.fed_comm_s == pytest.approx(frag, rel=1e-12)
    assert p.step_time_s == pytest.approx(0.1 + 2 * ag + rs + frag * 2 / 4, rel=1e-12)
    assert p.intergroup_bytes_per_step == pytest.approx(enc * 2 / 4)
    with pytest.raises(ValueError, match="fragments .K. must divide sync_every=4, got 3"):
        Plan("fl-fsdp", fedavg=FedAvgConfig(sync_every=4, fragments=3))


def test_a_sparse_codec_all_gathers_the_groups_encodings():
    """Top-k: F = 2 groups all-gather their encodings of the 500k-element shard (no reduction:
    a sum of sparse encodings is not sparse); sharded FL+HSDP: each replica's half, and the
    replicas then all-gather the F encodings of both halves."""
    spec = "topk:d=0.02:bits=2"
    enc = codec_nbytes(spec, 500_000)
    ag = AE + 0.5 * (2 * enc) / (BE / 2)  # NOTE: one ring step; two ranks share each NIC
    p = predict(cluster(), workload(), Plan("fl-fsdp", group_size=2, fedavg=FedAvgConfig(sync_every=2, codec=spec,
                                                                                         error_feedback=True)))
    assert p.fed_comm_s == pytest.approx(ag, rel=1e-12)
    assert p.intergroup_bytes_per_step == pytest.approx(enc / 2)  # NOTE: (F-1)/F of F encodings, every E = 2
    assert p.intergroup_bytes_per_step <= 0.03 * predict(cluster(), workload(), Plan(
        "fl-fsdp", group_size=2, fedavg=FedAvgConfig(sync_every=2))).intergroup_bytes_per_step
    half = codec_nbytes(spec, 250_000)
    c = cluster(nodes=4)
    hs = predict(c, workload(), Plan("fl-hsdp", group_size=4, shard_size=2,
                                     fedavg=FedAvgConfig(sync_every=2, codec=spec)))
    gather = AE + 2 * 0.5 * (2 * 2 * half) / BE  # NOTE: R = 2 replicas, each with F = 2 encodings
    assert hs.fed_comm_s == pytest.approx(AE + 2 * 0.5 * (2 * half) / BE + gather, rel=1e-12)
    with pytest.raises(ValueError, match=r"unknown replicate codec .*\(a dense codec: the replicas all-reduce"):
        Plan("hsdp", replicate_codec=spec)


def _a16(n: int) -> int:
    return -(-n // 16) * 16


def test_codec_bytes_are_the_wire_layout():
    """Payload, then one fp32 scale per 256-element block (int8, fp8), each 16-byte aligned."""
    for n in (1, 1000, 123_457):
        assert codec_nbytes("none", n) == 4 * n
        assert codec_nbytes("bf16", n) == codec_nbytes("fp16", n) == _a16(2 * n)
        assert codec_nbytes("int8", n) == codec_nbytes("fp8", n) == _a16(n) + _a16(4 * math.ceil(n / 256))


# ---------------------------------------------------------------- properties ----

plans = st.sampled_from([
    Plan("fsdp"), Plan("hsdp"), Plan("fsdp", hierarchical=True),
    Plan("fl-fsdp", group_size=2, fedavg=FedAvgConfig(sync_every=4, codec="none")),
    Plan("fl-fsdp", group_size=4, fedavg=FedAvgConfig(sync_every=2, codec="int8", overlap_steps=1)),
    Plan("fl-hsdp", group_size=4, shard_size=2, fedavg=FedAvgConfig(sync_every=8, codec="bf16")),
])


@settings(max_examples=60, deadline=None)
@given(plan=plans, be=st.floats(1e6, 1e10), factor=st.floats(1.01, 100.0), compute=st.floats(0.0, 1.0))
def test_step_time_never_grows_with_inter_bandwidth(plan: Plan, be: float, factor: float, compute: float):
    c = cluster(nodes=4, be=be)
    wl = workload(compute_s=compute)
    slow, fast = predict(c, wl, plan), predict(c.scale_inter(factor), wl, plan)
    assert fast.step_time_s <= slow.step_time_s * (1 + 1e-12)
    assert slow.step_time_s >= compute


@settings(max_examples=40, deadline=None)
@given(E=st.integers(1, 64), be=st.floats(1e6, 1e10))
def test_fl_step_time_falls_with_E_and_lighter_codecs(E: int, be: float):
    c, wl = cluster(nodes=4, be=be), workload()
    t = {codec: predict(c, wl, Plan("fl-fsdp", group_size=2,
                                    fedavg=FedAvgConfig(sync_every=E, codec=codec))).step_time_s
         for codec in ("none", "bf16", "int8")}
    assert t["int8"] <= t["bf16"] <= t["none"]
    later = predict(c, wl, Plan("fl-fsdp", group_size=2, fedavg=FedAvgConfig(sync_every=E + 1))).step_time_s
    assert later <= t["none"]
    overlapped = predict(c, wl, Plan("fl-fsdp", group_size=2,
                                     fedavg=FedAvgConfig(sync_every=E, overlap_steps=1))).step_time_s
    assert overlapped <= t["none"]


def test_fl_speedup_shrinks_as_inter_links_get_faster():
    # NOTE: only while the node links are the bottleneck (inter per node <= intra per rank):
    # beyond that FSDP is intra-bound while the exchange still speeds up, and with latency the
    # ratio of the latency floors (FSDP's longer rings) also moves it.
    c = Cluster(8, 2, Link(BI, 0.0), Link(BE, 0.0))
    wl, pl = workload(), Plan("fl-fsdp", group_size=2, fedavg=FedAvgConfig(sync_every=8, codec="int8"))
    s = [cm.speedup(c.scale_inter(f), wl, pl) for f in (0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0)]
    assert all(a >= b for a, b in zip(s, s[1:])), s
    assert s[0] > 2


# ---------------------------------------------------------------- crossovers ----

def test_bandwidth_crossover_is_where_speedup_equals_threshold():
    c, wl = cluster(nodes=8), workload()
    pl = Plan("fl-fsdp", group_size=2, fedavg=FedAvgConfig(sync_every=8, codec="int8"))
    thr = 1.5
    x = cm.crossover_bandwidth_ratio(c, wl, pl, "fsdp", threshold=thr)
    assert x.value is not None
    r0 = c.bandwidth_ratio

    def s(r: float) -> float:
        return cm.speedup(c.scale_inter(r / r0), wl, pl)

    assert s(x.value) == pytest.approx(thr, rel=1e-3)
    assert s(x.value * 0.9) > thr > s(x.value * 1.1)
    never = cm.crossover_bandwidth_ratio(c, wl, pl, "fsdp", threshold=1e6)
    assert never.value is None and "below" in never.describe()


def test_sync_every_crossover_is_the_smallest_paying_E():
    c, wl = cluster(nodes=8, be=1e7), workload(compute_s=0.01)
    pl = Plan("fl-fsdp", group_size=2, fedavg=FedAvgConfig(sync_every=1, codec="none"))
    x = cm.crossover_sync_every(c, wl, pl, "fsdp", threshold=1.2)
    E = int(x.value)
    assert E > 1
    assert cm.speedup(c, wl, Plan("fl-fsdp", group_size=2, fedavg=FedAvgConfig(sync_every=E)), "fsdp") >= 1.2
    assert cm.speedup(c, wl, Plan("fl-fsdp", group_size=2, fedavg=FedAvgConfig(sync_every=E - 1)), "fsdp") < 1.2
    with pytest.raises(ValueError, match="fl-fsdp / fl-hsdp, got fsdp"):
        cm.crossover_sync_every(c, wl, Plan("fsdp"))


# ---------------------------------------------------------------- recommendation ----

def test_recommend_federates_on_slow_links_and_not_on_fast_ones():
    wl = workload()
    slow = cm.recommend(cluster(nodes=8, be=1e7), wl, memory_bytes=math.inf)
    assert slow.best.plan.strategy.federated
    assert slow.best.tokens_per_s >= 0.95 * slow.ranked[0].tokens_per_s
    fast = cm.recommend(Cluster(8, 2, Link(BI, 0.0), Link(2 * BI * 10, 0.0)), wl, memory_bytes=math.inf)
    assert not fast.best.plan.strategy.federated, fast.reason


def test_recommend_considers_the_sparse_codec_where_its_bytes_pay():
    """Syncing every step over 1 MB/s links, top-k's exchange is the only one that is not the
    step's bottleneck: it wins, though it ranks as the lossiest codec; asked for dense codecs
    only, it does not come up."""
    wl, c = workload(), cluster(nodes=8, be=1e6)
    rec = cm.recommend(c, wl, memory_bytes=math.inf, max_sync_every=1)
    assert rec.best.plan.codec == "topk:d=0.02:bits=2" and rec.best.plan.error_feedback, rec.reason
    int8 = [p for p in rec.ranked if p.plan.codec == "int8"]
    assert int8 and int8[0].tokens_per_s < 0.95 * rec.best.tokens_per_s
    dense = cm.recommend(c, wl, memory_bytes=math.inf, max_sync_every=1, codecs=("none", "int8"), top=10 ** 6)
    assert {p.plan.codec for p in dense.ranked if p.plan.strategy.federated} == {"none", "int8"}


def test_recommend_respects_memory():
    wl = workload()
    c = cluster(nodes=8, be=1e7)
    fsdp = predict(c, wl, Plan("fsdp"))  # S = P = 16: the least memory per rank
    rec = cm.recommend(c, wl, memory_bytes=fsdp.memory_total * 1.01)
    assert all(p.shard_size == 16 for p in rec.ranked)
    assert rec.best.plan.strategy is Strategy.FSDP
    assert rec.left_out.startswith(f"{len(list(_all_plans(c, wl))) - len(rec.ranked)} plans need more than")
    with pytest.raises(ValueError, match="no plan fits: .* plans need more than 1 B per rank"):
        cm.recommend(cluster(), wl, memory_bytes=1.0)


def _all_plans(c, wl):
    return [p for p in cm.recommend(c, wl, memory_bytes=math.inf, top=10 ** 6).ranked]


def test_memory_per_rank_formula():
    """N = 1e6 on 2 nodes x 2: int8 + error feedback + nesterov + overlap keeps four fp32 copies of
    the N / S shard (anchor, residual, momentum, local-at-sync copy); the paper's mode none."""
    wl = workload(fsdp_units=4, activation_bytes=123.0)
    full = Plan("fl-fsdp", group_size=2, shard_size=None,
                fedavg=FedAvgConfig(sync_every=4, codec="int8", error_feedback=True, outer="nesterov", overlap_steps=1))
    m = predict(cluster(), wl, full).memory_bytes
    buckets = 2 * full.fedavg.bucket_cap_mb * 2**20
    assert m == {"state": 16 * N / 2, "unsharded": N / 4 * (2 * 2 + 4), "fedavg": 4 * 4 * N / 2 + buckets,
                 "activations": 123.0}
    assert cm.fedavg_shard_copies(full) == 4
    assert cm.fedavg_shard_copies(Plan("fl-fsdp", group_size=2,
                                       fedavg=FedAvgConfig(sync_every=1, codec="int8", error_feedback=True))) == 2
    assert cm.fedavg_shard_copies(Plan("fl-fsdp", 2)) == 0  # in place, bucket by bucket
    assert predict(cluster(), wl, Plan("fl-fsdp", 2)).memory_bytes["fedavg"] == buckets
    assert predict(cluster(), wl, Plan("fsdp")).memory_bytes["fedavg"] == 0


def test_the_paper_preset_recommends_a_plan_that_fits(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert cm.main(["--preset", "llama3.1-8b-leonardo", "--recommend", "--json", str(out)]) == 0
    rec = json.loads(out.read_text())["recommendation"]
    assert sum(rec["best"]["memory_bytes"].values()) <= 64e9
    assert "plans need more than 64 GB per rank" in rec["left_out"]
    assert "mem/rank" in capsys.readouterr().out


# ---------------------------------------------------------------- bad input ----

@pytest.mark.parametrize("make, match", [
    (lambda: Plan("zero"), "strategy must be one of fsdp, hsdp, fl-fsdp, fl-hsdp, got 'zero'"),
    (lambda: Plan("fl-fsdp", group_size=2,
                  fedavg=FedAvgConfig(sync_every=1, codec="int4")), "unknown codec 'int4'; known codecs: none"),
    (lambda: Plan("fl-fsdp", group_size=2, fedavg=FedAvgConfig(sync_every=0)),
     r"sync_every \(E, local steps between syncs\) must be an integer >= 1, got 0"),
    (lambda: predict(cluster(), workload(), Plan("fl-fsdp", group_size=4)), "at least two federation groups"),
    (lambda: predict(cluster(nodes=3), workload(), Plan("fl-fsdp", group_size=4)), "does not divide world_size 6"),
    (lambda: predict(cluster(), workload(), Plan("hsdp", shard_size=4)), "at least two replicas per group"),
    (lambda: predict(cluster(), workload(), Plan("fsdp", group_size=2)), "one group of all 4 ranks"),
    (lambda: Link(0.0), "bandwidth must be a finite number > 0, got 0.0"),
    (lambda: Link(1.0, -1.0), "latency must be a finite number >= 0"),
    (lambda: Cluster(0, 2, Link(1.0), Link(1.0)), "nodes must be an integer >= 1, got 0"),
    (lambda: workload(params=-1), "params must be a finite number > 0, got -1"),
    (lambda: workload(fsdp_overlap=1.5), r"fsdp_overlap must be a finite number in \[0, 1\], got 1.5"),
    (lambda: codec_nbytes("int8", -3), "numel must be an integer >= 0, got -3"),
    (lambda: cm.collective_time("broadcast", 1, 2, cluster()), "kind must be one of .* got 'broadcast'"),
    (lambda: cm.crossover_bandwidth_ratio(cluster(), workload(), Plan("fl-fsdp", group_size=2), lo=1, hi=0.5),
     "need 0 < lo < hi"),
    (lambda: cm.compute_time_from_flops(1e9, 1e3, 1e12, 0.0), r"mfu must be a finite number in \(0, 1\], got 0.0"),
])
def test_bad_input_is_refused_with_a_clear_message(make, match):
    with pytest.raises(ValueError, match=match):
        make()


# ---------------------------------------------------------------- CLI ----

def test_cli_preset_table_crossover_recommend_and_json(tmp_path, capsys):
    out = tmp_path / "pred.json"
    rc = cm.main(["--preset", "llama3.1-8b-leonardo", "--codec", "int8", "--crossover", "--recommend",
                  "--memory-gb", "64", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0
    for s in ("fsdp", "hsdp S=4", "fl-fsdp G=4 E=8 int8", "fl-hsdp G=8 E=8 int8 S=4", "recommended:"):
        assert s in text
    rec = json.loads(out.read_text())
    assert {p["plan"]["strategy"] for p in rec["predictions"]} == {"fsdp", "hsdp", "fl-fsdp", "fl-hsdp"}
    assert len(rec["crossover"]) == 2 and "recommendation" in rec


def test_cli_missing_arguments_exit_2(capsys):
    assert cm.main(["--params", "1e9", "--tokens-per-rank", "10", "--compute-s", "1"]) == 2
    assert "need --nodes, --ranks-per-node, --intra-bw, --inter-bw" in capsys.readouterr().err


def test_cli_measure_without_a_job_says_how_to_launch(capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert cm.main(["--measure"]) == 2
    assert "torchrun" in capsys.readouterr().err


def test_cli_explicit_flag_beats_preset_even_at_parser_default(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert cm.main(["--preset", "llama3.1-8b-leonardo", "--fsdp-overlap", "0", "--json", str(out)]) == 0
    pr = cm.CLUSTER_PRESETS["llama3.1-8b-leonardo"]
    c = Cluster(pr["nodes"], pr["ranks_per_node"], Link.gbit(pr["intra_gbit"], pr["intra_lat_us"]),
                Link.gbit(pr["inter_gbit"], pr["inter_lat_us"]))
    wl = Workload(pr["params"], pr["tokens_per_rank"],
                  cm.compute_time_from_flops(pr["params"], pr["tokens_per_rank"], pr["tflops"] * 1e12, pr["mfu"]),
                  fsdp_units=pr["fsdp_units"], fsdp_overlap=0.0)
    fsdp = json.loads(out.read_text())["predictions"][0]
    assert fsdp["plan"]["strategy"] == "fsdp"
    assert fsdp["step_time_s"] == pytest.approx(predict(c, wl, Plan("fsdp")).step_time_s, rel=1e-12)


# ---------------------------------------------------------------- stated assumptions (issue 25) ----

# The question of issue 25: 16 nodes of 8 GPUs, 400 GB/s in a node, 25 GB/s between nodes, 8B.
QUESTION = ["--params", "8e9", "--nodes", "16", "--ranks-per-node", "8", "--intra-bw", "400GB/s",
            "--inter-bw", "25GB/s", "--tokens-per-rank", "8192", "--tflops", "989"]
Q_N, Q_TOKENS = 8e9, 8192


def _ask(tmp_path, capsys, *extra: str) -> tuple[str, dict]:
    out = tmp_path / "q.json"
    assert cm.main([*QUESTION, *extra, "--json", str(out)]) == 0
    return capsys.readouterr().out, json.loads(out.read_text())


def _blocks(n: float) -> int:
    """The l with (l - 1/2)^3 <= N / (12 * 128^2) < (l + 1/2)^3: N = 12 l d^2 at d = 128 l."""
    x = n / (12 * 128**2)
    return next(lo for lo in range(1, 1000) if x < (lo + 0.5) ** 3)


def _question_workload(**kw) -> Workload:
    blocks = _blocks(Q_N)
    d = math.sqrt(Q_N / (12 * blocks))
    base = dict(params=Q_N, tokens_per_rank=Q_TOKENS, compute_s=6 * Q_N * Q_TOKENS / (989e12 * 0.4),
                fsdp_units=blocks + 1, fsdp_overlap=0.8,
                activation_bytes=2 * Q_TOKENS * d * blocks + 34 * Q_TOKENS * d + 4 * Q_TOKENS * 128256)
    base.update(kw)
    return Workload(**base)


Q_CLUSTER = Cluster(16, 8, Link(400e9), Link(25e9))


@pytest.mark.parametrize("text, bytes_per_s", [
    ("25GB/s", 25e9), ("200Gbit/s", 25e9), ("200gbit", 25e9), ("200", 25e9), ("200Gbps", 25e9),
    ("25 GB", 25e9), ("1.6Tbit/s", 2e11), ("500MB/s", 5e8), ("100Mbit", 1.25e7), (" 2e2 GBIT/s ", 25e9),
])
def test_bandwidth_units_parse_to_bytes_per_s(text: str, bytes_per_s: float):
    """GB/s are 8 Gbit/s; a bare number keeps the flags' old meaning, Gbit/s."""
    assert cm.parse_bandwidth(text) == bytes_per_s


@pytest.mark.parametrize("text", ["25gb/s", "25Gb/s", "25/s", "25 GiB/s", "fast", "", "-1GB/s", "0gbit", "nanGB/s"])
def test_bad_bandwidth_units_name_what_came_and_what_is_allowed(text: str, capsys):
    with pytest.raises(ValueError, match=rf"bandwidth must be .*({re.escape(repr(text))}|{re.escape(text)})"):
        cm.parse_bandwidth(text)
    with pytest.raises(SystemExit) as e:
        cm.main([*QUESTION, f"--inter-bw={text}"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "argument --inter-bw/--inter-gbit: bandwidth must be" in err and repr(text) in err


def test_gbyte_and_gbit_flags_predict_the_same(tmp_path, capsys):
    _, byte = _ask(tmp_path, capsys, "--memory-gb", "80")
    _, bit = _ask(tmp_path, capsys, "--memory-gb", "80", "--intra-gbit", "3200", "--inter-bw", "200Gbit/s")
    assert byte["assumptions"]["inter_node"]["value"] == bit["assumptions"]["inter_node"]["value"] == 25e9
    assert byte["assumptions"]["intra_node"]["value"] == bit["assumptions"]["intra_node"]["value"] == 400e9
    assert [p["step_time_s"] for p in byte["predictions"]] == [p["step_time_s"] for p in bit["predictions"]]


def test_assumptions_name_each_default_and_json_carries_them(tmp_path, capsys):
    text, rec = _ask(tmp_path, capsys, "--memory-gb", "80")
    a = rec["assumptions"]
    wl = _question_workload()
    expected = {"compute_s": wl.compute_s, "param_bytes": 2, "grad_bytes": 2, "allgathers_per_step": 2,
                "fsdp_units": wl.fsdp_units, "fsdp_overlap": 0.8, "state_bytes_per_param": 16,
                "activation_bytes": wl.activation_bytes, "memory_limit_bytes": 80e9,
                "intra_node": 400e9, "inter_node": 25e9, "inter_group": 25e9, "reduce_scatter_as_all_reduce": False,
                "replicate_codec": "none", "convergence": None}
    assert set(a) == set(expected)
    for key, value in expected.items():
        numeric = value and not isinstance(value, str)
        assert a[key]["value"] == pytest.approx(value, rel=1e-12) if numeric else a[key]["value"] == value, key
        if key != "convergence":
            assert a[key]["text"] in text, key  # every one printed, with its source and flag
            assert f"  {a[key]['text']}  [{a[key]['source']}; {a[key]['flag']}]" in text
    assert {k: a[k]["source"] for k in ("fsdp_units", "activation_bytes", "fsdp_overlap", "memory_limit_bytes",
                                         "state_bytes_per_param", "inter_node", "inter_group")} == {
        "fsdp_units": "estimated", "activation_bytes": "estimated", "fsdp_overlap": "default",
        "memory_limit_bytes": "flag", "state_bytes_per_param": "default", "inter_node": "flag",
        "inter_group": "default"}
    for named in ("MFU 0.4 [default]", f"FSDP units {wl.fsdp_units}", "FSDP overlap 0.8", "memory limit 80 GB",
                  "training state 16 B per parameter", "25 GB/s (200 Gbit/s) per node"):
        assert named in text, named
    assert "note: convergence is not modelled" in text and rec["notes"] == [a["convergence"]["text"]]
    # the values stated are the values used
    fsdp = predict(Q_CLUSTER, wl, Plan("fsdp"))
    assert rec["predictions"][0]["step_time_s"] == pytest.approx(fsdp.step_time_s, rel=1e-12)
    assert rec["predictions"][0]["memory_total"] == pytest.approx(fsdp.memory_total, rel=1e-12)


def test_without_a_memory_limit_nothing_is_recommended(tmp_path, capsys):
    assert cm.main([*QUESTION, "--recommend"]) == 2
    out = capsys.readouterr()
    assert "--recommend needs --memory-gb" in out.err and "recommended" not in out.out
    text, rec = _ask(tmp_path, capsys)
    assert "memory NOT checked" in text and rec["assumptions"]["memory_limit_bytes"]["value"] is None
    assert "mem/rank: not checked" in text and "recommendation" not in rec
    text, rec = _ask(tmp_path, capsys, "--recommend", "--memory-gb", "inf")  # asked for: said loudly
    assert "MEMORY NOT CHECKED" in rec["recommendation"]["reason"] and "memory NOT checked" in text
    with pytest.raises(TypeError, match="memory_bytes"):
        cm.recommend(cluster(), workload())  # the library asks for it too
    with pytest.raises(ValueError, match=r"memory_bytes must be a finite number > 0 .*math.inf.*got None"):
        cm.recommend(cluster(), workload(), memory_bytes=None)


def test_a_plan_that_does_not_fit_is_never_recommended(tmp_path, capsys):
    wl = _question_workload()
    free = cm.recommend(Q_CLUSTER, wl, memory_bytes=math.inf).best
    limit = free.memory_total * 0.99
    rec = cm.recommend(Q_CLUSTER, wl, memory_bytes=limit)
    assert rec.best.memory_total <= limit and rec.best.plan != free.plan
    assert all(p.memory_total <= limit for p in rec.ranked)
    # the CLI: rows over the limit are marked, the recommendation fits
    text, out = _ask(tmp_path, capsys, "--recommend", "--memory-gb", "20")
    for row in out["predictions"]:
        assert row["fits"] == (row["memory_total"] <= 20e9)
        line = next(x for x in text.splitlines() if x[2:].startswith(row["label"] + " "))
        assert line.endswith("!") != row["fits"], line
    assert out["recommendation"]["best"]["memory_total"] <= 20e9 and out["recommendation"]["best"]["fits"]
    assert "mem/rank with !: needs more than 20 GB per rank" in text


@pytest.mark.parametrize("flags, units, source", [
    ((), _blocks(Q_N) + 1, "estimated"), (("--layers", "32"), 33, "derived"), (("--fsdp-units", "7"), 7, "flag")])
def test_fsdp_units_come_from_the_model(tmp_path, capsys, flags, units, source):
    _, rec = _ask(tmp_path, capsys, *flags)
    assert rec["assumptions"]["fsdp_units"]["value"] == units
    assert rec["assumptions"]["fsdp_units"]["source"] == source
    fsdp = rec["predictions"][0]
    assert fsdp["memory_bytes"]["unsharded"] == pytest.approx(Q_N / units * (2 * 2 + 2), rel=1e-12)


@pytest.mark.parametrize("n", [1e8, 1.2e9, 8.03e9, 7e10, 4.05e11])
def test_blocks_estimate_solves_n_equals_12_l_d2(n: float):
    l_est = cm.estimate_blocks(n)
    assert l_est == _blocks(n)
    assert cm.estimate_activation_bytes(n, l_est, 1000, 1) == pytest.approx(
        1000 * math.sqrt(n / (12 * l_est)) * (2 * l_est + 34) + 4000, rel=1e-12)


def test_the_preset_states_its_own_units_and_memory(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert cm.main(["--preset", "llama3.1-8b-leonardo", "--json", str(out)]) == 0
    a = json.loads(out.read_text())["assumptions"]
    assert a["fsdp_units"]["value"] == 33 and a["fsdp_units"]["source"] == "preset llama3.1-8b-leonardo"
    assert a["memory_limit_bytes"]["value"] == 64e9 and a["activation_bytes"]["value"] == 8e9


@pytest.mark.parametrize("flags, overlap", [((), 0.8), (("--fsdp-overlap", "0.5"), 0.5), (("--gloo",), 0.0)])
def test_fsdp_overlap_is_stated_beside_the_fsdp_row(tmp_path, capsys, flags, overlap):
    text, rec = _ask(tmp_path, capsys, *flags)
    assert rec["assumptions"]["fsdp_overlap"]["value"] == overlap
    lines = text.splitlines()
    i = next(i for i, x in enumerate(lines) if x.startswith("  fsdp "))
    p = predict(Cluster(16, 8, Link(400e9), Link(25e9), reduce_scatter_as_all_reduce="--gloo" in flags),
                _question_workload(fsdp_overlap=overlap), Plan("fsdp"))
    hidden = min(overlap * p.inner_comm_s, p.compute_s)
    assert lines[i + 1].startswith("    ^ FSDP's ")
    assert f"{p.inner_comm_s:.3g} s of in-group communication per step, {hidden:.3g} s of it hidden " \
           f"(--fsdp-overlap {overlap:g}" in lines[i + 1]


def test_the_recommended_plan_is_a_row_with_its_ratios_and_an_e_sweep(tmp_path, capsys):
    text, rec = _ask(tmp_path, capsys, "--recommend", "--memory-gb", "80")
    wl = _question_workload()
    r = rec["recommendation"]
    plan = Plan.from_dict(r["best"]["plan"])
    fsdp, hsdp = predict(Q_CLUSTER, wl, Plan("fsdp")), predict(Q_CLUSTER, wl, Plan("hsdp"))
    best = predict(Q_CLUSTER, wl, plan)
    assert r["best"]["vs_fsdp"] == pytest.approx(fsdp.step_time_s / best.step_time_s, rel=1e-12)
    assert r["best"]["vs_hsdp"] == pytest.approx(hsdp.step_time_s / best.step_time_s, rel=1e-12)
    row = next(x for x in text.splitlines() if x.startswith(f"* {plan.label()} "))
    for base in (fsdp, hsdp):
        assert f" {base.step_time_s / best.step_time_s:.2f}x " in row
    sweep = r["sync_every_sweep"]
    assert [x["plan"]["fedavg"]["sync_every"] for x in sweep] == sorted({1, 2, 4, 8, 16, plan.sync_every})
    for x in sweep:
        p = predict(Q_CLUSTER, wl, plan.with_fedavg(sync_every=x["plan"]["fedavg"]["sync_every"]))
        assert x["step_time_s"] == pytest.approx(p.step_time_s, rel=1e-12)
        assert x["vs_fsdp"] == pytest.approx(fsdp.step_time_s / p.step_time_s, rel=1e-12)
        assert any(line[2:].startswith(p.plan.label() + " ") for line in text.splitlines())


def test_help_shows_every_default(monkeypatch, capsys):
    """Each option's help entry (from its flag to the next option's) ends with its default, or
    says how an unset one is derived; only what must be given has none."""
    from flcomm.costmodel.__main__ import make_parser

    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit):
        cm.main(["--help"])
    out = capsys.readouterr().out
    helptext = " ".join(out[out.index("options:"):].split())
    acts = [a for a in make_parser()._actions if a.dest != "help" and a.help != argparse.SUPPRESS]

    def start(act) -> str:
        opt = act.option_strings[0]
        if isinstance(act, argparse.BooleanOptionalAction):  # NOTE: --flag, --no-flag
            return ", ".join(act.option_strings)
        if act.nargs == 0:
            return f"{opt} {act.help.split()[0]}"
        return f"{opt} {{" if act.choices else f"{opt} {act.metavar or act.dest.upper()}"

    pos = []
    for act in acts:
        pos.append(helptext.index(start(act), pos[-1] + 1 if pos else 0))
    must_give = {"nodes", "ranks_per_node", "intra_bw", "inter_bw", "cluster_json", "params", "tokens_per_rank",
                 "tflops", "json", "measure_json", "preset"}
    for act, a, b in zip(acts, pos, [*pos[1:], len(helptext)]):
        entry = helptext[a:b]
        if act.default is False or (act.nargs == 0 and not isinstance(act, argparse.BooleanOptionalAction)):
            continue  # a switch (--overlap sets --overlap-steps, whose default is shown)
        if act.default is None:
            assert "(default:" in entry or act.dest in must_give, entry
        else:
            assert f"(default: {act.default})" in entry, entry


def test_a_measured_gloo_cluster_assumes_no_fsdp_overlap_and_says_measured(tmp_path, capsys):
    m = tmp_path / "m.json"
    m.write_text(json.dumps({"nodes": 2, "ranks_per_node": 2, "backend": "gloo",
                             "intra_node": {"bandwidth_Bps": BI, "latency_s": AI},
                             "inter_node": {"bandwidth_Bps": BE, "latency_s": AE}}))
    out = tmp_path / "o.json"
    assert cm.main(["--cluster-json", str(m), "--params", "1e6", "--tokens-per-rank", "1000", "--compute-s", "0.1",
                    "--fsdp-units", "1", "--activation-gb", "0", "--json", str(out)]) == 0
    rec = json.loads(out.read_text())
    a = rec["assumptions"]
    assert a["fsdp_overlap"]["value"] == 0.0 and a["reduce_scatter_as_all_reduce"]["value"] is True
    assert {a[k]["source"] for k in ("intra_node", "inter_node", "inter_group")} == {f"measured ({m})"}
    c = Cluster(2, 2, Link(BI, AI), Link(BE, AE), reduce_scatter_as_all_reduce=True)
    assert rec["predictions"][0]["step_time_s"] == pytest.approx(
        predict(c, workload(grad_bytes=2, activation_bytes=0.0), Plan("fsdp")).step_time_s, rel=1e-12)


@pytest.mark.parametrize("flag, message", [("--layers", "--layers must be an integer >= 1, got 0"),
                                           ("--fsdp-units", "fsdp_units must be an integer >= 1, got 0")])
def test_zero_layers_or_units_are_refused_not_estimated(flag, message, capsys):
    assert cm.main([*QUESTION, flag, "0"]) == 2
    assert message in capsys.readouterr().err


def test_auto_overlap_is_predicted_with_the_k_fedavg_would_choose():
    """``overlap_steps="auto"``: the prediction of the k FedAvg settles on, the smallest k with
    k * compute >= 1.25 * exchange (at most E / K), written out here."""
    c, wl = cluster(), workload()
    for E, K in ((8, 1), (8, 2), (2, 1)):
        auto = predict(c, wl, Plan("fl-fsdp", group_size=2, fedavg=FedAvgConfig(sync_every=E, codec="int8",
                                                                                overlap_steps="auto", fragments=K)))
        k = max(1, min(E // K, math.ceil(1.25 * auto.fed_comm_s / wl.compute_s)))
        fixed = predict(c, wl, Plan("fl-fsdp", group_size=2, fedavg=FedAvgConfig(sync_every=E, codec="int8",
                                                                                 overlap_steps=k, fragments=K)))
        assert auto.step_time_s == fixed.step_time_s, (E, K, k)


# ---------------------------------------------------------------- the replicate codec (issue 27) ----

@pytest.mark.parametrize("strategy, G", [("hsdp", None), ("fl-hsdp", 4)])
@pytest.mark.parametrize("codec, per_numel", [("int8", None), ("fp8", None), ("bf16", 2), ("fp16", 2)])
def test_replicate_codec_sends_its_bytes_over_the_replicas(strategy: str, G: int | None, codec: str,
                                                           per_numel: int | None):
    """HSDP's replica all-reduce of the 2 MB (500k fp32 elements) gradient shard in the codec:
    int8 / fp8 1 B per element plus a 4 B scale per 256-block, bf16 / fp16 2 B, each part
    16-aligned; the ring over R = 2 nodes sends the buffer once, the NIC shared by 2 ranks."""
    n = 500_000
    enc = _a16(n * per_numel) if per_numel else _a16(n) + _a16(4 * math.ceil(n / 256))
    c = cluster(nodes=4) if G else cluster()
    fed = FedAvgConfig(sync_every=4)
    plain = predict(c, workload(), Plan(strategy, G, 2, fed))
    coded = predict(c, workload(), Plan(strategy, G, 2, fed, replicate_codec=codec))
    ar = lambda nbytes: 2 * AE + 2 * 0.5 * nbytes / (BE / 2)  # noqa: E731
    assert coded.inner_comm_s - plain.inner_comm_s == pytest.approx(ar(enc) - ar(4 * n), rel=1e-9)
    # NOTE: fl-hsdp adds the sharded exchange's all-gather over the replicas, the same in both
    assert plain.internode_bytes_per_step - coded.internode_bytes_per_step == 4 * n - enc
    if strategy == "hsdp":
        assert (plain.internode_bytes_per_step, coded.internode_bytes_per_step) == (4 * n, enc)
    assert coded.intergroup_bytes_per_step == plain.intergroup_bytes_per_step  # the FedAvg exchange is the same
    assert f"rep={codec}" in coded.plan.label() and "rep=" not in plain.plan.label()
    assert Plan.from_dict(coded.plan.to_dict()) == coded.plan


@pytest.mark.parametrize("make, match", [
    (lambda: Plan("fsdp", replicate_codec="int8"),
     r"expected strategy hsdp or fl-hsdp \(R = G / S > 1 replicas\), got fsdp"),
    (lambda: Plan("fl-fsdp", replicate_codec="fp8"), r"expected strategy hsdp or fl-hsdp .*, got fl-fsdp"),
    (lambda: Plan("hsdp", replicate_codec="int4"), r"unknown replicate codec 'int4'; expected one of none, bf16"),
    (lambda: Plan("hsdp", replicate_codec="topk"), r"unknown replicate codec 'topk'.*\(a dense codec"),
])
def test_replicate_codec_without_replicas_or_unknown_is_refused(make, match):
    """The trainer's check (flcomm.codecs.check_replicate_codec): the same words for a plan."""
    with pytest.raises(ValueError, match=match):
        make()


def test_cli_replicate_codec_in_assumptions_and_rows(tmp_path, capsys):
    text, rec = _ask(tmp_path, capsys, "--replicate-codec", "int8")
    line = next(x for x in text.splitlines() if "HSDP replicas all-reduce" in x)
    per = (_a16(1 << 20) + _a16(4 * (1 << 20) // 256)) / (1 << 20)
    assert f"in int8, {per:.4g} B per element" in line and "[flag; --replicate-codec]" in line
    assert rec["assumptions"]["replicate_codec"]["value"] == "int8"
    rows = {p["plan"]["strategy"]: p for p in rec["predictions"]}
    assert rows["hsdp"]["plan"]["replicate_codec"] == "int8" and "rep=int8" in rows["hsdp"]["label"]
    assert rows["fsdp"]["plan"]["replicate_codec"] == "none"
    assert re.search(r"^\s+hsdp S=8 rep=int8 ", text, re.M), text
    text, rec = _ask(tmp_path, capsys)
    assert "gradients in 2 B per element (FSDP's own)  [default; --replicate-codec]" in text
