"""The training loop of one rank: :func:`train` sets up its :class:`~flcomm.train.run.Run`
(:func:`~flcomm.train.run.build_run`: mesh, sharded model, data, FedAvg, resume) and runs it
step by step:

* :func:`train_step`: forward, backward, gradient norm and clipping, the group's loss, the
  optimizer step (left out on a non-finite loss or gradient norm: ``nan_policy``),
  ``fed.step()``;
* :class:`StepLogger`: rank 0's JSONL record per step (loss, tokens/s, bytes per tier,
  exposed communication) and the progress bar;
* :class:`CheckpointPolicy`: evaluation every ``eval_every`` steps and checkpoints every
  ``save_every`` steps, both also at the end (``fed.finish()`` first).

Every phase of a step is announced to a :class:`~flcomm.train.monitor.Monitor` (heartbeats,
failure reports). :mod:`flcomm.train.launch` starts the ranks.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from flcomm.comm.base import LinkTier
from flcomm.train import checkpoint as ckpt
from flcomm.train.config import TrainConfig, lr_at
from flcomm.train.metrics import MetricsWriter, TierCounter, perplexity
from flcomm.train.model import lm_loss
from flcomm.train.monitor import Monitor
from flcomm.train.run import Run, build_run, evaluate


@dataclass
class TrainResult:
    """What :func:`train` returns on every rank."""

    losses: list[float] = field(default_factory=list)          # group-mean loss per step run here
    eval_losses: dict[int, float] = field(default_factory=dict)  # step -> world-mean eval loss
    start_step: int = 0
    final_step: int = 0
    params: dict[str, Tensor] | None = None                     # full parameters (return_params)
    tokens_per_step: int = 0
    wall_s: float = 0.0
    bytes_per_step: dict[str, float] = field(default_factory=dict)
    num_syncs: int = 0


def _full_params(model: nn.Module) -> dict[str, Tensor]:
    out = {}
    for name, p in model.named_parameters():
        t = p.detach()
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        out[name] = t.cpu().clone()
    return out


class NonFiniteLossError(FloatingPointError):
    """A non-finite loss or gradient norm with ``--nan-policy stop`` (the same on every rank)."""


def _agree_non_finite(run: Run, step: int) -> None:
    """World-wide agreement on a non-finite step (``--nan-policy stop``): every rank raises
    the same :class:`NonFiniteLossError`, naming the first bad step and the groups."""
    F = run.topo.num_groups
    t = torch.zeros(F, dtype=torch.int64, device=run.device)
    if run.bad_step is not None:
        t[run.mesh.coords.group] = run.bad_step
    t0 = time.perf_counter()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    steps = t.tolist()  # NOTE: the host read ends the wait on CUDA too
    # NOTE: world-wide: a group that is ahead waits here for the slowest (outside FedAvg's exposed time)
    run.group_wait_s += time.perf_counter() - t0
    bad = {f: int(s) for f, s in enumerate(steps) if s > 0}
    if bad:
        first = min(bad.values())
        raise NonFiniteLossError(
            f"non-finite loss or gradient norm at step {first} (federation group(s) "
            f"{sorted(bad)}, first bad step per group {bad}); stopped at step {step} on every rank "
            "(--nan-policy stop; --nan-policy skip-step skips such steps instead)")


def train_step(run: Run, step: int) -> float:
    """One step: forward, backward, gradient norm (and clipping), the group's loss, then,
    when everything is finite, the optimizer step; FedAvg's step either way (its schedule
    must stay in step across groups). Returns the group-mean loss.

    A non-finite loss or gradient norm is agreed on inside the federation group (with the
    loss all-reduce); ``skip-step`` leaves the step out, ``stop`` leaves it out and raises on
    every rank at the next world-wide point (at once for FSDP / HSDP and a single federation
    group, at the next FedAvg sync of any fragment for the FL strategies: the groups do not
    talk between syncs).
    """
    cfg, mon = run.cfg, run.monitor
    for g in run.optimizer.param_groups:
        g["lr"] = lr_at(cfg, step)
    mon.enter(step, "forward")
    x, y = run.loader.next_batch()
    loss = lm_loss(run.model(x), y)
    mon.enter(step, "backward")
    loss.backward()
    mon.enter(step, "optimizer")
    # NOTE: max_norm inf measures without scaling (the clip coefficient clamps to 1)
    gn = torch.nn.utils.clip_grad_norm_(run.model.parameters(), cfg.grad_clip if cfg.grad_clip > 0 else math.inf)
    gn = gn.full_tensor() if hasattr(gn, "full_tensor") else gn
    mon.enter(step, "loss")
    # NOTE: the logged loss is the mean over this rank's federation group (an intra-group
    # collective); a world-wide one per step would put a sync on the slow links.
    lt = torch.stack([loss.detach().float(), (~torch.isfinite(gn.detach().float())).float()])
    dist.all_reduce(lt, group=run.mesh.groups["group"])
    loss_v = float(lt[0]) / run.topo.group_size
    bad = not math.isfinite(loss_v) or float(lt[1]) > 0
    if bad and run.bad_step is None and cfg.nan_policy == "stop":
        run.bad_step = step
    skipped = bad or run.bad_step is not None
    if skipped:
        run.optimizer.zero_grad(set_to_none=True)
        if bad and run.rank == run.topo.group_ranks(run.mesh.coords.group)[0]:
            print(f"flcomm.train: step {step}: non-finite loss or gradient norm in federation group "
                  f"{run.mesh.coords.group}; step skipped", file=sys.stderr, flush=True)
    else:
        run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
    run.traffic.record_step()
    if run.fed is not None and run.fed.federated:
        # NOTE: FedAvg's own schedule (fragments sync at their offsets), for the step() below
        if cfg.nan_policy == "stop" and run.fed.starts_sync(run.fed.steps + 1):
            mon.enter(step, "nan-check")
            _agree_non_finite(run, step)
    elif run.bad_step is not None:
        _agree_non_finite(run, step)
    if run.fed is not None:
        mon.enter(step, "fedavg")
        run.fed.step(skipped=skipped)  # NOTE: FedAvg checks that an optimizer step came first
    return loss_v


def progress_bar(total: int, initial: int, desc: str) -> Any:
    """A tqdm bar on stderr, or None when stdout or stderr is not a terminal (a log file or a
    pipe would get one redrawn line per step).

    NOTE: tqdm's default lock is a multiprocessing RLock, a named semaphore that a spawned rank
    registers with the launcher's resource tracker; ranks end with ``os._exit``, which never
    unregisters it, and the tracker warned about "leaked semaphore objects" at the launcher's
    exit. One bar in one process needs only a thread lock."""
    if not (sys.stdout.isatty() and sys.stderr.isatty()):
        return None
    import threading

    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())
    return tqdm(total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True, file=sys.stderr)


def header_line(run: Run) -> str:
    """The run's first line: strategy, mesh, transport and the replicate all-reduce's codec."""
    cfg, t = run.cfg, run.topo
    F, R, S = t.mesh_shape
    line = (f"flcomm.train: {cfg.strategy} on {t.world_size} ranks ({t.ranks_per_node} per node; F={F} x R={R} x "
            f"S={S}), backend {run.info['backend']}, transport {cfg.transport}")
    if R > 1:
        ef = " + error feedback" if cfg.replicate_error_feedback else ""
        how = "FSDP2's own" if cfg.replicate_codec == "none" else f"flcomm's hook, {cfg.replicate_codec}{ef}"
        line += f", replicate all-reduce: {how}"
    return line


class StepLogger:
    """Rank 0's per-step records (metrics JSONL and progress bar): loss, tokens/s, bytes per
    link tier since the last record, exposed FedAvg time; the config record first and the
    summary last."""

    def __init__(self, run: Run) -> None:
        cfg = run.cfg
        self.run = run
        self.writer = MetricsWriter(cfg.metrics if self._leads() else None,
                                    append=run.resumed_from is not None or cfg.rejoin)
        self.writer.write({"config": {**cfg.to_dict(), **run.info, "resumed_from": run.resumed_from,
                                      "start_step": run.start_step}})
        self.counter = TierCounter(run.mesh.stats)
        self.sums = {t: 0 for t in LinkTier}
        self.exposed_prev = run.fed.exposed_comm_s if run.fed is not None else 0.0
        self.wait_prev = run.group_wait_s
        self._overlap_told = False
        self.t_start = time.perf_counter() - run.elapsed0
        # NOTE: cumulative: an elastic run's tokens per step change with its live groups
        self.tokens = run.start_step * run.tokens_per_step
        self.bar = progress_bar(cfg.steps, run.start_step, cfg.strategy) if cfg.progress and run.rank == 0 else None
        if self._leads():
            print(header_line(run), file=sys.stderr, flush=True)

    def elapsed(self) -> float:
        return time.perf_counter() - self.t_start

    def _leads(self) -> bool:
        """This rank writes the metrics: rank 0, or in an elastic run the first rank of the
        lowest live group (it changes when groups are lost or rejoin)."""
        fed = self.run.federation
        return fed.is_leader() if fed is not None else self.run.rank == 0

    def _membership(self) -> None:
        """Elastic: hand the metrics file over to the current leader, and record every
        membership change (step, generation, groups lost and joined, seconds it took)."""
        fed, path = self.run.federation, self.run.cfg.metrics
        if fed is None:
            return
        if path and self._leads() != (self.writer.path is not None):
            self.writer.close()
            self.writer = MetricsWriter(path if self._leads() else None, append=True)
        for ev in fed.events:
            self.writer.write({"membership": ev})
        fed.events.clear()

    def step(self, step: int, loss: float, dt: float, ev: float | None) -> None:
        """Record ``step``; bytes and exposed time are read here, after evaluation and
        checkpointing, whose ``fed.finish()`` may complete (and, bucket by bucket, issue) this
        step's exchange."""
        self._membership()
        fed, tps = self.run.fed, self.run.tokens_per_step
        self.tokens += tps
        exposed = (fed.exposed_comm_s - self.exposed_prev) if fed is not None else 0.0
        self.exposed_prev = fed.exposed_comm_s if fed is not None else 0.0
        wait, self.wait_prev = self.run.group_wait_s - self.wait_prev, self.run.group_wait_s
        d = self.counter.delta()
        for t in LinkTier:
            self.sums[t] += d[t]
        rec: dict[str, Any] = {
            "step": step, "loss": loss, "lr": lr_at(self.run.cfg, step), "tokens": self.tokens,
            "time_s": self.elapsed(), "wall_time": time.time(), "tokens_per_s": tps / dt, "step_time_s": dt,
            "exposed_comm_s": exposed, "group_wait_s": wait,
            "internode_bytes": d[LinkTier.INTER_NODE], "intergroup_bytes": d[LinkTier.INTER_GROUP],
            "intranode_bytes": d[LinkTier.INTRA_NODE],
        }
        if fed is not None:
            rec["num_syncs"], rec["overlap_steps"] = fed.num_syncs, fed.overlap_steps
            self._log_overlap_choice(fed)
        if ev is not None:
            rec["eval_loss"], rec["eval_ppl"] = ev, perplexity(ev)
        self.writer.write(rec)
        if self.bar is not None:
            self.bar.update(1)
            post = {"loss": f"{loss:.3f}", "tok/s": f"{rec['tokens_per_s']:.0f}"}
            if ev is not None:
                post["eval"] = f"{ev:.3f}"
            self.bar.set_postfix(post, refresh=False)

    def _log_overlap_choice(self, fed: Any) -> None:
        """``--overlap`` (``overlap_steps="auto"``): one line when FedAvg has chosen its k."""
        auto = fed.auto_overlap
        if auto is None or auto.chosen is None or self._overlap_told or not self._leads():
            return
        self._overlap_told = True
        print(f"flcomm.train: overlap_steps auto: k = {auto.chosen} (an exchange took {auto.exchange_s or 0:.3f} s, "
              f"a step {auto.step_s or 0:.3f} s, on this rank)", file=sys.stderr, flush=True)

    def finish(self, res: TrainResult, step: int) -> None:
        """Fill ``res``'s totals and write the summary record."""
        res.final_step, res.wall_s = step, self.elapsed()
        n = max(1, step - res.start_step)
        res.bytes_per_step = {t.value: self.sums[t] / n for t in LinkTier}
        res.num_syncs = self.run.fed.num_syncs if self.run.fed is not None else 0
        ev = res.eval_losses.get(step)
        self.writer.write({"summary": {"steps": step, "wall_s": res.wall_s,
                                       "final_loss": res.losses[-1] if res.losses else None, "eval_loss": ev,
                                       "eval_ppl": perplexity(ev) if ev is not None else None,
                                       "bytes_per_step": res.bytes_per_step, "num_syncs": res.num_syncs}})

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.writer.close()


