"""The training driver's strategies on 4 gloo ranks against single-process references (data
parallel for FSDP/HSDP; F model copies averaged every E steps for FL+FSDP/FL+HSDP), with the
metrics file's fields and byte counts, and the plot of the metrics files."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
import torch

from flcomm.comm.base import wire_bytes
from flcomm.federated.config import FedAvgConfig
from flcomm.train.config import TrainConfig
from flcomm.train.data import load_tokens
from flcomm.train.metrics import STEP_FIELDS, read_metrics
from flcomm.train.model import build_model, lm_loss
from tests.common.dist import run_distributed
from tests.common.train_ref import schedule

torch.set_num_threads(1)

SMALL = dict(model="tiny", steps=4, batch_size=2, seq_len=32, lr=3e-3, warmup=1, eval_batches=1,
             eval_fraction=0.05, max_tokens=300_000, progress=False, seed=0)


# ---------------------------------------------------------------- the strategies, distributed
def _run_strategies(rank: int, world: int, out_dir: str) -> dict:
    from flcomm.train.loop import train

    res = {}
    for name, strategy, kw in (("fsdp", "fsdp", {}), ("hsdp", "hsdp", dict(shard_size=2)),
                               ("fl-fsdp", "fl-fsdp", dict(fedavg=FedAvgConfig(sync_every=2))),
                               ("fl-hsdp", "fl-hsdp", dict(fedavg=FedAvgConfig(sync_every=2, verify=True))),
                               ("fsdp-hier", "fsdp", dict(hierarchical=True))):
        cfg = TrainConfig(strategy=strategy, ranks_per_node=2, metrics=os.path.join(out_dir, f"{name}.jsonl"),
                          **SMALL, **kw)
        r = train(cfg, return_params=True)
        res[name] = {"losses": r.losses, "params": r.params, "eval": r.eval_losses, "syncs": r.num_syncs}
    return res


def reference_batches(world: int, steps: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """``batches[step - 1][rank]`` from the documented data rules (flcomm/train/data.py), written
    here with numpy alone: hold out the last ``max(int(N f), P B (T + 1) + P)`` tokens; rank d
    reads slice ``[d n // P, (d + 1) n // P)`` of the n train tokens; window j of a slice is its
    tokens ``[j T, j T + T + 1)`` (inputs the first T, targets the last T), of ``(len - 1) // T``
    windows; epoch e reads them in the order ``np.random.default_rng([seed, d, e])
    .permutation``; a batch is the next B windows."""
    B, T, seed = SMALL["batch_size"], SMALL["seq_len"], SMALL["seed"]
    toks = np.asarray(load_tokens(None, None, SMALL["max_tokens"]))  # the input: the built-in corpus
    n_eval = max(int(len(toks) * SMALL["eval_fraction"]), world * B * (T + 1) + world)
    train = toks[: len(toks) - n_eval]
    per = len(train) // world
    out: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(steps)]
    for d in range(world):
        sl = train[d * per:(d + 1) * per].astype(np.int64)
        nw = (len(sl) - 1) // T
        order = np.concatenate([np.random.default_rng([seed, d, e]).permutation(nw)
                                for e in range(-(-steps * B // nw))])
        for step in range(steps):
            rows = torch.from_numpy(np.stack([sl[j * T: j * T + T + 1] for j in order[step * B:(step + 1) * B]]))
            out[step].append((rows[:, :-1], rows[:, 1:]))
    return out


def reference_lr(step: int) -> float:
    """:func:`schedule` of the SMALL runs."""
    return schedule(step, SMALL["lr"], SMALL["warmup"], SMALL["steps"], TrainConfig(**SMALL).min_lr_ratio)


def reference(world: int, groups: list[list[int]], sync_every: int | None) -> tuple[list[list[float]], list[dict]]:
    """Single process: one model copy per group, each trained with AdamW on the mean loss of its
    ranks' batches (data parallel inside the group), the copies' parameters averaged every
    ``sync_every`` steps (None: never). Data and LR from :func:`reference_batches` and
    :func:`reference_lr`; the model is flcomm's (checked against plain torch ops in
    tests/unit/test_model.py). Returns per-copy losses and final parameters."""
    cfg = TrainConfig(**SMALL)
    batches = reference_batches(world, cfg.steps)
    models = [build_model("tiny", seed=cfg.seed) for _ in groups]
    opts = [torch.optim.AdamW(m.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                              weight_decay=cfg.weight_decay) for m in models]
    losses: list[list[float]] = [[] for _ in groups]
    for step in range(1, cfg.steps + 1):
        for f, (m, opt, ranks) in enumerate(zip(models, opts, groups)):
            for g in opt.param_groups:
                g["lr"] = reference_lr(step)
            loss = sum(lm_loss(m(batches[step - 1][r][0]), batches[step - 1][r][1]) for r in ranks) / len(ranks)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), cfg.grad_clip)
            opt.step()
            opt.zero_grad()
            losses[f].append(float(loss.detach()))
        if sync_every and step % sync_every == 0:
            with torch.no_grad():
                for ps in zip(*(m.parameters() for m in models)):
                    avg = torch.stack([p for p in ps]).mean(0)
                    for p in ps:
                        p.copy_(avg)
    return losses, [dict((n, p.detach().clone()) for n, p in m.named_parameters()) for m in models]


@pytest.fixture(scope="module")
def strategy_runs(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("runs"))
    return run_distributed(_run_strategies, 4, out, timeout=300), out


@pytest.mark.parametrize("strategy", ["fsdp", "hsdp", "fsdp-hier"])
def test_fsdp_hsdp_equal_data_parallel_reference(strategy_runs, strategy):
    """fsdp-hier: FSDP with flcomm's hierarchical reduce-scatter / all-gather hooks."""
    results, _ = strategy_runs
    ref_losses, ref_params = reference(4, [[0, 1, 2, 3]], None)
    for r in range(4):
        got = results[r][strategy]
        np.testing.assert_allclose(got["losses"], ref_losses[0], rtol=1e-5, atol=1e-5)
        for n, p in got["params"].items():
            torch.testing.assert_close(p, ref_params[0][n], atol=2e-5, rtol=1e-4, msg=n)


