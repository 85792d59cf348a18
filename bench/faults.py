"""The fault matrix: a rank killed or frozen in each phase of a run, and the launcher killed,
on CPU/gloo with 4 ranks; every case must end within a bound, name the failed rank and the
phase, leave no process behind, and keep the last checkpoint loadable.

    python -m bench.faults                     # the full matrix: FL+FSDP and FL+HSDP, a table
    python -m bench.faults --json out.json     # also every case's record as JSON
    python -m bench.faults --quick             # FL+FSDP only (what tests/system/test_faults.py runs)
    python -m bench.faults --elastic --no-matrix   # the elastic rows only

Cases: {kill, freeze} x {forward, backward (reduce-scatter), FedAvg exchange, checkpoint save}
x strategy, under the built-in launcher (``--nproc 4``) and as four separate ranks (each its
own ``python -m flcomm.train`` with torchrun's environment variables, rank 0 hosting the
store), plus the launcher itself killed with SIGTERM and SIGKILL. Columns: the case, the exit
code, seconds from the fault until the last rank ended and until the launcher ended, whether
that stayed within the bound (2 x the collective timeout for the ranks, 10 s more for the
launcher), whether the message names the failed rank and the phase, processes left behind, and
the newest complete checkpoint's step (verified against its hashes). ``hangs`` and ``orphans``
in the last line must be 0.

Elastic rows (``--elastic``, flcomm.federated.elastic): 8 ranks as 4 federation groups x 2,
FedAvg every 4 steps, rank 3 (group 1) killed in the forward pass of step 5 or entering the
exchange of step 8, once with ``--rejoin`` (the launcher restarts group 1, which rejoins at
the survivors' next sync), and frozen (SIGSTOP) in the forward pass with a 10 s collective
timeout (its group's other rank times out, then the survivors notice). Columns: the groups
lost and rejoined, the grace, the membership round's seconds, seconds from the fault until the
survivors finished the step of that round, the bound (grace + 10 s), the tokens the lost group
trained since its last committed round (at most one round), all tokens, the final groups, and
whether the rejoined group's final parameters equal the survivors'.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

PHASES = {"forward": (3, "forward"), "backward": (3, "backward"), "fedavg": (4, "fedavg"),
          "checkpoint": (4, "checkpoint")}  # case -> (step, monitor phase); E = 2, saves every 2
PHASE_WORDS = {"forward": "forward", "backward": "backward", "fedavg": "FedAvg", "checkpoint": "checkpoint"}
FAULTY_RANK = 1
LAUNCHER_SLACK_S = 10.0  # the launcher's own end: stopping a frozen rank, interpreter exit


def train_args(strategy: str, timeout_s: float, steps: int = 6, ckpt_dir: str | None = None) -> list[str]:
    """A tiny 4-rank run: 2 emulated nodes of 2, FedAvg every 2 steps, a checkpoint every 2
    (with ``ckpt_dir``)."""
    args = ["--strategy", strategy, "--ranks-per-node", "2", "--model", "tiny", "--steps", str(steps),
            "--batch-size", "2", "--seq-len", "32", "--max-tokens", "100000", "--sync-every", "2",
            "--eval-batches", "1", "--eval-fraction", "0.05", "--warmup", "1", "--timeout-s", str(timeout_s),
            "--no-progress"]
    return args + (["--checkpoint-dir", ckpt_dir, "--save-every", "2"] if ckpt_dir else [])


@dataclass
class CaseResult:
    case: str
    rc: int | None = None
    seconds: float | None = None      # from the fault (or the launcher's kill) to the last rank's end
    launcher_s: float | None = None   # from the fault to the launcher's (or the last process's) exit
    bound_s: float = 0.0
    within_bound: bool = False
    names_rank: bool = False
    names_phase: bool = False
    orphans: int = 0
    hang: bool = False
    checkpoint_step: int | None = None
    message: str = ""
    rank_pids: list[int] = field(default_factory=list)


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra)
    return env


def _alive(pids: list[int]) -> list[int]:
    from flcomm.train.monitor import process_state

    return [p for p in pids if process_state(p) != "dead"]


def _pgroup(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group ``pgid``."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] not in ("Z", "X") and int(fields[2]) == pgid:
            out.append(int(d))
    return out


def _heartbeats(log_dir: str, world: int) -> dict[int, dict | None]:
    from flcomm.train.monitor import read_heartbeat

    return {r: read_heartbeat(log_dir, r) for r in range(world)}


def _latest_step(ckpt_dir: str) -> int | None:
    from flcomm.train import checkpoint as ckpt

    path = ckpt.latest_checkpoint(ckpt_dir)
    if path is None:
        return None
    meta = ckpt.read_meta(path)
    ckpt.verify_files(path, meta)
    return int(meta["step"])


def _reap(pids: list[int], wait_s: float) -> list[int]:
    deadline = time.monotonic() + wait_s
    while _alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = _alive(pids)
    for p in left:  # NOTE: a harness must not leave them either
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


def run_rank_fault(strategy: str, action: str, phase: str, workdir: str, timeout_s: float = 5.0,
                   separate: bool = False, wall_s: float = 240.0) -> CaseResult:
    """Rank 1 ``action`` (kill | freeze) when it enters ``phase`` (a key of PHASES)."""
    step, mphase = PHASES[phase]
    name = f"{strategy} {'4 ranks' if separate else 'launcher'} {action} {phase}"
    res = CaseResult(name, bound_s=2 * timeout_s)
    log_dir, ckpt_dir = os.path.join(workdir, "log"), os.path.join(workdir, "ckpt")
    args = train_args(strategy, timeout_s, ckpt_dir=ckpt_dir) + ["--log-dir", log_dir]
    env = _env(FLCOMM_FAULT=f"{FAULTY_RANK}:{step}:{mphase}:{action}")
    t_launch = time.time()
    if separate:
        procs = _start_separate(args, env)
    else:
        procs = [subprocess.Popen([sys.executable, "-m", "flcomm.train", "--nproc", "4", *args], env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                  start_new_session=True)]
    # NOTE: four separate ranks have no launcher to end a frozen one: its peers must end by
    # themselves, then the harness kills it (torchrun's agent would)
    errs = _wait_all([p for r, p in enumerate(procs) if not (separate and action == "freeze" and r == FAULTY_RANK)],
                     wall_s)
    if separate and action == "freeze":
        procs[FAULTY_RANK].kill()
        errs.insert(FAULTY_RANK, procs[FAULTY_RANK].communicate()[1] or "")
    res.hang = any(p.returncode is None for p in procs)
    t_end = time.time()
    hbs = _heartbeats(log_dir, 4)
    res.rank_pids = [int(h["pid"]) for h in hbs.values() if h]
    res.orphans = len(_reap(res.rank_pids + [q for p in procs for q in _pgroup(p.pid)], 3.0))
    res.rc = max((p.returncode for p in procs if p.returncode is not None), default=None)
    res.message = (errs[0] if not separate else "\n".join(errs)).strip()
    fault = hbs.get(FAULTY_RANK)
    if fault is not None and fault.get("step") == step:
        # NOTE: the faulty rank's last heartbeat is the phase it faulted in; every other rank
        # writes its error record right before it exits
        ends = [float(h["t"]) if h and h.get("state") == "error" else t_end
                for r, h in hbs.items() if r != FAULTY_RANK]
        res.seconds = max(ends) - float(fault["t"])
        res.launcher_s = t_end - float(fault["t"])
    else:
        res.seconds = res.launcher_s = t_end - t_launch
    res.within_bound = (res.seconds <= res.bound_s and res.launcher_s <= res.bound_s + LAUNCHER_SLACK_S
                        and not res.hang)
    res.names_rank = f"rank {FAULTY_RANK}" in res.message
    res.names_phase = PHASE_WORDS[phase] in res.message
    res.checkpoint_step = _latest_step(ckpt_dir)
    return res


def _start_separate(args: list[str], env: dict[str, str]) -> list[subprocess.Popen]:
    import socket

    with socket.socket() as s:  # NOTE: rank 0's store binds this port; a harness-only race
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for r in range(4):
        e = dict(env, RANK=str(r), WORLD_SIZE="4", LOCAL_RANK=str(r % 2), LOCAL_WORLD_SIZE="2",
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, "-m", "flcomm.train", *args], env=e,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                      start_new_session=True))
    return procs


def _wait_all(procs: list[subprocess.Popen], wall_s: float) -> list[str]:
    deadline = time.monotonic() + wall_s
    errs = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            err = ""
        errs.append(err or "")
    return errs


def run_launcher_kill(strategy: str, sig: int, workdir: str, timeout_s: float = 5.0,
                      wall_s: float = 240.0) -> CaseResult:
    """Kill the ``--nproc 4`` launcher with ``sig`` once every rank is training (step 2)."""
    from flcomm.train.monitor import read_heartbeat

    res = CaseResult(f"{strategy} launcher {signal.Signals(sig).name}", bound_s=5.0)
    log_dir = os.path.join(workdir, "log")
    args = train_args(strategy, timeout_s, steps=200) + ["--log-dir", log_dir]
    p = subprocess.Popen([sys.executable, "-m", "flcomm.train", "--nproc", "4", *args], env=_env(),
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + wall_s
    while time.monotonic() < deadline and p.poll() is None:
        hbs = [read_heartbeat(log_dir, r) for r in range(4)]
        if all(h is not None and h.get("step", 0) >= 2 for h in hbs):
            break
        time.sleep(0.2)
    pids = [int(h["pid"]) for h in _heartbeats(log_dir, 4).values() if h]
    t0 = time.time()
    p.send_signal(sig)
    try:
        res.message = p.communicate(timeout=wall_s)[1] or ""
    except subprocess.TimeoutExpired:
        res.hang = True
    while time.time() - t0 < res.bound_s + 5 and _alive(pids):
        time.sleep(0.05)
    res.seconds = time.time() - t0
    res.launcher_s = res.seconds
    res.rc = p.returncode
    res.rank_pids = pids
    res.orphans = len(_reap(pids + _pgroup(p.pid), 0.0))
    res.within_bound = len(pids) == 4 and res.seconds <= res.bound_s and not res.hang and res.rc == -sig
    res.names_rank = res.names_phase = True  # NOTE: nothing failed: nothing to name
    return res


ELASTIC_PHASES = {"forward": (5, "forward"), "fedavg": (8, "fedavg")}  # E = 4: both lose group 1 at the round of step 8
ELASTIC_RANK = 3  # the second rank of federation group 1 of 4
# the elastic runs: 4 federation groups of ELASTIC_G ranks, FedAvg every ELASTIC_E steps
ELASTIC_G, ELASTIC_E, ELASTIC_BATCH, ELASTIC_SEQ = 2, 4, 2, 32
ELASTIC_REJOIN_STEPS = 200  # the cap of a --rejoin run, which is stopped one round after the admission


@dataclass
class ElasticResult:
    """One elastic case: 8 ranks as 4 federation groups x 2, rank 3 (group 1) killed."""

    case: str
    rejoin: bool = False               # --rejoin: the launcher restarts the lost group
    rc: int | None = None
    lost: list[int] = field(default_factory=list)
    rejoined: list[int] = field(default_factory=list)
    grace_s: float = 0.0
    membership_s: float | None = None  # the membership round (detection to new groups built)
    resume_s: float | None = None      # from the fault until the survivors finished that sync's step
    bound_s: float = 0.0               # grace + 10 s (issue target), from the survivors' failed round
    within_bound: bool = False
    steps: list[int] = field(default_factory=list)
    fault_step: int | None = None      # the step the faulty rank's first incarnation was last seen at (heartbeat)
    tokens_lost: float = 0             # the lost group's tokens since its last committed round (from the reports)
    tokens: int = 0                    # every token the run trained on
    final_groups: list[int] = field(default_factory=list)
    rejoined_equal: bool | None = None  # the rejoined group's parameters equal the survivors' (stopped_at)
    stopped_at: int | None = None      # rejoin: the sync one round after the admission, where the run was stopped
    message: str = ""


def elastic_args(grace_s: float, steps: int, ckpt_dir: str, metrics: str, timeout_s: float = 20.0) -> list[str]:
    """8 ranks as 4 federation groups of 2 (one node each), FedAvg every 4 steps, a checkpoint
    every 4, ``--elastic``."""
    G, E = str(ELASTIC_G), str(ELASTIC_E)
    return ["--strategy", "fl-fsdp", "--nproc", str(4 * ELASTIC_G), "--ranks-per-node", G, "--group-size", G,
            "--model", "tiny", "--steps", str(steps), "--batch-size", str(ELASTIC_BATCH),
            "--seq-len", str(ELASTIC_SEQ), "--max-tokens", "200000", "--sync-every", E, "--eval-batches", "1",
            "--eval-fraction", "0.05", "--warmup", "1", "--timeout-s", str(timeout_s), "--no-progress", "--elastic",
            "--elastic-grace-s", str(grace_s), "--checkpoint-dir", ckpt_dir, "--save-every", E, "--metrics", metrics]


def group_params_equal(ckpt_root: str, groups: list[int], step: int) -> bool:
    """The checkpoints of step ``step`` of every group in ``groups`` hold the same model."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from flcomm.train import checkpoint as ckpt

    models = []
    for f in groups:
        path = os.path.join(ckpt.elastic_checkpoint_dir(ckpt_root, f), ckpt.step_name(step))
        out = os.path.join(os.path.dirname(path), "full.pt")
        dcp_to_torch_save(path, out)
        models.append(torch.load(out, weights_only=True)[f"group{f}"]["model"])
    ref = models[0]
    return all(all(torch.equal(ref[k], sd[k]) for k in ref) for sd in models)


