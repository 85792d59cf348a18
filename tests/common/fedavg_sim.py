"""Single-process references for the FedAvg tests: a tiny model, deterministic per-rank data,
and a simulation of F federation groups (one model copy and one inner optimizer each, the
group's G ranks' batches averaged into one gradient) synchronized every E steps.

The simulation is written from the algorithm's definition (average of the weights, an outer
torch.optim.SGD with Nesterov momentum on the pseudo-gradient, the one-step-delayed apply),
independently of flcomm's implementation.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

D_IN, D_OUT, BATCH = 4, 3, 5


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.fc2(torch.tanh(self.fc1(self.norm(x))))


class Net(nn.Module):
    """Input layer, ``blocks`` residual blocks, a 3-row head (uneven and empty shards on 2 and
    4 ranks), a constant persistent buffer, a non-persistent cache and optionally a BatchNorm
    (running statistics: floating buffers that change, plus an integer counter)."""

    def __init__(self, d: int = 8, blocks: int = 2, bn: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(D_IN, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(blocks))
        self.bn = nn.BatchNorm1d(d) if bn else None
        self.head = nn.Linear(d, D_OUT)
        self.register_buffer("scale", torch.full((d,), 0.5))
        self.register_buffer("cache", torch.arange(d, dtype=torch.float32), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x) * (2 * self.scale) + 0 * self.cache
        if self.bn is not None:
            # NOTE: after a nonlinearity: a bias right before BatchNorm gets a zero gradient,
            # which AdamW would turn into rounding-noise-driven steps
            h = self.bn(torch.tanh(h))
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def make_model(seed: int = 0, **kw) -> Net:
    torch.manual_seed(seed)
    return Net(**kw)


def batch(f: int, i: int, t: int, seed: int = 0) -> tuple[Tensor, Tensor]:
    """Rank i of group f's batch at step t (1-based)."""
    g = torch.Generator().manual_seed(1_000_003 * seed + 10_007 * f + 101 * i + t)
    x = torch.randn(BATCH, D_IN, generator=g)
    y = torch.randn(BATCH, D_OUT, generator=g)
    return x, y


