"""federated/shards.py on plain modules (the FSDP kinds are covered by tests/dist/test_fedavg*.py):
which tensors are averaged, in which order, and the fingerprint that compares shard peers."""

from __future__ import annotations

import torch
from torch import nn

from flcomm.federated.shards import collect_slots, describe, fingerprint, model_kind, persistent_buffers
from tests.common.fedavg_sim import make_model


def test_plain_slots_are_parameters_then_floating_persistent_buffers():
    model = make_model(0, bn=True)
    kind, slots = collect_slots(model)
    assert kind == "plain" == model_kind(model)
    params = [n for n, _ in model.named_parameters()]
    # BatchNorm running stats and the constant "scale" are averaged; the integer counter
    # (num_batches_tracked) and the non-persistent "cache" are not
    bufs = ["scale", "bn.running_mean", "bn.running_var"]
    assert [s.name for s in slots] == params + bufs
    assert [s.is_param for s in slots] == [True] * len(params) + [False] * len(bufs)
    assert "cache" not in {n for n, _, _ in persistent_buffers(model)}
    assert "bn.num_batches_tracked" in {n for n, _, _ in persistent_buffers(model)}
    # slots are the model's own storage (written in place) and are fetched on every use
    slots[0].local.add_(1.0)
    assert torch.equal(slots[0].local, model.inp.weight.detach())
    model.scale = torch.full_like(model.scale, 3.0)  # replaced buffer: found again by its owner
    assert bool((slots[len(params)].local == 3.0).all())
    assert describe(slots)[0] == ("inp.weight", tuple(model.inp.weight.shape))


def test_fingerprint_equal_for_same_shards_and_different_otherwise():
    a = collect_slots(make_model(0))[1]
    b = collect_slots(make_model(1))[1]  # other values, same layout
    c = collect_slots(make_model(0, d=6))[1]  # other shapes
    d = collect_slots(make_model(0).double())[1]  # other dtype
    fa = fingerprint(a)
    assert fa.dtype == torch.int64 and fa.shape == (3,)
    assert torch.equal(fa, fingerprint(b))
    assert not torch.equal(fa, fingerprint(c))
    assert not torch.equal(fa, fingerprint(d))
    assert int(fa[0]) == len(a) and int(fa[1]) == sum(s.local.numel() for s in a)


def test_integer_parameters_are_left_out():
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.zeros(3))
            self.i = nn.Parameter(torch.zeros(2, dtype=torch.int64), requires_grad=False)

    _, slots = collect_slots(M())
    assert [s.name for s in slots] == ["w"]
