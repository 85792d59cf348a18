"""Communication cost model of FSDP, HSDP, FL+FSDP and FL+HSDP (see :mod:`flcomm.costmodel.model`
for the model itself, :mod:`~flcomm.costmodel.search` for the crossover and the recommendation,
:mod:`~flcomm.costmodel.probe` for ``--measure``, :mod:`~flcomm.costmodel.assumptions` for what an
answer assumes and the units of bandwidths, :mod:`~flcomm.costmodel.report` for its table; the CLI
is ``flcomm-costmodel``)."""

from flcomm._lazy import renamed_attributes
from flcomm.costmodel.assumptions import (
    Assumption,
    assumptions,
    estimate_activation_bytes,
    estimate_blocks,
    parse_bandwidth,
)
from flcomm.costmodel.model import (
    CLUSTER_PRESETS,
    GBIT,
    Cluster,
    Link,
    Plan,
    Prediction,
    Strategy,
    Workload,
    codec_nbytes,
    collective_time,
    compute_time_from_flops,
    fedavg_shard_copies,
    memory_per_rank,
    predict,
    predict_strategies,
    speedup,
)
from flcomm.costmodel.search import (
    Crossover,
    Recommendation,
    crossover_bandwidth_ratio,
    crossover_sync_every,
    recommend,
)
from flcomm.costmodel.stragglers import PacingPrediction, expected_lateness, predict_pacing


def _on_first_use(name: str):
    # NOTE: the CLI and the probe (torch.distributed) load on first use, not with the formulas.
    if name == "main":
        from flcomm.costmodel.__main__ import main

        return main
    if name == "measure_tiers":
        from flcomm.costmodel.probe import measure_tiers

        return measure_tiers
    raise AttributeError(f"module 'flcomm.costmodel' has no attribute {name!r}")


# NOTE: PRESETS is the old name, for one release
__getattr__ = renamed_attributes(__name__, {"PRESETS": "CLUSTER_PRESETS"}, then=_on_first_use)


__all__ = [
    "Assumption", "CLUSTER_PRESETS", "Cluster", "Crossover", "GBIT", "Link", "PacingPrediction", "Plan",
    "Prediction", "Recommendation", "Strategy", "Workload", "assumptions", "codec_nbytes", "collective_time",
    "compute_time_from_flops", "crossover_bandwidth_ratio", "crossover_sync_every", "estimate_activation_bytes",
    "estimate_blocks", "expected_lateness", "fedavg_shard_copies", "main", "measure_tiers", "memory_per_rank",
    "parse_bandwidth", "predict", "predict_pacing", "predict_strategies", "recommend", "speedup",
]
