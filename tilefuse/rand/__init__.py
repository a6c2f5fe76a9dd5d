"""Random normals (rand.md): ``randn``, ``randn_like`` and ``set_seed``, with the bits of ``torch.randn``."""
from .ops import *  # noqa: F401,F403
from .ops import __all__  # noqa: F401
