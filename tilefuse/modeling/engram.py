"""Autograd Engram gate: EngramGateFn and engram_gate (engram.md §2.7.1, v1)."""
from __future__ import annotations

import torch

from tilefuse._autograd import records
from tilefuse.engram import engram_gate_bwd, engram_gate_fwd, fused_weight, grad_w_reduce

__all__ = ["EngramGateFn", "engram_gate"]


def _accumulator(weight: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """The fp32 target of a weight's gradient: its ``main_grad`` if set, else fresh zeros.

    Returns ``(target, used_main_grad)``.
    """
    main_grad = getattr(weight, "main_grad", None)
    if main_grad is not None:
        return main_grad, True
    return torch.zeros(weight.shape, dtype=torch.float32, device=weight.device), False


def _flat(hidden_states: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple:
    """``x``, ``k`` as ``[T, M, H]`` and ``v`` as ``[T, H]``: the leading dims flattened by views (no copies)."""
    m, h = hidden_states.shape[-2:]
    return hidden_states.view(-1, m, h), k.view(-1, m, h), v.view(-1, h)


class EngramGateFn(torch.autograd.Function):
    """``out = x + σ(u)·v`` over ``[*, M, H]`` with the fused forward/backward ops (§2.7.1).

    Weight gradients are accumulated into ``main_grad`` when a weight carries one (then ``None`` is
    returned for it and ``.grad`` stays untouched); otherwise they are returned as fp32 tensors.
    """

    @staticmethod
    def forward(ctx, hidden_states, k, v, weight_hidden, weight_embed, clamp_value, eps):
        shape = hidden_states.shape
        x2, k2, v2 = _flat(hidden_states, k, v)
        weight = fused_weight(weight_hidden, weight_embed)
        out, dot, gate_score, rstd_x, rstd_k = engram_gate_fwd(x2, k2, v2, weight, eps, clamp_value, True)
        ctx.save_for_backward(x2, k2, v2, weight_hidden, weight_embed, weight, dot, gate_score, rstd_x, rstd_k)
        ctx.clamp_value = clamp_value
        ctx.shape = shape
        return out.view(shape)

    @staticmethod
    def backward(ctx, grad_output):
        x2, k2, v2, weight_hidden, weight_embed, weight, dot, gate_score, rstd_x, rstd_k = ctx.saved_tensors
        shape = ctx.shape
        m, h = shape[-2], shape[-1]
        # The engine may hand over a non-dense gradient (e.g. expanded from a sum); the op needs it dense.
        grad = grad_output.reshape(-1, m, h).contiguous()
        grad_x, grad_k, grad_v, partial = engram_gate_bwd(grad, x2, k2, v2, weight, dot, gate_score, rstd_x,
                                                          rstd_k, ctx.clamp_value)
        acc_hidden, main_hidden = _accumulator(weight_hidden)
        acc_embed, main_embed = _accumulator(weight_embed)
        grad_w_reduce(partial, weight_hidden, weight_embed, acc_hidden, acc_embed)
        return (grad_x.view(shape), grad_k.view(shape), grad_v.view(*shape[:-2], h),
                None if main_hidden else acc_hidden, None if main_embed else acc_embed, None, None)


def engram_gate(hidden_states: torch.Tensor, k: torch.Tensor, v: torch.Tensor, weight_hidden: torch.Tensor,
                weight_embed: torch.Tensor, clamp_value: float, eps: float) -> torch.Tensor:
    """Differentiable Engram gate (§2.7.1): ``EngramGateFn.apply`` with all seven arguments positional.

    ``hidden_states``, ``k``: ``[*, M, H]`` bf16; ``v``: ``[*, H]`` bf16; weights ``[M, H]`` bf16. Leading
    dims are flattened with views (no copies). Where autograd records nothing (grad mode off, or no argument that
    requires grad) the forward alone runs, without saving the statistics: the same output bits.
    """
    if records(hidden_states, k, v, weight_hidden, weight_embed):
        return EngramGateFn.apply(hidden_states, k, v, weight_hidden, weight_embed, clamp_value, eps)
    x2, k2, v2 = _flat(hidden_states, k, v)
    out = engram_gate_fwd(x2, k2, v2, fused_weight(weight_hidden, weight_embed), eps, clamp_value, False)[0]
    return out.view(hidden_states.shape)
