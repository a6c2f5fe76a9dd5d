"""Rotary position embedding: apply_rotary (transform.md)."""
from .ops import *  # noqa: F401,F403
from .ops import __all__  # noqa: F401
