"""Where tilefuse keeps what it builds: the exported kernel libraries (``tilefuse._jit``) and the native launch
extension (``tilefuse._native``). Below both; imports nothing of tilefuse."""
from __future__ import annotations

import os


def cache_dir() -> str:
    """``TILEFUSE_CACHE_DIR``, else ``<TILELANG_CACHE_DIR or ~/.tilelang/cache>/tilefuse``."""
    base = os.environ.get("TILELANG_CACHE_DIR") or os.path.expanduser("~/.tilelang/cache")
    return os.environ.get("TILEFUSE_CACHE_DIR") or os.path.join(base, "tilefuse")
