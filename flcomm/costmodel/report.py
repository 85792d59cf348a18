"""The table the CLI prints: one row per plan with its speedups over FSDP and HSDP (step-time
ratios), its memory per rank against the limit, the FSDP overlap stated beside the FSDP row,
and the recommended plan with the same plan at other E (:func:`sync_every_sweep`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from flcomm.comm.base import format_bytes
from flcomm.costmodel.model import Cluster, Prediction, Strategy, Workload, predict

__all__ = ["SWEEP_E", "Row", "format_table", "ratio", "row_record", "sync_every_sweep"]

SWEEP_E = (1, 2, 4, 8, 16)  # the E of the sweep beside the recommended plan (and its own E)
_HDR = (f"{'plan':<44} {'step s':>9} {'exposed s':>9} {'tokens/s':>11} {'vs FSDP':>8} {'vs HSDP':>8} "
        f"{'inter-node/step':>15} {'inter-group/step':>16} {'mem/rank':>10}")

Row = tuple[str, Prediction]  # (mark: "" or "*", prediction)


def ratio(base: Prediction | None, p: Prediction) -> float | None:
    """tokens/s of ``p`` over tokens/s of ``base``: the inverse ratio of their step times."""
    return None if base is None else base.step_time_s / p.step_time_s


def _x(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}x"


def _mem(p: Prediction, memory_bytes: float | None) -> str:
    over = memory_bytes is not None and p.memory_total > memory_bytes
    return format_bytes(p.memory_total) + ("!" if over else " ")


def _line(mark: str, p: Prediction, fsdp: Prediction | None, hsdp: Prediction | None,
          memory_bytes: float | None) -> str:
    label = f"{mark or ' '} {p.plan.label()}"
    return (f"{label:<44} {p.step_time_s:9.4g} {p.exposed_comm_s:9.4g} {p.tokens_per_s:11.4g} "
            f"{_x(ratio(fsdp, p)):>8} {_x(ratio(hsdp, p)):>8} {format_bytes(p.internode_bytes_per_step):>15} "
            f"{format_bytes(p.intergroup_bytes_per_step):>16} {_mem(p, memory_bytes):>10}")


def _overlap_note(p: Prediction, wl: Workload) -> str:
    hidden = min(wl.fsdp_overlap * p.inner_comm_s, p.compute_s)
    return (f"    ^ FSDP's {p.inner_comm_s:.3g} s of in-group communication per step, {hidden:.3g} s of it hidden "
            f"(--fsdp-overlap {wl.fsdp_overlap:g} of it, at most the compute; {wl.fsdp_units} FSDP units)")


def format_table(rows: Sequence[Row], wl: Workload, fsdp: Prediction | None, hsdp: Prediction | None,
                 memory_bytes: float | None, recommended: Sequence[Row] = ()) -> str:
    """``rows`` (the strategies), then the ``recommended`` rows under their own heading; the
    FSDP row is followed by its overlap assumption, and a legend says how memory was checked."""
    lines = [_HDR, "-" * len(_HDR)]
    for mark, p in rows:
        lines.append(_line(mark, p, fsdp, hsdp, memory_bytes))
        if p.plan.strategy is Strategy.FSDP:
            lines.append(_overlap_note(p, wl))
    if recommended:
        lines.append("recommended (*), and the same plan at other E:")
        lines += [_line(mark, p, fsdp, hsdp, memory_bytes) for mark, p in recommended]
    every = [p for _, p in [*rows, *recommended]]
    if memory_bytes is None:
        lines.append("mem/rank: not checked against a device memory (--memory-gb)")
    elif any(p.memory_total > memory_bytes for p in every):
        lines.append(f"mem/rank with !: needs more than {format_bytes(memory_bytes)} per rank, does not fit")
    return "\n".join(lines)


def sync_every_sweep(cluster: Cluster, wl: Workload, best: Prediction, Es: Sequence[int] = SWEEP_E) -> list[Row]:
    """The recommended plan (marked ``*``) among the same plan at each E of ``Es`` (and its own),
    in order of E; only the plan itself when it does not federate. An E that its fragments do
    not divide is left out."""
    if not best.plan.strategy.federated:
        return [("*", best)]
    out: list[Row] = []
    for E in sorted({*Es, best.plan.sync_every}):
        if E == best.plan.sync_every:
            out.append(("*", best))
        elif E % best.plan.fragments == 0:
            out.append(("", predict(cluster, wl, best.plan.with_fedavg(sync_every=E))))
    return out


def row_record(p: Prediction, fsdp: Prediction | None, hsdp: Prediction | None,
               memory_bytes: float | None) -> dict[str, Any]:
    """A row for ``--json``: the prediction with its ratios and whether it fits."""
    fits = None if memory_bytes is None else bool(p.memory_total <= memory_bytes)
    return {**p.as_dict(), "vs_fsdp": ratio(fsdp, p), "vs_hsdp": ratio(hsdp, p), "memory_total": p.memory_total,
            "fits": fits, "memory_limit_bytes": memory_bytes}
