"""Outer updates of the FedAvg synchronizer: how the anchor (the model at the last sync) moves
given the delta averaged over the federation groups.

* ``avg`` (the paper's FedAvg): ``anchor += mean(delta)``, i.e. the new model is the average of
  the groups' models.
* ``nesterov`` (DiLoCo's outer optimizer): the pseudo-gradient ``g = -mean(delta)`` goes through
  SGD with Nesterov momentum, with torch.optim.SGD's conventions::

      buf = momentum * buf + g     (buf starts at zero, so the first step sets buf = g)
      anchor -= lr * (g + momentum * buf)

  With lr = 1 and momentum = 0 it reduces to ``avg``. The operations are torch.optim.SGD's
  (``buf.mul_(momentum).add_(g)``, ``g.add(buf, alpha=momentum)``, ``anchor.add_(d, alpha=-lr)``),
  so the anchor rounds as a parameter stepped by SGD(nesterov=True) does, bit for bit: DiLoCo
  implementations that step torch's SGD on the averaged pseudo-gradient (torchft's) agree with
  flcomm to the last bit on two groups, where otherwise an ulp a round grows through AdamW.
"""

from __future__ import annotations

import torch
from torch import Tensor

from flcomm.enums import Choice


class Outer(Choice, what="outer"):
    AVG = "avg"
    NESTEROV = "nesterov"


class OuterOptimizer:
    """Applies the outer update to a list of fp32 anchor tensors, in place.

    Args:
        kind: ``avg`` or ``nesterov``.
        lr, momentum: the Nesterov SGD hyper-parameters (ignored by ``avg``).
    """

    def __init__(self, kind: Outer | str, lr: float = 0.7, momentum: float = 0.9) -> None:
        self.kind = Outer.parse(kind)  # NOTE: lr and momentum are checked by FedAvgConfig
        self.lr, self.momentum = float(lr), float(momentum)
        # NOTE: momentum buffers exist from the start (zeros), so a state dict taken before the
        # first sync already has every tensor torch.distributed.checkpoint needs to load into.
        self.buffers: list[Tensor] = []

    def allocate(self, param_anchors: list[Tensor]) -> None:
        """Create the momentum buffers (zeros) for the parameter anchors (nesterov only)."""
        self.buffers = [torch.zeros_like(a) for a in param_anchors] if self.kind is Outer.NESTEROV else []

    @property
    def scale(self) -> float:
        """What :meth:`piece_`'s result is scaled by: ``anchor.add_(result, alpha=scale)``."""
        return -self.lr if self.kind is Outer.NESTEROV else 1.0

    @torch.no_grad()
    def piece_(self, mean: Tensor, buf: Tensor | None, ok: Tensor | None = None) -> Tensor:
        """Turn a piece of the mean delta, in place, into the anchor's step direction and return
        it: the anchor moves by ``anchor.add_(result, alpha=self.scale)`` (avg: the mean itself;
        nesterov: ``g + momentum * buf``, scaled by ``-lr`` in the anchor's own add, as SGD does).
        ``buf`` is the same piece of the momentum buffer (nesterov), updated in place.
        Elementwise, so a tensor may be updated bucket by bucket.

        ``ok``: a 0-dim bool tensor on the device; where it is False the caller has zeroed
        ``mean`` and ``buf`` is left as it was (``buf * 1 + -0``), without reading ``ok`` on the
        host. The displacement is then not zero: the caller drops it."""
        if self.kind is Outer.AVG:
            return mean
        if buf is None:
            raise RuntimeError("the nesterov outer update needs the momentum buffer: call allocate() first")
        mean.neg_()  # pseudo-gradient g = old minus new
        mu: float | Tensor = self.momentum
        if ok is not None:
            # NOTE: in buf's dtype, so buf * mu rounds as with the Python scalar
            mu = torch.full((), self.momentum, dtype=buf.dtype, device=buf.device).masked_fill_(~ok, 1.0)
        buf.mul_(mu).add_(mean)
        return mean.add_(buf, alpha=self.momentum)  # Nesterov: g + momentum * buf (times -lr: self.scale)

    def state_dict(self) -> dict:
        return {"kind": self.kind.value, "lr": self.lr, "momentum": self.momentum,
                "buffers": list(self.buffers)}

    def load_state_dict(self, sd: dict, shapes: list[tuple[int, ...]]) -> None:
        """``shapes``: the shapes of the parameter anchors, to check the buffers against."""
        if sd.get("kind") != self.kind.value:
            raise ValueError(f"outer optimizer state is for outer={sd.get('kind')!r}, this FedAvg "
                             f"uses outer={self.kind.value!r}")
        bufs = list(sd.get("buffers") or [])
        want = list(shapes) if self.kind is Outer.NESTEROV else []
        got = [tuple(b.shape) for b in bufs]
        if got != want:
            raise ValueError(f"outer momentum buffers have shapes {got}, expected {want} "
                             "(the state is from another model or topology)")
        for dst, src in zip(self.buffers, bufs):
            if dst is not src:
                dst.copy_(src)
