"""Train a Hugging Face ``LlamaForCausalLM`` with FL+FSDP or FL+HSDP through ``flcomm.FedAvg``.

The model is built from a local ``LlamaConfig`` (nothing is downloaded; input and output
embeddings tied) and reads flcomm's built-in byte-level corpus (vocabulary 256). What flcomm
adds to an ordinary FSDP2 loop is marked ``# flcomm``:

1. the strategy's Topology: F federation groups of G ranks, each group FSDP over G ranks, or HSDP with
   R = G / S replicas of S-way shards, and its mesh (dims "fed", "replicate", "shard");
2. ``fully_shard`` per decoder layer and at the root, on the group's part of the mesh:
   ``mesh["shard"]`` (FL+FSDP) or ``mesh["replicate", "shard"]`` (FL+HSDP);
3. ``FedAvg`` over the "fed" dim: ``fed.step()`` after every optimizer step (every E steps it
   averages each shard with the same shard of the other groups), ``fed.finish()`` at the end.

Usage (CPU, gloo; transformers comes with ``pip install --no-build-isolation -e ".[hf]"``)::

    python examples/hf_llama.py --nproc 4                 # FL+FSDP: 2 groups x 2 ranks
    python examples/hf_llama.py --nproc 8 --strategy fl-hsdp \\
        --codec int8 --error-feedback --overlap           # FL+HSDP: 2 groups x (2 x 2)
    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        examples/hf_llama.py                              # one federation group per node

G and S default as in the driver (``flcomm.Strategy``): a group is one node (LOCAL_WORLD_SIZE
ranks; fl-hsdp: two nodes when that leaves two groups), halved when all ranks share one node.
End on a multiple of --sync-every, so the groups end equal. On GPUs the same loop runs with the
"nccl" backend, ``torch.cuda.set_device(LOCAL_RANK)``, ``flcomm.init_fed_mesh(topo, "cuda")`` and the model and
batches on the GPU.
"""

from __future__ import annotations

import argparse
import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard

import flcomm
from flcomm.train.data import BYTE_VOCAB, ShardedLoader, load_tokens


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=None, help="spawn N local processes (else: torchrun's env)")
    p.add_argument("--strategy", default="fl-fsdp", choices=("fl-fsdp", "fl-hsdp"))
    p.add_argument("--ranks-per-node", type=int, default=None, help="default: LOCAL_WORLD_SIZE")
    p.add_argument("--group-size", type=int, default=None, help="G, ranks per federation group")
    p.add_argument("--shard-size", type=int, default=None, help="S, ranks per shard group (fl-hsdp)")
    p.add_argument("--sync-every", type=int, default=4, help="E, local steps between averages")
    p.add_argument("--codec", default="none", help="none | bf16 | fp16 | int8 | fp8")
    p.add_argument("--error-feedback", action="store_true")
    p.add_argument("--overlap", action="store_true", help="apply each average one step later")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=300.0)
    return p.parse_args(argv)


def build_model(args: argparse.Namespace) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=BYTE_VOCAB, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                      num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=args.seq_len, tie_word_embeddings=True, use_cache=False)
    torch.manual_seed(args.seed)  # NOTE: FedAvg also broadcasts group 0's model at construction
    return LlamaForCausalLM(cfg)


def train(args: argparse.Namespace) -> tuple[list[float], nn.Module, flcomm.FedAvg]:
    """Train on this rank (torch.distributed initialized); return its losses, model and FedAvg."""
    world, rank = dist.get_world_size(), dist.get_rank()
    L = args.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world))
    strategy = flcomm.Strategy.parse(args.strategy)
    topo = strategy.topology(world, L, args.group_size, args.shard_size)           # flcomm
    mesh = flcomm.init_fed_mesh(topo, "cpu", timeout=timedelta(seconds=args.timeout_s))     # flcomm
    dims = "shard" if topo.num_replicas == 1 else ("replicate", "shard")

    model = build_model(args)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh.device_mesh[dims])
    fully_shard(model, mesh=mesh.device_mesh[dims])  # embeddings (tied to lm_head), final norm
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    fed = flcomm.FedAvg(model, mesh, sync_every=args.sync_every, codec=args.codec,  # flcomm
                        error_feedback=args.error_feedback, overlap_steps=1 if args.overlap else 0)

    # every rank reads its own slice of the corpus (data parallel within and across groups)
    loader = ShardedLoader(load_tokens(max_tokens=400_000), args.seq_len, args.batch_size, world, rank,
                           args.seed)
    losses = []
    for step in range(1, args.steps + 1):
        x, y = loader.next_batch()
        loss = F.cross_entropy(model(input_ids=x).logits.flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        fed.step()                                                                 # flcomm
        losses.append(loss.item())
        if rank == 0 and (step % 10 == 0 or step == args.steps):
            print(f"step {step:4d}  loss {loss.item():.3f}  syncs {fed.num_syncs}", flush=True)
    fed.finish()                                                                   # flcomm
    if rank == 0:
        print(f"mesh (fed, replicate, shard) = {topo.mesh_shape}; FedAvg sent "
              f"{mesh.stats.bytes('inter_group') / 2**20:.2f} MiB between groups from rank 0")
    return losses, model, fed


def _worker(rank: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(args.nproc), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(args.nproc))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.nproc))
    main_worker(args)


def main_worker(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout_s))
    try:
        train(args)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.nproc:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        torch.multiprocessing.spawn(_worker, args=(args, port), nprocs=args.nproc)
    else:
        main_worker(args)  # under torchrun


if __name__ == "__main__":
    main()
