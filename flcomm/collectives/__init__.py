"""Collectives written against the transport protocol: hierarchical reduce-scatter /
all-gather / all-reduce, the compressed two-hop all-reduce, and pipelined buckets."""

from flcomm.collectives.bucketing import BucketedAllReduce
from flcomm.collectives.compressed import compressed_all_reduce, compressed_wire_bytes
from flcomm.collectives.hierarchical import (
    Hierarchy,
    hierarchical_all_gather,
    hierarchical_all_reduce,
    hierarchical_reduce_scatter,
)

__all__ = [
    "BucketedAllReduce",
    "Hierarchy",
    "compressed_all_reduce",
    "compressed_wire_bytes",
    "hierarchical_all_gather",
    "hierarchical_all_reduce",
    "hierarchical_reduce_scatter",
]
