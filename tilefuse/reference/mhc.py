"""Reference mHC ops (mhc.md): plain PyTorch, the CPU path of every public mHC op and the test oracle.

Inputs in the spec's dtypes (bf16 streams, fp32 mixes and weights) are computed in fp32 and return the
spec's dtypes (one bf16 rounding at the end where the spec stores bf16). float64 inputs are computed in
float64 and return float64, with no rounding, so that the math can be checked with
``torch.autograd.gradcheck``.

``__all__`` holds the reference names of the API; the ``*_bwd_ref`` functions below are the explicit
backward formulas of §2 (used by the public ``*_bwd`` ops and the autograd Functions) and are not part
of the API.
"""
from __future__ import annotations

import torch

__all__ = [
    "expand_to_mhc_ref",
    "mhc_head_compute_mix_ref",
    "mhc_post_ref",
    "mhc_pre_apply_mix_ref",
    "mhc_pre_norm_fn_partials_ref",
    "mhc_pre_norm_fn_ref",
    "mhc_pre_split_mixes_ref",
    "sinkhorn_normalize_ref",
]

# Parameter-gradient partials (§2.3, §2.7): tokens are cut into blocks of this many tokens and block b
# goes to partial b mod P.
TOKEN_BLOCK = 32


# ----------------------------------------------------------------------------------------------------
# helpers


def _acc(*tensors: torch.Tensor | None) -> torch.dtype:
    """Accumulation dtype: float64 if any input is float64, else fp32 (§0.1)."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def seq_sum(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum along ``dim`` one slice at a time, in increasing index, starting from 0 (a fixed order)."""
    dim = dim % t.dim()
    acc = t.new_zeros(t.shape[:dim] + t.shape[dim + 1:])
    for i in range(t.size(dim)):
        acc = acc + t.select(dim, i)
    return acc