def _progress(metrics: str) -> tuple[int | None, int]:
    """From a metrics file being written: the step of the first membership record that admitted
    a group (None: none yet) and the last step recorded (0: none yet)."""
    from flcomm.train.metrics import read_metrics

    try:
        m = read_metrics(metrics)
    except (OSError, ValueError):  # NOTE: not there yet, or a line half written
        return None, 0
    joined = next((e["step"] for e in m.membership if e["joined"]), None)
    return joined, (m.steps[-1]["step"] if m.steps else 0)


def run_elastic_fault(phase: str, workdir: str, grace_s: float = 3.0, rejoin: bool = False,
                      steps: int = 12, wall_s: float = 300.0, extra: tuple[str, ...] = (),
                      action: str = "kill", timeout_s: float = 20.0) -> ElasticResult:
    """Kill (or freeze: ``action``) rank 3 of 8 (federation group 1 of 4) when it enters
    ``phase`` (a key of ELASTIC_PHASES), under ``--elastic`` (and ``--rejoin``: the launcher
    restarts group 1); ``extra``: more flags of the run. A frozen rank's peers notice it after
    the collective timeout ``timeout_s``, which the bound then includes.

    With ``rejoin`` the run is stopped (SIGTERM to the launcher) once every group has saved the
    sync one round after group 1 was admitted, whose checkpoints are then compared: how many
    steps the survivors run while group 1 restarts depends on the machine, so ``steps`` only
    caps the run."""
    from flcomm.train.checkpoint import newest_group_checkpoints
    from flcomm.train.metrics import read_metrics
    from flcomm.train.monitor import read_heartbeat

    step, mphase = ELASTIC_PHASES[phase]
    res = ElasticResult(f"elastic {action} {phase}" + (" + rejoin" if rejoin else ""), rejoin=rejoin,
                        grace_s=grace_s, bound_s=grace_s + 10.0)
    log_dir, ckpt_dir, metrics = (os.path.join(workdir, n) for n in ("log", "ckpt", "m.jsonl"))
    args = (elastic_args(grace_s, steps, ckpt_dir, metrics, timeout_s) + ["--log-dir", log_dir]
            + (["--rejoin"] if rejoin else []) + list(extra))
    env = _env(FLCOMM_FAULT=f"{ELASTIC_RANK}:{step}:{mphase}:{action}")
    err_path = os.path.join(workdir, "stderr.txt")
    t_fault = joined = first = None
    groups = list(range(4))
    with open(err_path, "w") as err:
        p = subprocess.Popen([sys.executable, "-m", "flcomm.train", *args], env=env, stdout=subprocess.DEVNULL,
                             stderr=err, text=True, start_new_session=True)
        deadline = time.monotonic() + wall_s
        while p.poll() is None and time.monotonic() < deadline:
            # NOTE: the faulty rank's heartbeat of the phase it dies in (a restarted rank overwrites it)
            hb = read_heartbeat(log_dir, ELASTIC_RANK)
            if hb is not None and (first is None or hb.get("pid") == first["pid"]):
                first = hb  # NOTE: the first incarnation's; a restarted rank has another pid
            if t_fault is None and hb is not None and hb.get("step") == step and hb.get("phase") == mphase:
                t_fault = float(hb["t"])
            if rejoin:
                admitted, last = _progress(metrics)
                joined = joined if joined is not None else admitted
                saved = newest_group_checkpoints(ckpt_dir)
                # NOTE: a step's checkpoint is written before its metrics record: stop once both are
                if joined is not None and len(saved) == len(groups) and last >= joined + ELASTIC_E and \
                        min(st for st, _ in saved.values()) >= joined + ELASTIC_E:
                    res.stopped_at = joined + ELASTIC_E
                    p.send_signal(signal.SIGTERM)
                    try:
                        p.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        pass
                    break
            time.sleep(0.05)
        if p.poll() is None:
            p.kill()
        p.wait()
    with open(err_path) as f:
        res.message = f.read()
    res.rc = p.returncode
    ended = res.rc == 0 or (res.stopped_at is not None and res.rc == -signal.SIGTERM)
    if not os.path.exists(metrics):
        return res
    m = read_metrics(metrics)
    events = m.membership
    lost = [e for e in events if e["lost"]]
    res.lost = sorted({g for e in lost for g in e["lost"]})
    res.rejoined = sorted({g for e in events if e["joined"] for g in e["joined"]})
    res.steps = [r["step"] for r in m.steps]
    res.tokens = m.steps[-1]["tokens"] if m.steps else 0
    res.final_groups = events[-1]["groups"] if events else []
    if lost:
        res.membership_s = lost[0]["seconds"]
        after = [r for r in m.steps if r["step"] == lost[0]["step"]]
        if after and t_fault is not None:
            res.resume_s = float(after[0]["wall_time"]) - t_fault
        # NOTE: the survivors' failed round ends the membership round; from there to training
        res.within_bound = res.membership_s <= res.bound_s and ended
        # NOTE: from what the run reported: the round the group was lost at, less the run's
        # sync_every, is its last committed one; it had begun the steps up to its last heartbeat;
        # a group's step is a step's tokens (cumulative: over the steps) over the groups that ran it
        res.fault_step = int(first["step"]) if first is not None else None
        last_round = lost[0]["step"] - m.config["fedavg"]["sync_every"]
        per_group_step = m.steps[0]["tokens"] / m.steps[0]["step"] / len(lost[0]["previous_groups"])
        if res.fault_step is not None:
            lost_tokens = (res.fault_step - last_round) * per_group_step
            res.tokens_lost = int(lost_tokens) if lost_tokens == int(lost_tokens) else lost_tokens
    if res.stopped_at is not None:
        res.rejoined_equal = group_params_equal(ckpt_dir, groups, res.stopped_at)
    return res


