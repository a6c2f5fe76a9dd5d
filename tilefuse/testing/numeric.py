"""Comparators and byte counting for kernel tests (spec testing.md section 2.1-2.5).

Everything here works on any device and never imports TileLang.
"""
from __future__ import annotations

import math

import torch

__all__ = ["assert_equal", "calc_diff", "check_bias", "count_bytes", "clear_unused_sf"]

# How many mismatching elements an assert_equal failure message lists.
_MAX_REPORTED = 10


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``t`` in row-major element order, as a 2-D uint8 tensor ``[numel, itemsize]``."""
    flat = t.contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    return flat.view(torch.uint8).reshape(flat.numel(), t.element_size())


def _value(t: torch.Tensor, index: int):
    """Element ``index`` of the flattened ``t`` as a Python number (FP8 widened to float)."""
    v = t.reshape(-1)[index]
    if v.dtype.is_floating_point and v.element_size() == 1:
        v = v.float()
    return v.item()


def _coords(flat_index: int, shape: torch.Size) -> tuple[int, ...]:
    coords = []
    for size in reversed(shape):
        coords.append(flat_index % size)
        flat_index //= size
    return tuple(reversed(coords))


def assert_equal(x: torch.Tensor, y: torch.Tensor, check_dtype: bool = True, check_shape: bool = True,
                 check_stride: bool = True) -> None:
    """Assert that ``x`` and ``y`` are bitwise identical (testing.md 2.1).

    Checks, in order: dtype (optional), shape (optional), strides (optional, skipped when empty), device,
    then the raw bytes of every element. NaNs with the same bit pattern are equal; ``+0`` and ``-0`` differ.
    With ``check_dtype=False`` and different dtypes, ``x`` is converted to ``y``'s dtype first; with
    ``check_shape=False`` the elements are compared in row-major order (the counts must still agree).
    On a mismatch the message gives the number of differing elements and the first coordinates with
    both values.
    """
    if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
        raise TypeError(f"assert_equal: x and y must be tensors, got {type(x).__name__} and {type(y).__name__}")
    if check_dtype and x.dtype != y.dtype:
        raise AssertionError(f"assert_equal: dtype mismatch: {x.dtype} vs {y.dtype}")
    if check_shape and x.shape != y.shape:
        raise AssertionError(f"assert_equal: shape mismatch: {tuple(x.shape)} vs {tuple(y.shape)}")
    if check_stride and x.numel() > 0 and x.stride() != y.stride():
        raise AssertionError(f"assert_equal: stride mismatch: {x.stride()} vs {y.stride()}")
    if x.device != y.device:
        raise AssertionError(f"assert_equal: device mismatch: {x.device} vs {y.device}")
    if x.numel() != y.numel():
        raise AssertionError(f"assert_equal: element count mismatch: {x.numel()} vs {y.numel()}")
    if x.dtype != y.dtype:
        x = x.to(y.dtype)
    differs = (_as_bytes(x) != _as_bytes(y)).any(dim=1)
    if not bool(differs.any()):
        return
    bad = differs.nonzero().flatten()
    lines = [f"assert_equal: {bad.numel()} of {x.numel()} elements differ (shape {tuple(x.shape)}, {x.dtype})"]
    for i in bad[:_MAX_REPORTED].tolist():
        lines.append(f"  at {_coords(i, x.shape)}: {_value(x, i)!r} vs {_value(y, i)!r}")
    if bad.numel() > _MAX_REPORTED:
        lines.append(f"  ... and {bad.numel() - _MAX_REPORTED} more")
    raise AssertionError("\n".join(lines))


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """Global relative squared error ``sum((x-y)^2) / sum(x^2 + y^2)`` in float64 (testing.md 2.2).

    Symmetric, scale-invariant, in [0, 2]; 0 when both tensors are all zero.
    """
    x, y = x.double(), y.double()
    denominator = (x * x + y * y).sum()
    if float(denominator) == 0.0:
        return 0.0
    return float(((x - y) ** 2).sum() / denominator)


def check_bias(x: torch.Tensor, ref: torch.Tensor) -> None:
    """Assert that ``x`` is not one-sidedly rounded against ``ref`` (testing.md 2.3).

    With ``p = (#{x < ref} + #{x == ref}/2) / n``, asserts ``|p - 1/2| < 10/sqrt(n)`` (20 sigma of a fair
    binomial). Catches always-floor or always-ceil rounding, not round-toward-zero on symmetric data.
    """
    n = x.numel()
    if n == 0:
        return
    x, ref = x.double(), ref.double()
    p = (float((x < ref).sum()) + 0.5 * float((x == ref).sum())) / n
    bound = 10.0 / math.sqrt(n)
    if abs(p - 0.5) >= bound:
        raise AssertionError(f"check_bias: fraction below the reference is {p:.6f}, |p - 0.5| >= {bound:.6f} "
                             f"(n = {n}): the rounding is biased")


def count_bytes(*tensors) -> int:
    """Total bytes (numel x element size) of the tensors, recursing into tuples and lists, skipping None."""
    total = 0
    for t in tensors:
        if t is None:
            continue
        if isinstance(t, (tuple, list)):
            total += count_bytes(*t)
        elif isinstance(t, torch.Tensor):
            total += t.numel() * t.element_size()
        else:
            raise TypeError(f"count_bytes: expected tensors, tuples, lists or None, got {type(t).__name__}")
    return total


def clear_unused_sf(sf: torch.Tensor, hidden: int, num_per_channels: int) -> torch.Tensor:
    """The bytes of a per-token scale-factor tensor with its padding zeroed (testing.md 2.5, quant.md 1.5).

    ``sf`` has logical shape ``(rows, W)``: fp32 with ``W = cdiv(hidden, num_per_channels)`` blocks, or
    packed UE8M0 int32 with ``W = cdiv(blocks, 4)`` words whose unused high bytes are padding. Returns a
    fresh contiguous uint8 tensor ``(rows, W * itemsize)`` (``sf`` itself is never modified) in which the
    padding bytes of packed sf are zero, so a kernel's and the reference's sf can be compared bytewise.
    """
    if sf.dim() != 2:
        raise ValueError(f"clear_unused_sf: sf must be 2-D, got shape {tuple(sf.shape)}")
    blocks = -(-hidden // num_per_channels)
    packed = sf.dtype == torch.int32
    words = -(-blocks // 4) if packed else blocks
    if sf.size(1) != words:
        raise ValueError(f"clear_unused_sf: sf must have {words} columns for hidden={hidden}, "
                         f"num_per_channels={num_per_channels} ({sf.dtype}), got shape {tuple(sf.shape)}")
    out = sf.clone(memory_format=torch.contiguous_format).view(torch.uint8)
    if packed:
        out[:, blocks:] = 0
    return out
