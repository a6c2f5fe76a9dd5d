"""MoE routing: gates, top-k, fused expert-major mapping, expand and reduce (moe.md)."""
from .ops import *  # noqa: F401,F403
from .ops import __all__  # noqa: F401