def format_elastic(rows: list[ElasticResult]) -> str:
    head = (f"{'case':<28} {'rc':>3} {'lost':>5} {'rejoin':>6} {'grace':>5} {'member s':>8} {'resume s':>8} "
            f"{'bound':>5} {'ok':>3} {'tok lost':>8} {'tokens':>7} {'final':>10} {'equal':>5} {'stop':>4}")
    lines = [head, "-" * len(head)]
    for r in rows:
        equal = {None: "-", True: "y", False: "n"}[r.rejoined_equal]
        lines.append(f"{r.case:<28} {str(r.rc):>3} {str(r.lost):>5} {str(r.rejoined):>6} {r.grace_s:>5.1f} "
                     f"{r.membership_s or 0:>8.2f} {r.resume_s or 0:>8.2f} {r.bound_s:>5.1f} "
                     f"{'y' if r.within_bound else 'n':>3} {r.tokens_lost:>8g} {r.tokens:>7} "
                     f"{str(r.final_groups):>10} {equal:>5} {str(r.stopped_at or '-'):>4}")
    return "\n".join(lines)


def matrix(quick: bool) -> list[tuple]:
    strategies = ["fl-fsdp"] if quick else ["fl-fsdp", "fl-hsdp"]
    cases: list[tuple] = []
    for s in strategies:
        for separate in ([False] if quick else [False, True]):
            for action in ("kill", "freeze"):
                for phase in PHASES:
                    cases.append(("rank", s, action, phase, separate))
        for sig in (signal.SIGTERM, signal.SIGKILL):
            cases.append(("launcher", s, sig))
    return cases


