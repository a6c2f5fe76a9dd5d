"""Models of the MoE kernels for the tests: the kernels' arithmetic in their own order, with element-wise torch
ops, so a GPU test can compare a kernel bit for bit where the reference rounds in another (valid) order."""
import torch

from tilefuse import formats
from tilefuse.reference import moe as ref


def backward_model(scores, topk_idx, topk_weights, grad_topk_weights, routed_scaling_factor, mask=None,
                   grad_scores_sum=None):
    """The backward kernel's arithmetic in its own order, with torch element-wise ops only (no torch
    reductions): bit-identical to the kernel wherever ``torch.expm1`` (fp32) is the kernel's ``expm1f``
    (same device). The order (tilefuse/moe/_moe_gate_kernel.py's docstring): the K-slot sums and the aux term's expert sums are XOR
    butterflies over 32 lanes; a lane's aux partial adds its experts ``c * 128 + 4 lane + j`` (c, then j)
    from +0; duplicated slots accumulate in slot order from +0."""
    f64 = torch.float64
    rows, experts = scores.shape
    num_topk = topk_idx.size(1)
    u = scores.to(f64)
    valid = topk_idx >= 0
    idx = topk_idx.clamp(0, experts - 1)
    zero = torch.zeros((), dtype=f64, device=u.device)
    u_k = torch.where(valid, u.gather(1, idx), zero)
    g = torch.where(valid, grad_topk_weights.to(f64), zero)
    dot = ref.butterfly_sum32(g * topk_weights.to(f64))[:, None]
    usum = ref.butterfly_sum32(u_k)[:, None]
    per_slot = torch.where(valid, (routed_scaling_factor * g - dot) / (usum + ref.EPS), zero)
    grad = torch.zeros_like(u)
    for k in range(num_topk):                              # one slot at a time: no duplicate inside a scatter
        col = idx[:, k:k + 1]
        grad = grad.scatter(1, col, grad.gather(1, col) + per_slot[:, k:k + 1])   # -1 slots add +0
    if grad_scores_sum is not None:
        seq = torch.arange(rows, device=u.device) // max(rows // grad_scores_sum.size(0), 1)
        h = grad_scores_sum.to(f64)[seq]
        chunks = formats.cdiv(experts, 128)
        pad = chunks * 128 - experts
        lanes_u = torch.nn.functional.pad(u, (0, pad)).view(rows, chunks, 32, 4)
        lanes_h = torch.nn.functional.pad(h, (0, pad)).view(rows, chunks, 32, 4)
        su = torch.zeros(rows, 32, dtype=f64, device=u.device)
        ah = torch.zeros(rows, 32, dtype=f64, device=u.device)
        for c in range(chunks):
            for j in range(4):
                su = su + lanes_u[:, c, :, j]
                ah = ah + lanes_h[:, c, :, j] * lanes_u[:, c, :, j]
        su, ah = ref.butterfly_sum32(su)[:, None], ref.butterfly_sum32(ah)[:, None]
        inv = torch.where(mask.reshape(-1, 1), 1.0 / su, zero)
        grad = grad + (h - ah * inv) * inv
    return (sqrt_softplus_grad32(scores).to(f64) * grad).to(torch.float32)


def sqrt_softplus_grad32(u: torch.Tensor) -> torch.Tensor:
    """The backward kernel's derivative of fp32 scores ``u``, in fp32 (``tfg_ssp_grad32``):
    ``-expm1(-u*u) / (2u)``, ``u / 2`` below 2^-60, 0 at u <= 0 and for NaN. Each operation is IEEE fp32
    round-to-nearest, so it is the kernel's bit for bit wherever ``torch.expm1`` (fp32) is CUDA's ``expm1f``."""
    positive = u > 0
    safe = torch.where(positive, u, torch.ones_like(u))
    main = -torch.expm1(-(safe * safe)) / (2 * safe)
    small = torch.where(safe < 2.0 ** -60, safe * 0.5, main)
    return torch.where(positive, small, torch.zeros_like(u))
