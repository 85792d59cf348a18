"""What :mod:`bench.peers` and :mod:`bench.recovery` share (nccl-tests' ``src/common.cu``, for
the two torchft benchmarks): neither imports the other's rank code, both import this.

* the job: the outer step both libraries take, where a rank is (:class:`Env`), the model sharded
  with FSDP2 and its AdamW, the data slice, one training step, a rank's shard and its end;
* torchft's side: a replica group's gloo world, its Manager (checkpoint server on the node's
  address) and DiLoCo over fragments;
* launching: a free port, helper processes in a node (the lighthouse, a store) and their reaping.

torch and torchft are imported inside the functions: ``--help`` and the launcher need neither.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import subprocess
import sys
from datetime import timedelta
from typing import Any

OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9


# ---------------------------------------------------------------- the job (one rank) ----

@dataclasses.dataclass
class Env:
    """Where this rank is: its node (= federation / replica group), rank in it, and addresses."""
    rank: int
    world: int
    node: int
    nodes: int
    local: int
    per_node: int
    addrs: list[str]

    @classmethod
    def from_environ(cls) -> Env:
        e = os.environ
        per_node = int(e["LOCAL_WORLD_SIZE"])
        world = int(e["WORLD_SIZE"])
        return cls(int(e["RANK"]), world, int(e["NODE_RANK"]), world // per_node, int(e["LOCAL_RANK"]), per_node,
                   e["PEERS_ADDRS"].split(","))


def start_rank() -> Env:
    """A rank's start: one torch thread (the emulated nodes share the machine's cores) and where it is."""
    import torch

    torch.set_num_threads(1)
    return Env.from_environ()


def local_shard(model: Any) -> Any:
    """This rank's parameter shards, flattened in ``named_parameters`` order (fp32)."""
    import torch

    parts = []
    for _, p in model.named_parameters():
        t = p.to_local() if hasattr(p, "to_local") else p
        parts.append(t.detach().reshape(-1).float())
    return torch.cat(parts)


def build_model_sharded(a: argparse.Namespace, dm: Any) -> tuple[Any, Any]:
    """The job's model on every rank from the same seed (``a.empty``: a near-empty one),
    FSDP2 over ``dm`` per decoder block and on the root, and its AdamW."""
    import torch
    from torch.distributed.fsdp import fully_shard

    from flcomm.train.model import build_model, get_config

    mcfg = get_config(a.model, **({"dim": 16, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1, "ffn_dim": 16}
                                  if getattr(a, "empty", False) else {}))
    torch.manual_seed(a.seed)
    model = build_model(mcfg, device="cpu", seed=a.seed)
    for block in model.layers:
        fully_shard(block, mesh=dm, reshard_after_forward=True)
    fully_shard(model, mesh=dm, reshard_after_forward=False)
    return model, torch.optim.AdamW(model.parameters(), lr=a.lr)


def build_data(a: argparse.Namespace, env: Env) -> tuple[Any, list]:
    """This rank's slice of the built-in corpus, as the driver cuts it: (train loader, held-out batches)."""
    from flcomm.train.data import ShardedLoader, eval_batches, load_tokens, split_for_ranks

    tokens = load_tokens(None)
    P, index = env.world, env.node * env.per_node + env.local
    split = split_for_ranks(tokens, P, a.batch_size, a.seq_len, 0.02)
    loader = ShardedLoader(split.train, a.seq_len, a.batch_size, P, index, a.seed)
    return loader, eval_batches(split.heldout, a.seq_len, a.batch_size, a.eval_batches, P, index)


def train_step(model: Any, inner: Any, fed: Any, loader: Any) -> Any:
    """One step of the job: forward and backward on the next batch, the inner step (torchft:
    DiLoCo's post-step hook syncs here), then flcomm's ``fed.step()`` when there is one; the loss."""
    from flcomm.train.model import lm_loss

    x, y = loader.next_batch()
    loss = lm_loss(model(x), y)
    loss.backward()
    inner.step()
    inner.zero_grad(set_to_none=True)
    if fed is not None:
        fed.step()
    return loss


def end_rank(diloco: Any, manager: Any) -> int:
    """A rank's end once everything is written: torchft's DiLoCo and Manager closed and the process
    left at once; else the gloo world destroyed. Returns the exit code (0)."""
    import torch.distributed as dist

    if diloco is not None:
        diloco.__exit__(None, None, None)
        manager.shutdown(wait=False)
        # NOTE: everything is written; torchft's background threads can abort the interpreter's
        # teardown ("terminate called without an active exception", seen on one rank in 8)
        sys.stdout.flush()
        os._exit(0)
    dist.destroy_process_group()
    return 0