@pytest.mark.parametrize("strategy", ["fl-fsdp", "fl-hsdp"])
def test_fl_strategies_equal_periodic_averaging_reference(strategy_runs, strategy):
    """P = 4 on 2 nodes of 2: two federation groups {0,1}, {2,3}; E = 2 over 4 steps."""
    results, _ = strategy_runs
    ref_losses, ref_params = reference(4, [[0, 1], [2, 3]], 2)
    for r in range(4):
        got = results[r][strategy]
        assert got["syncs"] == 2
        np.testing.assert_allclose(got["losses"], ref_losses[r // 2], rtol=1e-5, atol=1e-5)
        for n, p in got["params"].items():  # after the last sync every copy is the average
            torch.testing.assert_close(p, ref_params[0][n], atol=2e-5, rtol=1e-4, msg=n)


def _block_and_root_bytes() -> tuple[int, int]:
    m = build_model("tiny", device="meta")
    blocks = sum(p.numel() for p in m.layers.parameters()) * 4
    return blocks, sum(p.numel() for p in m.parameters()) * 4 - blocks


def test_metrics_files(strategy_runs):
    """Every step record has the fields; bytes follow the ring convention: FSDP over 4 ranks on 2
    nodes crosses nodes with 3/4 of (2 all-gathers + 1 reduce-scatter) per block and (1 + 1) for
    the root; FL+FSDP stays inside its node and sends its 2-rank shard (all-reduce over 2 groups:
    2 (2-1)/2 x B/2) between groups at each sync."""
    _, out = strategy_runs
    blocks, root = _block_and_root_bytes()
    runs = {s: read_metrics(os.path.join(out, f"{s}.jsonl")) for s in ("fsdp", "hsdp", "fl-fsdp", "fl-hsdp")}
    for s, run in runs.items():
        assert run.config["strategy"] == s and run.summary is not None
        assert [r["step"] for r in run.steps] == [1, 2, 3, 4]
        for rec in run.steps:
            for k in STEP_FIELDS:
                assert isinstance(rec[k], (int, float)) and math.isfinite(rec[k]), (s, k)
            assert rec["tokens_per_s"] > 0 and rec["step_time_s"] > 0
        # the schedule and the token count the run reports, against the documented rules
        assert [r["lr"] for r in run.steps] == pytest.approx([reference_lr(t) for t in (1, 2, 3, 4)], rel=1e-12)
        step_tokens = 4 * SMALL["batch_size"] * SMALL["seq_len"]
        assert [r["tokens"] for r in run.steps] == [step_tokens * t for t in (1, 2, 3, 4)]
        assert "eval_loss" in run.steps[-1] and "eval_loss" not in run.steps[0]
        assert run.steps[-1]["eval_ppl"] == pytest.approx(math.exp(run.steps[-1]["eval_loss"]))
    fsdp = runs["fsdp"].steps
    assert all(r["internode_bytes"] == 3 * (blocks * 3 + root * 2) // 4 for r in fsdp)
    assert all(r["intergroup_bytes"] == 0 for r in fsdp)
    fl = runs["fl-fsdp"].steps
    assert all(r["internode_bytes"] == 0 for r in fl)
    # + FedAvg's non-finite check: an all-reduce of one int32 flag per group (F = 2)
    sync = (blocks + root) // 2 + wire_bytes("all_reduce", 4 * 2, 2)
    assert [r["intergroup_bytes"] for r in fl] == [0, sync, 0, sync]
    # the world-wide non-finite check runs before each sync (E = 2) and the last step's evaluation
    assert [r["group_wait_s"] > 0 for r in fl] == [False, True, False, True]
    # + FedAvg's refusal check at each sync: an all-reduce of (world + 1) int32 over the group
    flags = wire_bytes("all_reduce", 4 * (4 + 1), 2)
    assert [r["intranode_bytes"] for r in fl] == [(blocks * 3 + root * 2) // 2 + (flags if s else 0)
                                                  for s in (0, 1, 0, 1)]
    # hierarchical FSDP (2 nodes x 2): the inter-node stage carries 1/2 of a 1/2-size buffer
    # (a third of the flat ring's inter-node bytes); the intra-node stage 1/2 of the buffer
    hier = read_metrics(os.path.join(out, "fsdp-hier.jsonl")).steps
    assert all(r["internode_bytes"] == (blocks * 3 + root * 2) // 4 for r in hier)
    assert all(r["intranode_bytes"] == (blocks * 3 + root * 2) // 2 for r in hier)
    with open(os.path.join(out, "fsdp.jsonl")) as f:
        assert all(json.loads(line) for line in f)


def test_plot(strategy_runs, tmp_path):
    from flcomm.train.plot import plot_runs

    _, out = strategy_runs
    png = plot_runs([os.path.join(out, "fsdp.jsonl"), os.path.join(out, "fl-fsdp.jsonl")],
                    str(tmp_path / "p.png"))
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------- --nan-policy stop on FedAvg's schedule
E, K, BAD_STEP = 4, 2, 5  # fragments sync at offsets 0 and 2: steps 2, 4, 6, 8


def _stop_on_fragment_sync(rank: int, world: int) -> dict:
    """fl-fsdp, two groups of one rank, E = 4 in K = 2 fragments; group 1's loss is NaN at
    BAD_STEP. Per step: what FedAvg says before it, and whether an exchange was applied."""
    import flcomm.train.loop as loop
    from flcomm.train.monitor import Monitor
    from flcomm.train.run import build_run

    cfg = TrainConfig(**{**SMALL, "steps": 8}, strategy="fl-fsdp", ranks_per_node=1, group_size=1,
                      fedavg=FedAvgConfig(sync_every=E, fragments=K), nan_policy="stop")
    run = build_run(cfg, Monitor(None, rank, world))
    real, now = loop.lm_loss, {"step": 0}

    def loss(logits, y):
        out = real(logits, y)
        return out * float("nan") if now["step"] == BAD_STEP and run.mesh.coords.group == 1 else out

    out: dict = {"said": [], "synced": []}
    loop.lm_loss = loss
    try:
        for s in range(1, cfg.steps + 1):
            now["step"] = s
            out["said"].append(run.fed.starts_sync(run.fed.steps + 1))
            before = run.fed.num_syncs
            loop.train_step(run, s)
            out["synced"].append(run.fed.num_syncs > before)
    except FloatingPointError as e:
        out["error"], out["at"] = str(e), s
    finally:
        loop.lm_loss = real
    return out


def test_nan_stop_is_agreed_at_the_next_fragment_sync():
    """The stop comes at the first sync of any fragment after the bad step (1/K of the shard
    every E/K steps), not at the next multiple of E; FedAvg's starts_sync says which steps
    those are, and they are the steps whose exchange was applied (no overlap)."""
    res = run_distributed(_stop_on_fragment_sync, 2, timeout=300)
    want_at = next(s for s in range(BAD_STEP, 9) if s % (E // K) == 0)
    for r in res:
        assert r["at"] == want_at == 6, r
        assert f"non-finite loss or gradient norm at step {BAD_STEP} (federation group(s) [1]" in r["error"]
        done = list(range(1, r["at"] + 1))
        assert r["said"] == [s % (E // K) == 0 for s in done], r
        assert r["synced"] == [s % (E // K) == 0 for s in done[:-1]], r  # the step that raised synced nothing



# ---------------------------------------------------------------- the native transport
def _run_transports(rank: int, world: int, out_dir: str) -> dict:
    from flcomm.train.loop import train
    from tests.common import fake_nccl

    res = {}
    with fake_nccl.installed():  # NOTE: flcomm's NCCL library, as its gloo stand-in
        # fl-fsdp: a shard group across two nodes (hierarchical); fl-hsdp: the sharded exchange
        for name, kw in (("fl-fsdp", dict(group_size=2, hierarchical=True)),
                         ("fl-hsdp", dict(group_size=2, shard_size=1))):
            for transport in ("torch", "native"):
                cfg = TrainConfig(strategy=name, ranks_per_node=1, transport=transport,
                                  fedavg=FedAvgConfig(sync_every=2, codec="int8", overlap_steps=1),
                                  metrics=os.path.join(out_dir, f"{name}-{transport}.jsonl"), **kw, **SMALL)
                r = train(cfg, return_params=True)
                res[name, transport] = {"losses": r.losses, "params": r.params}
    return res


def test_the_trainer_on_the_native_transport_gives_torchs_bits(tmp_path):
    """``--transport native`` (on the NCCL stand-in): fl-hsdp with the hierarchical collectives,
    int8 and overlap trains to the torch transport's parameters bit for bit, and the metrics say
    which transport ran."""
    res = run_distributed(_run_transports, 4, str(tmp_path), timeout=300)[0]
    for name in ("fl-fsdp", "fl-hsdp"):
        want, got = res[name, "torch"], res[name, "native"]
        assert got["losses"] == want["losses"], name
        for n, p in want["params"].items():
            assert torch.equal(got["params"][n], p), (name, n)
        for transport in ("torch", "native"):
            m = read_metrics(os.path.join(tmp_path, f"{name}-{transport}.jsonl"))
            assert m.config["transport"] == transport, m.config