def run(case: tuple, timeout_s: float) -> CaseResult:
    with tempfile.TemporaryDirectory(prefix="flcomm-fault-") as d:
        if case[0] == "rank":
            _, s, action, phase, separate = case
            return run_rank_fault(s, action, phase, d, timeout_s, separate)
        return run_launcher_kill(case[1], case[2], d, timeout_s)


def format_table(rows: list[CaseResult]) -> str:
    head = (f"{'case':<36} {'rc':>4} {'ranks s':>7} {'launch s':>8} {'bound':>6} {'ok':>3} {'rank':>5} "
            f"{'phase':>6} {'orph':>5} {'ckpt':>5}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.case:<36} {str(r.rc):>4} {r.seconds or 0:>7.1f} {r.launcher_s or 0:>8.1f} {r.bound_s:>6.1f} "
                     f"{'y' if r.within_bound else 'n':>3} {'y' if r.names_rank else 'n':>5} "
                     f"{'y' if r.names_phase else 'n':>6} {r.orphans:>5} {str(r.checkpoint_step):>5}")
    hangs = sum(r.hang or not r.within_bound for r in rows)
    lines.append(f"cases {len(rows)}, hangs {hangs}, orphans {sum(r.orphans for r in rows)}, "
                 f"unnamed {sum(not (r.names_rank and r.names_phase) for r in rows)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.faults", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="FL+FSDP under the launcher only")
    p.add_argument("--timeout-s", type=float, default=5.0, help="the runs' collective timeout")
    p.add_argument("--json", default=None, help="write every case's record here")
    p.add_argument("--elastic", action=argparse.BooleanOptionalAction, default=None,
                   help="the elastic rows (8 ranks as 4 groups x 2, a rank of group 1 killed; default: "
                        "with the full matrix, not with --quick); --elastic alone with --no-matrix")
    p.add_argument("--matrix", action=argparse.BooleanOptionalAction, default=True, help="the fault matrix")
    p.add_argument("--grace-s", type=float, default=3.0, help="--elastic-grace-s of the elastic rows")
    args = p.parse_args(argv)
    rows = []
    for case in matrix(args.quick) if args.matrix else []:
        r = run(case, args.timeout_s)
        rows.append(r)
        print(f"{r.case}: rc {r.rc}, {r.seconds or 0:.1f} s, orphans {r.orphans}", file=sys.stderr, flush=True)
    if rows:
        print(format_table(rows))
    erows = []
    if args.elastic or (args.elastic is None and not args.quick):
        for phase, rejoin, action in (("forward", False, "kill"), ("fedavg", False, "kill"), ("forward", True, "kill"),
                                      ("forward", False, "freeze")):
            with tempfile.TemporaryDirectory(prefix="flcomm-elastic-") as d:
                e = run_elastic_fault(phase, d, args.grace_s, rejoin, steps=ELASTIC_REJOIN_STEPS if rejoin else 12,
                                      action=action, timeout_s=10.0 if action == "freeze" else 20.0)
            erows.append(e)
            print(f"{e.case}: rc {e.rc}, lost {e.lost}, membership {e.membership_s or 0:.1f} s",
                  file=sys.stderr, flush=True)
        print(format_elastic(erows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows + erows], f, indent=1)
    ok = all(r.within_bound and not r.orphans and r.names_rank and r.names_phase for r in rows)
    return 0 if ok and all(e.within_bound and (e.rejoined_equal or not e.rejoin) for e in erows) else 1


if __name__ == "__main__":
    sys.exit(main())
