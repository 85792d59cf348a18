"""FedAvg's overlapped exchange against what runs on which thread, on gloo:

* offload with overlapping fragments (``overlap_steps`` k > E / K: a fragment's apply meets the
  next fragment's exchange in flight) is bit-identical to the same run without offload, and
  within fp32 tolerance of the single-process simulation (tests/common/fedavg_sim.py);
* the exchange job reads no tensor value on the host, and the training thread reads one per
  apply (the refusal flags), none per start;
* with offload the training thread subtracts nothing (the job's pack takes the delta from local_at_sync).

exposed_comm_s's accounting is in tests/unit/test_exposed_time.py.
"""

from __future__ import annotations

import threading

import pytest
import torch

from flcomm.federated.mesh import init_fed_mesh
from tests.common.dist import run_distributed
from tests.common.fedavg_sim import batch, loss_fn, make_model, make_opt, simulate

pytestmark = pytest.mark.timeout(300)

E, K, k, T = 2, 2, 2, 9  # fragment 1 syncs at 1, 3, ...; fragment 0 at 2, 4, ...; applied 2 steps later
BUCKET_MB = 512 * 4 / 2**20  # 512 fp32 elements: aligned, so offload keeps the layout (about 70 buckets)
D = 64
LR = 0.05
HOST_READS = {"__bool__", "item", "tolist", "__int__", "__float__", "__index__"}
SUBTRACTIONS = {"sub", "sub_", "__sub__", "__rsub__", "__isub__", "subtract", "rsub"}


class _Interleave:
    """Makes the job in flight copy (stage pieces) between the apply step's copies and its adds:
    the training thread waits before each ``add_`` until the job made a few more ``copy_`` calls
    (or ended), so a shared scratch is overwritten in between whenever it is shared. ``met``
    counts the adds that the job's copies really came between, ``stalled`` the waits that ran
    out: a probe that never interleaves would prove nothing, so the test asserts on both."""

    def __init__(self) -> None:
        self.cv = threading.Condition()
        self.copies, self.running = 0, False
        self.met = self.stalled = 0

    def job_copied(self) -> None:
        with self.cv:
            self.copies += 1
            self.cv.notify_all()

    def job_running(self, running: bool) -> None:
        with self.cv:
            self.running = running
            self.cv.notify_all()

    def before_add(self) -> None:
        with self.cv:
            c0 = self.copies
            if not self.cv.wait_for(lambda: self.copies >= c0 + 3 or not self.running, timeout=5):
                self.stalled += 1
            elif self.copies >= c0 + 3:
                self.met += 1


class _Record(torch.overrides.TorchFunctionMode):
    """The names of the torch functions and Tensor methods called on this thread; ``hook(name)``
    before each call, ``after(name)`` after it."""

    def __init__(self, hook=None, after=None) -> None:
        super().__init__()
        self.names: list[str] = []
        self.hook, self.after = hook, after

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        self.names.append(name)
        if self.hook is not None:
            self.hook(name)
        out = func(*args, **(kwargs or {}))
        if self.after is not None:
            self.after(name)
        return out


def _run(rank: int, world: int, offload: str | None) -> dict:
    import warnings

    from flcomm.federated.fedavg import FedAvg
    from flcomm.federated.topology import Topology

    fm = init_fed_mesh(Topology(world, world, group_size=1, shard_size=1), node_tiers=False)
    model = make_model(0, d=D)
    opt = make_opt(model.parameters(), "sgd", LR)
    fed = FedAvg(model, fm, sync_every=E, fragments=K, overlap_steps=k, outer="nesterov",
                 offload=offload, bucket_cap_mb=BUCKET_MB)
    warnings.filterwarnings("ignore", "FedAvg: the exchanges up to step")  # NOTE: the gated jobs are late
    # NOTE: a job starts only when the next step begins, so it is in flight during that step's
    # apply of the other fragment (whatever the machine's speed)
    submit, gates, job_reads, mix = fed._links.engine.submit, [], [], _Interleave()

    def gated(fn, name):
        gate = threading.Event()
        gates.append(gate)

        def run(job):
            gate.wait(60)
            mix.job_running(True)
            try:
                with _Record(after=lambda n: mix.job_copied() if n == "copy_" else None) as rec:
                    out = fn(job)
            finally:
                mix.job_running(False)
            job_reads.append(sorted(n for n in rec.names if n in HOST_READS))
            return out
        return submit(run, name)

    fed._links.engine.submit = gated  # NOTE: the process's engine: restored below, for the next run
    steps = []
    try:
        for t in range(1, T + 1):
            loss_fn(model, *batch(rank, 0, t)).backward()
            opt.step()
            opt.zero_grad()
            for g in gates:
                g.set()
            with _Record(hook=lambda n: mix.before_add() if n == "add_" else None) as rec:
                applied = fed.step()
            steps.append({"reads": sorted(n for n in rec.names if n in HOST_READS),
                          "subs": sorted(n for n in rec.names if n in SUBTRACTIONS), "did": applied})
        for g in gates:
            g.set()
        fed.finish()
    finally:
        for g in gates:
            g.set()
        del fed._links.engine.submit
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "buffers": {n: b.detach().clone() for n, b in model.named_buffers()},
            "steps": steps, "job_reads": job_reads, "syncs": fed.num_syncs, "met": mix.met, "stalled": mix.stalled,
            "numels": [fr.exchange.bar.bucket_numels for fr in fed._frags]}


def _worker(rank: int, world: int) -> dict:
    return {"offload": _run(rank, world, "cpu"), "device": _run(rank, world, None)}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(_worker, 2, timeout=240)


def test_offload_with_overlapping_fragments_is_bit_identical_to_the_device_run(results):
    for r in results:
        off, dev = r["offload"], r["device"]
        assert off["numels"] == dev["numels"]
        assert off["syncs"] == dev["syncs"] == T  # one fragment syncs at every step
        # NOTE: the job's copies came between the apply's adds (else the equality shows nothing)
        assert off["met"] > 0 and off["stalled"] == 0, (off["met"], off["stalled"])
        for n, p in dev["params"].items():
            assert torch.equal(off["params"][n], p), (n, float((off["params"][n] - p).abs().max()))


def test_overlapping_fragments_match_the_simulation(results):
    sim = simulate(2, 1, E, T, opt="sgd", lr=LR, outer="nesterov", overlap=True, overlap_steps=k, fragments=K,
                   model_kw={"d": D})
    for f, r in enumerate(results):
        got = {**r["offload"]["params"], **{n: b for n, b in r["offload"]["buffers"].items() if n in sim[f]}}
        assert sorted(got) == sorted(sim[f])
        for n, want in sim[f].items():
            torch.testing.assert_close(got[n], want, rtol=1e-4, atol=2e-5, msg=lambda m, n=n: f"{n}: {m}")


def test_no_host_reads_in_the_job_and_one_per_apply(results):
    for r in results:
        off = r["offload"]
        assert len(off["job_reads"]) == T and all(reads == [] for reads in off["job_reads"]), off["job_reads"]
        for t, s in enumerate(off["steps"], 1):
            applies = 1 if t > k else 0  # the exchange started at t - k
            assert s["reads"] == ["__bool__"] * applies, (t, s["reads"])


def test_the_training_thread_computes_no_own_delta(results):
    for r in results:
        for t, s in enumerate(r["offload"]["steps"], 1):
            assert s["did"] and s["subs"] == [], (t, s["subs"])
