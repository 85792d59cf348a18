"""flcomm: federated-learning-style sharded data parallelism inside a GPU cluster.

Federation groups train with FSDP/HSDP on fast links; across groups only a FedAvg of the
parameter shards crosses the slow links, every E local steps (Mittone & Aldinucci, FL+FSDP and
FL+HSDP). See README.md.
"""

from __future__ import annotations

__version__ = "0.1.0"

from flcomm.info import build_info

__all__ = ["__version__", "build_info"]