# ---------------------------------------------------------------- torchft's side ----

def init_group_world(env: Env, port: int, timeout: timedelta) -> None:
    """The gloo world of this rank's replica group (= node) alone, its store on the node's own
    address at ``port`` (torchft: each replica group is a world of its own)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://{env.addrs[env.node]}:{port}", rank=env.local,
                            world_size=env.per_node, timeout=timeout)


def tft_manager(a: argparse.Namespace, env: Env, model: Any, inner: Any, min_replicas: int, store_port: int) -> Any:
    """torchft's Manager of this rank's replica group (= node): its state is the model and the
    inner optimizer (what a healing group fetches), its store on the node's address."""
    from torchft import Manager, ProcessGroupGloo
    from torchft.checkpointing.http_transport import HTTPTransport

    timeout = timedelta(seconds=a.timeout)
    host = env.addrs[env.node]

    class NodeHTTPTransport(HTTPTransport):
        """torchft's checkpoint server (what a healing group fetches from), addressed by the
        node's IP: its own address() names this machine's hostname, which every emulated node
        shares (on a real cluster each node's hostname resolves to that node)."""

        def address(self) -> str:
            return f"http://{host}:{self._server.socket.getsockname()[1]}/checkpoint/"

    def state() -> dict:
        return {"model": model.state_dict(), "inner": inner.state_dict()}

    def load(sd: dict) -> None:
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["inner"])

    # NOTE: init_sync=False: every rank starts from the same seed already. With torchft's
    # default (True) the first quorum, at DiLoCo's first sync, heals the non-primary groups
    # from the primary's state, discarding their first E local steps (measured: 8e-3 off).
    return Manager(pg=ProcessGroupGloo(timeout=timeout), load_state_dict=load, state_dict=state,
                   min_replica_size=min_replicas, use_async_quorum=False, replica_id=f"group{env.node}",
                   store_addr=env.addrs[env.node], store_port=store_port, rank=env.local,
                   world_size=env.per_node, lighthouse_addr=f"http://{env.addrs[0]}:{a.lighthouse_port}",
                   hostname=env.addrs[env.node], timeout=timeout, quorum_timeout=timeout,
                   connect_timeout=timeout, init_sync=False,
                   checkpoint_transport=NodeHTTPTransport(timeout=timeout, num_chunks=0))


def tft_diloco(a: argparse.Namespace, manager: Any, frags: list[Any], inner: Any, delay: int = 0) -> Any:
    """torchft's DiLoCo over ``frags`` (one: plain DiLoCo; more: Streaming DiLoCo with a sync
    delay of ``delay`` steps), each fragment with its own SGD-Nesterov outer step, every
    ``a.sync_every`` steps, bucketed at ``a.bucket_mb``; entered (its hooks are on)."""
    import torch
    from torchft.local_sgd import DiLoCo

    outer = [torch.optim.SGD(f.parameters(), lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)
             for f in frags]
    diloco = DiLoCo(manager, frags, inner, outer if len(outer) > 1 else outer[0], sync_every=a.sync_every,
                    backup_device=torch.device("cpu"), pin_memory=False, use_bucketization=True,
                    bucket_cap_mb=a.bucket_mb, fragment_sync_delay=delay)
    diloco.__enter__()
    return diloco


# ---------------------------------------------------------------- launching ----

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reap(procs: list[subprocess.Popen], files: list[Any] = ()) -> None:
    """Kill those of ``procs`` still running, wait for all, and close ``files`` (their logs)."""
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
    for f in files:
        f.close()


def serve(c: Any, node: int, code: str, log_path: str) -> subprocess.Popen:
    """``python -c code`` in ``node`` of cluster ``c`` (a lighthouse or a store), its output to
    ``log_path``; the caller reaps it."""
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    with open(log_path, "w") as log:  # NOTE: the child keeps its own descriptor
        return subprocess.Popen(c.exec_argv(node, [sys.executable, "-c", code]), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)


def lighthouse_code(port: int, min_replicas: int) -> str:
    """The statements that start torchft's lighthouse on ``port`` (for :func:`serve`)."""
    return (f"from torchft._torchft import LighthouseServer; "
            f"h = LighthouseServer(bind='[::]:{port}', min_replicas={min_replicas}); "
            "print('lighthouse', h.address(), flush=True); ")
