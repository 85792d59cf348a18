"""--nan-policy on fl-fsdp with 4 gloo ranks, one federation group's loss NaN at step 3: ``stop``
ends every rank at the next FedAvg sync with one message and finite parameters; ``skip-step``
goes on, with the NaN step skipped in that group only."""

from __future__ import annotations

import pytest
import torch

from flcomm.federated.config import FedAvgConfig
from flcomm.train.config import TrainConfig
from tests.common.dist import run_distributed


def _nan_runs(rank: int, world: int) -> dict:
    """fl-fsdp on 4 ranks, once per --nan-policy; federation group 1 gets a NaN loss at step 3."""
    import flcomm.train.loop as loop
    from flcomm.train.monitor import Monitor
    from flcomm.train.run import build_run

    real, step = loop.lm_loss, {"n": 0}
    group = {"g": -1}

    def loss(logits, y):
        out = real(logits, y)
        return out * float("nan") if step["n"] == 3 and group["g"] == 1 else out

    res = {}
    for policy in ("stop", "skip-step"):
        cfg = TrainConfig(strategy="fl-fsdp", ranks_per_node=2, fedavg=FedAvgConfig(sync_every=2), model="tiny",
                          steps=6, batch_size=2, seq_len=32, warmup=1, eval_batches=1, eval_fraction=0.05,
                          max_tokens=100_000, progress=False, nan_policy=policy)
        run = build_run(cfg, Monitor(None, rank, world))
        group["g"] = run.mesh.coords.group
        loop.lm_loss = loss
        out: dict = {"losses": []}
        try:
            for s in range(1, cfg.steps + 1):
                step["n"] = s
                out["losses"].append(loop.train_step(run, s))
            run.fed.finish()
        except FloatingPointError as e:
            out["error"], out["at"] = str(e), s
        finally:
            loop.lm_loss = real
        out["finite"] = all(bool(torch.isfinite(p.detach().to_local() if hasattr(p, "to_local") else p).all())
                            for p in run.model.parameters())
        res[policy] = out
    return res


@pytest.fixture(scope="module")
def nan_runs():
    return run_distributed(_nan_runs, 4, timeout=300)


def test_nan_policy_stop_is_agreed_on_every_rank(nan_runs):
    res = [r["stop"] for r in nan_runs]
    msgs = {r["error"] for r in res}
    assert len(msgs) == 1, msgs  # the same message everywhere
    msg = msgs.pop()
    assert "non-finite loss or gradient norm at step 3 (federation group(s) [1]" in msg
    assert all(r["at"] == 4 for r in res)  # the next FedAvg sync (E = 2): groups do not talk before
    assert all(r["finite"] for r in res)  # the bad step was not applied


def test_nan_policy_skip_step_goes_on(nan_runs):
    for r, out in enumerate(r["skip-step"] for r in nan_runs):
        assert "error" not in out and len(out["losses"]) == 6 and out["finite"], (r, out)
        bad = [i + 1 for i, v in enumerate(out["losses"]) if v != v]
        assert bad == ([3] if r >= 2 else []), (r, out["losses"])
