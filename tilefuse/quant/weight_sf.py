"""Public batched_transpose_weight_sf (quant.md 5.13)."""
from __future__ import annotations

import torch

from tilefuse import _check
from tilefuse._registry import public
from tilefuse.quant import _weight_sf_kernel as _K
from tilefuse.reference import weight_sf as _ref

__all__ = ["batched_transpose_weight_sf"]

_OP = "batched_transpose_weight_sf"
_POOL_ALIGN_WORDS = 8  # 32 bytes


def _layouts(shape: torch.Size, block_size: int, transpose_sf1: bool):
    """((shape, strides) of sf0, (shape, strides) of sf1) for an sf of ``shape`` (quant.md 5.13)."""
    nsn, nsk = shape[-2:]
    n, k = nsn * block_size, nsk * block_size
    w0, w1 = -(-nsk // 4), -(-nsn // 4)
    sf0 = ((n, w0), (1, n))
    sf1 = ((w1, k), (k, 1)) if transpose_sf1 else ((k, w1), (1, k))
    if len(shape) == 3:
        g = shape[0]
        sf0 = ((g, *sf0[0]), (w0 * n, *sf0[1]))
        sf1 = ((g, *sf1[0]), (w1 * k, *sf1[1]))
    return sf0, sf1


def _validate(sf, block_size, transpose_sf1s, outs) -> None:
    if not isinstance(sf, (list, tuple)):
        _check.fail(_OP, f"sf must be a list of tensors, got {type(sf).__name__}", TypeError)
    _check.choice(_OP, "block_size", block_size, (32, 128))
    if not (isinstance(transpose_sf1s, (list, tuple)) and len(transpose_sf1s) == len(sf)):
        _check.fail(_OP, f"transpose_sf1s must be a list with one bool per sf ({len(sf)}), got {transpose_sf1s!r}")
    if not (outs is None or (isinstance(outs, (list, tuple)) and len(outs) == len(sf))):
        _check.fail(_OP, f"outs must be None or a list with one entry per sf ({len(sf)}), got {type(outs).__name__}")
    device = None
    for i, s in enumerate(sf):
        name = f"sf[{i}]"
        _check.tensor(_OP, name, s, dtype=torch.float32, ndim=(2, 3), contiguous=True, device=device)
        device = s.device
        if not (s.dim() == 2 or s.size(0) > 0):
            _check.fail(_OP, f"{name} must have G > 0, got shape {tuple(s.shape)}")
        nsn, nsk = s.shape[-2:]
        if not ((nsn * block_size) % 128 == 0 and (nsk * block_size) % 128 == 0):
            _check.fail(_OP, f"{name} must describe n and k (sf dims x block_size {block_size}) that are "
                             f"multiples of 128, got shape {tuple(s.shape)}")
        if not (isinstance(transpose_sf1s[i], bool)):
            _check.fail(_OP, f"transpose_sf1s[{i}] must be a bool, got {transpose_sf1s[i]!r}", TypeError)
        if outs is None or outs[i] is None:
            continue
        pair = outs[i]
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2):
            _check.fail(_OP, f"outs[{i}] must be None or a pair (sf0_out, sf1_out), got {type(pair).__name__}",
                        TypeError)
        for j, (t, (shape, stride)) in enumerate(zip(pair, _layouts(s.shape, block_size, transpose_sf1s[i]))):
            tname = f"outs[{i}][{j}]"
            _check.tensor(_OP, tname, t, dtype=torch.int32, shape=shape, device=device)
            # Strides of size-1 dims address nothing; every other stride must match exactly.
            if not (all(a == b for a, b, n in zip(t.stride(), stride, shape) if n > 1)):
                _check.fail(_OP, f"{tname} must have strides {stride}, got {t.stride()}")
            if t.data_ptr() % 32 != 0:
                _check.fail(_OP, f"{tname} must be 32-byte aligned, got address "
                                 f"{t.data_ptr():#x}")


@public("quant", path="kernel")
def batched_transpose_weight_sf(sf: list[torch.Tensor], block_size: int, transpose_sf1s: list[bool],
                                outs: list | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Convert power-of-two weight sf into the two packed UE8M0 GEMM layouts (quant.md 5.13).

    ``outs[i]`` (when given) is overwritten in place and returned; the other outputs are views into one
    newly allocated int32 pool, each starting on a 32-byte boundary. Padding bytes are written as 0.
    """
    _validate(sf, block_size, transpose_sf1s, outs)
    if len(sf) == 0:
        return []
    if sf[0].is_cuda:
        return _K.batched_transpose_weight_sf_cuda(sf, block_size, transpose_sf1s, outs)
    layouts = [_layouts(s.shape, block_size, t) for s, t in zip(sf, transpose_sf1s)]
    need = [outs is None or outs[i] is None for i in range(len(sf))]
    sizes = [[_POOL_ALIGN_WORDS * -(-torch.Size(shape).numel() // _POOL_ALIGN_WORDS) for shape, _ in pair]
             for pair in layouts]
    pool = torch.empty(sum(sum(s) for s, n in zip(sizes, need) if n), dtype=torch.int32, device=sf[0].device)
    offset, targets = 0, []
    for i, pair in enumerate(layouts):
        if not need[i]:
            targets.append(tuple(outs[i]))
            continue
        views = []
        for (shape, stride), size in zip(pair, sizes[i]):
            views.append(pool.as_strided(shape, stride, offset))
            offset += size
        targets.append(tuple(views))
    for (sf0, sf1), (out0, out1) in zip(_ref.batched_transpose_weight_sf(sf, block_size, transpose_sf1s), targets):
        out0.copy_(sf0)
        out1.copy_(sf1)
    return targets
