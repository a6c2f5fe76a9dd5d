"""Reference Engram hash, gate and Sinkhorn helpers (engram.md).

The public names are the oracles of engram.md §2.8 / §2.9. The private ``_*`` functions compute the
semantics of the public ops in ``tilefuse.engram`` where they differ from those oracles (fused weight,
kernel sign convention, backward formulas, partial layouts, fma accumulation); they are the CPU path of
those ops. Everything is plain PyTorch and never imports TileLang.

Floating-point work runs in fp32 as the spec says. The gate helpers upcast to fp32 *at least*: float64
inputs stay float64, which lets tests ``gradcheck`` the formulas; bf16 inputs get exactly the spec's fp32
arithmetic.
"""
from __future__ import annotations

import torch

__all__ = [
    "engram_gate_ref",
    "engram_hash_ref",
    "engram_sinkhorn_finalize_ref",
    "engram_sinkhorn_momentum_update_ref",
    "engram_sinkhorn_step_ref",
    "make_offsets",
]


# ----------------------------------------------------------------------------------------------------
# Shared helpers
# ----------------------------------------------------------------------------------------------------

def _low32(x: torch.Tensor) -> torch.Tensor:
    """Keep the low 32 bits of an int64 tensor as a two's-complement int32 (wrapping cast)."""
    return (torch.remainder(x + 2**31, 2**32) - 2**31).to(torch.int32)


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    """Accumulation dtype of the gate helpers: float64 for float64 inputs, else fp32 (the spec's)."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _fma_f32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Correctly rounded fp32 ``fma(a, b, c)`` = RN(a*b + c) with one rounding (fp32 inputs).

    ``a*b`` is exact in float64 (48 bits). ``p + c`` is formed in float64 with its exact rounding error
    (TwoSum); the float64 sum is then made round-to-odd (move one ulp towards the error when it is nonzero
    and the last mantissa bit is even), which makes the final rounding to fp32 correct (53 >= 24 + 2).
    """
    p = a.double() * b.double()
    c = c.double()
    s = p + c
    bp = s - c
    err = (p - bp) + (c - (s - bp))  # TwoSum: s + err == p + c exactly
    even = (s.view(torch.int64) & 1) == 0
    toward = torch.where(err > 0, torch.full_like(s, float("inf")), torch.full_like(s, float("-inf")))
    s = torch.where((err != 0) & even, torch.nextafter(s, toward), s)
    return s.float()


