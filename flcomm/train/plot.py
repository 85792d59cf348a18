"""Plot runs from their metrics files: loss against wall time and against tokens (PNG).

    python -m flcomm.train plot RUN.jsonl [RUN2.jsonl ...] --out loss.png

Left panel: training loss (thin) and evaluation loss (markers) against wall-clock seconds, the
paper's time-to-quality view; right panel: the same against tokens processed (the
sample-efficiency view). One colour per run.
"""

from __future__ import annotations

from collections.abc import Sequence

from flcomm.train.metrics import RunMetrics, read_metrics


def plot_runs(paths: Sequence[str], out: str, labels: Sequence[str] | None = None,
              title: str | None = None) -> str:
    """Write the two-panel PNG for ``paths`` to ``out``; returns ``out``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise RuntimeError("plotting needs matplotlib (pip install 'flcomm[plot]')") from e
    if not paths:
        raise ValueError("plot needs at least one metrics file")
    runs: list[RunMetrics] = [read_metrics(p) for p in paths]
    if labels is not None and len(labels) != len(runs):
        raise ValueError(f"got {len(labels)} labels for {len(runs)} runs")
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, run in enumerate(runs):
        if not run.steps:
            raise ValueError(f"{run.path} has no step records")
        label = labels[i] if labels is not None else run.label
        color = f"C{i}"
        for ax, key, scale in ((axes[0], "time_s", 1.0), (axes[1], "tokens", 1e-6)):
            xs = [r[key] * scale for r in run.steps]
            ax.plot(xs, [r["loss"] for r in run.steps], color=color, lw=1, alpha=0.6,
                                 label=f"{label} train")
            ev = run.evals()
            if ev:
                ax.plot([r[key] * scale for r in ev], [r["eval_loss"] for r in ev], "o-", color=color,
                        ms=4, lw=1.5, label=f"{label} eval")
    axes[0].set_xlabel("wall time (s)")
    axes[1].set_xlabel("tokens (M)")
    for ax in axes:
        ax.set_ylabel("loss (nats/token)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
