"""The peers ``python -m tilefuse bench --compare`` runs beside tilefuse, and how their outputs are compared.

A peer is another implementation of an op, called on the same inputs in the same process and timed with the
same timer:

- ``tk2``: TileKernels 2.1.0 (``$TILEFUSE_PEER_TK2``);
- ``tk1``: TileKernels 1.0.0 (``$TILEFUSE_PEER_TK1``), for the ops 2.1.0 dropped. Both releases are the package
  ``tile_kernels``, so 1.0.0 runs in a second process (``bench --compare`` starts it);
- ``liger``: Liger-Kernel (``$TILEFUSE_PEER_LIGER``), where it has the op;
- ``compile``: ``torch.compile`` of our own reference.

The folders come from ``.gpu/prelude.sh`` (``../shared/gpu/setup`` ships the wheels). Nothing here is imported
by tilefuse itself; a peer's package is imported only when a compare run asks for it.
"""
from __future__ import annotations

import importlib
import os
import sys

import torch

from tilefuse.testing.numeric import calc_diff  # noqa: F401  (agree's inexact rule; re-exported)

PEER_ENV = {"tk2": "TILEFUSE_PEER_TK2", "tk1": "TILEFUSE_PEER_TK1", "liger": "TILEFUSE_PEER_LIGER"}
PEER_NAMES = {"tk2": "TileKernels 2.1.0", "tk1": "TileKernels 1.0.0", "liger": "Liger-Kernel",
              "compile": "torch.compile(reference)"}
_LOADED: dict[str, object] = {}


def load(peer: str):
    """The top module of ``peer`` (``tile_kernels`` or ``liger_kernel``), imported from its folder; raises
    ``RuntimeError`` naming the variable when the folder is missing. One process holds one TileKernels release."""
    if peer in _LOADED:
        return _LOADED[peer]
    if peer not in PEER_ENV:
        raise ValueError(f"peer must be one of {sorted(PEER_ENV)}, got {peer!r}")
    folder = os.environ.get(PEER_ENV[peer], "")
    if not folder or not os.path.isdir(folder):
        raise RuntimeError(f"peer {peer}: ${PEER_ENV[peer]} must name its unpacked folder (source .gpu/prelude.sh), "
                           f"got {folder!r}")
    if peer in ("tk1", "tk2"):
        other = {"tk1": "tk2", "tk2": "tk1"}[peer]
        if other in _LOADED:
            raise RuntimeError(f"peer {peer}: this process already imported {PEER_NAMES[other]} (both are "
                               "tile_kernels); run it in a second process")
        if peer == "tk1":  # 1.0.0 imports tilelang.utils.target, which TileLang 0.1.15 moved to tilelang.backend
            import tilelang.backend.target as target

            sys.modules.setdefault("tilelang.utils.target", target)
            import tilelang.utils

            if not hasattr(tilelang.utils, "target"):
                tilelang.utils.target = target
    sys.path.insert(0, folder)
    module = importlib.import_module("liger_kernel" if peer == "liger" else "tile_kernels")
    _LOADED[peer] = module
    return module


def tensors(obj) -> list[torch.Tensor]:
    """The tensors of a nested tuple/list, in order (``None`` skipped)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for item in obj for t in tensors(item)]
    return []


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The logical elements of ``t`` as bytes, in row-major order (strided views compare by what they show)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def agree(ours, theirs, exact: bool) -> tuple[bool, str]:
    """Compare two results tensor by tensor: ``(ok, text)``. Bitwise first; an inexact op whose bytes differ is
    judged by ``calc_diff`` of the values (ok under 1e-6)."""
    a, b = tensors(ours), tensors(theirs)
    if len(a) != len(b):
        return False, f"{len(a)} vs {len(b)} outputs"
    worst = 0.0
    for i, (x, y) in enumerate(zip(a, b)):
        if tuple(x.shape) != tuple(y.shape):
            return False, f"output {i}: shape {tuple(x.shape)} vs {tuple(y.shape)}"
        if x.element_size() != y.element_size():
            return False, f"output {i}: {x.dtype} vs {y.dtype}"
        if torch.equal(_bytes(x), _bytes(y)):
            continue
        if exact or not (x.is_floating_point() and y.is_floating_point()):
            n = int((_bytes(x) != _bytes(y)).sum())
            return False, f"output {i}: {n} bytes differ"
        worst = max(worst, calc_diff(x.float(), y.float()))
    if worst == 0.0:
        return True, "bitwise"
    return worst < 1e-6, f"calc_diff {worst:.1e}"