@dataclass
class CheckpointPolicy:
    """When to evaluate and to save: every ``eval_every`` / ``save_every`` steps and at the last
    step; both finish an exchange in flight first."""

    cfg: TrainConfig
    end: int
    fault: Any = None  # ``fault(tmp_dir)``, passed to every save (tests inject a crash)

    def eval_due(self, step: int) -> bool:
        return bool(self.cfg.eval_every and step % self.cfg.eval_every == 0) or step == self.end

    def save_due(self, step: int) -> bool:
        c = self.cfg
        return bool(c.checkpoint_dir) and (bool(c.save_every and step % c.save_every == 0) or step == self.end)

    def save(self, run: Run, step: int, elapsed_s: float) -> None:
        run.monitor.enter(step, "checkpoint")
        if run.fed is not None:
            run.fed.finish()
        rank_state = {"step": step, "data": run.loader.state_dict(),
                      "fed": run.fed.state_dict() if run.fed is not None else None, "elapsed_s": elapsed_s}
        meta = run.meta
        if run.federation is not None:
            m = run.federation.membership
            meta = {**meta, "elastic": {"generation": m.generation, "groups": list(m.groups)}}
        ckpt.save(run.checkpoint_dir(), step, run.model, run.optimizer, rank_state, meta,
                  run.mesh.coords.group, self.cfg.keep_checkpoints, self._fault_hook(run, step))

    def _fault_hook(self, run: Run, step: int) -> Any:
        f = run.monitor.fault
        if f is None or f.phase != "checkpoint" or f.rank != run.rank or f.step != step:
            return self.fault
        return lambda tmp: f.fire()  # NOTE: an injected checkpoint fault fires after the files are written