def loss_fn(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    return ((model(x) - y) ** 2).mean()


def make_opt(params, opt: str, lr: float) -> torch.optim.Optimizer:
    if opt == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    if opt == "sgd":
        return torch.optim.SGD(params, lr=lr)
    raise ValueError(opt)


def averaged_names(model: nn.Module) -> tuple[list[str], list[str]]:
    """(parameter names, floating persistent buffer names)."""
    params = [n for n, _ in model.named_parameters()]
    sd = model.state_dict()
    bufs = [n for n, b in model.named_buffers() if n in sd and b.is_floating_point()]
    return params, bufs


def _tensor(m: nn.Module, name: str) -> Tensor:
    d = dict(m.named_parameters())
    if name in d:
        return d[name]
    return dict(m.named_buffers())[name]


def runs_of(names: list[str], sizes: list[int], fragments: int) -> list[list[str]]:
    """The fragments: contiguous runs of tensors, run j ending at the first tensor where the
    running size reaches (j+1)/K of the total."""
    total, runs, start, cum = sum(sizes), [], 0, 0
    for i, n in enumerate(sizes):
        cum += n
        while len(runs) < fragments - 1 and cum * fragments >= (len(runs) + 1) * total:
            runs.append(names[start:i + 1])
            start = i + 1
    runs.append(names[start:])
    return runs


def simulate(F: int, G: int, E: int, T: int, *, opt: str = "adamw", lr: float = 1e-2,
             outer: str = "avg", outer_lr: float = 0.7, outer_momentum: float = 0.9,
             inner_state: str = "keep", overlap: bool = False, overlap_steps: int = 1, seed: int = 0,
             model_kw: dict | None = None, fragments: int = 1,
             drop_at: dict[int, int] | None = None, codec=None,
             error_feedback: bool = False) -> list[dict[str, Tensor]]:
    """Train F copies for T steps; return each copy's parameters and floating buffers.

    Sync at steps E, 2E, ...: ``avg`` sets every copy to the mean of the copies; ``nesterov``
    gives torch.optim.SGD(nesterov=True) on a global model the gradient ``global - mean`` and
    sets every copy to the global model (buffers: the mean). With ``fragments`` K the tensors
    (parameters then buffers) are cut into K contiguous runs, run j ending at the first tensor
    where the running size reaches (j+1)/K of the total, and run j syncs (as above, on its tensors
    only) at the steps t with (t - j E / K) % E == 0 (Streaming DiLoCo). With ``overlap`` the result of the
    sync at step t is applied after the local step t + k (k = ``overlap_steps``; or at the end) as
    ``w_f += (new_global - old_global) - (w_f(t) - old_global)``.

    ``drop_at[f] = s``: group f takes part in no sync at a step >= s (an elastic federation that
    lost it there); the syncs average the other groups only, and its copy is left as it is.

    ``codec`` (a function from a flat fp32 tensor to what is decoded of it): each group's delta
    ``w_f - global`` over the synced tensors, concatenated in order (plus its residual with
    ``error_feedback``, which then keeps ``y - codec(y)``), goes through it; the decoded deltas
    are summed in group order and divided by the number of groups, and that mean delta ``m``
    makes the mean ``global + m`` (the outer optimizer's gradient: ``-m``).
    """
    model_kw = model_kw or {}
    models = [make_model(seed, **model_kw) for _ in range(F)]
    opts = [make_opt(m.parameters(), opt, lr) for m in models]
    pnames, bnames = averaged_names(models[0])
    names = pnames + bnames
    glob = {n: _tensor(models[0], n).detach().clone() for n in names}  # the model at the last sync
    gparams = [glob[n] for n in pnames]
    outer_opt = (torch.optim.SGD(gparams, lr=outer_lr, momentum=outer_momentum, nesterov=True)
                 if outer == "nesterov" else None)
    sizes = [_tensor(models[0], n).numel() for n in names]
    runs = runs_of(names, sizes, fragments)
    assert len(runs) == fragments and all(runs), (runs, sizes)
    pending: dict[int, tuple[dict, int]] = {}  # overlap: fragment -> (result, step to apply at)

    drop_at = drop_at or {}
    live: list[int] = list(range(F))
    residual: dict[int, Tensor] = {}

    def coded_mean_delta(names: list[str]) -> dict[str, Tensor]:
        total = None
        for k in live:
            y = torch.cat([(_tensor(models[k], n).detach() - glob[n]).reshape(-1) for n in names])
            if error_feedback and k in residual:
                y = y + residual[k]
            d = codec(y)
            if error_feedback:
                residual[k] = y - d
            total = d if total is None else total + d
        total = total / len(live)
        out, off = {}, 0
        for n in names:
            out[n] = total[off: off + glob[n].numel()].view_as(glob[n])
            off += glob[n].numel()
        return out

    @torch.no_grad()
    def sync(names: list[str]) -> dict:
        if codec is None:
            mean = {n: torch.stack([_tensor(models[k], n).detach() for k in live]).mean(0) for n in names}
            grad = {n: glob[n] - mean[n] for n in names}
        else:
            md = coded_mean_delta(names)
            mean = {n: glob[n] + md[n] for n in names}
            grad = {n: -md[n] for n in names}
        deltas = [{n: _tensor(m, n).detach() - glob[n] for n in names} for m in models]
        old = {n: glob[n].clone() for n in names}
        if outer_opt is None:
            for n in names:
                glob[n].copy_(mean[n])
        else:
            for n in pnames:
                glob[n].grad = grad[n] if n in names else None  # SGD skips grad None
            outer_opt.step()
            for n in bnames:
                if n in names:
                    glob[n].copy_(mean[n])
        if inner_state == "average":
            plists = [list(m.parameters()) for m in models]
            for idx in range(len(plists[0])):
                states = [opts[k].state[plists[k][idx]] for k in range(len(models))]
                for key in list(states[0]):
                    if key == "step":
                        continue
                    avg = torch.stack([s[key] for s in states]).mean(0)
                    for s in states:
                        s[key] = avg.clone()
        elif inner_state == "reset":
            for o in opts:
                o.state.clear()
        return {"disp": {n: glob[n] - old[n] for n in names}, "delta": deltas}

    @torch.no_grad()
    def apply(p: dict) -> None:
        for k, m in enumerate(models):
            if k not in live:
                continue
            for n in p["disp"]:
                _tensor(m, n).add_(p["disp"][n] - p["delta"][k][n])

    for t in range(1, T + 1):
        for f, m in enumerate(models):
            losses = [loss_fn(m, *batch(f, i, t, seed)) for i in range(G)]
            (sum(losses) / G).backward()
            opts[f].step()
            opts[f].zero_grad()
        for j in sorted(pending):
            if t >= pending[j][1]:
                apply(pending.pop(j)[0])
        for j, run in enumerate(runs):
            if (t - j * E // fragments) % E:
                continue
            live[:] = [k for k in range(F) if drop_at.get(k, T + 1) > t]
            res = sync(run)
            if overlap:
                pending[j] = (res, t + overlap_steps)
            else:
                with torch.no_grad():
                    for m in (models[k] for k in live):
                        for n in run:
                            _tensor(m, n).copy_(glob[n])
    for j in sorted(pending):
        apply(pending[j][0])
    return [{n: _tensor(m, n).detach().clone() for n in names} for m in models]
