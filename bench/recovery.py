"""Recovery, flcomm against torchft: one rank of federation group 1 (torchft: replica group 1)
is killed at step k; both libraries get the same supervisor, the same job and the same cluster,
and are measured from the outside the same way.

The supervisor does what torchrun does to a node whose worker died: it kills the group's other
ranks at once and starts the whole group again (once), on a fresh store (torchft: the group's
store and gloo world on a port per restart; flcomm: a fresh incarnation prefix in the job's
store). The rest differs by library, as each is meant to be used:

- torchft DiLoCo: ``min_replica_size=1`` (the survivors may go on alone) and the lighthouse's
  default join and heartbeat timeouts (60 s, 5 s). The restarted group trains from its seed to
  its first sync, where the quorum heals it from a survivor (model and inner optimizer).
- flcomm FedAvg(outer="nesterov") in an elastic federation (``grace_s`` = torchft's heartbeat
  timeout, 5 s): the survivors drop the group at the next sync after ``grace_s`` and go on; the
  restarted group (``rejoin_mode``) waits until the survivors admit it at a sync and takes that
  sync's state from a survivor. Its AdamW state starts fresh here (the driver's ``--rejoin``
  loads a survivor's checkpoint for it).

Every rank appends a record per step (wall time, step, loop iteration, and at a sync a SHA-1 of
its shard) to a JSON-lines file, flushed, so a killed rank's records survive it. Columns:

  surv +s    the survivors' wall time from their first step to their last, less the same in a
             run without the fault (same harness, same cluster)
  rejoin s   from the kill to the moment the restarted group holds the federation's state: the
             first sync record of it whose shard digest equals the survivors' at the same step
  redone     steps the survivors ran twice (a round whose sync was not committed is trained again)
  out        the federation's steps the killed group missed: the step it came back at (rejoin s)
             less the last sync before the kill

``python -m bench.recovery worker ...`` is one rank; :func:`run` is called by
``python -m bench.peers --recovery``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench import tft_common as tc  # noqa: E402

LIBS = ("tft", "fl")
GRACE_S = 5.0  # flcomm's grace = torchft's lighthouse heartbeat timeout (its default)
RESTART_PORT_STRIDE = 100  # torchft: a restarted group's store port is base + node + stride x restart


# ---------------------------------------------------------------- one rank ----

def _digest(model: Any) -> str:
    return hashlib.sha1(tc.local_shard(model).numpy().tobytes()).hexdigest()


class RankRecords:
    """This rank's records, one JSON line each with its wall time, flushed as written: a killed
    rank's records survive it (``rank<r>.inc<restart>.jsonl`` in ``out``)."""

    def __init__(self, out: str, rank: int, restart: int) -> None:
        os.makedirs(out, exist_ok=True)
        self._file = open(os.path.join(out, f"rank{rank}.inc{restart}.jsonl"), "w")

    def __call__(self, **kv: Any) -> None:
        self._file.write(json.dumps({"t": time.time(), **kv}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _tft_rank(a: argparse.Namespace, env: tc.Env, timeout: timedelta) -> tuple[Any, Any, Any, Any]:
    """torchft's side of a rank: its group's world and store on a port of its incarnation, the
    model, a Manager that lets the survivors go on alone (``min_replica_size=1``) and DiLoCo:
    (model, inner, diloco, manager)."""
    from torch.distributed.device_mesh import init_device_mesh

    port = a.store_port + env.node + RESTART_PORT_STRIDE * a.restart
    tc.init_group_world(env, port, timeout)
    model, inner = tc.build_model_sharded(a, init_device_mesh("cpu", (env.per_node,), mesh_dim_names=("shard",)))
    manager = tc.tft_manager(a, env, model, inner, 1, port)
    return model, inner, tc.tft_diloco(a, manager, [model], inner), manager


def _fl_rank(a: argparse.Namespace, env: tc.Env, store: Any, timeout: timedelta) -> tuple[Any, Any, Any]:
    """flcomm's side of a rank: its group's world under its incarnation's prefix in the job's
    store, the model and FedAvg in an elastic federation (a restarted group in ``rejoin_mode``):
    (model, inner, fed)."""
    import torch.distributed as dist

    import flcomm
    from flcomm.federated.elastic import Federation

    restarted = a.restart > 0
    # NOTE: the group's world under a prefix of its incarnation, as the driver's --elastic
    dist.init_process_group("gloo", store=dist.PrefixStore(f"flcomm/group{env.node}/inc{a.restart}/", store),
                            rank=env.local, world_size=env.per_node, timeout=timeout)
    topo = flcomm.Strategy.FL_FSDP.topology(env.world, ranks_per_node=env.per_node, group_size=env.per_node)
    mesh = flcomm.init_fed_mesh(topo, "cpu", timeout=timeout, group_rank=env.rank)
    model, inner = tc.build_model_sharded(a, mesh.device_mesh["shard"])
    federation = Federation(store, topo, env.rank, mesh.config, grace_s=a.grace, stats=mesh.stats,
                            rejoin_mode=restarted)
    cfg = flcomm.FedAvgConfig(sync_every=a.sync_every, outer="nesterov", outer_lr=tc.OUTER_LR,
                              outer_momentum=tc.OUTER_MOMENTUM, bucket_cap_mb=a.bucket_mb)
    return model, inner, flcomm.FedAvg(model, mesh, cfg, inner_optimizer=inner, federation=federation,
                                       sync_module_states=not restarted)


def _start_together(store: Any, world: int) -> None:
    """Wait in the job's store until all ``world`` ranks of the first incarnation are up."""
    # NOTE: every group is in the first quorum (torchft's managers heartbeat by now; with
    # min_replica_size=1 a late group would otherwise miss it and train alone)
    store.add("started", 1)
    store.wait(["started"])
    while int(store.get("started")) < world:
        time.sleep(0.05)


def _train(a: argparse.Namespace, env: tc.Env, model: Any, inner: Any, fed: Any, diloco: Any, manager: Any,
           loader: Any, record: RankRecords) -> tuple[int, int]:
    """The steps to ``a.steps`` (from the admitted step for a rejoining flcomm group), a record
    per step, and the kill of ``a.kill_rank`` after its ``a.kill_step``-th iteration in the first
    incarnation: (step, iterations) at the end."""
    E, restarted = a.sync_every, a.restart > 0
    step = it = 0
    if fed is not None and restarted:
        step = fed.rejoin()
        record(event="joined", step=step, digest=_digest(model))
    loader.position = step * a.batch_size
    while step < a.steps:
        t_step = time.perf_counter()
        loss = tc.train_step(model, inner, fed, loader)
        it += 1
        step += 1
        if not restarted:  # NOTE: a floor under the first incarnation's steps only (run_once)
            time.sleep(max(0.0, a.min_step_s - (time.perf_counter() - t_step)))
        synced = diloco._local_step == 0 if diloco is not None else step % E == 0
        if diloco is not None and synced:
            # NOTE: torchft's committed rounds are the step: a round not committed is trained
            # again, and a healed group takes the survivors' step
            step = manager.current_step() * E
            loader.position = step * a.batch_size
        record(event="step", step=step, iter=it, sync=synced, loss=float(loss.detach()),
               digest=_digest(model) if synced else None)
        # NOTE: by iteration: torchft's step can jump (a group healed after a quorum without it)
        if not restarted and env.rank == a.kill_rank and it == a.kill_step:
            record(event="kill", step=step)
            os.kill(os.getpid(), signal.SIGKILL)
    return step, it


def worker(a: argparse.Namespace) -> int:
    """One rank of a recovery run (``--restart``: its incarnation): the library's side, the start
    barrier of the first incarnation, the steps, the records."""
    import torch.distributed as dist

    env = tc.start_rank()
    restarted, timeout = a.restart > 0, timedelta(seconds=a.timeout)
    record = RankRecords(a.out, env.rank, a.restart)
    record(event="start")
    fed = diloco = manager = None
    store = dist.TCPStore(env.addrs[0], a.job_port, is_master=False, timeout=timeout)
    if a.lib == "tft":
        model, inner, diloco, manager = _tft_rank(a, env, timeout)
    else:
        model, inner, fed = _fl_rank(a, env, store, timeout)
    loader, _ = tc.build_data(a, env)
    if not restarted:
        _start_together(store, env.world)
    step, it = _train(a, env, model, inner, fed, diloco, manager, loader, record)
    if fed is not None:
        fed.finish()
    record(event="end", step=step, iter=it)
    record.close()
    return tc.end_rank(diloco, manager)


# ---------------------------------------------------------------- the supervisor ----

def supervise(c: Any, argv: list[str], ranks_per_node: int, env: dict[str, str], log_dir: str,
              timeout: float, kill_group: int | None) -> list[int]:
    """Start every rank; when a rank of ``kill_group`` dies, kill the group's other ranks and
    start the group again with ``--restart 1`` (once), as torchrun restarts a node's workers.
    Returns the exit codes (of the last incarnation) in rank order."""
    os.makedirs(log_dir, exist_ok=True)
    world = _nodes(c) * ranks_per_node
    files: list[Any] = []

    def start(r: int, inc: int) -> subprocess.Popen:
        f = open(os.path.join(log_dir, f"rank{r}.inc{inc}.log"), "w")
        files.append(f)
        return subprocess.Popen(c.exec_argv(r // ranks_per_node, [*argv, "--restart", str(inc)]),
                                env=c.rank_env(r, ranks_per_node, env), cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)

    procs = [start(r, 0) for r in range(world)]
    restarted = False
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the recovery run did not finish within {timeout:.0f} s (logs: {log_dir})")
            for r, p in enumerate(procs):
                g = r // ranks_per_node
                if p.poll() not in (None, 0) and g == kill_group and not restarted:
                    mates = range(g * ranks_per_node, (g + 1) * ranks_per_node)
                    tc.reap([procs[q] for q in mates])
                    for q in mates:
                        procs[q] = start(q, 1)
                    restarted = True
                    break
                if p.poll() not in (None, 0):
                    raise RuntimeError(f"rank {r} failed (exit code {p.returncode}); its log: {log_dir}")
            time.sleep(0.05)
    finally:
        tc.reap(procs, files)
    return [p.returncode for p in procs]


def _nodes(c: Any) -> int:
    # NOTE: duck-typed: under python -m bench.peers, its LocalCluster is __main__'s, not bench.peers'
    # (and this module does not import bench.peers: both import bench.tft_common)
    return c.spec.nodes if hasattr(c, "spec") else c.nodes


def run_once(c: Any, a: argparse.Namespace, lib: str, E: int, out: str, kill: bool) -> dict:
    """One recovery run (``kill`` False: the same run without the fault); its records.
    ``a.min_step_s`` (0 unless set; the tests set it) is a floor under each step of the first
    incarnation: the survivors then still train when a restarted group that came up slowly
    reaches its first sync, instead of having finished without it."""
    local, nodes = not hasattr(c, "spec"), _nodes(c)
    ports = {k: tc.free_port() if local else d for k, d in (("store", 29710), ("lighthouse", 29750), ("job", 29760))}
    os.makedirs(out, exist_ok=True)
    # the job's store (flcomm's elastic federation; both libraries' start barrier) and, for
    # torchft, the lighthouse, in node 0
    lighthouse = tc.lighthouse_code(ports["lighthouse"], 1) if lib == "tft" else ""
    server = tc.serve(c, 0, f"import time, datetime, torch.distributed as d; {lighthouse}"
                          f"s = d.TCPStore('{c.addr(0)}', {ports['job']}, None, True, "
                          "timeout=datetime.timedelta(seconds=600), wait_for_workers=False); "
                          "print('up', flush=True); time.sleep(1e9)", os.path.join(out, "server.log"))
    env = {"PEERS_ADDRS": ",".join(c.addr(n) for n in range(nodes)),
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    kill_rank = a.ranks_per_node  # group 1's first rank
    argv = [sys.executable, "-m", "bench.recovery", "worker", "--lib", lib, "--sync-every", str(E),
            "--model", a.model, "--steps", str(a.steps), "--batch-size", str(a.batch_size), "--seq-len",
            str(a.seq_len), "--lr", str(a.lr), "--seed", str(a.seed), "--bucket-mb", str(a.bucket_mb),
            "--timeout", str(a.timeout), "--grace", str(GRACE_S), "--store-port", str(ports["store"]),
            "--lighthouse-port", str(ports["lighthouse"]), "--job-port", str(ports["job"]), "--out", out,
            "--kill-rank", str(kill_rank if kill else -1), "--kill-step", str(kill_step(a, E)),
            "--min-step-s", str(getattr(a, "min_step_s", 0.0))]
    t0 = time.perf_counter()
    try:
        time.sleep(1.0)  # NOTE: the lighthouse or store is up before a rank dials it
        supervise(c, argv, a.ranks_per_node, env, os.path.join(out, "logs"), a.timeout * 2, 1 if kill else None)
    finally:
        tc.reap([server])
    meta = {"lib": lib, "sync_every": E, "kill": kill, "kill_rank": kill_rank, "kill_step": kill_step(a, E),
            "steps": a.steps, "ranks_per_node": a.ranks_per_node, "nodes": nodes, "wall_s": time.perf_counter() - t0}
    with open(os.path.join(out, "run.json"), "w") as f:
        json.dump(meta, f)
    return read_run(out)


def read_run(out: str) -> dict:
    """A recovery run's meta with every rank's records by (rank, incarnation)."""
    with open(os.path.join(out, "run.json")) as f:
        meta = json.load(f)
    recs: dict[tuple[int, int], list[dict]] = {}
    for name in sorted(os.listdir(out)):
        if name.startswith("rank") and name.endswith(".jsonl"):
            r, inc = name[4:-6].split(".inc")
            with open(os.path.join(out, name)) as f:
                recs[(int(r), int(inc))] = [json.loads(line) for line in f if line.strip()]
    return {**meta, "records": recs, "out": out}


# ---------------------------------------------------------------- the columns ----

def train_span(recs: list[dict]) -> float:
    """Wall time from the first step's record to the last."""
    steps = [r["t"] for r in recs if r["event"] == "step"]
    return steps[-1] - steps[0]


def analyse(fault: dict, clean: dict) -> dict:
    """The columns of the module doc from a faulty run and the same run without the fault."""
    rpn, N, E = fault["ranks_per_node"], fault["steps"], fault["sync_every"]
    kill_rank = fault["kill_rank"]
    killed_group = kill_rank // rpn
    survivors = [r for r in range(fault["nodes"] * rpn) if r // rpn != killed_group]
    recs = fault["records"]
    kill = next((x for x in recs[(kill_rank, 0)] if x["event"] == "kill"), None)
    if kill is None:
        raise ValueError(f"{fault.get('out', 'the run')}: rank {kill_rank} has no kill record (it did not reach "
                         f"step {fault.get('kill_step')})")
    extra = statistics.fmean(train_span(recs[(r, 0)]) - train_span(clean["records"][(r, 0)]) for r in survivors)
    redone = max(sum(1 for x in recs[(r, 0)] if x["event"] == "step") - N for r in survivors)
    # the survivors' shard digests by (index in the group, step)
    theirs = {(r % rpn, x["step"]): x["digest"] for r in survivors for x in recs[(r, 0)]
              if x.get("digest") and x["event"] == "step"}
    back = []
    for r in range(killed_group * rpn, (killed_group + 1) * rpn):
        hit = next((x for x in recs.get((r, 1), []) if x.get("digest") and theirs.get((r % rpn, x["step"])) ==
                    x["digest"]), None)
        back.append(hit)
    rejoin_s = max(h["t"] for h in back) - kill["t"] if all(back) else None
    last_sync = (kill["step"] // E) * E
    out = max(h["step"] for h in back) - last_sync if all(back) else None
    # the clean run's groups agree at every sync (else its quorums left a group out)
    clean_digests: dict[tuple[int, int], set] = {}
    for (r, _), xs in clean["records"].items():
        for x in xs:
            if x.get("digest"):
                clean_digests.setdefault((r % rpn, x["step"]), set()).add(x["digest"])
    agree = all(len(v) == 1 for v in clean_digests.values())
    return {"lib": fault["lib"], "sync_every": E, "kill_step": kill["step"], "survivors_extra_s": extra,
            "rejoin_s": rejoin_s, "redone_steps": redone, "out_steps": out, "clean_groups_agree": agree,
            "survivors_span_s": statistics.fmean(train_span(recs[(r, 0)]) for r in survivors),
            "clean_span_s": statistics.fmean(train_span(clean["records"][(r, 0)]) for r in survivors)}


def run(c: Any, a: argparse.Namespace, out_dir: str, log: Any) -> list[dict]:
    """``bench.peers --recovery``: for each ``--sync-every`` and library, the run without the
    fault and with it (the kill after ``--kill-step``, default the middle of the second round);
    the analysed rows (a library whose runs failed is left out)."""
    rows = []
    for E in a.sync_every:
        for lib in LIBS:
            got = {}
            for kill in (False, True):
                path = os.path.join(out_dir, f"recovery_{lib}_E{E}_{'kill' if kill else 'clean'}")
                what = f"kill rank {a.ranks_per_node} after step {kill_step(a, E)}" if kill else "no fault"
                log(f"[recovery] {lib} E={E} {what}")
                try:
                    got[kill] = run_once(c, a, lib, E, path, kill)
                except (RuntimeError, OSError) as e:
                    log(f"      FAILED, left out of the table: {e}")
            if len(got) == 2:
                try:
                    rows.append(analyse(got[True], got[False]))
                except ValueError as e:
                    log(f"      left out of the table: {e}")
    return rows


def kill_step(a: argparse.Namespace, E: int) -> int:
    return a.kill_step if a.kill_step is not None else E + E // 2


def reanalyse(dirs: list[str]) -> list[dict]:
    """The rows of recovery runs recorded under ``dirs`` (pairs of ``recovery_<lib>_E<E>_kill`` and
    ``_clean``)."""
    rows = []
    for d in dirs:
        for sub in sorted(os.listdir(d)):
            if sub.startswith("recovery_") and sub.endswith("_kill"):
                clean = os.path.join(d, sub[:-len("kill")] + "clean")
                if os.path.isfile(os.path.join(d, sub, "run.json")) and os.path.isfile(os.path.join(clean, "run.json")):
                    rows.append(analyse(read_run(os.path.join(d, sub)), read_run(clean)))
    return rows


def table(rows: list[dict]) -> str:
    def f(v: Any, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    head = f"{'recovery':<10} {'E':>3} {'kill at':>7} {'surv +s':>8} {'rejoin s':>9} {'redone':>7} {'out':>5}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['lib']:<10} {r['sync_every']:>3} {r['kill_step']:>7} {f(r['survivors_extra_s'], '.2f'):>8} "
                     f"{f(r['rejoin_s'], '.2f'):>9} {r['redone_steps']:>7} {f(r['out_steps'], 'd'):>5}"
                     + ("" if r["clean_groups_agree"] else "   (the run without the fault: groups disagreed)"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] != ["worker"]:
        sys.exit("bench.recovery runs through python -m bench.peers --recovery; 'worker' is one rank")
    w = argparse.ArgumentParser(prog="bench.recovery worker")
    w.add_argument("--lib", choices=LIBS, required=True)
    for k, t, d in (("sync-every", int, 4), ("steps", int, 16), ("batch-size", int, 8), ("seq-len", int, 128),
                    ("lr", float, 3e-3), ("seed", int, 0), ("bucket-mb", float, 25.0), ("timeout", float, 300.0),
                    ("grace", float, GRACE_S), ("store-port", int, 29710), ("lighthouse-port", int, 29750),
                    ("job-port", int, 29760), ("kill-rank", int, -1), ("kill-step", int, 0), ("restart", int, 0),
                    ("eval-batches", int, 1), ("min-step-s", float, 0.0)):
        w.add_argument("--" + k, type=t, default=d)
    w.add_argument("--model", default="small")
    w.add_argument("--out", required=True)
    return worker(w.parse_args(argv[1:]))


if __name__ == "__main__":
    sys.exit(main())
