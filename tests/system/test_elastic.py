"""Elastic federation (flcomm.federated.elastic): a lost federation group costs that group, not
the job.

FedAvg level: 8 ranks as 4 groups x 2, each group its own torch.distributed world; a rank of
group 1 dies (before a sync, or while its exchange is in flight); the survivors' parameters
must equal the single-process simulation that drops group 1 at that round
(:func:`tests.common.fedavg_sim.simulate` with ``drop_at``), and the other rank of group 1 must stop
with GroupLostError.
"""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta

import pytest
import torch

from flcomm.federated.mesh import init_fed_mesh
from tests.common.dist import run_distributed
from tests.common.fedavg_sim import averaged_names, batch, loss_fn, make_model, make_opt, simulate

F, G = 4, 2
GRACE_S = 3.0
# NOTE: a membership round is the grace plus building the new groups (about a second); 5 x that
# (a loaded machine; bench/faults.py's table holds it to grace + 10 s)
MEMBERSHIP_BOUND_S = 5 * (GRACE_S + 1.0)


def _train_elastic(rank: int, world: int, E: int, T: int, kill: tuple[int, int, str], overlap: bool,
                   outer: str, transport: str = "torch", codec: str = "none", S: int = G) -> dict:
    from tests.common import dist as tdist

    if transport == "native":
        from tests.common import fake_nccl

        with fake_nccl.installed():
            out = _train_elastic_on(rank, world, E, T, kill, overlap, outer, transport, codec, S)
    else:
        out = _train_elastic_on(rank, world, E, T, kill, overlap, outer, transport, codec, S)
    tdist.STORE.add("ended", 1)  # NOTE: a frozen rank waits for every other to end
    return out


def _train_elastic_on(rank: int, world: int, E: int, T: int, kill: tuple[int, int, str], overlap: bool,
                      outer: str, transport: str, codec: str, S: int) -> dict:
    from flcomm.federated.elastic import Federation, GroupLostError
    from flcomm.federated.fedavg import FedAvg
    from flcomm.federated.topology import Topology
    from tests.common import dist as tdist

    timeout = timedelta(seconds=30)
    topo = Topology(world, ranks_per_node=G, group_size=G, shard_size=S)
    mesh = init_fed_mesh(topo, timeout=timeout, group_rank=rank, transport=transport)
    federation = Federation(tdist.STORE, topo, rank, mesh.config, grace_s=GRACE_S, stats=mesh.stats)
    f = rank // G
    model = make_model(0)
    opt = make_opt(model.parameters(), "adamw", 1e-2)
    # NOTE: each rank computes its group's loss over all G batches: replicated by construction;
    # verify checks that through the federation's rounds
    fed = FedAvg(model, mesh, sync_every=E, outer=outer, overlap_steps=int(overlap), federation=federation,
                 replicated=True, verify=True, codec=codec, error_feedback=codec != "none", bucket_cap_mb=1.0)
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
            if rank == kill_rank and t == kill_step and phase in ("exchange", "frozen-exchange"):
                time.sleep(0.02)  # NOTE: the exchange is in flight (overlap) when the rank dies
                if phase == "exchange":
                    os._exit(1)
                # NOTE: frozen: alive and connected, it issues nothing until every other rank ended
                while tdist.STORE.add("ended", 0) < world - 1:
                    time.sleep(0.05)
                return {"frozen": True}
        fed.finish()
    except GroupLostError as e:
        return {"lost": str(e), "group": e.group}
    params, bufs = averaged_names(model)
    sd = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    return {"params": {n: sd[n].detach().clone() for n in params + bufs}, "events": federation.events,
            "generation": federation.generation, "groups": list(federation.groups),
            "fed_transport": type(federation.transport).__name__}


SPARSE = ("topk:k=4:bits=2:block=64", 64, 4, 2)