def train(cfg: TrainConfig, return_params: bool = False, stop_after: int | None = None,
          _save_fault: Any = None, monitor: Monitor | None = None, store: Any = None) -> TrainResult:
    """Run ``cfg`` on this rank of an initialized process group (see the module docstring).

    ``return_params`` adds the full (unsharded) parameters at the end to the result (tests).
    ``stop_after`` ends the run after that step as if the job were stopped there (a time limit):
    it evaluates and checkpoints as at the end, but the schedule still spans ``cfg.steps``.
    ``_save_fault(tmp_dir)`` is passed to every checkpoint save (tests inject a crash).
    ``monitor`` records this rank's phases and failure (:mod:`flcomm.train.monitor`); a
    failure is re-raised with the one-line report added as a note. ``store``: the job's store
    (``--elastic``).
    """
    if not dist.is_initialized():
        raise RuntimeError("train() needs torch.distributed to be initialized (use launch_local, "
                           "worker_main or torchrun)")
    mon = monitor or Monitor(None, dist.get_rank(), dist.get_world_size())
    try:
        return _train(cfg, mon, return_params, stop_after, _save_fault, store)
    except BaseException as e:
        msg = mon.fail(e)
        if hasattr(e, "add_note"):  # NOTE: Python >= 3.11; the monitor keeps it either way
            e.add_note(msg)
        raise


