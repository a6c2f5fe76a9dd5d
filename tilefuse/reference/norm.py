"""Reference RMSNorm forward/backward (quant.md 5.11).

Math is binary32 (float64 when the inputs are float64, which the tests use for autograd checks) in the
spec's operation grouping; reductions use torch's order, so kernels are compared with a tolerance.
"""
from __future__ import annotations

import torch

__all__ = ["norm_forward_ref", "norm_backward_ref"]


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """binary32 for bf16/fp32 inputs, float64 for float64 inputs."""
    return torch.promote_types(x.dtype, torch.float32)


def norm_forward_ref(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                     residual: torch.Tensor | None = None, out_scale: float = 1.0):
    """RMSNorm of the last dim: ``(out, rstd, residual_out)`` (quant.md 5.11).

    ``h = x`` or ``round_{x.dtype}(x + residual)``; ``rstd = rsqrt(sum(h^2) / H + eps)``;
    ``out = round_{x.dtype}((h * rstd) * (w * out_scale))`` (``(h * rstd) * out_scale`` without weight).
    ``residual_out`` is ``h`` when a residual is given, else None. ``rstd`` has shape ``x.shape[:-1]``.
    """
    cd = _compute_dtype(x)
    h = x if residual is None else (x.to(cd) + residual.to(cd)).to(x.dtype)
    hf = h.to(cd)
    eps_t = torch.tensor(eps, dtype=cd, device=x.device)
    scale = torch.tensor(out_scale, dtype=cd, device=x.device)
    s = hf.square().sum(-1)
    rstd = torch.rsqrt(s / x.size(-1) + eps_t)
    factor = scale if weight is None else weight.to(cd) * scale
    out = ((hf * rstd.unsqueeze(-1)) * factor).to(x.dtype)
    return out, rstd, (None if residual is None else h)


def norm_backward_ref(out_grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, rstd: torch.Tensor,
                      residual_out_grad: torch.Tensor | None = None, out_scale: float = 1.0):
    """RMSNorm backward: ``(x_grad, weight_grad)`` (quant.md 5.11).

    Per row: ``xh = x * rstd``, ``g = dy * out_scale``, ``gw = g * w``, ``A = sum(xh * gw)``,
    ``dx = (gw - xh * (A / H)) * rstd [+ residual_out_grad]`` in ``x.dtype``. ``weight_grad = sum_rows(xh * g)``
    in the compute precision (binary32), or None without a weight.
    """
    cd = _compute_dtype(x)
    scale = torch.tensor(out_scale, dtype=cd, device=x.device)
    r = rstd.to(cd).unsqueeze(-1)
    xh = x.to(cd) * r
    g = out_grad.to(cd) * scale
    gw = g if weight is None else g * weight.to(cd)
    a = (xh * gw).sum(-1, keepdim=True)
    dx = (gw - xh * (a / x.size(-1))) * r
    if residual_out_grad is not None:
        dx = dx + residual_out_grad.to(cd)
    weight_grad = None if weight is None else (xh * g).reshape(-1, x.size(-1)).sum(0)
    return dx.to(x.dtype), weight_grad
