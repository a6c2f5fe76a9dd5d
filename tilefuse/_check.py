"""Argument checks shared by every public op.

Every failure names the op, the argument, what was expected and what was given, e.g.
``per_token_cast: x must have hidden % 64 == 0, got shape (8, 100)``. Wrong types and dtypes raise
``TypeError``; wrong shapes, values, alignment and device mixes raise ``ValueError``. The checks only
read tensor metadata: they never synchronize with the device. Tensors on the meta device (shapes without data)
pass them: an op that computes only shapes from its inputs gives meta outputs (shape inference), and an op that
must read values on the host (an output size that depends on the data) refuses them with :func:`has_data`.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import torch


def fail(op: str, message: str, exc: type = ValueError):
    """Raise ``exc`` with the message prefixed by the op name."""
    raise exc(f"{op}: {message}")


def expect(cond: bool, op: str, message: str, exc: type = ValueError) -> None:
    """Raise ``exc(f"{op}: {message}")`` unless ``cond`` holds. For a formatted message write
    ``if not cond: fail(op, f"...")`` instead: the arguments here are built on every call, and checks sit on the
    per-call host path of every op."""
    if not cond:
        raise exc(f"{op}: {message}")


def _dtype_names(dtypes: Iterable[torch.dtype]) -> str:
    names = [str(d).replace("torch.", "") for d in dtypes]
    return names[0] if len(names) == 1 else "one of " + ", ".join(names)


def _matches(size: torch.Size, shape: Sequence[int | None]) -> bool:
    """``size`` has ``shape``'s rank and its sizes where ``shape`` names one (``None``: any size)."""
    if len(size) != len(shape):
        return False
    for want, got in zip(shape, size):
        if want is not None and want != got:
            return False
    return True


def tensor(
    op: str,
    name: str,
    t,
    *,
    dtype: torch.dtype | Sequence[torch.dtype] | None = None,
    ndim: int | Sequence[int] | None = None,
    shape: Sequence[int | None] | None = None,
    contiguous: bool = False,
    inner_contiguous: bool = False,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Check one tensor argument and return it.

    ``shape`` entries that are ``None`` match any size. ``inner_contiguous`` asks for a unit stride in
    the last dimension only (row-strided views are fine). ``device`` asks for the same device as
    another argument (pass ``other.device``).
    """
    if not isinstance(t, torch.Tensor):
        fail(op, f"{name} must be a torch.Tensor, got {type(t).__name__}", TypeError)
    if dtype is not None and (t.dtype != dtype if isinstance(dtype, torch.dtype) else t.dtype not in tuple(dtype)):
        allowed = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
        fail(op, f"{name} must have dtype {_dtype_names(allowed)}, got {str(t.dtype).replace('torch.', '')}",
             TypeError)
    if ndim is not None and (t.dim() != ndim if isinstance(ndim, int) else t.dim() not in tuple(ndim)):
        allowed_nd = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        want = allowed_nd[0] if len(allowed_nd) == 1 else " or ".join(map(str, allowed_nd))
        fail(op, f"{name} must be {want}-D, got shape {tuple(t.shape)}")
    # torch.Size equals a tuple of the same sizes: the common case, a shape without wildcards, costs one compare
    if shape is not None and t.shape != shape and not _matches(t.shape, shape):
        want = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"
        fail(op, f"{name} must have shape {want}, got {tuple(t.shape)}")
    if contiguous and not t.is_contiguous():
        fail(op, f"{name} must be contiguous, got strides {t.stride()}")
    if inner_contiguous and t.dim() > 0 and t.size(-1) > 1 and t.stride(-1) != 1:
        fail(op, f"{name} must have a unit stride in its last dimension, got strides {t.stride()}")
    if device is not None and t.device != device:
        fail(op, f"{name} must be on {device} like the other inputs, got {t.device}")
    return t


def has_data(op: str, name: str, t: torch.Tensor, why: str) -> None:
    """Before the host reads ``t``'s values: a tensor on the meta device has none, a ``ValueError`` naming the op,
    the argument and ``why`` it is read."""
    if t.is_meta:  # (fake tensors of tracing report their fake device, never meta)
        fail(op, f"{name} must be on a CPU or CUDA device: {why}, and a tensor on the meta device has no data")


def optional(op: str, name: str, t, **kwargs) -> torch.Tensor | None:
    """``tensor`` for an argument that may be ``None``."""
    return None if t is None else tensor(op, name, t, **kwargs)


def choice(op: str, name: str, value, allowed: Iterable) -> None:
    """Check that ``value`` is one of ``allowed``."""
    allowed = tuple(allowed)
    if value not in allowed:
        fail(op, f"{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}")


def integer(op: str, name: str, value, *, min: int | None = None, max: int | None = None) -> int:
    """Check a Python int argument (bool is rejected) and its range."""
    if isinstance(value, bool) or not isinstance(value, int):
        fail(op, f"{name} must be an int, got {type(value).__name__}", TypeError)
    if min is not None and value < min:
        fail(op, f"{name} must be >= {min}, got {value}")
    if max is not None and value > max:
        fail(op, f"{name} must be <= {max}, got {value}")
    return value


def same_device(op: str, **tensors) -> torch.device | None:
    """Check that every non-None tensor argument lives on one device; return it."""
    device = None
    first = None
    for name, t in tensors.items():
        if t is None:
            continue
        if device is None:
            device, first = t.device, name
        elif t.device != device:
            fail(op, f"{name} must be on the same device as {first} ({device}), got {t.device}")
    return device


def real(op: str, name: str, value, *, positive: bool = False) -> float:
    """Check a Python real scalar (bool rejected), optionally ``> 0``; return it as float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        fail(op, f"{name} must be a real number, got {type(value).__name__}", TypeError)
    if positive and not value > 0:
        fail(op, f"{name} must be > 0, got {value}")
    return float(value)


def flag(op: str, name: str, value) -> bool:
    """Check a bool argument."""
    if not isinstance(value, bool):
        fail(op, f"{name} must be a bool, got {type(value).__name__}", TypeError)
    return value
