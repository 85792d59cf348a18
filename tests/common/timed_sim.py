"""A single-process reference of FedAvg's timed mode (syncs on the wall clock, deltas weighted by
tokens), written from the rule as stated in flcomm/federated/pacing.py's docstring, with none of
flcomm's code: F model copies, each with its own inner optimizer, the group's G ranks' batches
averaged into one gradient (tests/common/fedavg_sim.py's model, data and loss).

The clock is simulated: group f's clock after n local steps reads ``n * step_s[f]`` (0 at the
start, so t0 = 0). Sync event p (1-based) is due at ``p * period / K`` and moves fragment
``(p - 1) % K``; a group starts it at its first step n (after the one that started event p - 1)
with ``n * step_s[f] >= p * period / K``. A group's tokens for a step are the sum over its G
ranks of ``tokens(f, i, n)``. At event p, each group's delta ``w_f - global`` on the fragment's
tensors is weighted by ``t_f / sum(t)`` (t_f: the group's tokens since that fragment's last
sync), so the average is ``global + sum_f t_f delta_f / sum_f t_f``; ``avg`` takes it, ``nesterov``
gives torch.optim.SGD(nesterov=True) the gradient ``-mean delta`` (buffers: the weighted mean).
Blocking: every copy takes the new global at once. Overlap k: applied after the group's step
``n + k`` (or before its next event of that fragment, or at the end) as
``w += (new_global - old_global) - (w(n) - old_global)``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from tests.common.fedavg_sim import _tensor, averaged_names, batch, loss_fn, make_model, make_opt, runs_of


def event_steps(step_s: list[float], period: float, fragments: int, events: int) -> list[list[int]]:
    """``[f][p - 1]``: the local step at which group f starts sync event p (the clock rule)."""
    out = []
    for s in step_s:
        starts, n = [], 0
        for p in range(1, events + 1):
            n += 1
            while n * s < p * period / fragments:
                n += 1
            starts.append(n)
        out.append(starts)
    return out


def default_tokens(f: int, i: int, n: int) -> int:
    """Rank i of group f's tokens at its step n: uneven, so the weights are not the steps'."""
    return 1 + (f + 2 * i + n) % 3


def simulate_timed(F: int, G: int, step_s: list[float], period: float, events: int, *, fragments: int = 1,
                   opt: str = "sgd", lr: float = 0.05, outer: str = "avg", outer_lr: float = 0.7,
                   outer_momentum: float = 0.9, overlap_steps: int = 0, weighted: bool = True,
                   tokens: Callable[[int, int, int], int] = default_tokens, model_kw: dict | None = None
                   ) -> tuple[list[dict[str, Tensor]], list[dict]]:
    """The copies' parameters and floating buffers after ``events`` sync events (each group
    trains up to its start of the last one, then applies what is pending), and per event
    ``{"round", "fragment", "tokens": [t_f], "steps": [steps_f], "start": [n_f]}``.
    ``weighted=False``: the plain mean (what the rule is not), for a test's sanity bound."""
    model_kw = model_kw or {}
    models = [make_model(0, **model_kw) for _ in range(F)]
    opts = [make_opt(m.parameters(), opt, lr) for m in models]
    pnames, bnames = averaged_names(models[0])
    names = pnames + bnames
    glob = {n: _tensor(models[0], n).detach().clone() for n in names}
    outer_opt = (torch.optim.SGD([glob[n] for n in pnames], lr=outer_lr, momentum=outer_momentum, nesterov=True)
                 if outer == "nesterov" else None)
    runs = runs_of(names, [glob[n].numel() for n in names], fragments)
    starts = event_steps(step_s, period, fragments, events)
    done = [0] * F  # local steps run per group
    since = [[(0, 0)] * fragments for _ in range(F)]  # (tokens, steps) since each fragment's last sync
    pending: list[dict[int, tuple[int, dict]]] = [{} for _ in range(F)]  # f -> {fragment: (apply at, result)}
    records = []

    @torch.no_grad()
    def apply(f: int, res: dict) -> None:
        for n in res["disp"]:
            _tensor(models[f], n).add_(res["disp"][n] - res["own"][f][n])

    def advance(f: int, to: int) -> None:
        while done[f] < to:
            n = done[f] = done[f] + 1
            m = models[f]
            (sum(loss_fn(m, *batch(f, i, n)) for i in range(G)) / G).backward()
            opts[f].step()
            opts[f].zero_grad()
            t = sum(tokens(f, i, n) for i in range(G))
            since[f] = [(a + t, b + 1) for a, b in since[f]]
            for j, (at, res) in list(pending[f].items()):
                if n >= at:
                    apply(f, res)
                    del pending[f][j]

    for p in range(1, events + 1):
        j = (p - 1) % fragments
        run = runs[j]
        for f in range(F):
            advance(f, starts[f][p - 1])
            if j in pending[f]:  # its next event before its apply: applied first
                apply(f, pending[f].pop(j)[1])
        toks = [since[f][j][0] for f in range(F)]
        steps = [since[f][j][1] for f in range(F)]
        for f in range(F):
            since[f][j] = (0, 0)
        w = [t / sum(toks) for t in toks] if weighted else [1.0 / F] * F
        with torch.no_grad():
            delta = {n: sum(w[f] * (_tensor(models[f], n).detach() - glob[n]) for f in range(F)) for n in run}
            own = [{n: _tensor(models[f], n).detach() - glob[n] for n in run} for f in range(F)]
            old = {n: glob[n].clone() for n in run}
            if outer_opt is None:
                for n in run:
                    glob[n].add_(delta[n])
            else:
                for n in pnames:
                    glob[n].grad = -delta[n] if n in run else None
                outer_opt.step()
                for n in bnames:
                    if n in run:
                        glob[n].add_(delta[n])
            res = {"disp": {n: glob[n] - old[n] for n in run}, "own": own}
            for f in range(F):
                if overlap_steps:
                    pending[f][j] = (starts[f][p - 1] + overlap_steps, res)
                else:
                    for n in run:
                        _tensor(models[f], n).copy_(glob[n])
        records.append({"round": p, "fragment": j, "tokens": toks, "steps": steps,
                        "start": [starts[f][p - 1] for f in range(F)]})
    for f in range(F):
        for _, res in sorted(pending[f].values(), key=lambda x: x[0]):
            apply(f, res)
    return [{n: _tensor(m, n).detach().clone() for n in names} for m in models], records
