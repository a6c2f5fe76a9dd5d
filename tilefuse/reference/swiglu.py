"""Reference SwiGLU forward/backward (quant.md 3.11-3.13, v1 signatures).

Binary32 math on widened inputs in the spec's exact operation order (float64 when the input is float64,
which the tests use for autograd checks). ``exp`` is ``torch.exp``: on CUDA tensors that is libdevice's
precise ``expf``, which the kernels must match bit for bit (quant.md 3.11).
"""
from __future__ import annotations

import torch

from . import quant as _quant

__all__ = ["swiglu_forward", "swiglu_backward"]


def fma_f32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Fused multiply-add ``a * b + c`` of fp32 tensors with a single rounding to binary32.

    The product of two binary32 values is exact in binary64 (48 <= 53 significant bits). The binary64 sum
    is made round-to-odd (TwoSum gives the exact error; an inexact result with an even last bit moves one
    binary64 ulp towards the exact value), and round-to-odd at 53 >= 24 + 2 bits followed by RNE to binary32
    equals one correct RNE rounding of the exact ``a * b + c``.
    """
    p = a.double() * b.double()
    c64 = c.double()
    hi = p + c64
    # TwoSum (Knuth): lo = (p + c64) - hi exactly, without an FMA.
    bv = hi - p
    lo = (p - (hi - bv)) + (c64 - bv)
    even = (hi.view(torch.int64) & 1) == 0
    toward = torch.where(lo > 0, torch.full_like(hi, float("inf")), torch.full_like(hi, float("-inf")))
    hi = torch.where((lo != 0) & even, torch.nextafter(hi, toward), hi)
    return hi.float()


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def _clamp_value(c: float, dtype: torch.dtype, device) -> torch.Tensor:
    """The clamp constant as a 0-d tensor of the compute precision (binary32 for bf16/fp32 inputs)."""
    return torch.tensor(c, dtype=dtype, device=device)


def _row_weights(n_rows: int, pos_to_token_topk: torch.Tensor | None, topk_weights: torch.Tensor | None,
                 dtype: torch.dtype, device) -> torch.Tensor | None:
    """Per-row weight ``topk_weights.flatten()[p]`` for ``p = pos_to_token_topk[row] >= 0``, else 0.

    None when there is no ``pos_to_token_topk`` (unweighted).
    """
    if pos_to_token_topk is None:
        return None
    p = pos_to_token_topk.long()
    flat = topk_weights.reshape(-1).to(dtype)
    w = flat[p.clamp(0, max(flat.numel() - 1, 0))] if flat.numel() else torch.zeros(n_rows, dtype=dtype,
                                                                                    device=device)
    return torch.where(p >= 0, w, torch.zeros_like(w))


def clamp_counts(x: torch.Tensor, swiglu_clamp_value: float, rows: torch.Tensor | None = None) -> torch.Tensor:
    """``[#(l > c), #(r > c), #(r < -c)]`` (int64) over ``rows`` (a bool mask, default all), pre-clamp values."""
    h = x.size(-1) // 2
    cd = _compute_dtype(x)
    xf = x.to(cd)
    c = _clamp_value(swiglu_clamp_value, cd, x.device)
    left, right = xf[:, :h], xf[:, h:]
    keep = torch.ones_like(left, dtype=torch.bool) if rows is None else rows[:, None]
    return torch.stack([((left > c) & keep).sum(), ((right > c) & keep).sum(),
                        ((right < -c) & keep).sum()]).to(torch.int64)


def _clamp(left: torch.Tensor, right: torch.Tensor, c: torch.Tensor | None):
    """Section 3.11 clamp: ``l <- min(l, c)``, ``r <- min(max(r, -c), c)``."""
    if c is None:
        return left, right
    return torch.minimum(left, c), torch.minimum(torch.maximum(right, -c), c)


def swiglu_forward(x: torch.Tensor, pos_to_token_topk: torch.Tensor | None = None,
                   topk_weights: torch.Tensor | None = None, swiglu_clamp_value: float | None = None,
                   clamped_count: torch.Tensor | None = None) -> torch.Tensor:
    """SwiGLU of ``x = [l | r]`` ``(T_e, 2H)`` -> binary32 ``(T_e, H)`` (quant.md 3.11, 3.12).

    ``t = 1 + exp(-l)``, ``act = (l / t) * r`` after the optional clamp, times the row weight
    ``topk_weights.flatten()[pos_to_token_topk[row]]`` (0 for negative positions) when positions are given.
    ``clamped_count`` (int64 ``(3,)``) gets the pre-clamp counts of all rows added in place.
    """
    cd = _compute_dtype(x)
    h = x.size(-1) // 2
    xf = x.to(cd)
    left, right = xf[:, :h], xf[:, h:]
    c = None if swiglu_clamp_value is None else _clamp_value(swiglu_clamp_value, cd, x.device)
    if clamped_count is not None:
        clamped_count += clamp_counts(x, swiglu_clamp_value)
    left, right = _clamp(left, right, c)
    t = torch.exp(-left) + 1
    act = (left / t) * right
    w = _row_weights(x.size(0), pos_to_token_topk, topk_weights, cd, x.device)
    return act if w is None else act * w.unsqueeze(1)


def swiglu_backward(x, grad_out: torch.Tensor, weight: torch.Tensor, pos_to_token_topk: torch.Tensor,
                    token_topk_to_pos: torch.Tensor, num_per_channels: int,
                    swiglu_clamp_value: float | None = None):
    """SwiGLU backward (quant.md 3.13): binary32 ``(out, x_grad, weight_grad)``.

    ``x`` is a per-token quantized pair ``(e4m3 data (T_e, 2H), fp32 sf (T_e, 2H/npc))``, dequantized
    per group of ``num_per_channels`` channels, or a plain bf16/fp32 ``(T_e, 2H)`` tensor. Per row, with
    ``w`` the row's routing weight (0 for ``pos_to_token_topk < 0``) and ``g`` the widened ``grad_out``:
    ``s = 1 / t``, ``gws = (g * w) * s``, ``dx = (gws * y) * fma(x, 1 - s, 1)`` (zero where ``x > c``),
    ``dy = gws * x`` (zero where ``|y| > c``), ``out = act * w`` and
    ``weight_grad[t, k] = sum_j g_j * act_j`` at the ``(t, k)`` the row's position points to, 0 where
    ``token_topk_to_pos == -1`` (0 as well where neither rule reaches).
    """
    if isinstance(x, (tuple, list)):
        data, sf = x
        xf = _quant.cast_back((data.reshape(-1, data.size(-1)), sf), "fp32", (1, num_per_channels))
    else:
        xf = x.reshape(-1, x.size(-1)).float()
    h = xf.size(-1) // 2
    xv, yv = xf[:, :h], xf[:, h:]
    g = grad_out.reshape(-1, h).float()
    c = None if swiglu_clamp_value is None else _clamp_value(swiglu_clamp_value, torch.float32, xf.device)
    if c is not None:
        cx, cy = xv > c, (yv > c) | (yv < -c)
    xv, yv = _clamp(xv, yv, c)
    t = torch.exp(-xv) + 1
    s = torch.reciprocal(t)  # IEEE 1 / t
    act = (xv / t) * yv
    w = _row_weights(xf.size(0), pos_to_token_topk, weight, torch.float32, xf.device).unsqueeze(1)
    gws = (g * w) * s
    dx = (gws * yv) * fma_f32(xv, 1 - s, torch.ones_like(s))
    dy = gws * xv
    if c is not None:
        dx = torch.where(cx, torch.zeros_like(dx), dx)
        dy = torch.where(cy, torch.zeros_like(dy), dy)
    out = act * w
    x_grad = torch.cat([dx, dy], dim=1)
    row_sum = (g * act).sum(-1)
    # Scatter row sums to their (t, k); rows with a negative position go to a dummy last slot (no host sync).
    n = weight.numel()
    p = pos_to_token_topk.long()
    weight_grad = torch.zeros(n + 1, dtype=torch.float32, device=xf.device)
    weight_grad.index_put_((torch.where(p >= 0, p, n),), row_sum)
    weight_grad = weight_grad[:n].view(weight.shape)
    weight_grad = torch.where(token_topk_to_pos == -1, torch.zeros_like(weight_grad), weight_grad)
    return out, x_grad, weight_grad
