"""The peers ``python -m tilefuse bench --compare`` runs beside tilefuse, and the agreement rules by which their
outputs are compared with ours.

A peer is another implementation of an op, called on the same inputs in the same process and timed with the
same timer:

- ``tk2``: TileKernels 2.1.0 (``$TILEFUSE_PEER_TK2``);
- ``tk1``: TileKernels 1.0.0 (``$TILEFUSE_PEER_TK1``), for the ops 2.1.0 dropped. Both releases are the package
  ``tile_kernels``, so 1.0.0 runs in a second process (``bench --compare`` starts it);
- ``liger``: Liger-Kernel (``$TILEFUSE_PEER_LIGER``), where it has the op;
- ``compile``: ``torch.compile`` of our own reference.

Each variable names the folder that holds the peer's importable package (the folder put on ``sys.path``; on our
GPU machine ``.gpu/prelude.sh`` sets them). Only the bench imports this module; a peer's package is imported only when a compare run asks for it.
"""
from __future__ import annotations

import importlib
import os
import sys

import torch

from tilefuse.bench.core import tensors
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
        raise RuntimeError(f"peer {peer}: ${PEER_ENV[peer]} must name the folder holding its package, "
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


def _canonical_fused_mapping(res) -> tuple:
    """``get_fused_mapping``'s seven tensors with the rows of each expert segment put in ascending flat-slot order
    (``pos_to_token_topk``; padding rows last), ``token_topk_to_pos`` renumbered to match. Upstream orders a
    segment's rows by SM worker (moe.md 1.5), ours by token: any consistent layout of the same segments maps to
    one canonical form, and an inconsistent one (a map pointing at the wrong row) does not."""
    p2e, p2t, p2tt, tt2p, start, end, counts = res[:7]
    n = p2e.numel()
    pos = torch.arange(n, device=p2e.device)
    segment = torch.searchsorted(end.to(torch.int64).contiguous(), pos, right=True)  # E for the tail past the total
    slots = tt2p.numel()
    key = segment * (slots + 1) + torch.where(p2tt >= 0, p2tt.to(torch.int64), slots)
    perm = torch.sort(key, stable=True).indices
    inv = torch.empty_like(perm)
    inv[perm] = pos
    old = tt2p.to(torch.int64)
    new = torch.where(old >= 0, inv[old.clamp(0, max(n - 1, 0))] if n else old, old).to(tt2p.dtype)
    return p2e[perm], p2t[perm], p2tt[perm], new, start, end, counts


def fused_mapping_agree(ours, theirs) -> tuple[bool, str]:
    """``agree`` for ``get_fused_mapping``: the count lists equal, the segments (starts, ends, aligned counts)
    bitwise equal, and the maps bitwise equal after both are put in the canonical in-segment order."""
    if list(ours[7]) != list(theirs[7]):
        return False, "num_tokens_per_expert lists differ"
    for i in range(7):
        if tuple(ours[i].shape) != tuple(theirs[i].shape) or ours[i].dtype != theirs[i].dtype:
            return False, f"output {i}: {tuple(ours[i].shape)} {ours[i].dtype} vs {tuple(theirs[i].shape)} " \
                          f"{theirs[i].dtype}"
    if agree(ours[:7], theirs[:7], True)[0]:
        return True, "bitwise"
    ok, text = agree(_canonical_fused_mapping(ours), _canonical_fused_mapping(theirs), True)
    return ok, "bitwise up to the row order inside segments" if ok else f"canonical order: {text}"
