"""Reference rotary embedding (transform.md section 6): plain PyTorch, the CPU path of ``apply_rotary`` and the
oracle of its tests.

Per rotation pair ``(f, s)`` of a valid token with cosine ``c`` and sine ``n`` (section 3.3):

* ``conjugate=False``: ``first = fma(f, c, -RN(s n))``, ``second = fma(f, n, RN(s c))``;
* ``conjugate=True``: ``first = fma(f, c, RN(s n))``, ``second = fma(f, -n, RN(s c))``;

each ``fma`` rounded once to binary32 (``fma_f32``, exact), the products ``RN(.)`` plain fp32 multiplies, and
each result rounded once to ``x.dtype``.
"""
from __future__ import annotations

import torch

from .moe import fma_f32

__all__ = ["rotary_embedding_ref"]

_OP = "rotary_embedding_ref"
_INT32_MIN, _INT32_MAX = -(2 ** 31), 2 ** 31 - 1


def _fail(message: str, exc: type = ValueError):
    raise exc(f"{_OP}: {message}")


def _flag(name: str, value) -> bool:
    """A bool or an int, read by its truth value (section 2.3)."""
    if not isinstance(value, int):
        _fail(f"{name} must be a bool or an int, got {type(value).__name__}", TypeError)
    return bool(value)


def _check(x, cos, sin, positions, seqlen_offsets) -> None:
    if not isinstance(x, torch.Tensor):
        _fail(f"x must be a torch.Tensor, got {type(x).__name__}", TypeError)
    if x.dtype not in (torch.bfloat16, torch.float32):
        _fail(f"x must have dtype bfloat16 or float32, got {str(x.dtype).replace('torch.', '')}", TypeError)
    if x.dim() not in (3, 4):
        _fail(f"x must be 3-D (T, H, D) or 4-D (B, S, H, D), got shape {tuple(x.shape)}")
    for name, t in (("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor):
            _fail(f"{name} must be a torch.Tensor, got {type(t).__name__}", TypeError)
        if t.dtype != torch.float32:
            _fail(f"{name} must have dtype float32, got {str(t.dtype).replace('torch.', '')}", TypeError)
        if t.dim() != 2:
            _fail(f"{name} must be 2-D (R, D/2), got shape {tuple(t.shape)}")
    if cos.shape != sin.shape:
        _fail(f"sin must have the shape of cos {tuple(cos.shape)}, got {tuple(sin.shape)}")
    k = cos.shape[1]
    if k < 1 or 2 * k > x.shape[-1]:
        _fail(f"cos must have 1 <= shape[1] <= x.shape[-1] / 2 = {x.shape[-1] / 2:g}, got shape {tuple(cos.shape)}")
    if positions is not None:
        if not isinstance(positions, torch.Tensor):
            _fail(f"positions must be a torch.Tensor, got {type(positions).__name__}", TypeError)
        if positions.dtype not in (torch.int32, torch.int64):
            _fail(f"positions must have dtype int32 or int64, got {str(positions.dtype).replace('torch.', '')}",
                  TypeError)
        want = tuple(x.shape[:-2])
        if tuple(positions.shape) != want:
            _fail(f"positions must have shape {want} (x's leading dimensions), got {tuple(positions.shape)}")
    if isinstance(seqlen_offsets, bool) or not isinstance(seqlen_offsets, int):
        _fail(f"seqlen_offsets must be an int, got {type(seqlen_offsets).__name__}", TypeError)
    if not _INT32_MIN <= seqlen_offsets <= _INT32_MAX:
        _fail(f"seqlen_offsets must lie in [-2^31, 2^31), got {seqlen_offsets}")


def rotary_embedding_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor | None = None,
                         seqlen_offsets: int = 0, interleaved=False, conjugate=False) -> torch.Tensor:
    """Rotate the first ``D = 2 cos.shape[1]`` columns of every head of ``x`` (section 6); returns a new tensor.

    ``x``: ``(T, H, Dx)`` or ``(B, S, H, Dx)`` bf16/fp32, any strides, not modified; columns ``[D, Dx)`` are copied.
    ``cos``, ``sin``: ``(R, D/2)`` fp32. Token ``t`` of batch row ``b`` uses row ``p = positions[b, t] +
    seqlen_offsets`` (or ``t + seqlen_offsets``); a token with ``p`` outside ``[0, R)`` is copied unchanged, and
    without ``positions`` such an offset raises ``ValueError``.
    """
    _check(x, cos, sin, positions, seqlen_offsets)
    interleaved = _flag("interleaved", interleaved)
    conjugate = _flag("conjugate", conjugate)
    x4 = x if x.dim() == 4 else x.unsqueeze(0)
    b, s, _, _ = x4.shape
    rows, k = cos.shape
    if positions is None:
        if s > 0 and (seqlen_offsets < 0 or seqlen_offsets + s > rows):
            _fail(f"seqlen_offsets + S must lie in [0, R] without positions, got seqlen_offsets={seqlen_offsets}, "
                  f"S={s}, R={rows}")
        p = (torch.arange(s, device=x.device, dtype=torch.int64) + seqlen_offsets).expand(b, s)
    else:
        p = positions.reshape(b, s).to(torch.int64) + seqlen_offsets
    valid = (p >= 0) & (p < rows)
    row = torch.where(valid, p, torch.zeros_like(p))
    if rows == 0:  # no row exists: every token is out of range
        c = n = torch.zeros(b, s, 1, k, dtype=torch.float32, device=x.device)
    else:
        c = cos[row].unsqueeze(2)  # (B, S, 1, D/2): one row for all heads of a token
        n = sin[row].unsqueeze(2)
    rot = x4[..., : 2 * k].to(torch.float32)
    if interleaved:
        f, sv = rot[..., 0::2], rot[..., 1::2]
    else:
        f, sv = rot[..., :k], rot[..., k:]
    if conjugate:
        first = fma_f32(f, c, sv * n)
        second = fma_f32(f, -n, sv * c)
    else:
        first = fma_f32(f, c, -(sv * n))
        second = fma_f32(f, n, sv * c)
    first, second = first.to(x.dtype), second.to(x.dtype)
    new = torch.stack((first, second), dim=-1).flatten(-2) if interleaved else torch.cat((first, second), dim=-1)
    out = x4.clone(memory_format=torch.contiguous_format)
    out[..., : 2 * k] = torch.where(valid[:, :, None, None], new, x4[..., : 2 * k])
    return out if x.dim() == 4 else out[0]