def _train(cfg: TrainConfig, mon: Monitor, return_params: bool, stop_after: int | None,
           save_fault: Any, store: Any = None) -> TrainResult:
    run = build_run(cfg, mon, store)
    end = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
    policy = CheckpointPolicy(cfg, end, save_fault)
    log = StepLogger(run)
    res = TrainResult(start_step=run.start_step, tokens_per_step=run.tokens_per_step)
    run.model.train()
    step = run.start_step
    try:
        if cfg.rejoin:
            # NOTE: admitted in the middle of the survivors' step: its evaluation and checkpoint are still to come
            _eval_and_save(run, policy, log, res, step)
        for step in range(run.start_step + 1, end + 1):
            t0 = time.perf_counter()
            res.losses.append(train_step(run, step))
            dt = time.perf_counter() - t0
            if cfg.nan_policy == "stop" and (policy.eval_due(step) or policy.save_due(step)):
                mon.enter(step, "nan-check")
                _agree_non_finite(run, step)
            ev = _eval_and_save(run, policy, log, res, step)
            log.step(step, res.losses[-1], dt, ev)
        mon.enter(step, "end")
        if run.fed is not None:
            run.fed.finish()
        if run.federation is not None:
            run.federation.finish()
        log.finish(res, step)
    finally:
        log.close()
    mon.done()
    if return_params:
        res.params = _full_params(run.model)
    return res


def _eval_and_save(run: Run, policy: CheckpointPolicy, log: StepLogger, res: TrainResult, step: int) -> float | None:
    """Evaluation and checkpoint of ``step`` when due (both finish an exchange in flight first);
    the evaluation loss, if any."""
    ev = None
    if policy.eval_due(step):
        run.monitor.enter(step, "eval")
        if run.fed is not None:
            run.fed.finish()
        ev = res.eval_losses[step] = log.counter.excluding(
            lambda: evaluate(run.model, run.held, run.device, run.fed, step))
    if policy.save_due(step):
        policy.save(run, step, log.elapsed())
    return ev
