"""Deprecated (for one release): :mod:`flcomm.ops.apply`, which this name is now (importing it
warns once)."""

import sys

from flcomm._lazy import moved_module
from flcomm.ops import apply

moved_module(__name__, apply.__name__)
# NOTE: the module itself, not a copy of its names, so a patch of flcomm.apply.X reaches the code
sys.modules[__name__] = apply
