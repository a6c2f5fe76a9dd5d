"""Transposes: transpose and batched_transpose (quant.md 3.15)."""
from .ops import *  # noqa: F401,F403
from .ops import __all__  # noqa: F401