def token_partials(t: torch.Tensor, num_partials: int, block: int = TOKEN_BLOCK) -> torch.Tensor:
    """Per-partial sums of ``t [T, F]`` over tokens: ``[P, F]`` (§2.3 parameter-gradient reduction).

    Tokens are cut into blocks of ``block``; block b is summed and added to partial ``b mod P``, blocks in
    increasing order. Tail tokens of the last block contribute zero.
    """
    T, F = t.shape
    blocks = -(-T // block)
    rounds = -(-blocks // num_partials)
    pad = t.new_zeros(rounds * num_partials * block - T, F)
    padded = torch.cat([t, pad]).view(rounds, num_partials, block, F)
    return seq_sum(padded.sum(2), 0)


def _rms_factor(sqrsum: torch.Tensor, group_size: int, eps: float) -> torch.Tensor:
    """``r = rsqrt(Q / K + eps)`` (§2.2.2 step 5)."""
    return torch.rsqrt(sqrsum / group_size + eps)


def _group_scale(scale: torch.Tensor, n: int) -> torch.Tensor:
    """The length-M scale vector of §2.3: s0 for the n pre rows, s1 for n post rows, s2 for n² comb rows."""
    return torch.cat([scale[0:1].expand(n), scale[1:2].expand(n), scale[2:3].expand(n * n)])


# ----------------------------------------------------------------------------------------------------
# §2.1 expand


def expand_to_mhc_ref(hidden: torch.Tensor, mhc_mult: int) -> torch.Tensor:
    """``out[..., i, :] = hidden[..., :]`` for every stream i (§2.1)."""
    return hidden.unsqueeze(-2).expand(*hidden.shape[:-1], mhc_mult, hidden.shape[-1]).contiguous()


def expand_to_mhc_bwd_ref(o_grad: torch.Tensor) -> torch.Tensor:
    """Sum of ``o_grad [..., n, C]`` over streams in increasing order in fp32, one final rounding (§2.1)."""
    return seq_sum(o_grad.to(_acc(o_grad)), -2).to(o_grad.dtype)


# ----------------------------------------------------------------------------------------------------
# §2.2 prenorm projection


def mhc_fn_normw_merge_bwd_ref(fn: torch.Tensor, normw: torch.Tensor, out_fn_grad: torch.Tensor):
    """Gradients of ``W = fn * normw`` (§2.2.1): ``(d_fn, d_normw)``, d_normw summed over rows in order."""
    return out_fn_grad * normw, seq_sum(out_fn_grad * fn, 0)


def mhc_pre_norm_fn_partials_ref(residual: torch.Tensor, fn: torch.Tensor, n_splits: int):
    """Split-K partials of the prenorm GEMM (§2.11): ``(out_mul [S, T, 1, M], sqrsum [S, T, 1])``.

    Split s covers the K-columns ``[s*(K//S), (s+1)*(K//S))`` of the flattened residual row; a
    non-divisible tail is dropped. Each partial is the dot product with every row of ``fn`` and the sum of
    squares over that slice.
    """
    acc = _acc(residual, fn)
    K = residual.shape[-2] * residual.shape[-1]
    x = residual.reshape(-1, K).to(acc)
    w = fn.to(acc)
    width = K // n_splits
    cols = [slice(s * width, (s + 1) * width) for s in range(n_splits)]
    out_mul = torch.stack([x[:, c] @ w[:, c].T for c in cols])
    sqrsum = torch.stack([(x[:, c] * x[:, c]).sum(-1) for c in cols])
    return out_mul.unsqueeze(2), sqrsum.unsqueeze(2)


def mhc_reduce_partials_and_rmsnorm_ref(out_mul_splitted: torch.Tensor, sqrsum_splitted: torch.Tensor,
                                        rms_group_size: int, rms_eps: float):
    """Reduce split partials in split order, then RMS-normalise (§2.2.2 steps 4-6).

    ``out_mul_splitted [S, T, G, M]``, ``sqrsum_splitted [S, T, G]`` -> ``(out_mul [T, G, M],
    sqrsum [T, G], out [T, M])`` with ``out[j] = sum_g out_mul[g, j] * rsqrt(sqrsum[g] / K_g + eps)``.
    """
    out_mul = seq_sum(out_mul_splitted, 0)
    sqrsum = seq_sum(sqrsum_splitted, 0)
    r = _rms_factor(sqrsum, rms_group_size, rms_eps)
    out = seq_sum(out_mul * r.unsqueeze(-1), -2)
    return out_mul, sqrsum, out


def mhc_reduce_partials_and_rmsnorm_bwd_ref(out_grad: torch.Tensor, out_mul: torch.Tensor, sqrsum: torch.Tensor,
                                            rms_group_size: int, rms_eps: float):
    """Backward of the RMS step (§2.2.3 first three bullets): ``(out_mul_grad [T, G, M], sqrsum_grad [T, G])``.

    ``dP = d_out * r``, ``dr = sum_j d_out * P``, ``dQ = ((dr * r) / (Q + eps*K)) / -2``.
    """
    r = _rms_factor(sqrsum, rms_group_size, rms_eps)
    g = out_grad.unsqueeze(-2)
    out_mul_grad = g * r.unsqueeze(-1)
    dr = (g * out_mul).sum(-1)
    sqrsum_grad = dr * r / (sqrsum + rms_eps * rms_group_size) / -2
    return out_mul_grad, sqrsum_grad


def mhc_pre_norm_fn_gemm_bwd_ref(out_mul_grad: torch.Tensor, sqrsum_grad: torch.Tensor, residual: torch.Tensor,
                                 fn: torch.Tensor, x_grad: torch.Tensor | None = None):
    """Backward of the prenorm GEMM and sum of squares (§2.2.3, G = 1).

    ``out_mul_grad [T, M]``, ``sqrsum_grad [T]``, ``residual [..., n, C]``, ``fn [M, K]`` ->
    ``(dx [..., n, C] in residual's dtype, d_fn [M, K])`` with ``dx = (D + dP @ fn) + 2 x dQ`` where D is
    ``x_grad`` (the accumulation buffer) or 0, and ``d_fn = dP^T @ x`` summed over tokens.
    """
    acc = _acc(residual, fn, out_mul_grad)
    K = fn.shape[1]
    x = residual.reshape(-1, K).to(acc)
    d_mul = out_mul_grad.to(acc)
    dx = d_mul @ fn.to(acc)
    if x_grad is not None:
        dx = x_grad.reshape(-1, K).to(acc) + dx
    dx = dx + 2 * x * sqrsum_grad.to(acc).unsqueeze(-1)
    return dx.to(residual.dtype).view(residual.shape), d_mul.T @ x


def mhc_pre_norm_fn_ref(residual: torch.Tensor, mhc_fn: torch.Tensor, mhc_norm_weight: torch.Tensor | None,
                        mhc_norm_eps: float) -> torch.Tensor:
    """Mix logits ``out[..., j] = (x . W[j]) * rsqrt(sum(x^2) / K + eps)`` (§1.1 step 1, §2.2).

    ``residual [..., n, C]`` is flattened stream-major to ``x`` of length K = n*C; ``W = mhc_fn``, times the
    norm weight column-wise if one is given. Returns ``[..., M]``.
    """
    w = mhc_fn if mhc_norm_weight is None else mhc_fn * mhc_norm_weight
    out_mul, sqrsum = mhc_pre_norm_fn_partials_ref(residual, w, 1)
    K = residual.shape[-2] * residual.shape[-1]
    _, _, out = mhc_reduce_partials_and_rmsnorm_ref(out_mul, sqrsum, K, mhc_norm_eps)
    return out.view(*residual.shape[:-2], mhc_fn.shape[0])


# ----------------------------------------------------------------------------------------------------
# §2.3 split mixes


def mhc_pre_split_mixes_ref(input_mixes: torch.Tensor, mhc_scale: torch.Tensor, mhc_base: torch.Tensor,
                            mhc_mult: int, mhc_post_mult_value: float, mhc_pre_eps: float):
    """Split mix logits ``[..., M]`` into ``(pre [..., n, 1], post [..., n, 1], comb [..., n, n])`` (§2.3).

    ``z = m * scale_grp + base``; ``pre = sigmoid(z) + eps_pre``; ``post = sigmoid(z) * v``; comb = z.
    """
    n = mhc_mult
    z = input_mixes * _group_scale(mhc_scale, n) + mhc_base
    pre = torch.sigmoid(z[..., :n]) + mhc_pre_eps
    post = torch.sigmoid(z[..., n:2 * n]) * mhc_post_mult_value
    comb = z[..., 2 * n:].unflatten(-1, (n, n))
    return pre.unsqueeze(-1), post.unsqueeze(-1), comb


def mhc_pre_split_mixes_bwd_ref(d_pre: torch.Tensor, d_post: torch.Tensor, d_comb: torch.Tensor,
                                input_mixes: torch.Tensor, post: torch.Tensor, mhc_scale: torch.Tensor,
                                mhc_base: torch.Tensor, mhc_post_mult_value: float, num_partials: int = 1):
    """Backward of §2.3 on flattened tensors: ``(d_input [T, M], d_scale [3], d_base [M])``.

    ``d_pre, d_post [T, n]``, ``d_comb [T, n*n]``, ``input_mixes [T, M]``, ``post`` the saved post mix
    ``[T, n]``. Parameter gradients go through ``num_partials`` token partials reduced in order.
    """
    n = d_pre.shape[-1]
    sig = torch.sigmoid(input_mixes[:, :n] * mhc_scale[0] + mhc_base[:n])
    dz_pre = d_pre * sig * (1 - sig)
    dz_post = d_post * post * (1 - post / mhc_post_mult_value)
    dz = torch.cat([dz_pre, dz_post, d_comb], -1)
    d_input = dz * _group_scale(mhc_scale, n)
    prod = dz * input_mixes
    per_group = torch.stack([prod[:, :n].sum(-1), prod[:, n:2 * n].sum(-1), prod[:, 2 * n:].sum(-1)], -1)
    d_scale = seq_sum(token_partials(per_group, num_partials), 0)
    d_base = seq_sum(token_partials(dz, num_partials), 0)
    return d_input, d_scale, d_base


# ----------------------------------------------------------------------------------------------------
# §2.4 Sinkhorn


def sinkhorn_normalize_ref(x: torch.Tensor, repeat: int = 10, eps: float = 1e-6) -> torch.Tensor:
    """Sinkhorn of ``[..., n, n]`` logits (§2.4): row softmax, ``+eps``, column step, then ``repeat - 1``
    (row step, column step) pairs; a step divides by ``(sum + eps)``."""
    a = torch.softmax(x, dim=-1) + eps
    a = a / (a.sum(-2, keepdim=True) + eps)
    for _ in range(repeat - 1):
        a = a / (a.sum(-1, keepdim=True) + eps)
        a = a / (a.sum(-2, keepdim=True) + eps)
    return a


def sinkhorn_normalize_bwd_ref(grad_output: torch.Tensor, x: torch.Tensor, repeat: int, eps: float) -> torch.Tensor:
    """Backward of §2.4: replay the forward keeping each step's input and sums, then walk back."""
    a0 = torch.softmax(x, dim=-1)
    a = a0 + eps
    steps = []
    for s in range(2 * repeat - 1):
        dim = -2 if s % 2 == 0 else -1  # column steps at even s, row steps at odd s
        sums = a.sum(dim, keepdim=True) + eps
        steps.append((dim, a, sums))
        a = a / sums
    g = grad_output
    for dim, u, sums in reversed(steps):
        tau = (g * u).sum(dim, keepdim=True) / sums
        g = (g - tau) / sums
    return (g - (g * a0).sum(-1, keepdim=True)) * a0


# ----------------------------------------------------------------------------------------------------
# §2.5 apply pre mix


def mhc_pre_apply_mix_ref(x: torch.Tensor, mix: torch.Tensor) -> torch.Tensor:
    """``out[..., c] = sum_i mix[..., i, 0] * x[..., i, c]`` in fp32, rounded to x's dtype (§2.5)."""
    acc = _acc(x, mix)
    return (x.to(acc) * mix.to(acc)).sum(-2).to(x.dtype)


def mhc_pre_apply_mix_bwd_ref(o_grad: torch.Tensor, x: torch.Tensor, mix: torch.Tensor,
                              x_grad: torch.Tensor | None = None):
    """Backward of §2.5: ``(dx [..., n, C] in x's dtype, d_mix [..., n, 1])``.

    ``dx = D + mix * d_out`` with D = ``x_grad`` (accumulation buffer) or 0; ``d_mix = sum_c d_out * x``.
    """
    acc = _acc(x, mix, o_grad)
    g = o_grad.to(acc).unsqueeze(-2)
    d_mix = (g * x.to(acc)).sum(-1, keepdim=True)
    dx = mix.to(acc) * g
    if x_grad is not None:
        dx = x_grad.to(acc) + dx
    return dx.to(x.dtype), d_mix


# ----------------------------------------------------------------------------------------------------
# §2.6 post


def mhc_post_ref(x: torch.Tensor, residual: torch.Tensor, post_layer_mix: torch.Tensor,
                 comb_res_mix: torch.Tensor) -> torch.Tensor:
    """``R'[..., o, c] = post[o] * x[c] + sum_i comb[i, o] * R[i, c]`` in fp32, rounded (§2.6)."""
    acc = _acc(x, residual, post_layer_mix, comb_res_mix)
    mixed = torch.einsum("...io,...ic->...oc", comb_res_mix.to(acc), residual.to(acc))
    return (mixed + x.to(acc).unsqueeze(-2) * post_layer_mix.to(acc)).to(residual.dtype)


def mhc_post_bwd_ref(x: torch.Tensor, residual: torch.Tensor, post_layer_mix: torch.Tensor,
                     comb_res_mix: torch.Tensor, d_o: torch.Tensor):
    """Backward of §2.6: ``(d_x, d_residual, d_post [..., n, 1], d_comb [..., n, n])``."""
    acc = _acc(x, residual, post_layer_mix, comb_res_mix, d_o)
    g = d_o.to(acc)
    d_x = (g * post_layer_mix.to(acc)).sum(-2).to(x.dtype)
    d_residual = torch.einsum("...io,...oc->...ic", comb_res_mix.to(acc), g).to(residual.dtype)
    d_post = (g * x.to(acc).unsqueeze(-2)).sum(-1, keepdim=True)
    d_comb = torch.einsum("...ic,...oc->...io", residual.to(acc), g)
    return d_x, d_residual, d_post, d_comb


# ----------------------------------------------------------------------------------------------------
# §2.7 head mix


def mhc_head_compute_mix_ref(input_mix: torch.Tensor, mhc_scale: torch.Tensor, mhc_base: torch.Tensor,
                             mhc_pre_eps: float) -> torch.Tensor:
    """``out = sigmoid(m * s + b) + eps_pre`` (§2.7)."""
    return torch.sigmoid(input_mix * mhc_scale + mhc_base) + mhc_pre_eps


def mhc_head_compute_mix_bwd_ref(d_out: torch.Tensor, input_mix: torch.Tensor, mhc_scale: torch.Tensor,
                                 mhc_base: torch.Tensor, num_partials: int, block: int = TOKEN_BLOCK):
    """Backward of §2.7 on ``[T, n]``: ``(d_input [T, n], d_scale partials [P, 1], d_base partials [P, n])``."""
    sig = torch.sigmoid(input_mix * mhc_scale + mhc_base)
    dz = sig * (1 - sig) * d_out
    d_input = dz * mhc_scale
    scale_partial = token_partials((dz * input_mix).sum(-1, keepdim=True), num_partials, block)
    base_partial = token_partials(dz, num_partials, block)
    return d_input, scale_partial, base_partial
