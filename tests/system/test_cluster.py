"""The emulated cluster (flcomm/train/netns.py; its command line: bench/cluster/netns.py): shaping,
isolation, teardown, launch errors.

The tests that build namespaces need root (CAP_NET_ADMIN/CAP_SYS_ADMIN) and are skipped
without it; the root check itself runs anywhere (spec validation: tests/unit/test_cluster_spec.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest

from bench.cluster.netns import selfcheck
from flcomm.train import netns
from flcomm.train.netns import ClusterError, ClusterSpec, EmulatedCluster

ROOT = os.geteuid() == 0
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
needs_root = pytest.mark.skipif(
    not ROOT or not all(map(__import__("shutil").which, ("ip", "tc"))),
    reason="needs root and iproute2 (ip, tc) to create network namespaces and tc qdiscs; "
           f"running as uid {os.geteuid()}")


def _tag() -> str:
    """A tag no other test or process on the host uses (review F9: clusters made beside this test,
    by a parallel worker or a benchmark, must not show in its before/after comparison)."""
    return "t" + uuid.uuid4().hex[:7]


def _ours(tag: str) -> set[str]:
    """The namespaces on the host under ``tag``, and only those."""
    return set(netns.list_namespaces(netns.PREFIX + tag))


def test_without_root_it_says_so(monkeypatch):
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    with pytest.raises(PermissionError, match="needs root.*uid 1000.*sudo"):
        with EmulatedCluster(ClusterSpec(2)):
            pass
    r = subprocess.run([sys.executable, "-c", "import os, sys; os.geteuid = lambda: 1000; "
                        "from bench.cluster.netns import main; sys.exit(main(['cleanup']))"],
                       capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 77 and "needs root" in r.stderr


@needs_root
def test_layout_isolation_and_teardown_on_error():
    tag = _tag()
    host_addrs = subprocess.run(["ip", "-br", "addr"], capture_output=True, text=True).stdout
    with pytest.raises(RuntimeError, match="boom"):
        with EmulatedCluster(ClusterSpec(3, rate="50mbit"), tag=tag) as c:
            made = set(c.namespaces)
            assert made == {c.switch, c.ns(0), c.ns(1), c.ns(2)} == _ours(tag)
            # the subnet exists only inside the nodes, never in the host namespace
            assert netns.SUBNET not in subprocess.run(["ip", "-br", "addr"], capture_output=True,
                                                      text=True).stdout
            addr = subprocess.run(c.exec_argv(1, ["ip", "-br", "addr", "show", netns.NODE_IF]),
                                  capture_output=True, text=True).stdout
            assert f"{netns.SUBNET}.2/24" in addr
            for ns, dev in ((c.ns(0), netns.NODE_IF), (c.switch, "p2")):
                q = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "show", "dev", dev],
                                   capture_output=True, text=True).stdout
                assert "tbf" in q and "50Mbit" in q, q
            # a node names its peers' addresses from its own hosts file (no DNS to wait on)
            for i in range(3):
                for addr in (f"('{c.addr(i)}', 0)", f"('::ffff:{c.addr(i)}', 0, 0, 0)"):  # c10d: dual-stack
                    got = subprocess.run(c.exec_argv(0, [sys.executable, "-c", "import socket; "
                                                         f"print(socket.getnameinfo({addr}, 0)[0])"]),
                                         capture_output=True, text=True, timeout=30)
                    assert got.stdout.strip() == c.ns(i), (addr, got.stdout, got.stderr)
            raise RuntimeError("boom")
    assert _ours(tag) == set()
    assert not any(os.path.exists(os.path.join(netns.NETNS_ETC, ns)) for ns in made)
    assert subprocess.run(["ip", "-br", "addr"], capture_output=True, text=True).stdout == host_addrs


@needs_root
def test_launch_env_pin_failure_and_timeout(tmp_path):
    tag = _tag()
    with EmulatedCluster(ClusterSpec(2), tag=tag) as c:
        code = ("import os, sys; e = os.environ; "
                "sys.exit(0 if (e['WORLD_SIZE'], e['MASTER_ADDR'], e['GLOO_SOCKET_IFNAME']) "
                "== ('4', '10.99.0.1', 'fl0') "
                "and int(e['RANK']) // 2 == int(e['NODE_RANK']) and int(e['RANK']) % 2 == int(e['LOCAL_RANK']) "
                "else 3)")
        assert c.launch([sys.executable, "-c", code], 2, timeout=60, stream_rank0=False) == [0, 0, 0, 0]
        # rank 3 fails at once, the others would sleep: they are stopped after the grace period
        bad = "import os, sys, time; r = int(os.environ['RANK']); print('rank', r, 'failing') if r == 3 else None; " \
              "sys.exit(5) if r == 3 else time.sleep(60)"
        with pytest.raises(ClusterError, match=r"(?s)ranks \[.*3\] failed.*rank 3's log.*rank 3 failing"):
            c.launch([sys.executable, "-c", bad], 2, timeout=60, grace=1.0, stream_rank0=False)
        # pin: each node's ranks see the node's own share of the CPUs
        mine = sorted(os.sched_getaffinity(0))
        show = "import os; print(sorted(os.sched_getaffinity(0)))"
        logs = str(tmp_path / "pin")
        assert c.launch([sys.executable, "-c", show], 2, timeout=60, stream_rank0=False, pin=True,
                        log_dir=logs) == [0, 0, 0, 0]
        for r in range(4):
            with open(os.path.join(logs, f"rank{r}.log")) as f:
                assert f.read().strip() == str(netns.node_cpus(r // 2, 2, mine)), r
        with pytest.raises(ClusterError, match="did not finish within 2 s"):
            c.launch([sys.executable, "-c", "import time; time.sleep(60)"], 2, timeout=2, stream_rank0=False)
        assert all(netns._namespace_pids(ns) == [] for ns in c.namespaces)
    assert _ours(tag) == set()


@needs_root
def test_cleanup_removes_a_leaked_cluster():
    tag = _tag()
    c = EmulatedCluster(ClusterSpec(2), tag=tag)
    c._create()  # as if the process had been SIGKILLed after setting up
    assert _ours(tag) == {c.switch, c.ns(0), c.ns(1)}
    gone = netns.cleanup(netns.PREFIX + tag)
    assert set(gone) == {c.switch, c.ns(0), c.ns(1)}
    assert _ours(tag) == set()


@needs_root
@pytest.mark.timeout(240)
def test_inter_node_is_shaped_and_intra_node_is_not():
    """gloo all_reduce inside a node (loopback, unshaped) vs across nodes (two tbf veths)."""
    tag = _tag()
    spec = ClusterSpec(2, rate="100mbit")
    res = selfcheck(spec, ranks_per_node=2, size_mb=2.0, iters=2, timeout=150, log=lambda s: None, tag=tag)
    assert _ours(tag) == set()
    # the shaper is an upper bound (burst lets a little through above rate); well under it means
    # the link was not the bottleneck or shaping is misconfigured
    assert 0.3 < res["inter_over_shaped"] < 1.3, res
    assert res["intra_over_inter"] > 2.0, res


_HOLDER = """
import sys, time
sys.path.insert(0, {root!r})
from flcomm.train.netns import ClusterSpec, EmulatedCluster
with EmulatedCluster(ClusterSpec(2), tag={tag!r}) as c:
    print("up", flush=True)
    c.launch(["sleep", "120"], 1, stream_rank0=False, timeout=120)
"""


def _hold(tag: str) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", _HOLDER.format(root=REPO, tag=tag)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "up"
    import time

    for _ in range(100):  # until both ranks run inside their namespaces
        if all(netns._namespace_pids(f"{netns.PREFIX}{tag}n{i}") for i in range(2)):
            break
        time.sleep(0.05)
    return p


@needs_root
def test_sigterm_tears_down_and_sigkill_leaves_nothing_running():
    import signal
    import time

    tag = _tag()
    p = _hold(tag)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=30)
    assert "tearing the cluster down" in err
    assert _ours(tag) == set()
    # SIGKILL: no teardown can run, but the ranks die with the launcher; cleanup removes the rest
    tag = _tag()
    p = _hold(tag)
    p.kill()
    p.wait(timeout=10)
    names = [f"{netns.PREFIX}{tag}n{i}" for i in range(2)]
    for _ in range(100):
        if not any(netns._namespace_pids(ns) for ns in names):
            break
        time.sleep(0.05)
    assert not any(netns._namespace_pids(ns) for ns in names)
    assert set(netns.cleanup(netns.PREFIX + tag)) == {*names, f"{netns.PREFIX}{tag}sw"}
    assert _ours(tag) == set()
