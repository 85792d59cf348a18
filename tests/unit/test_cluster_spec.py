"""The emulated cluster's pure parts (flcomm/train/netns.py, bench/strategies.py): spec
validation, the CPU split per node, and the strategy benchmark's run specs and statistics."""

from __future__ import annotations

import re

import pytest

from flcomm.train import netns
from flcomm.train.metrics import eval_at_time
from flcomm.train.netns import ClusterSpec, EmulatedCluster


def test_spec_validation():
    assert netns.parse_rate("100mbit") == 100e6
    assert netns.parse_rate("12.5mbps") == 100e6
    with pytest.raises(ValueError, match="rate must look like 100mbit, 1gbit or 12.5mbps .* got '100 megabit'"):
        ClusterSpec(2, rate="100 megabit")
    with pytest.raises(ValueError, match="burst must be >= 256kb .* got '64kb'"):
        ClusterSpec(2, burst="64kb")
    with pytest.raises(ValueError, match=r"nodes must be an integer in \[1, 250\], got 0"):
        ClusterSpec(0)
    with pytest.raises(ValueError, match="tag must be 1-8 lowercase"):
        EmulatedCluster(ClusterSpec(2), tag="Bad-Tag")


def test_node_cpus_split_the_machine():
    # an equal contiguous share each, the remainder left out
    assert [netns.node_cpus(n, 2, [3, 0, 1, 2, 4]) for n in range(2)] == [[0, 1], [2, 3]]
    assert [netns.node_cpus(n, 2, [0, 1]) for n in range(2)] == [[0], [1]]
    # more nodes than CPUs: one CPU each, round robin
    assert [netns.node_cpus(n, 3, [5, 7]) for n in range(3)] == [[5], [7], [5]]
    # every node's share is disjoint from the others' when there are enough CPUs
    cpus = list(range(16))
    for nodes in range(1, 17):
        shares = [set(netns.node_cpus(n, nodes, cpus)) for n in range(nodes)]
        assert all(len(x) == 16 // nodes for x in shares)
        assert len(set().union(*shares)) == nodes * (16 // nodes)
    with pytest.raises(ValueError, match="node must be in"):
        netns.node_cpus(2, 2, [0, 1])

# ---------------------------------------------------------------- bench/strategies.py helpers ----

def test_strategies_run_specs_and_statistics():
    from bench import strategies as bs

    s = bs.RunSpec.parse("fl-fsdp:E=8:codec=int8:overlap:G=2")
    assert (s.strategy, s.sync_every, s.codec, s.overlap, s.group_size) == ("fl-fsdp", 8, "int8", True, 2)
    assert s.driver_args() == ["--strategy", "fl-fsdp", "--sync-every", "8", "--codec", "int8", "--overlap-steps",
                               "auto", "--group-size", "2"]
    assert bs.RunSpec.parse("fsdp").driver_args() == ["--strategy", "fsdp"]
    assert bs.RunSpec.parse("fsdp:hier").driver_args() == ["--strategy", "fsdp", "--hierarchical"]
    with pytest.raises(ValueError, match="strategy must be one of fsdp, hsdp, fl-fsdp, fl-hsdp, got 'ddp'"):
        bs.RunSpec.parse("ddp")
    with pytest.raises(ValueError, match="expected E=<int>.* got 'E=x'"):
        bs.RunSpec.parse("fl-fsdp:E=x")
    steps = [{"step": i, "time_s": 10.0 * i, "step_time_s": 1.0 + (i == 4)} for i in range(1, 9)]
    steps[3]["eval_loss"], steps[7]["eval_loss"] = 4.0, 3.0   # t = 40 s and 80 s
    assert [r["step"] for r in bs.timed_steps(steps, 4)] == [5, 6, 7, 8]
    with pytest.raises(ValueError, match="no timed steps left after 8"):
        bs.timed_steps(steps, 8)
    assert eval_at_time(steps, 30.0) is None
    assert eval_at_time(steps, 60.0) == pytest.approx(3.5)
    assert eval_at_time(steps, 100.0) == 3.0
    # blocks are gathered twice, the root once: strictly between 1 and 2
    assert 1.0 < bs.effective_allgathers("small") < 2.0


def test_strategies_replicate_codec_spec_reaches_the_driver():
    from bench import strategies as bs
    from flcomm.train.__main__ import _config, _train_parser

    s = bs.RunSpec.parse("hsdp:rep=int8:repef:S=2")
    assert s.label() == "hsdp rep=int8+ef"
    cfg = _config(_train_parser().parse_args(s.driver_args()))
    got = (cfg.strategy, cfg.shard_size, cfg.replicate_codec, cfg.replicate_error_feedback)
    assert got == ("hsdp", 2, "int8", True)
    assert _config(_train_parser().parse_args(bs.RunSpec.parse("hsdp").driver_args())).replicate_codec == "none"
    with pytest.raises(ValueError, match=re.escape("rep=<none|bf16|fp16|int8|fp8>") + ".* got 'rep=int4'"):
        bs.RunSpec.parse("hsdp:rep=int4")


def test_strategies_codec_options_and_error_feedback_reach_the_driver():
    from bench import strategies as bs
    from flcomm.train.__main__ import _config, _train_parser

    s = bs.RunSpec.parse("fl-fsdp:E=8:codec=topk:d=0.01:bits=4:ef:overlap")
    assert (s.codec, s.error_feedback, s.overlap, s.sync_every) == ("topk:d=0.01:bits=4", True, True, 8)
    assert s.label() == "fl-fsdp E=8 topk:d=0.01:bits=4+ef ovl" and ":" not in s.slug()
    fed = _config(_train_parser().parse_args(s.driver_args())).fedavg
    assert (fed.codec, fed.error_feedback, fed.overlap_steps) == ("topk:d=0.01:bits=4", True, "auto")
    assert fed == s.fedavg()
    assert bs.RunSpec.parse("fl-fsdp:codec=int8:ef").fedavg().error_feedback
    with pytest.raises(ValueError, match="run spec 'fl-fsdp:codec=topk:bits=3'.*bits must be one of 2, 4, 8"):
        bs.RunSpec.parse("fl-fsdp:codec=topk:bits=3")
