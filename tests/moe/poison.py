"""Kernel outputs that start poisoned (DESIGN.md, test tiers), so an element a kernel fails to write shows.

``poison_outputs(monkeypatch, module)`` replaces the ``torch`` that a kernel module's launchers see by a stand-in
whose ``empty`` / ``empty_like`` / ``empty_strided`` fill every tensor they return, whatever its size: the very
buffers the kernels then write (outputs and scratch buffers alike), not freed memory, which PyTorch's caching
allocator does not hand back to requests of 1 MiB or less. Everything else is torch itself. Floating-point
tensors get 0xFF bytes (NaN), integer ones 0x5A bytes (a large positive value: never an index, a count or the -1
the kernels write for an empty slot). Outputs of the native launch plans (``tilefuse._native``: topk_gate, the
gate forward's eager path without optional inputs) are allocated in C++ and are not poisoned by this.
"""
import torch

from tilefuse.moe import (_count_kernel, _mapping_kernel, _moe_gate_kernel, _shuffle_kernel,
                          _top2_sum_gate_kernel, _topk_kernel)

LAUNCHER_MODULES = (_count_kernel, _mapping_kernel, _moe_gate_kernel, _shuffle_kernel, _top2_sum_gate_kernel,
                    _topk_kernel)
FLOAT_BYTE, INT_BYTE = 0xFF, 0x5A


def poison_bytes(dtype: torch.dtype) -> int:
    return FLOAT_BYTE if dtype.is_floating_point else INT_BYTE


def fill_poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill every element of ``t`` (any size, any strides) with its dtype's poison bytes; returns ``t``."""
    if t.numel() == 0:
        return t
    if t.is_contiguous():
        t.reshape(-1).view(torch.uint8).fill_(poison_bytes(t.dtype))
    else:
        t.copy_(fill_poison_(torch.empty(t.shape, dtype=t.dtype, device=t.device)))
    return t


def is_poison(t: torch.Tensor) -> torch.Tensor:
    """Element-wise: ``t`` holds its dtype's poison bytes."""
    raw = t.contiguous().reshape(-1).view(torch.uint8).reshape(*t.shape, t.element_size())
    return (raw == poison_bytes(t.dtype)).all(-1)


class _PoisonedTorch:
    """torch, but for the three uninitialised allocations."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*args, **kwargs):
        return fill_poison_(torch.empty(*args, **kwargs))

    @staticmethod
    def empty_like(*args, **kwargs):
        return fill_poison_(torch.empty_like(*args, **kwargs))

    @staticmethod
    def empty_strided(*args, **kwargs):
        return fill_poison_(torch.empty_strided(*args, **kwargs))


def poison_outputs(monkeypatch, *modules) -> None:
    """Until the test ends, the launchers of ``modules`` (default: every MoE kernel module) allocate poisoned."""
    for module in modules or LAUNCHER_MODULES:
        monkeypatch.setattr(module, "torch", _PoisonedTorch())
