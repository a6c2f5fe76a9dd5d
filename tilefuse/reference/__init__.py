"""Pure-PyTorch references: the exact semantics of every op, the CPU path, and the oracle of every test.

Nothing under this package imports TileLang.
"""
from .quant import *  # noqa: F401,F403
from .swiglu import *  # noqa: F401,F403
from .norm import *  # noqa: F401,F403
from .weight_sf import *  # noqa: F401,F403
from .moe import *  # noqa: F401,F403
from .engram import *  # noqa: F401,F403
from .mhc import *  # noqa: F401,F403
from .transform import *  # noqa: F401,F403
from . import quant as _q, swiglu as _s, norm as _n, weight_sf as _w, moe as _moe, engram as _e, mhc as _m
from . import transform as _t

__all__ = [*_q.__all__, *_s.__all__, *_n.__all__, *_w.__all__, *_moe.__all__, *_e.__all__, *_m.__all__, *_t.__all__]
