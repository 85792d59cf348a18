"""What an answer of the cost model rests on, stated: bandwidth units, the model's shape when
only its size is known, and the record of every assumption that the CLI prints and writes.

* :func:`parse_bandwidth`: "25GB/s", "200Gbit/s", "100gbit" or a bare number (Gbit/s) in bytes/s;
* :func:`estimate_blocks`, :func:`estimate_activation_bytes`: a Llama-style model of N parameters
  (FSDP units = blocks + the root; activations with checkpointing per block);
* :func:`assumptions`: one :class:`Assumption` per setting the prediction depends on, with the
  value used, where it came from and the flag that changes it.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from typing import Any

from flcomm.comm.base import format_bytes
from flcomm.costmodel.model import GBIT, Cluster, Link, Workload, codec_nbytes
from flcomm.validate import integer, number

__all__ = [
    "ASPECT", "CONVERGENCE_NOTE", "FSDP_OVERLAP", "VOCAB", "Assumption", "assumptions", "d_model",
    "estimate_activation_bytes", "estimate_blocks", "format_assumptions", "format_bandwidth", "parse_bandwidth",
]

ASPECT = 128    # d_model / blocks of Llama-style models (Llama 3: 4096 / 32, 2048 / 16)
VOCAB = 128256  # Llama 3's vocabulary, for the fp32 logits of the activation estimate
# NOTE: FSDP2 prefetches the next unit's all-gather; with NCCL on GPUs most in-group traffic
# hides behind compute. gloo on CPU runs it in the training thread: nothing is hidden.
FSDP_OVERLAP = {"nccl": 0.8, "gloo": 0.0}
CONVERGENCE_NOTE = ("convergence is not modelled: these are times per step; a larger E or a lossy codec "
                    "may need more steps to reach the same loss")

_BITS = {"mbit": 1e6 / 8, "gbit": 1e9 / 8, "tbit": 1e12 / 8, "mbps": 1e6 / 8, "gbps": 1e9 / 8, "tbps": 1e12 / 8}
_BYTES = {"MB": 1e6, "GB": 1e9, "TB": 1e12}
_BW = re.compile(r"\s*([+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)\s*([A-Za-z]*)(/s)?\s*")
BANDWIDTH_UNITS = ("a bare number (Gbit/s), or a number with Mbit, Gbit, Tbit, Mbps, Gbps, Tbps (bits/s, "
                   "any case, /s optional) or MB/s, GB/s, TB/s (bytes/s, capital B), e.g. 25GB/s or 200Gbit/s")


def parse_bandwidth(text: str | float) -> float:
    """Bytes/s of a bandwidth: ``"25GB/s"`` (bytes), ``"200Gbit/s"``, ``"100gbit"``, ``"400Gbps"``
    (bits); a bare number is Gbit/s, the unit of the ``--*-gbit`` flags. ``"25gb/s"`` is refused:
    a lower-case b could mean either."""
    if not isinstance(text, str):
        return number("bandwidth (Gbit/s)", text, 0, lo_open=True) * GBIT
    m = _BW.fullmatch(text)
    u = m.group(2) if m else ""
    scale = None
    if m and not u and not m.group(3):
        scale = GBIT
    elif m and u.lower() in _BITS:
        scale = _BITS[u.lower()]
    elif m and _byte_unit(u):
        scale = _BYTES[_byte_unit(u)]
    if scale is None:
        raise ValueError(f"bandwidth must be {BANDWIDTH_UNITS}; got {text!r}")
    return number("bandwidth", float(m.group(1)), 0, lo_open=True, also=f" (from {text!r})") * scale


def _byte_unit(u: str) -> str | None:
    """"GB" for "GB" / "gB"; None unless a prefix and a capital B."""
    return f"{u[0].upper()}B" if len(u) == 2 and u[1] == "B" and f"{u[0].upper()}B" in _BYTES else None


def format_bandwidth(bytes_per_s: float) -> str:
    """``"400 GB/s (3200 Gbit/s)"``."""
    return f"{bytes_per_s / 1e9:.4g} GB/s ({bytes_per_s / GBIT:.4g} Gbit/s)"


# ---------------------------------------------------------------- the model's shape ----

def estimate_blocks(params: float, aspect: float = ASPECT) -> int:
    """Transformer blocks l of a model of N parameters with d_model = aspect * l, from
    N = 12 * l * d_model**2 (attention 4 d^2 and MLP 8 d^2 per block; embeddings not counted):
    l = round((N / (12 * aspect**2)) ** (1/3)), at least 1."""
    number("params", params, 0, lo_open=True)
    number("aspect", aspect, 0, lo_open=True)
    return max(1, round((params / (12 * aspect**2)) ** (1 / 3)))


def d_model(params: float, blocks: int) -> float:
    """The hidden size of N = 12 * blocks * d**2."""
    integer("blocks", blocks, 1)
    return math.sqrt(number("params", params, 0, lo_open=True) / (12 * blocks))


def estimate_activation_bytes(params: float, blocks: int, tokens_per_rank: float, vocab: int = VOCAB) -> float:
    """Activations one rank holds at the peak of a step, with activation checkpointing per block,
    bf16 activations and flash attention (d = :func:`d_model`, t = tokens per rank):
    the saved input of every block ``2 * t * d * blocks``, one block recomputed in the backward
    ``34 * t * d`` (Korthikanti et al. 2022, without the attention scores), and the fp32
    logits ``4 * t * vocab``."""
    integer("vocab", vocab, 1)
    t, d = number("tokens_per_rank", tokens_per_rank, 0, lo_open=True), d_model(params, blocks)
    return 2 * t * d * blocks + 34 * t * d + 4 * t * vocab


# ---------------------------------------------------------------- the record ----

@dataclass(frozen=True)
class Assumption:
    """One setting the prediction depends on: ``value`` (SI units: s, bytes, bytes/s; None for
    "not checked"), ``text`` (one human line), ``source`` (flag, preset <name>, default,
    estimated, derived) and ``flag`` (the option that changes it)."""

    key: str
    value: Any
    text: str
    source: str
    flag: str


def _link_text(name: str, link: Link, per: str) -> str:
    return f"{name} {format_bandwidth(link.bandwidth)} per {per}, latency {link.latency * 1e6:g} us per ring step"


def _replicate_text(codec: str, grad_bytes: int) -> str:
    if codec == "none":
        return f"HSDP replicas all-reduce gradients in {grad_bytes} B per element (FSDP's own)"
    per = codec_nbytes(codec, 1 << 20) / (1 << 20)
    return f"HSDP replicas all-reduce gradients in {codec}, {per:.4g} B per element with its scales (flcomm's hook)"


def assumptions(cluster: Cluster, workload: Workload, memory_bytes: float | None,
                sources: dict[str, str] | None = None, how: dict[str, str] | None = None,
                replicate_codec: str = "none") -> list[Assumption]:
    """Every setting of ``cluster`` and ``workload`` (and the memory limit, and the HSDP rows'
    replicate codec) that the answer depends on. ``sources``: key -> where the value came from
    (default "default"); ``how``: key -> how it was derived, appended to its text."""
    src, how = sources or {}, how or {}
    w, c = workload, cluster
    rows = [
        ("compute_s", w.compute_s, f"compute {w.compute_s:.4g} s per step", "--compute-s / --tflops --mfu"),
        ("param_bytes", w.param_bytes, f"parameters all-gathered in {w.param_bytes} B per element", "--param-bytes"),
        ("grad_bytes", w.grad_bytes, f"gradients reduce-scattered in {w.grad_bytes} B per element", "--grad-bytes"),
        ("replicate_codec", replicate_codec, _replicate_text(replicate_codec, w.grad_bytes), "--replicate-codec"),
        ("allgathers_per_step", w.allgathers_per_step,
         f"{w.allgathers_per_step:g} parameter all-gathers per step (forward and backward)", "--allgathers-per-step"),
        ("fsdp_units", w.fsdp_units, f"FSDP units {w.fsdp_units}, each collective issued once per unit",
         "--fsdp-units / --layers"),
        ("fsdp_overlap", w.fsdp_overlap,
         f"FSDP overlap {w.fsdp_overlap:g}: {100 * w.fsdp_overlap:g}% of in-group communication hidden behind "
         "compute", "--fsdp-overlap"),
        ("state_bytes_per_param", w.state_bytes_per_param,
         f"training state {w.state_bytes_per_param:g} B per parameter, sharded (bf16 parameters + fp32 "
         "master + Adam m and v = 16)", "--state-bytes"),
        ("activation_bytes", w.activation_bytes, f"activations {format_bytes(w.activation_bytes)} per rank",
         "--activation-gb"),
        ("memory_limit_bytes", memory_bytes,
         f"memory limit {format_bytes(memory_bytes)} per rank" if memory_bytes is not None
         else "memory NOT checked: no limit given, plans may not fit", "--memory-gb"),
        ("intra_node", c.intra.bandwidth, _link_text("intra-node", c.intra, "rank"), "--intra-bw, --intra-lat-us"),
        ("inter_node", c.inter_node.bandwidth, _link_text("inter-node", c.inter_node, "node"),
         "--inter-bw, --inter-lat-us"),
        ("inter_group", c.inter_group.bandwidth, _link_text("inter-group", c.inter_group, "node"),
         "--group-bw, --group-lat-us"),
        ("reduce_scatter_as_all_reduce", c.reduce_scatter_as_all_reduce,
         "reduce-scatter runs as a full all-reduce (gloo)" if c.reduce_scatter_as_all_reduce
         else "ring collectives as NCCL runs them (no tree, no SHARP)", "--gloo"),
        ("convergence", None, CONVERGENCE_NOTE, "-"),
    ]
    out = []
    for key, value, text, flag in rows:
        text = f"{text} ({how[key]})" if key in how else text
        out.append(Assumption(key, value, text, src.get(key, "model" if key == "convergence" else "default"), flag))
    return out


def format_assumptions(items: list[Assumption]) -> str:
    """The ``assumptions:`` block of the CLI: one line each, with its source and flag."""
    return "\n".join(["assumptions (source; the flag that changes it):"] +
                     [f"  {a.text}  [{a.source}; {a.flag}]" for a in items])


def as_json(items: list[Assumption]) -> dict[str, dict[str, Any]]:
    return {a.key: {k: v for k, v in asdict(a).items() if k != "key"} for a in items}
