"""Host-side pieces the kernel launchers share (no TileLang here)."""
from __future__ import annotations

import torch

_PLACEHOLDERS: dict = {}


def placeholder(device, dtype: torch.dtype, shape: tuple = (1,)) -> torch.Tensor:
    """A cached zero tensor bound to an absent optional input: never written, and read (if at all) as zeros."""
    key = (device, dtype, shape)
    t = _PLACEHOLDERS.get(key)
    if t is None:
        t = _PLACEHOLDERS[key] = torch.zeros(shape, dtype=dtype, device=device)
    return t


def aligned(t: torch.Tensor, align: int = 16) -> torch.Tensor:
    """``t`` itself when its data starts on an ``align``-byte boundary (the kernels' vector accesses), else a copy
    in a fresh allocation (a contiguous view may start at any storage offset)."""
    return t if t.data_ptr() % align == 0 else t.clone(memory_format=torch.contiguous_format)
