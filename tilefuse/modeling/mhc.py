"""Autograd mHC layers: mhc_pre, mhc_head, expand_from_embedding (mhc.md §2.10).

A layer is ``R' = mhc_post(F(u), R, post, comb)`` with ``u, (post, comb) = mhc_pre(R, ...)``; the model
enters with ``expand_from_embedding`` and leaves with ``mhc_head``.
"""
from __future__ import annotations

import torch

from tilefuse import _check
from tilefuse.mhc import (expand_to_mhc, mhc_fn_normw_merge_fwd, mhc_head_compute_mix, mhc_pre_apply_mix,
                          mhc_pre_big_fuse, mhc_pre_norm_fn, mhc_pre_split_mixes, sinkhorn_normalize)

__all__ = ["expand_from_embedding", "mhc_head", "mhc_pre"]


def expand_from_embedding(x: torch.Tensor, mhc_mult: int = 4) -> torch.Tensor:
    """Widen embeddings ``[..., C]`` to ``n`` identical residual streams ``[..., n, C]`` (§2.1)."""
    return expand_to_mhc(x, mhc_mult)


def _check_layer_residual(op: str, residual, mhc_mult) -> int:
    """The layer needs a 4-D bf16 residual ``[B, S, n, C]`` with ``n == mhc_mult`` (§2.10.1)."""
    n = _check.integer(op, "mhc_mult", mhc_mult, min=1)
    _check.tensor(op, "residual", residual, dtype=torch.bfloat16, ndim=4)
    if residual.shape[2] != n:
        _check.fail(op, f"residual must have mhc_mult={n} streams in dim 2, got shape {tuple(residual.shape)}")
    return n


def mhc_pre(residual: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, *,
            norm_weight: torch.Tensor | None = None, norm_eps: float = 1e-6, mhc_mult: int = 4,
            post_mult_value: float = 1.0, pre_eps: float = 1e-6, sinkhorn_eps: float = 1e-6,
            sinkhorn_repeat: int = 10, n_splits: int = 16):
    """Pre half of an mHC layer (§2.10.1): ``(layer_input [B, S, C], (post_mix [B, S, n, 1], comb_mix [B, S, n, n]))``.

    With grad enabled: norm_fn (fused residual-gradient accumulation, so the same residual must go to
    ``mhc_post``) -> split -> Sinkhorn -> apply. Without grad: ``mhc_pre_big_fuse``, bit-identical; the
    norm weight, if given, is merged into ``fn`` first (upstream ignores it there).
    """
    n = _check_layer_residual("mhc_pre", residual, mhc_mult)
    if torch.is_grad_enabled():
        mixes = mhc_pre_norm_fn(residual, fn, norm_weight, norm_eps, n_splits=n_splits)
        pre, post, comb = mhc_pre_split_mixes(mixes, scale, base, n, post_mult_value, pre_eps)
        comb = sinkhorn_normalize(comb, sinkhorn_repeat, sinkhorn_eps)
        return mhc_pre_apply_mix(residual, pre), (post, comb)
    if norm_weight is not None:
        _check.tensor("mhc_pre", "fn", fn, dtype=torch.float32, ndim=2)
        merged = torch.empty_like(fn, memory_format=torch.contiguous_format)
        mhc_fn_normw_merge_fwd(fn.contiguous(), norm_weight.contiguous(), merged)
        fn = merged
    post, comb, layer_input = mhc_pre_big_fuse(residual, fn, scale, base, norm_eps, pre_eps, sinkhorn_eps,
                                               post_mult_value, sinkhorn_repeat, n_splits)
    return layer_input, (post, comb)


def mhc_head(residual: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, *,
             norm_weight: torch.Tensor | None = None, norm_eps: float = 1e-6, mhc_mult: int = 4,
             pre_eps: float = 1e-6, n_splits: int = 16) -> torch.Tensor:
    """Collapse the streams before the LM head (§2.10.3): ``sum_i h[i] * R[i]`` (bf16 ``[B, S, C]``) with
    ``h = sigmoid(m * s + b) + eps_pre`` and ``m`` the prenorm projection by ``fn [n, K]``.

    ``fn`` is zero-padded to ``mhc_mult * (mhc_mult + 2)`` rows (its gradient keeps shape ``[n, K]``); the
    residual gradient is accumulated the plain way (no side channel, unlike upstream).
    """
    op = "mhc_head"
    n = _check_layer_residual(op, residual, mhc_mult)
    M = n * (n + 2)
    _check.tensor(op, "fn", fn, dtype=torch.float32, shape=(n, None))
    _check.tensor(op, "scale", scale, dtype=torch.float32)
    if scale.numel() != 1:
        _check.fail(op, f"scale must hold one element, got shape {tuple(scale.shape)}")
    fn_padded = torch.nn.functional.pad(fn, (0, 0, 0, M - n))
    mixes = mhc_pre_norm_fn(residual, fn_padded, norm_weight, norm_eps, fuse_grad_acc=False, n_splits=n_splits)
    mix = mhc_head_compute_mix(mixes[..., :n].contiguous(), scale.reshape(1), base, pre_eps)
    return mhc_pre_apply_mix(residual, mix.unsqueeze(-1))
