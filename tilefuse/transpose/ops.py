"""Public transpose and batched_transpose (quant.md 3.15).

Both are bitwise copies: ``out[b, j, i] = x[b, i, j]``, returned as a new contiguous tensor. Any dtype is
accepted. The shape and stride rules are those of the upstream kernel, checked on every device so that code
written against the CPU path also runs on the GPU.

CUDA tensors of 1-, 2- or 4-byte elements take the TileLang kernel (``_kernel.py``): an eager call launches
it directly; under ``torch.compile`` the call goes through the custom op ``tilefuse::batched_transpose``.
Other element sizes (fp64, int64, complex) and CPU tensors take torch's copy, the reference.
"""
from __future__ import annotations

import torch

from tilefuse import _check
from tilefuse._registry import public
from tilefuse.transpose import _kernel

__all__ = ["transpose", "batched_transpose"]


def _check_matrix(op: str, x: torch.Tensor) -> None:
    """The section 3.15 requirements on the last two dims: M % 64, N % 64, unit inner stride, row stride % 4."""
    m, n = x.shape[-2:]
    if not (m % 64 == 0 and n % 64 == 0):
        _check.fail(op, f"x must have both matrix dims divisible by 64, got shape {tuple(x.shape)}")
    if x.numel() == 0:
        return
    if x.stride(-1) != 1:
        _check.fail(op, f"x must have a unit stride in its last dimension, got strides {x.stride()}")
    if x.stride(-2) % 4 != 0:
        _check.fail(op, f"x must have a row stride divisible by 4 elements, got strides {x.stride()}")


def _on_kernel(x: torch.Tensor) -> bool:
    return x.is_cuda and x.element_size() in _kernel.ELEM_SIZES


@public("transpose", path="kernel")
def batched_transpose(x: torch.Tensor) -> torch.Tensor:
    """``(B, M, N) -> (B, N, M)`` contiguous copy with ``out[b, j, i] = x[b, i, j]`` (quant.md 3.15)."""
    op = "batched_transpose"
    _check.tensor(op, "x", x, ndim=3)
    _check_matrix(op, x)
    if _on_kernel(x):
        return _kernel.batched_transpose_cuda(x)
    return x.transpose(1, 2).contiguous()


@public("transpose", path="kernel")
def transpose(x: torch.Tensor) -> torch.Tensor:
    """``(M, N) -> (N, M)`` contiguous copy; row-strided views are accepted (quant.md 3.15)."""
    op = "transpose"
    _check.tensor(op, "x", x, ndim=2)
    _check_matrix(op, x)
    if _on_kernel(x):
        return _kernel.transpose_cuda(x)
    return x.t().contiguous()
