"""Elastic federation (flcomm.federated.elastic): a lost federation group costs that group, not
the job.

FedAvg level: 8 ranks as 4 groups x 2, each group its own torch.distributed world; a rank of
group 1 dies (before a sync, or while its exchange is in flight); the survivors' parameters
must equal the single-process simulation that drops group 1 at that round
(:func:`tests.fedavg_sim.simulate` with ``drop_at``), and the other rank of group 1 must stop
with GroupLostError.
"""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta

import pytest
import torch

from tests.dist import run_distributed
from tests.fedavg_sim import averaged_names, batch, loss_fn, make_model, make_opt, simulate

F, G = 4, 2
GRACE_S = 3.0
# NOTE: a membership round is the grace plus building the new groups (about a second); 5 x that
# (a loaded machine; bench/faults.py's table holds it to grace + 10 s)
MEMBERSHIP_BOUND_S = 5 * (GRACE_S + 1.0)


def _train_elastic(rank: int, world: int, E: int, T: int, kill: tuple[int, int, str], overlap: bool,
                   outer: str) -> dict:
    from flcomm.federated.elastic import Federation, GroupLostError
    from flcomm.federated.fedavg import FedAvg
    from flcomm.federated.topology import Topology
    from tests import dist as tdist

    timeout = timedelta(seconds=30)
    topo = Topology(world, ranks_per_node=G, group_size=G)
    mesh = topo.build(timeout=timeout, group_rank=rank)
    federation = Federation(tdist.STORE, topo, rank, timeout=timeout, grace_s=GRACE_S, stats=mesh.stats)
    f = rank // G
    model = make_model(0)
    opt = make_opt(model.parameters(), "adamw", 1e-2)
    fed = FedAvg(model, mesh, sync_every=E, outer=outer, overlap=overlap, federation=federation)
    kill_rank, kill_step, phase = kill
    try:
        for t in range(1, T + 1):
            if rank == kill_rank and t == kill_step and phase == "forward":
                os._exit(1)
            # NOTE: the group's loss over its G ranks' batches, on each rank (a replicated model)
            (sum(loss_fn(model, *batch(f, i, t)) for i in range(G)) / G).backward()
            opt.step()
            opt.zero_grad()
            fed.step()
            if rank == kill_rank and t == kill_step and phase == "exchange":
                time.sleep(0.02)  # NOTE: the exchange is in flight (overlap) when the rank dies
                os._exit(1)
        fed.finish()
    except GroupLostError as e:
        return {"lost": str(e), "group": e.group}
    params, bufs = averaged_names(model)
    sd = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    return {"params": {n: sd[n].detach().clone() for n in params + bufs}, "events": federation.events,
            "generation": federation.generation, "groups": list(federation.groups)}


