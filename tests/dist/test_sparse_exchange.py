"""The sparse top-k exchange on gloo: the all-gather all-reduce (flcomm.collectives.compressed's
GatherPlan) against a single-process simulation with the format written from its definition
(tests/common/topk_ref.py, no flcomm code), bit for bit, with error feedback over rounds and its
wire bytes; FedAvg with the sparse codec against the FedAvg simulation with the codec modelled
(tests/common/fedavg_sim.py); and every group holding the same bits after every sync on 8 ranks,
FL+FSDP and FL+HSDP (the sharded exchange), through overlap, fragments, offload, the outer
optimizer and bf16 residuals (``verify=True`` checks each sync; the test checks the end
independently)."""

from __future__ import annotations

import pytest
import torch

from tests.common import topk_ref
from tests.common.dist import run_distributed
from tests.common.two_hop import rank_input

# (codec, block, k, bits, n)
COLLECTIVE = [("topk:d=0.02:bits=2", 4096, 82, 2, 10000), ("topk:k=3:bits=4:block=64", 64, 3, 4, 1000),
              ("topk:k=64:bits=8:block=64", 64, 64, 8, 777), ("topk:k=2:bits=2:block=16", 16, 2, 2, 5)]
ROUNDS = 4


def _simulate(xs: list[torch.Tensor], block: int, k: int, bits: int, op: str,
              residuals: list[torch.Tensor] | None = None):
    """Every rank's input (plus residual) padded to whole blocks, decoded from its encoding, the
    decoded summed in rank order (/ W for avg). Returns (result, new residuals)."""
    n = xs[0].numel()
    P = -(-n // block) * block
    total, new_res = torch.zeros(P), []
    for r, x in enumerate(xs):
        y = torch.zeros(P)
        y[:n] = x if residuals is None else x + residuals[r]
        d = topk_ref.round_trip(y, block, k, bits)
        new_res.append((y - d)[:n])
        total += d
    if op == "avg":
        total /= len(xs)
    return total[:n], new_res


def _collective_body(rank: int, world: int) -> dict:
    from flcomm.collectives.compressed import compressed_all_reduce, compressed_wire_bytes
    from flcomm.comm import LinkTier, TorchTransport

    tr = TorchTransport()
    out: dict = {}
    for i, (spec, _, _, _, n) in enumerate(COLLECTIVE):
        for op in ("sum", "avg"):
            x = rank_input(rank, i, n, 1.0)
            y = x.clone()
            w = compressed_all_reduce(tr, y, codec=spec, op=op, async_op=True)
            w.wait()
            res, outs = torch.zeros(n), []
            for _ in range(ROUNDS):
                z = x.clone()
                compressed_all_reduce(tr, z, codec=spec, op=op, residual=res)
                outs.append(z)
            out[(spec, op)] = (y, outs, res)
    n = 64 * 4096
    tr.stats.reset()
    compressed_all_reduce(tr, torch.randn(n), codec="topk:d=0.02:bits=2")
    measured = tr.stats.bytes(LinkTier.INTRA_NODE)
    tr.stats.reset()
    tr.all_reduce(torch.randn(n))
    out["wire"] = (measured, compressed_wire_bytes(n, world, "topk:d=0.02:bits=2"), tr.stats.bytes(LinkTier.INTRA_NODE))
    return out


@pytest.fixture(scope="module", params=[3, 4])
def collective(request) -> tuple[int, list[dict]]:
    return request.param, run_distributed(_collective_body, request.param, timeout=240)


def test_all_gather_all_reduce_is_the_simulation_bit_for_bit(collective):
    world, results = collective
    for i, (spec, block, k, bits, n) in enumerate(COLLECTIVE):
        for op in ("sum", "avg"):
            xs = [rank_input(r, i, n, 1.0) for r in range(world)]
            want, _ = _simulate(xs, block, k, bits, op)
            for r in range(world):
                assert torch.equal(results[r][(spec, op)][0], want), (spec, op, r)


def test_error_feedback_rounds_are_the_simulation_and_keep_what_was_not_sent(collective):
    world, results = collective
    for i, (spec, block, k, bits, n) in enumerate(COLLECTIVE):
        for op in ("sum", "avg"):
            xs = [rank_input(r, i, n, 1.0) for r in range(world)]
            res = [torch.zeros(n) for _ in range(world)]
            for t in range(ROUNDS):
                want, res = _simulate(xs, block, k, bits, op, res)
                for r in range(world):
                    assert torch.equal(results[r][(spec, op)][1][t], want), (spec, op, r, t)
            for r in range(world):
                assert torch.equal(results[r][(spec, op)][2], res[r]), (spec, op, r)
            # telescoping: the results of the rounds plus what the residuals still hold is the
            # exact total (up to fp32 sums)
            got = sum(results[0][(spec, op)][1])
            exact = sum(xs) * ROUNDS
            held = sum(results[r][(spec, op)][2] for r in range(world))
            if op == "avg":
                exact, held = exact / world, held / world
            assert torch.allclose(got + held, exact, rtol=0, atol=1e-4), (spec, op)


def test_wire_bytes_are_the_prediction_and_a_small_fraction_of_fp32(collective):
    world, results = collective
    measured, predicted, fp32 = results[0]["wire"]
    assert measured == predicted
    # NOTE: an all-gather of W encodings against a ring all-reduce: F E / (8 N)
    assert measured / fp32 == pytest.approx(world * topk_ref.nbytes(64 * 4096, 4096, 82, 2) / (8 * 64 * 4096), rel=1e-3)
    assert measured / fp32 <= 0.03


# ------------------------------------------------------------------ FedAvg against the simulation
SIM_CODEC = ("topk:k=8:bits=2:block=256", 256, 8, 2)
SIM_CASES = [
    {"codec": SIM_CODEC[0], "error_feedback": True},
    {"codec": SIM_CODEC[0], "error_feedback": True, "outer": "nesterov", "overlap": True, "overlap_steps": 1},
    {"codec": SIM_CODEC[0], "error_feedback": False, "outer": "nesterov"},
]


def _sim_codec(y: torch.Tensor) -> torch.Tensor:
    _, block, k, bits = SIM_CODEC
    n = y.numel()
    p = torch.zeros(-(-n // block) * block)
    p[:n] = y
    return topk_ref.round_trip(p, block, k, bits)[:n]


def _sim_body(rank: int, world: int) -> list[dict]:
    from flcomm.federated.fedavg import FedAvg
    from tests.common.fedavg_harness import build, fedavg_settings, full_state, train

    out = []
    for case in SIM_CASES:
        fm, model, opt = build(world, world, None, "plain", model_kw={"d": 32})
        # NOTE: one bucket: its blocks are the simulation's blocks of the concatenated deltas
        fed = FedAvg(model, fm, sync_every=2, inner_optimizer=opt, bucket_cap_mb=1.0, **fedavg_settings(case))
        train(fm, model, opt, fed, range(1, 9))
        fed.finish()
        out.append(full_state(model, "plain"))
    return out


def test_fedavg_with_the_sparse_codec_is_the_simulation():
    from tests.common.fedavg_harness import compare
    from tests.common.fedavg_sim import make_model, simulate

    F = 4
    got = run_distributed(_sim_body, F, timeout=240)
    init = make_model(0, d=32).state_dict()
    for c, case in enumerate(SIM_CASES):
        want = simulate(F, 1, 2, 8, model_kw={"d": 32}, outer=case.get("outer", "avg"),
                        overlap=case.get("overlap", False), overlap_steps=case.get("overlap_steps", 1),
                        codec=_sim_codec, error_feedback=case["error_feedback"])
        plain = simulate(F, 1, 2, 8, model_kw={"d": 32}, outer=case.get("outer", "avg"),
                         overlap=case.get("overlap", False), overlap_steps=case.get("overlap_steps", 1))
        for f in range(F):
            compare(got[f][c], want[f], f"{case} group {f}")
        # NOTE: the codec mattered: the uncompressed training differs by far more than the tolerance
        moved = max((want[0][n] - plain[0][n]).abs().max().item() for n in init if n in want[0])
        assert moved > 1e-3, (case, moved)


# ------------------------------------------------------------------ 8 ranks: the groups agree
AGREE = [
    ("fl-fsdp", {"error_feedback": True}),
    ("fl-fsdp", {"error_feedback": True, "overlap_steps": 1, "outer": "nesterov"}),
    ("fl-fsdp", {"error_feedback": True, "fragments": 2, "sync_every": 4}),
    ("fl-fsdp", {"error_feedback": True, "offload": "cpu", "residual_dtype": "bf16"}),
    ("fl-hsdp", {"error_feedback": True}),
    ("fl-hsdp", {"error_feedback": True, "overlap_steps": 1, "outer": "nesterov", "offload": "cpu"}),
]


def _flat(state: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([state[n].reshape(-1) for n in sorted(state)])


def _agree_body(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from flcomm.federated.fedavg import FedAvg
    from tests.common.fedavg_harness import build, fed_mesh, full_state, train

    out = {}
    for topo, kw in AGREE:
        F, S = (4, None) if topo == "fl-fsdp" else (2, 2)
        fm = fed_mesh(world, F, S)
        _, model, opt = build(world, F, S, "fsdp2", mesh=fm, model_kw={"d": 32})
        kw = {"sync_every": 2, **kw}
        E = kw["sync_every"]
        fed = FedAvg(model, fm, inner_optimizer=opt, verify=True, codec="topk:k=6:bits=2:block=128",
                     bucket_cap_mb=0.01, **kw)
        train(fm, model, opt, fed, range(1, 3 * E + 1))
        fed.finish()
        flat = _flat(full_state(model, "fsdp2"))
        got = [torch.zeros_like(flat) for _ in range(world)]
        dist.all_gather(got, flat)
        out[f"{topo} {kw}"] = (fed.num_syncs, [torch.equal(g, got[0]) for g in got])
    return out


def test_every_group_holds_the_same_bits_on_8_ranks():
    res = run_distributed(_agree_body, 8, timeout=400)
    for name, (syncs, same) in res[0].items():
        K = 2 if "fragments" in name else 1
        assert syncs == 3 * K, (name, syncs)
        # NOTE: after the blocking sync of the last step (overlap: applied by finish) every rank
        # holds the same full model: every group, and inside FL+HSDP every replica
        if "overlap" not in name and "fragments" not in name:
            assert all(same), (name, same)
