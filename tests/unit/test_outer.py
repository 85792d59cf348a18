"""The nesterov outer step against its independent reference, torch.optim.SGD(nesterov=True)
stepped on the pseudo-gradient ``-mean(delta)``: the anchor must round as SGD's parameter does,
bit for bit (what lets flcomm agree with torchft's DiLoCo to the last bit), over rounds whose
momentum carries over, for sizes with and without a vector tail."""

from __future__ import annotations

import pytest
import torch

from flcomm.federated.outer import OuterOptimizer


@pytest.mark.parametrize("n", [1, 7, 1024, 4099])
def test_nesterov_anchor_steps_as_torch_sgd_bit_for_bit(n):
    g = torch.Generator().manual_seed(n)
    anchor = torch.randn(n, generator=g)
    param = torch.nn.Parameter(anchor.clone())
    sgd = torch.optim.SGD([param], lr=0.7, momentum=0.9, nesterov=True)
    outer = OuterOptimizer("nesterov", lr=0.7, momentum=0.9)
    outer.allocate([anchor])
    for _ in range(5):
        mean = torch.randn(n, generator=g) * 1e-2          # the groups' mean delta (new - old)
        param.grad = -mean.clone()                          # SGD's input: the pseudo-gradient
        sgd.step()
        anchor.add_(outer.piece_(mean.clone(), outer.buffers[0]), alpha=outer.scale)
        assert torch.equal(anchor, param.detach()), (anchor - param.detach()).abs().max()


def test_avg_moves_the_anchor_by_the_mean():
    outer = OuterOptimizer("avg")
    anchor, mean = torch.zeros(5), torch.arange(5.0)
    anchor.add_(outer.piece_(mean.clone(), None), alpha=outer.scale)
    assert torch.equal(anchor, mean)
