"""An emulated two-tier cluster on one machine: N "nodes" as network namespaces.

Layout (nothing is created in the host's own namespace; every address exists only inside the
namespaces made here)::

    namespace <prefix><tag>sw:   bridge br0 with ports p0 .. p{N-1}
    namespace <prefix><tag>n<i>: lo + fl0 (10.99.0.<i+1>/24), the node's only interface
    veth pair fl0 (node i) <-> p<i> (switch), shaped with `tc qdisc ... tbf` on BOTH ends, so
    each node has a full-duplex link of the given rate to the switch.

The ranks of node i run inside its namespace. Two ranks of one node reach each other through
the node's own address, which the kernel routes over loopback: unshaped (the intra-node tier).
Ranks of different nodes cross two shaped veths and the bridge (the inter-node tier).
``GLOO_SOCKET_IFNAME=fl0`` makes gloo bind to the node's interface.

It needs root (network namespaces and qdiscs); without it every entry point stops with a
message that says so. Everything it makes is torn down on exit, on an exception, on Ctrl-C and
on SIGTERM/SIGHUP; ``cleanup`` removes what a killed run (SIGKILL) may have left.

NOTE: the kernel here has tbf but no netem: bandwidth can be shaped, latency cannot. tbf needs a
burst of 256kb or more, or TSO's 64 KiB segments starve it (DESIGN.md).

Used by ``python -m flcomm.train compare`` (it runs on this cluster when it can:
:func:`unavailable` says why not) and by the benchmarks; the command line that runs any command
on every rank, measures the tiers and cleans up is ``python -m bench.cluster.netns``
(bench/cluster/netns.py).
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import FrameType, TracebackType

PREFIX = "flcn-"          # every namespace this module makes starts with it
NODE_IF = "fl0"           # the node's interface (GLOO_SOCKET_IFNAME)
SUBNET = "10.99.0"        # /24, exists only inside the namespaces made here
MASTER_PORT = 29500
NETNS_ETC = "/etc/netns"  # `ip netns exec NS` bind-mounts NETNS_ETC/NS/* over /etc/*
_RATE_RE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit|tbit|bps|kbps|mbps|gbps)$", re.I)
_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
               "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9}


class ClusterError(RuntimeError):
    """Setting up, running on or tearing down the emulated cluster failed."""


def unavailable() -> str | None:
    """Why this machine cannot run the emulated cluster (not root, no ``ip`` or ``tc``, ``ip
    netns`` refused), or None when it can. A missing tbf qdisc shows only when the cluster is
    brought up (:class:`ClusterError`)."""
    try:
        require_root()
    except (PermissionError, ClusterError) as e:
        return str(e)
    p = _run(["ip", "netns", "list"], check=False)
    if p.returncode != 0:
        return f"`ip netns list` failed (exit {p.returncode}): {p.stderr.strip()}"
    return None


def require_root() -> None:
    """Raise PermissionError (with what to do) unless running as root with ip and tc."""
    if os.geteuid() != 0:
        raise PermissionError(
            "the emulated cluster needs root: it creates network namespaces, veth pairs and tc "
            f"qdiscs (running as uid {os.geteuid()}); run it with sudo, or in a container with "
            "CAP_NET_ADMIN and CAP_SYS_ADMIN")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise ClusterError(f"the emulated cluster needs `{tool}` (iproute2) on PATH; not found")


def parse_rate(rate: str | float | int) -> float:
    """A tc rate ("100mbit", "1gbit", "12.5mbps") or a number of bit/s -> bit/s."""
    if isinstance(rate, (int, float)) and not isinstance(rate, bool):
        if rate <= 0:
            raise ValueError(f"rate must be > 0 bit/s, got {rate}")
        return float(rate)
    if not isinstance(rate, str):
        raise TypeError(f"rate must be a tc rate string or a number of bit/s, got {type(rate).__name__}")
    m = _RATE_RE.match(rate.strip())
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"rate must look like 100mbit, 1gbit or 12.5mbps (tc units), got {rate!r}")
    return float(m.group(1)) * _RATE_UNITS[m.group(2).lower()]


def _tc_rate(bits_per_s: float) -> str:
    return f"{int(round(bits_per_s))}bit"


def _run(cmd: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(list(cmd), capture_output=True, text=True, timeout=30)
    if check and p.returncode != 0:
        raise ClusterError(f"`{' '.join(cmd)}` failed (exit {p.returncode}): {p.stderr.strip()}")
    return p


def list_namespaces(prefix: str = PREFIX) -> list[str]:
    """Names of the network namespaces starting with ``prefix``."""
    p = _run(["ip", "-j", "netns", "list"], check=False)
    names: list[str] = []
    if p.returncode == 0 and p.stdout.strip():
        try:
            names = [e["name"] for e in json.loads(p.stdout)]
        except (ValueError, KeyError, TypeError):
            names = []
    if not names:  # older iproute2 without -j for netns
        names = [line.split()[0] for line in _run(["ip", "netns", "list"], check=False).stdout.splitlines()
                 if line.strip()]
    return sorted(n for n in names if n.startswith(prefix))


def _namespace_pids(ns: str) -> list[int]:
    p = _run(["ip", "netns", "pids", ns], check=False)
    return [int(x) for x in p.stdout.split() if x.strip().isdigit()]


def delete_namespace(ns: str) -> None:
    """Kill what still runs inside ``ns`` (only processes of a namespace this module made), then
    delete it; its veth ends go with it."""
    if not ns.startswith(PREFIX):
        raise ValueError(f"refusing to delete namespace {ns!r}: not one of ours (prefix {PREFIX!r})")
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = _namespace_pids(ns)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        if pids:
            time.sleep(0.5)
    _run(["ip", "netns", "del", ns], check=False)
    shutil.rmtree(os.path.join(NETNS_ETC, ns), ignore_errors=True)


def cleanup(prefix: str = PREFIX) -> list[str]:
    """Delete every namespace starting with ``prefix`` (what a killed run left); returns them."""
    if not prefix.startswith(PREFIX):
        raise ValueError(f"prefix must start with {PREFIX!r}, got {prefix!r}")
    require_root()
    gone = list_namespaces(prefix)
    for ns in gone:
        delete_namespace(ns)
    return gone


@dataclass(frozen=True)
class ClusterSpec:
    """Shape of the emulated cluster.

    Args:
        nodes: number of namespaces ("nodes"), 1 to 250.
        rate: inter-node link rate per node and direction (tc units, e.g. "100mbit").
        burst: tbf bucket; 256kb or more (smaller starves TSO-sized segments).
        queue_latency: tbf queue limit expressed as time at ``rate``.
    """

    nodes: int
    rate: str = "100mbit"
    burst: str = "256kb"
    queue_latency: str = "100ms"

    def __post_init__(self) -> None:
        if not isinstance(self.nodes, int) or isinstance(self.nodes, bool) or not 1 <= self.nodes <= 250:
            raise ValueError(f"nodes must be an integer in [1, 250], got {self.nodes!r}")
        parse_rate(self.rate)
        m = re.match(r"^(\d+)(k|kb|m|mb)?$", self.burst.strip().lower())
        if not m:
            raise ValueError(f"burst must look like 256kb or 1mb, got {self.burst!r}")
        mult = {None: 1, "k": 1024, "kb": 1024, "m": 1 << 20, "mb": 1 << 20}[m.group(2)]
        if int(m.group(1)) * mult < 256 * 1024:
            raise ValueError(f"burst must be >= 256kb (smaller starves TSO segments), got {self.burst!r}")

    @property
    def rate_bits(self) -> float:
        return parse_rate(self.rate)


class EmulatedCluster:
    """Context manager: creates the namespaces on enter, removes them on exit (always).

    Steps of ``__enter__``:
      1. check root; pick a unique tag; install SIGINT/SIGTERM/SIGHUP handlers that raise, so
         the teardown in ``__exit__`` runs;
      2. create the switch namespace with bridge ``br0``;
      3. per node: create its namespace, a veth pair ``fl0`` <-> ``p<i>`` directly inside the two
         namespaces, address ``10.99.0.<i+1>/24`` on fl0, bring lo/fl0/p<i> up, attach p<i> to
         the bridge, and add a tbf qdisc to both ends.
    Any failure tears down what was made so far and re-raises.
    """

    def __init__(self, spec: ClusterSpec, tag: str | None = None) -> None:
        self.spec = spec
        self.tag = tag or uuid.uuid4().hex[:6]
        if not re.fullmatch(r"[a-z0-9]{1,8}", self.tag):
            raise ValueError(f"tag must be 1-8 lowercase letters/digits, got {self.tag!r}")
        self.switch = f"{PREFIX}{self.tag}sw"
        self._made: list[str] = []
        self._procs: list[subprocess.Popen] = []
        self._old_handlers: dict[int, object] = {}

    # ---- names ----
    def ns(self, node: int) -> str:
        self._check_node(node)
        return f"{PREFIX}{self.tag}n{node}"

    def addr(self, node: int) -> str:
        self._check_node(node)
        return f"{SUBNET}.{node + 1}"

    @property
    def namespaces(self) -> list[str]:
        return list(self._made)

    def _check_node(self, node: int) -> None:
        if not 0 <= node < self.spec.nodes:
            raise ValueError(f"node must be in [0, {self.spec.nodes}), got {node}")

    # ---- lifecycle ----
    def __enter__(self) -> EmulatedCluster:
        require_root()
        self._install_signal_handlers()
        try:
            self._create()
        except BaseException:
            self.teardown()
            self._restore_signal_handlers()
            raise
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        try:
            self.teardown()
        finally:
            self._restore_signal_handlers()

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # NOTE: signal handlers can only be set from the main thread

        def handler(signum: int, frame: FrameType | None) -> None:
            raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}: tearing the cluster down")

        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            self._old_handlers[sig] = signal.signal(sig, handler)

    def _restore_signal_handlers(self) -> None:
        for sig, h in self._old_handlers.items():
            signal.signal(sig, h)  # type: ignore[arg-type]
        self._old_handlers.clear()

    def _ns_add(self, ns: str) -> None:
        _run(["ip", "netns", "add", ns])
        self._made.append(ns)

    def _write_hosts(self, ns: str) -> None:
        """An /etc/hosts for ``ns`` naming every node's address, IPv4 and v4-mapped IPv6.

        NOTE: c10d looks up the name of each peer's address; without an entry the lookup falls
        through to DNS, which a namespace cannot reach, and every run warned "The hostname of the
        client socket cannot be retrieved. err=-3" (EAI_AGAIN)."""
        d = os.path.join(NETNS_ETC, ns)
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "hosts"), "w") as f:
            f.write("127.0.0.1 localhost\n::1 localhost\n")
            # NOTE: c10d's sockets are dual-stack: a peer shows as ::ffff:10.99.0.x, looked up as IPv6
            f.writelines(f"{a} {self.ns(i)}\n" for i in range(self.spec.nodes)
                         for a in (self.addr(i), f"::ffff:{self.addr(i)}"))

    def _create(self) -> None:
        rate = _tc_rate(self.spec.rate_bits)
        self._ns_add(self.switch)
        sw = ["ip", "-n", self.switch]
        _run(sw + ["link", "add", "br0", "type", "bridge"])
        _run(sw + ["link", "set", "br0", "up"])
        _run(sw + ["link", "set", "lo", "up"])
        for i in range(self.spec.nodes):
            ns = self.ns(i)
            self._ns_add(ns)
            self._write_hosts(ns)
            port = f"p{i}"
            _run(["ip", "link", "add", "name", NODE_IF, "netns", ns, "type", "veth",
                  "peer", "name", port, "netns", self.switch])
            _run(["ip", "-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", NODE_IF])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            _run(["ip", "-n", ns, "link", "set", NODE_IF, "up"])
            _run(sw + ["link", "set", port, "master", "br0"])
            _run(sw + ["link", "set", port, "up"])
            for where, dev in ((ns, NODE_IF), (self.switch, port)):
                _run(["ip", "netns", "exec", where, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                      "rate", rate, "burst", self.spec.burst, "latency", self.spec.queue_latency])

    def teardown(self) -> None:
        """Stop the launched processes (their process groups), then delete every namespace
        made here. Safe to call twice."""
        self.kill_all()
        for ns in reversed(self._made):
            delete_namespace(ns)
        self._made.clear()

    # ---- running ----
    def exec_argv(self, node: int, argv: Sequence[str]) -> list[str]:
        """argv that runs ``argv`` inside node ``node``'s namespace."""
        return ["ip", "netns", "exec", self.ns(node), *argv]

    def rank_env(self, rank: int, ranks_per_node: int, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """torchrun-style environment of global rank ``rank`` (node = rank // ranks_per_node)."""
        world = self.spec.nodes * ranks_per_node
        node = rank // ranks_per_node
        env = dict(os.environ)
        env.update({
            "RANK": str(rank), "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank % ranks_per_node), "LOCAL_WORLD_SIZE": str(ranks_per_node),
            "NODE_RANK": str(node), "GROUP_RANK": str(node),
            "MASTER_ADDR": self.addr(0), "MASTER_PORT": str(MASTER_PORT),
            "GLOO_SOCKET_IFNAME": NODE_IF, "TP_SOCKET_IFNAME": NODE_IF,
            "FLCOMM_EMULATED_RATE_BITS": str(int(self.spec.rate_bits)),
        })
        # NOTE: all ranks share this machine's cores; one intra-op thread each avoids
        # oversubscription unless the caller asked otherwise.
        env.setdefault("OMP_NUM_THREADS", "1")
        if extra:
            env.update(extra)
        return env

    def launch(self, argv: Sequence[str], ranks_per_node: int, *, env: Mapping[str, str] | None = None,
               timeout: float = 600.0, log_dir: str | None = None, stream_rank0: bool = True,
               cwd: str | None = None, grace: float = 10.0, pin: bool = False) -> list[int]:
        """Run ``argv`` on every rank (``nodes * ranks_per_node``) and wait. With ``pin``, each
        node's ranks run on the node's own share of this machine's CPUs (:func:`node_cpus`), as
        real nodes do not share cores: less migration and less scatter in step times.

        Steps: start each rank in its node's namespace in a new session with its env; poll; when
        a rank fails, give the others ``grace`` seconds, then stop them (one failed rank leaves
        the rest blocked in a collective); stop everything at ``timeout``. Logs go to
        ``log_dir/rank<r>.log`` (rank 0 to this stdout too when ``stream_rank0``).

        Returns the exit codes in rank order; raises ClusterError on timeout or failure, with
        the tail of the first failed rank's log.
        """
        if not isinstance(ranks_per_node, int) or ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be a positive integer, got {ranks_per_node!r}")
        if not self._made:
            raise ClusterError("the cluster is not up: use it as `with EmulatedCluster(spec) as c:`")
        if not argv:
            raise ValueError("argv must name a command to run on every rank, got an empty list")
        log_dir = log_dir or tempfile.mkdtemp(prefix="flcn-logs-")
        os.makedirs(log_dir, exist_ok=True)
        world = self.spec.nodes * ranks_per_node
        mine = sorted(os.sched_getaffinity(0))
        cpus = [node_cpus(n, self.spec.nodes, mine) if pin else None for n in range(self.spec.nodes)]
        procs: list[subprocess.Popen] = []
        files = []
        for r in range(world):
            f = open(os.path.join(log_dir, f"rank{r}.log"), "w")
            files.append(f)
            out = None if (r == 0 and stream_rank0) else f
            p = subprocess.Popen(self.exec_argv(r // ranks_per_node, argv),
                                 env=self.rank_env(r, ranks_per_node, env), cwd=cwd,
                                 stdout=out, stderr=subprocess.STDOUT if out is not None else None,
                                 start_new_session=True,
                                 preexec_fn=functools.partial(_start_rank, cpus[r // ranks_per_node]))
            procs.append(p)
            self._procs.append(p)
        deadline = time.monotonic() + timeout
        failed_at: float | None = None
        try:
            while True:
                codes = [p.poll() for p in procs]
                if all(c is not None for c in codes):
                    break
                if failed_at is None and any(c not in (None, 0) for c in codes):
                    failed_at = time.monotonic()
                now = time.monotonic()
                if now > deadline or (failed_at is not None and now - failed_at > grace):
                    self.kill_all()
                    codes = [p.wait() for p in procs]
                    if failed_at is None:
                        raise ClusterError(f"ranks did not finish within {timeout:.0f} s; logs in {log_dir}")
                    break
                time.sleep(0.1)
        finally:
            for f in files:
                f.close()
        bad = [r for r, c in enumerate(codes) if c != 0]
        if bad:
            first = next((r for r in bad if codes[r] > 0), bad[0])
            tail = _tail(os.path.join(log_dir, f"rank{first}.log"))
            raise ClusterError(f"ranks {bad} failed with exit codes {[codes[r] for r in bad]}; "
                               f"rank {first}'s log ({log_dir}):\n{tail}")
        return codes

    def kill_all(self) -> None:
        """SIGTERM, then SIGKILL, the process groups of the ranks launched here."""
        live = [p for p in self._procs if p.poll() is None]
        for sig, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 5.0)):
            for p in live:
                try:
                    os.killpg(p.pid, sig)  # NOTE: start_new_session: the pgid is the rank's pid
                except ProcessLookupError:
                    pass
            end = time.monotonic() + wait
            while time.monotonic() < end and any(p.poll() is None for p in live):
                time.sleep(0.05)
            live = [p for p in live if p.poll() is None]
            if not live:
                break
        self._procs = [p for p in self._procs if p.poll() is None]

    def tx_bytes(self) -> list[int]:
        """Bytes each node has sent on its shaped interface so far (kernel counters)."""
        out = []
        for i in range(self.spec.nodes):
            p = _run(["ip", "-n", self.ns(i), "-s", "-j", "link", "show", NODE_IF])
            out.append(int(json.loads(p.stdout)[0]["stats64"]["tx"]["bytes"]))
        return out


def node_cpus(node: int, nodes: int, cpus: Sequence[int]) -> list[int]:
    """The CPUs of node ``node`` when ``nodes`` emulated nodes split the machine's ``cpus``: an
    equal contiguous share each (the remainder left out), or one each round robin when there
    are more nodes than CPUs."""
    cpus = sorted(cpus)
    if not 0 <= node < nodes:
        raise ValueError(f"node must be in [0, {nodes}), got {node}")
    if not cpus:
        raise ValueError("no CPUs to split among the nodes")
    share = len(cpus) // nodes
    if share == 0:
        return [cpus[node % len(cpus)]]
    return cpus[node * share: (node + 1) * share]


def _start_rank(cpus: list[int] | None) -> None:
    """preexec_fn of every rank: SIGKILL when the launcher dies (also by SIGKILL), so no rank
    outlives it; with ``cpus``, run on those only. NOTE: both settings survive the exec of
    `ip netns exec` and of the rank."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if cpus:
        os.sched_setaffinity(0, cpus)


def _tail(path: str, n: int = 40) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError as e:
        return f"(no log: {e})"
