"""Manifold-constrained hyper-connections: pre/post mixes, Sinkhorn, fused norm projections (mhc.md)."""
from .ops import *  # noqa: F401,F403
from .ops import __all__  # noqa: F401