@pytest.mark.parametrize("case", [
    # (E, T, rank killed, its step, phase, overlap, outer, the round group 1 is dropped at)
    (4, 10, 3, 6, "forward", False, "avg", 8),
    (4, 10, 3, 4, "exchange", True, "nesterov", 4),
], ids=["killed-in-forward-paper-mode", "killed-during-overlapped-exchange-nesterov"])
def test_survivors_equal_the_simulation_without_the_lost_group(case):
    E, T, kill_rank, kill_step, phase, overlap, outer, dropped = case
    out = run_distributed(_train_elastic, F * G, E, T, (kill_rank, kill_step, phase), overlap, outer,
                          timeout=90, group_worlds=G, may_die=frozenset({kill_rank}))
    want = simulate(F, G, E, T, outer=outer, overlap=overlap, drop_at={1: dropped})
    lost_group = [r for r in range(F * G) if r // G == 1]
    for r in lost_group:
        if r == kill_rank:
            assert out[r] is None
        else:
            assert out[r] is not None and out[r]["group"] == 1, out[r]
            assert "federation group 1 is out of the federation" in out[r]["lost"]
            assert f"[{kill_rank}]" in out[r]["lost"], out[r]["lost"]
    for r in range(F * G):
        if r // G == 1:
            continue
        got = out[r]
        assert got["groups"] == [0, 2, 3] and got["generation"] == 1
        ev = got["events"]
        assert len(ev) == 1 and ev[0]["lost"] == [1] and ev[0]["generation"] == 1
        assert ev[0]["step"] == dropped + (1 if overlap else 0)
        for n, v in want[r // G].items():
            torch.testing.assert_close(got["params"][n], v, rtol=0, atol=1e-6, msg=lambda m: f"rank {r} {n}: {m}")


# ---------------------------------------------------------------- the driver and its launcher
# 8 ranks as 4 groups x 2 (bench/faults.py's elastic rows): E = 4, rank 3 killed.
ROUND_TOKENS = 4 * 2 * 2 * 32  # one round of one group: E steps x G ranks x batch x seq_len


def test_killed_rank_costs_its_group_only_and_the_group_rejoins(tmp_path):
    from bench import faults

    # NOTE: the run is stopped one round after group 1 is admitted (however many steps the
    # survivors ran while it restarted); the cap is far beyond that
    r = faults.run_elastic_fault("forward", str(tmp_path), GRACE_S, rejoin=True, steps=faults.ELASTIC_REJOIN_STEPS)
    assert r.stopped_at is not None and r.rc == -signal.SIGTERM, r.message[-3000:]
    assert r.lost == [1] and r.rejoined == [1] and r.final_groups == [0, 1, 2, 3], r
    assert r.stopped_at <= r.steps[-1] < faults.ELASTIC_REJOIN_STEPS
    assert r.steps == list(range(1, r.steps[-1] + 1)), r.steps  # the survivors never went back
    assert r.membership_s <= MEMBERSHIP_BOUND_S, r
    assert 0 < r.tokens_lost <= ROUND_TOKENS
    # the rejoined group's parameters equal the survivors' a round after it was admitted
    assert r.rejoined_equal, r


def test_killed_in_the_exchange_then_resume_with_fewer_groups(tmp_path):
    from bench import faults
    from flcomm.train.metrics import read_metrics

    r = faults.run_elastic_fault("fedavg", str(tmp_path), GRACE_S, steps=12)
    assert r.rc == 0 and r.lost == [1] and r.final_groups == [0, 2, 3], r.message[-3000:]
    assert r.steps == list(range(1, 13)) and r.membership_s <= MEMBERSHIP_BOUND_S, r
    assert r.tokens_lost == ROUND_TOKENS  # the round it died in, no more
    # resume from the per-group checkpoints with 3 groups of 2: group 1's own newest is of step
    # 4, so it takes group 0's of step 12 (anchor, model and optimizer); the others their own
    metrics = str(tmp_path / "resumed.jsonl")
    args = faults.elastic_args(GRACE_S, 16, str(tmp_path / "ckpt"), metrics)
    args[args.index("--nproc") + 1] = "6"
    out = faults.subprocess.run([faults.sys.executable, "-m", "flcomm.train", *args, "--resume"], env=faults._env(),
                                capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    m = read_metrics(metrics)
    assert m.config["start_step"] == 12 and m.config["world_size"] == 6
    assert [s["step"] for s in m.steps] == [13, 14, 15, 16]
    _refused_before_launch(tmp_path / "ckpt", args)


def _refused_before_launch(root, args: list[str]) -> None:
    """An elastic --resume checks, before launch, the checkpoints it may load: every group's of
    the newest step (groups 0-2 of step 16 here; group 3's newest is of step 12), and every
    group's ``latest``, which the ranks read."""
    from flcomm.train.__main__ import _config, _train_parser
    from flcomm.train.driver import check_before_launch

    cfg = _config(_train_parser().parse_args([*args, "--resume"]))
    check_before_launch(cfg, 6)  # intact: accepted

    def flip(path) -> str:
        victim = sorted(p for p in path.iterdir() if p.suffix == ".distcp")[0]
        raw = victim.read_bytes()
        victim.write_bytes(raw[:-1] + bytes([raw[-1] ^ 1]))
        return victim.name

    flip(root / "group3" / "step_00000012")  # not a candidate: group 3's is older than step 16
    check_before_launch(cfg, 6)
    name = flip(root / "group1" / "step_00000016")
    with pytest.raises(ValueError, match=f"group1/step_00000016/{name} does not match its SHA-256"):
        check_before_launch(cfg, 6)
    flip(root / "group1" / "step_00000016")  # flipped back
    (root / "group3" / "latest").write_text("garbage\n")
    with pytest.raises(ValueError, match="group3/latest must name a checkpoint"):
        check_before_launch(cfg, 6)


def test_fewer_groups_than_min_groups_end_the_job(tmp_path):
    from bench import faults

    r = faults.run_elastic_fault("fedavg", str(tmp_path), GRACE_S, steps=12, extra=("--min-groups", "4"))
    assert r.rc not in (0, None), r
    assert "fewer than --min-groups 4" in r.message, r.message[-3000:]
