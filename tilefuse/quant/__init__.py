"""Quantization: FP8 (E4M3), FP4 (E2M1) and E5M6 casts, cast-back, fused SwiGLU and RMSNorm casts."""
from .cast import *  # noqa: F401,F403
from .swiglu import *  # noqa: F401,F403
from .norm import *  # noqa: F401,F403
from .weight_sf import *  # noqa: F401,F403
from . import cast as _c, swiglu as _s, norm as _n, weight_sf as _w

__all__ = [*_c.__all__, *_s.__all__, *_n.__all__, *_w.__all__]
