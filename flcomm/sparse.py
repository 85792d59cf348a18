"""Deprecated (for one release): :mod:`flcomm.ops.topk`, which this name is now (importing it
warns once)."""

import sys

from flcomm._lazy import moved_module
from flcomm.ops import topk

moved_module(__name__, topk.__name__)
# NOTE: the module itself, not a copy of its names, so a patch of flcomm.sparse.X reaches the code
sys.modules[__name__] = topk