def _chunk_sum(terms: torch.Tensor, num_chunks: int) -> torch.Tensor:
    """Per-chunk sequential sums over dim 0 (engram.md §2.5.4, §2.9.2).

    Rows are cut into ``num_chunks`` consecutive chunks of ``ceil(R / num_chunks)`` rows; chunk ``p``
    is accumulated from 0 in ascending row order. Empty chunks give zeros. Returns
    ``(num_chunks, *terms.shape[1:])``.
    """
    rows = terms.shape[0]
    q = -(-rows // num_chunks) if rows else 0
    out = torch.zeros((num_chunks, *terms.shape[1:]), dtype=terms.dtype, device=terms.device)
    if rows == 0:
        return out
    padded = torch.zeros((num_chunks * q, *terms.shape[1:]), dtype=terms.dtype, device=terms.device)
    padded[:rows] = terms
    padded = padded.view(num_chunks, q, *terms.shape[1:])
    for i in range(q):  # adding the zero padding rows leaves a sum unchanged
        out = out + padded[:, i]
    return out


def _sequential_sum(x: torch.Tensor) -> torch.Tensor:
    """``Σ_p x[p]`` over dim 0, sequentially in ascending ``p`` from 0 (engram.md §2.6, §2.9.3)."""
    acc = torch.zeros(x.shape[1:], dtype=x.dtype, device=x.device)
    for p in range(x.shape[0]):
        acc = acc + x[p]
    return acc


# ----------------------------------------------------------------------------------------------------
# Hash (§2.1, §2.2)
# ----------------------------------------------------------------------------------------------------

def make_offsets(vocab_sizes: torch.Tensor) -> torch.Tensor:
    """Exclusive prefix sums of each layer's table sizes, row-major over (order, head) (§2.1).

    ``(L, N-1, K)`` int32 -> ``(L, C)`` int32, int32 wrapping arithmetic; every layer starts at 0.
    """
    sizes = vocab_sizes.reshape(vocab_sizes.shape[0], -1).long()
    inclusive = torch.cumsum(sizes, dim=1)
    return _low32(inclusive - sizes)


def engram_hash_ref(ngram_token_ids: torch.Tensor, multipliers: torch.Tensor, vocab_sizes: torch.Tensor,
                    offsets: torch.Tensor) -> torch.Tensor:
    """N-gram hash indices ``(L, T, C)`` int32 (§2.2.2).

    ``h_0 = a_0·μ_0``, ``h_j = h_{j-1} XOR a_j·μ_j`` with wrapping int64 products; column
    ``(j-1)·K + e`` of layer ``l`` is ``low32(floormod(h_j, V) + offsets)``.
    """
    num_tokens, n = ngram_token_ids.shape
    num_layers, _, k = vocab_sizes.shape
    ids = ngram_token_ids.long()
    mult = multipliers.long()
    sizes = vocab_sizes.long()
    out = torch.empty((num_layers, num_tokens, (n - 1) * k), dtype=torch.int32, device=ngram_token_ids.device)
    h = ids[None, :, 0] * mult[:, 0, None]  # (L, T)
    for j in range(1, n):
        h = h ^ (ids[None, :, j] * mult[:, j, None])
        local = torch.remainder(h[:, :, None], sizes[:, None, j - 1, :])  # (L, T, K), in [0, V)
        cols = slice((j - 1) * k, j * k)
        out[:, :, cols] = _low32(local + offsets[:, None, cols].long())
    return out


# ----------------------------------------------------------------------------------------------------
# Gate (§2.3 - §2.8)
# ----------------------------------------------------------------------------------------------------

def engram_gate_ref(hidden_states: torch.Tensor, k: torch.Tensor, v: torch.Tensor, weight_hidden: torch.Tensor,
                    weight_embed: torch.Tensor, clamp_value: float, eps: float, save_for_backward: bool = False):
    """Autograd-capable gate oracle (§2.8, v1): ``out = x + σ(u)·v`` over ``[T, M, H]``.

    ``rx = rsqrt(mean(x²) + eps)``, ``rk`` likewise, ``D = Σ_d (x·w_h)(k·w_e)``,
    ``s = D·rx·rk·H^(-1/2)``, ``u = √clamp_min(|s|, clamp)·sign(s)`` (so ``s = 0`` gives ``g = 0.5``).
    Returns ``out`` (dtype of ``hidden_states``) or ``(out, D, g, rx, rk)``.
    """
    acc = _acc_dtype(hidden_states)
    x = hidden_states.to(acc)
    kk = k.to(acc)
    h = x.shape[-1]
    rx = torch.rsqrt(x.square().mean(-1) + eps)
    rk = torch.rsqrt(kk.square().mean(-1) + eps)
    dot = ((x * weight_hidden.to(acc)) * (kk * weight_embed.to(acc))).sum(-1)
    s = dot * rx * rk * h ** -0.5
    u = torch.sqrt(torch.clamp_min(s.abs(), clamp_value)) * torch.sign(s)
    g = torch.sigmoid(u)
    out = (x + g.unsqueeze(-1) * v.to(acc).unsqueeze(-2)).to(hidden_states.dtype)
    if save_for_backward:
        return out, dot, g, rx, rk
    return out


def _gate_fwd(x: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, eps: float,
              clamp_value: float):
    """Gate forward with the fused weight and the kernel's conventions (§2.4.2).

    Returns ``(out, D, g, rx, rk)``: ``D = Σ x·w·k`` raw, ``rx = 1/√(Σx²/H + eps)``,
    ``s = ((D·rx)·rk)·c_H``, ``u = copysign(√max(|s|, clamp), s)`` (sign bit of ``s``), ``g = σ(u)``,
    ``out = x + g·v`` rounded to the dtype of ``x``.
    """
    acc = _acc_dtype(x)
    xf, kf, vf, wf = x.to(acc), k.to(acc), v.to(acc), w.to(acc)
    h = x.shape[-1]
    sxx = xf.square().sum(-1)
    skk = kf.square().sum(-1)
    dot = (xf * wf * kf).sum(-1)
    rx = torch.rsqrt(sxx / h + eps)
    rk = torch.rsqrt(skk / h + eps)
    s = dot * rx * rk * h ** -0.5  # the Python double H^-1/2 is rounded once to the tensor dtype
    u = torch.copysign(torch.sqrt(torch.clamp_min(s.abs(), clamp_value)), s)
    g = torch.sigmoid(u)
    out = (xf + g.unsqueeze(-1) * vf.unsqueeze(-2)).to(x.dtype)
    return out, dot, g, rx, rk


def _gate_bwd(grad_out: torch.Tensor, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor,
              dot: torch.Tensor, gate_score: torch.Tensor, rstd_x: torch.Tensor, rstd_k: torch.Tensor,
              clamp_value: float, num_partials: int):
    """Gate backward from the saved statistics (§2.5.2, §2.5.4).

    Returns ``(grad_x, grad_k, grad_v, grad_w_partial)``; ``grad_w_partial`` is
    ``(num_partials, M, H)`` with ``Σ_t β·x·k`` over consecutive token chunks.
    """
    acc = _acc_dtype(x)
    h = x.shape[-1]
    c_h = h ** -0.5  # a Python double, rounded once to the tensor dtype when multiplied
    gf, xf, kf, vf, wf = (t.to(acc) for t in (grad_out, x, k, v, w))
    d, g, rx, rk = (t.to(acc) for t in (dot, gate_score, rstd_x, rstd_k))
    dg = (gf * vf.unsqueeze(-2)).sum(-1)
    a = c_h * rx * rk
    below = ((d.abs() * c_h) * rx) * rk < clamp_value
    beta = dg * g * (1 - g) * 0.5 * torch.sqrt(a / d.abs())
    beta = torch.where(below, torch.zeros_like(beta), beta)
    qx = (d * rx * rx / h).unsqueeze(-1)
    qk = (d * rk * rk / h).unsqueeze(-1)
    b = beta.unsqueeze(-1)
    grad_x = gf + b * (kf * wf - xf * qx)
    grad_k = b * (xf * wf - kf * qk)
    grad_v = torch.zeros_like(vf)
    for i in range(x.shape[1]):  # branches in ascending order
        grad_v = grad_v + gf[:, i] * g[:, i, None]
    grad_w_partial = _chunk_sum((b * xf) * kf, num_partials)
    return grad_x.to(x.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype), grad_w_partial


def _grad_w_reduce(grad_w_partial: torch.Tensor, weight_hidden: torch.Tensor, weight_embed: torch.Tensor,
                   grad_weight_hidden: torch.Tensor, grad_weight_embed: torch.Tensor) -> None:
    """``S = Σ_p partial[p]`` (ascending, fp32); accumulators ``← fma(S, w_other, acc)`` in place (§2.6)."""
    s = _sequential_sum(grad_w_partial)
    grad_weight_hidden.copy_(_fma_f32(s, weight_embed.float(), grad_weight_hidden))
    grad_weight_embed.copy_(_fma_f32(s, weight_hidden.float(), grad_weight_embed))


# ----------------------------------------------------------------------------------------------------
# Sinkhorn helpers (§2.9, v2.1)
# ----------------------------------------------------------------------------------------------------

def engram_sinkhorn_momentum_update_ref(grad: torch.Tensor, momentum_buffer: torch.Tensor, beta1: float,
                                        nesterov: bool = True) -> torch.Tensor:
    """``m' = (1-β)·g + β·m`` copied into ``momentum_buffer``; returns ``β·m' + (1-β)·g`` (nesterov) or
    ``m'`` as a new fp32 tensor shaped like the buffer (§2.9.1)."""
    g = grad.float().reshape(momentum_buffer.shape)
    m_new = (1 - beta1) * g + beta1 * momentum_buffer.float()
    momentum_buffer.copy_(m_new)
    if nesterov:
        return beta1 * m_new + (1 - beta1) * g
    return m_new


def _sinkhorn_momentum_update(grad: torch.Tensor, momentum_buffer: torch.Tensor, beta1: float,
                              nesterov: bool) -> torch.Tensor:
    """Kernel formulation of §2.9.1: ``m' = fma(m, β, RN(β'·g))``, output ``fma(g, β', RN(β·m'))``."""
    beta = torch.tensor(beta1, dtype=torch.float32)
    beta_c = torch.tensor(1 - beta1, dtype=torch.float32)  # 1 - beta1 in double, rounded once
    g = grad.float().reshape(momentum_buffer.shape)
    m_new = _fma_f32(momentum_buffer.float(), beta, beta_c * g)
    momentum_buffer.copy_(m_new)
    if nesterov:
        return _fma_f32(g, beta_c, beta * m_new)
    return m_new


def _row_norms(matrix: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor):
    """``y = (r·B)·c`` and its row norms ``n = √Σ_j y²`` (§2.9.2)."""
    y = (row_scale.unsqueeze(1) * matrix) * col_scale.unsqueeze(0)
    return y, torch.sqrt(y.square().sum(1))


def engram_sinkhorn_step_ref(matrix: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor,
                             col_sumsq: torch.Tensor, eps: float) -> torch.Tensor:
    """One row normalisation (§2.9.3): ``r ← r/(n+eps)`` in place, ``col_sumsq[j] = Σ_i (r_i·B_ij·c_j)²``
    with the new ``r`` (overwritten); returns the row norms ``n``."""
    _, norm = _row_norms(matrix, row_scale, col_scale)
    row_scale.copy_(row_scale / (norm + eps))
    z, _ = _row_norms(matrix, row_scale, col_scale)
    col_sumsq.copy_(z.square().sum(0))
    return norm


def _sinkhorn_step(matrix: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor, eps: float,
                   num_partials: int):
    """Kernel formulation of §2.9.2: ``ρ = 1/(n+eps)``, ``r ← r·ρ`` in place, ``z = y·ρ``; returns
    ``(row_norm, col_sumsq_partial)`` with ``Σ z²`` over ``num_partials`` consecutive row chunks."""
    y, norm = _row_norms(matrix, row_scale, col_scale)
    rho = 1 / (norm + eps)
    row_scale.mul_(rho)
    z = y * rho.unsqueeze(1)
    return norm, _chunk_sum(z.square(), num_partials)


def engram_sinkhorn_finalize_ref(matrix: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor,
                                 eps: float, alpha: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """``alpha·(r/(n+eps))[:, None]·B·c`` (§2.9.4); written into ``out`` when given."""
    _, norm = _row_norms(matrix, row_scale, col_scale)
    result = alpha * (row_scale / (norm + eps)).unsqueeze(1) * matrix * col_scale.unsqueeze(0)
    if out is None:
        return result
    return out.copy_(result)


def _sinkhorn_finalize(matrix: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor, eps: float,
                       alpha: float, out: torch.Tensor | None) -> torch.Tensor:
    """Kernel formulation of §2.9.4: ``out = y·(fp32(alpha)/(n+eps))``."""
    y, norm = _row_norms(matrix, row_scale, col_scale)
    result = y * (torch.tensor(alpha, dtype=torch.float32) / (norm + eps)).unsqueeze(1)
    if out is None:
        return result
    return out.copy_(result)
