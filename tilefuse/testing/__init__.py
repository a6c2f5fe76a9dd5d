"""Testing tools for tilefuse users: bitwise comparators, error metrics, input generators, timers.

Use them to test your own kernels the way tilefuse tests its own (spec testing.md section 2). Nothing
here imports TileLang.
"""
from .generators import *  # noqa: F401,F403
from .numeric import *  # noqa: F401,F403
from .timing import *  # noqa: F401,F403
from . import generators as _generators, numeric as _numeric, timing as _timing

__all__ = [*_numeric.__all__, *_generators.__all__, *_timing.__all__]
