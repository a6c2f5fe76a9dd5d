"""Engram conditional memory: n-gram hash, fused gate forward/backward, Sinkhorn helpers (engram.md)."""
from .ops import *  # noqa: F401,F403
from .ops import __all__  # noqa: F401