def _sparse_round_trip(y: torch.Tensor) -> torch.Tensor:
    from tests.common import topk_ref

    _, block, k, bits = SPARSE
    p = torch.zeros(-(-y.numel() // block) * block)
    p[: y.numel()] = y
    return topk_ref.round_trip(p, block, k, bits)[: y.numel()]


@pytest.mark.parametrize("case", [
    # (E, T, rank killed, its step, phase, overlap, outer, the round group 1 is dropped at, transport, codec)
    (4, 10, 3, 6, "forward", False, "avg", 8, "torch", "none"),
    (4, 10, 3, 4, "exchange", True, "nesterov", 4, "torch", "none"),
    (4, 10, 3, 4, "exchange", True, "nesterov", 4, "native", "none"),
    (4, 10, 3, 4, "frozen-exchange", True, "nesterov", 4, "native", "none"),
    (4, 10, 3, 4, "exchange", True, "nesterov", 4, "native", "none", 1),
    (4, 10, 3, 4, "exchange", True, "nesterov", 4, "torch", "none", 1),
    (4, 10, 3, 4, "exchange", True, "nesterov", 4, "torch", SPARSE[0]),
], ids=["killed-in-forward-paper-mode", "killed-during-overlapped-exchange-nesterov",
        "native-killed-during-overlapped-exchange", "native-frozen-during-overlapped-exchange",
        "native-fl-hsdp-killed-during-overlapped-exchange", "fl-hsdp-killed-during-overlapped-exchange",
        "sparse-codec-killed-during-overlapped-exchange"])
def test_survivors_equal_the_simulation_without_the_lost_group(case):
    """Also on the native transport (the strict NCCL stand-in), where only the watchdog or the
    round's agreement ends a wait on the lost peer; FL+HSDP as R = 2 replicas of S = 1."""
    E, T, kill_rank, kill_step, phase, overlap, outer, dropped, transport, codec, *rest = case
    S = rest[0] if rest else G
    out = run_distributed(_train_elastic, F * G, E, T, (kill_rank, kill_step, phase), overlap, outer, transport,
                          codec, S, timeout=90, group_worlds=G, may_die=frozenset({kill_rank}))
    # NOTE: the sparse codec's redone round restores the residuals the aborted one changed: the
    # survivors' residuals are those of the simulation, where group 1 never took part in it
    want = simulate(F, G, E, T, outer=outer, overlap=overlap, drop_at={1: dropped},
                    codec=None if codec == "none" else _sparse_round_trip, error_feedback=codec != "none")
    lost_group = [r for r in range(F * G) if r // G == 1]
    for r in lost_group:
        if r == kill_rank:
            assert out[r] == ({"frozen": True} if phase == "frozen-exchange" else None), out[r]
        else:
            assert out[r] is not None and out[r]["group"] == 1, out[r]
            assert "federation group 1 is out of the federation" in out[r]["lost"]
            assert f"[{kill_rank}]" in out[r]["lost"], out[r]["lost"]
    for r in range(F * G):
        if r // G == 1:
            continue
        got = out[r]
        assert got["groups"] == [0, 2, 3] and got["generation"] == 1
        assert got["fed_transport"] == ("NcclTransport" if transport == "native" else "ProcessGroupTransport")
        ev = got["events"]
        assert len(ev) == 1 and ev[0]["lost"] == [1] and ev[0]["generation"] == 1
        assert ev[0]["step"] == dropped + (1 if overlap else 0)
        for n, v in want[r // G].items():
            torch.testing.assert_close(got["params"][n], v, rtol=0, atol=1e-6, msg=lambda m: f"rank {r} {n}: {m}")


# ---------------------------------------------------------------- the round protocol, against stubs
def _stub_federation(awaits: list, outcomes: list, calls: list):
    """A Federation whose store-facing steps are stubs recording the calls (no store, no groups):
    :meth:`Federation.run_round`'s own sequencing is what runs."""
    from flcomm.federated.elastic import Federation

    fed = Federation.__new__(Federation)

    def await_round(name, job, timeout_s):
        calls.append(("await", name, job, timeout_s))
        return awaits.pop(0)

    fed._await_round = await_round
    fed.commit = lambda name, ok, admit: calls.append(("commit", name, ok, admit)) or outcomes.pop(0)
    fed.reform = lambda step: calls.append(("reform", step))
    fed.advance = lambda admit, step: calls.append(("advance", admit, step))
    fed.source_index = lambda joined: calls.append(("source_index", joined)) or 1
    return fed


def test_run_round_redoes_an_aborted_round_and_hands_over_to_admitted_groups():
    """Abort: reform at the round's step, then restore, rebind and redo (in that order, the
    redone job awaited next); a commit that admits group 2: the next generation, rebind, and the
    handover from the survivor's index. The job's result comes back."""
    from flcomm.federated.elastic import Outcome

    calls: list = []
    fed = _stub_federation([(None, False), ("avg", True)], [Outcome(False), Outcome(True, (2,))], calls)
    got = fed.run_round("s4f0", "job0", 7.0, step=4, redo=lambda: calls.append(("redo",)) or "job1",
                        rebind=lambda: calls.append(("rebind",)), restore=lambda: calls.append(("restore",)),
                        handover=lambda src: calls.append(("handover", src)))
    assert got == "avg"
    assert calls == [("await", "s4f0", "job0", 7.0), ("commit", "s4f0", False, True), ("reform", 4), ("restore",),
                     ("rebind",), ("redo",), ("await", "s4f0", "job1", 7.0), ("commit", "s4f0", True, True),
                     ("advance", (2,), 4), ("rebind",), ("source_index", (2,)), ("handover", 1)]


def test_run_round_without_handover_admits_no_group():
    """A round that may not admit (an evaluation): commit is asked with ``admit=False``, nothing
    is restored without a ``restore``, and a commit ends it."""
    from flcomm.federated.elastic import Outcome

    calls: list = []
    fed = _stub_federation([(None, False), (3.5, True)], [Outcome(False), Outcome(True)], calls)
    got = fed.run_round("eval8", "j0", 2.0, step=8, redo=lambda: "j1", rebind=lambda: calls.append(("rebind",)))
    assert got == 3.5
    assert [c[0] for c in calls] == ["await", "commit", "reform", "rebind", "await", "commit"]
    assert all(c[3] is False for c in calls if c[0] == "commit")


def test_snapshot_restores_what_the_round_changed():
    from flcomm.federated.elastic import snapshot

    a, b = torch.arange(6.0).view(2, 3), torch.ones(4, dtype=torch.bfloat16)
    want = [a.clone(), b.clone()]
    restore = snapshot([a, b])
    a.mul_(-2)
    b.add_(3)
    restore()
    assert torch.equal(a, want[0]) and torch.equal(b, want[1])


# ---------------------------------------------------------------- the driver and its launcher
# 8 ranks as 4 groups x 2 (bench/faults.py's elastic rows: --sync-every 4 --batch-size 2
# --seq-len 32), rank 3 (group 1) killed; the lost group loses the steps it began since its last
# committed round (the step it dies in included: its batch was drawn). NOTE: faults.py counts
# them from what the run reports (heartbeat, metrics); these counts are the test's own.
GROUP_STEP_TOKENS = 2 * 2 * 32  # one step of one group: G ranks x batch x seq_len
ROUND_TOKENS = 4 * GROUP_STEP_TOKENS  # one round of one group: E steps


@pytest.mark.parametrize("transport", ["torch", "native"])
def test_killed_rank_costs_its_group_only_and_the_group_rejoins(tmp_path, transport, monkeypatch):
    """Also on the native transport (the NCCL stand-in in the trainer's processes): each
    generation's fed communicator is made fresh by its live members, the rejoined group's too."""
    from bench import faults

    extra: tuple[str, ...] = ()
    if transport == "native":
        site = os.path.join(os.path.dirname(os.path.dirname(__file__)), "common", "fake_nccl_site")
        monkeypatch.setenv("PYTHONPATH", site + os.pathsep + os.environ.get("PYTHONPATH", ""))
        extra = ("--transport", "native")
    # NOTE: the run is stopped one round after group 1 is admitted (however many steps the
    # survivors ran while it restarted); the cap is far beyond that
    r = faults.run_elastic_fault("forward", str(tmp_path), GRACE_S, rejoin=True, steps=faults.ELASTIC_REJOIN_STEPS,
                                 extra=extra)
    assert r.stopped_at is not None and r.rc == -signal.SIGTERM, r.message[-3000:]
    assert r.lost == [1] and r.rejoined == [1] and r.final_groups == [0, 1, 2, 3], r
    assert r.stopped_at <= r.steps[-1] < faults.ELASTIC_REJOIN_STEPS
    assert r.steps == list(range(1, r.steps[-1] + 1)), r.steps  # the survivors never went back
    assert r.membership_s <= MEMBERSHIP_BOUND_S, r
    # killed in the forward of step 5, one step after its last committed round (step 4)
    assert r.fault_step == 5 and r.tokens_lost == 1 * GROUP_STEP_TOKENS, r
    # the rejoined group's parameters equal the survivors' a round after it was admitted
    assert r.rejoined_equal, r
    from flcomm.train.metrics import read_metrics

    assert read_metrics(str(tmp_path / "m.jsonl")).config["transport"] == transport


def test_killed_in_the_exchange_then_resume_with_fewer_groups(tmp_path):
    from bench import faults
    from flcomm.train.metrics import read_metrics

    r = faults.run_elastic_fault("fedavg", str(tmp_path), GRACE_S, steps=12)
    assert r.rc == 0 and r.lost == [1] and r.final_groups == [0, 2, 3], r.message[-3000:]
    assert r.steps == list(range(1, 13)) and r.membership_s <= MEMBERSHIP_BOUND_S, r
    assert r.tokens_lost == ROUND_TOKENS  # the round it died in, no more
    _check_tokens_lost_from_the_files(tmp_path, r.tokens_lost)
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


def _check_tokens_lost_from_the_files(workdir, tokens_lost: float) -> None:
    """The count another way: the killed rank's last heartbeat (the step it died in), group 1's
    newest checkpoint (its last committed round: the run saves every round), and the tokens of
    the run's last step over the 3 groups that ran it."""
    from flcomm.train.metrics import read_metrics
    from flcomm.train.monitor import read_heartbeat

    died = read_heartbeat(str(workdir / "log"), 3)
    assert died is not None and died["state"] == "run" and died["phase"] == "fedavg", died  # killed: no report
    saved = sorted(int(p.name.split("_")[1]) for p in (workdir / "ckpt" / "group1").glob("step_*"))
    steps = read_metrics(str(workdir / "m.jsonl")).steps
    last_step = steps[-1]["tokens"] - steps[-2]["tokens"]
    assert tokens_lost == (died["step"] - saved[-1]) * last_step / 3


def _refused_before_launch(root, args: list[str]) -> None:
    """An elastic --resume checks, before launch, the checkpoints it may load: every group's of
    the newest step (groups 0-2 of step 16 here; group 3's newest is of step 12), and every
    group's ``latest``, which the ranks read."""
    from flcomm.train.__main__ import _config, _train_parser
    from flcomm.train.checkpoint import check_before_launch

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
