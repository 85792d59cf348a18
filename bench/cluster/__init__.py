"""An emulated two-tier cluster on one machine (network namespaces + shaped veth links).

See :mod:`bench.cluster.netns`.
"""
