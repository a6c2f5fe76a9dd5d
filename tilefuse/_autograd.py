"""The public ops' autograd entry: ``Function.apply`` only where autograd records the call.

``torch.autograd.Function.apply`` costs microseconds of host time a call even under ``torch.no_grad()`` and
``torch.inference_mode()``: more than the rest of an op's Python path, which is what an inference call of one token
waits on. Where autograd records nothing -- grad mode off, or no tensor argument requires grad -- the
Function's ``forward`` runs alone, with a context that keeps nothing: the same kernels and the same outputs.
"""
from __future__ import annotations

import torch


class _NoContext:
    """The ``ctx`` of a forward that autograd does not record: it keeps nothing."""

    def save_for_backward(self, *tensors) -> None:
        pass

    def mark_dirty(self, *tensors) -> None:
        pass

    def mark_non_differentiable(self, *tensors) -> None:
        pass


def records(*args) -> bool:
    """Whether autograd records a call on ``args``: grad mode is on and a tensor argument requires grad."""
    return torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)


def apply(function: type[torch.autograd.Function], *args):
    """``function.apply(*args)`` where autograd records the call (:func:`records`), else ``function.forward`` with
    a context that keeps nothing."""
    if records(*args):
        return function.apply(*args)
    return function.forward(_NoContext(), *args)
