"""Public mHC ops (mhc.md): the v1 autograd ops and the v2.1 destination-passing kernel-level ops.

Every op validates its arguments first (nothing is written when a check fails), then runs a TileLang kernel
on CUDA tensors where the op has one and the kernel takes the shape (``path="kernel"``; each op's docstring
says which shapes), else the reference math of ``tilefuse.reference.mhc``. The v2.1 ops work on
flattened, contiguous tensors (leading dims merged into T) and write into the caller's buffers; the v1
ops keep the caller's leading dims and carry autograd (``_functions.py``).

The reference path supports any multiplicity n and hidden size C (mhc.md §0.3 allows it); kernel
constraints (n = 4, K % 256, M <= 32) belong to the kernel path.
"""
from __future__ import annotations


import torch

from tilefuse import _autograd, _check
from tilefuse._registry import public
from tilefuse.reference import mhc as R

from . import _functions as F
from . import _sinkhorn_kernel
from . import _mix_kernel
from . import _normw_kernel
from . import _recompute_kernel

__all__ = [
    "expand_to_mhc",
    "expand_to_mhc_bwd",
    "expand_to_mhc_fwd",
    "mhc_fn_normw_merge_bwd",
    "mhc_fn_normw_merge_fwd",
    "mhc_head_compute_mix",
    "mhc_head_compute_mix_bwd",
    "mhc_head_compute_mix_fwd",
    "mhc_multilayer_recompute",
    "mhc_post",
    "mhc_post_bwd",
    "mhc_post_fwd",
    "mhc_pre_apply_mix",
    "mhc_pre_apply_mix_bwd",
    "mhc_pre_apply_mix_fwd",
    "mhc_pre_big_fuse",
    "mhc_pre_big_fuse_fwd",
    "mhc_pre_norm_fn",
    "mhc_pre_split_mixes",
    "mhc_pre_split_mixes_bwd",
    "mhc_pre_split_mixes_fwd",
    "mhc_reduce_partials_and_rmsnorm_bwd",
    "mhc_reduce_partials_and_rmsnorm_fwd",
    "mhc_sinkhorn_bwd",
    "mhc_sinkhorn_fwd",
    "sinkhorn_normalize",
]

BF16 = torch.bfloat16
F32 = torch.float32


# ----------------------------------------------------------------------------------------------------
# shared checks


def _post_mult(op: str, name: str, value) -> float:
    """``post_mult_value`` is a nonzero real (the backward divides by it, §2.3)."""
    value = _check.real(op, name, value)
    if value == 0.0:
        _check.fail(op, f"{name} must be nonzero, got {value}")
    return value


def _streams(op: str, name: str, t, n: int | None = None, **kwargs) -> torch.Tensor:
    """A bf16 stream tensor ``[..., n, C]`` with n >= 1 (and equal to ``n`` if given)."""
    _check.tensor(op, name, t, dtype=BF16, **kwargs)
    if not (t.dim() >= 2):
        _check.fail(op, f"{name} must be at least 2-D [..., n, C], got shape {tuple(t.shape)}")
    want = "n >= 1" if n is None else f"n == {n}"
    if not (t.shape[-2] >= 1 and (n is None or t.shape[-2] == n)):
        _check.fail(op, f"{name} must have {want} streams in dim -2, got shape {tuple(t.shape)}")
    return t


def _mult_of_m(op: str, name: str, M: int) -> int:
    """The multiplicity n with ``M == n * (n + 2)``."""
    n = round((M + 1) ** 0.5) - 1
    if not (n >= 1 and n * (n + 2) == M):
        _check.fail(op, f"{name} must have n*(n+2) mix columns, got {M}")
    return n


# ----------------------------------------------------------------------------------------------------
# §2.1 expand


@public("mhc", path="kernel")
def expand_to_mhc(hidden: torch.Tensor, mhc_mult: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Copy ``hidden [..., C]`` (bf16, contiguous) to ``[..., n, C]``; autograd sums the streams (§2.1).

    CUDA tensors take the TileLang kernels (``_expand_kernel``) when ``C % 8 == 0`` and ``n <= 8``, else the
    reference."""
    op = "expand_to_mhc"
    _check.tensor(op, "hidden", hidden, dtype=BF16, contiguous=True)
    if not (hidden.dim() >= 1):
        _check.fail(op, f"hidden must be at least 1-D, got shape {tuple(hidden.shape)}")
    n = _check.integer(op, "mhc_mult", mhc_mult, min=1)
    _check.optional(op, "out", out, dtype=BF16, shape=(*hidden.shape[:-1], n, hidden.shape[-1]), contiguous=True,
                    device=hidden.device)
    return _autograd.apply(F.ExpandToMHCFn, hidden, n, out)


@public("mhc", path="kernel")
def expand_to_mhc_fwd(x: torch.Tensor, o: torch.Tensor) -> None:
    """v2.1: write ``o[t, i, :] = x[t, :]`` for ``x [T, C]``, ``o [T, n, C]`` (bf16). CUDA: the kernel when
    ``C % 8 == 0`` and ``n <= 8``, else the reference."""
    op = "expand_to_mhc_fwd"
    _check.tensor(op, "x", x, dtype=BF16, ndim=2, contiguous=True)
    _check.tensor(op, "o", o, dtype=BF16, shape=(x.shape[0], None, x.shape[1]), contiguous=True, device=x.device)
    if not (o.shape[1] >= 1):
        _check.fail(op, f"o must have n >= 1 streams, got shape {tuple(o.shape)}")
    F.expand_fwd_into(x, o)


@public("mhc", path="kernel")
def expand_to_mhc_bwd(o_grad: torch.Tensor, x_grad: torch.Tensor) -> None:
    """v2.1: overwrite ``x_grad [T, C]`` with the in-order fp32 sum of ``o_grad [T, n, C]`` over streams. CUDA:
    the kernel when ``C % 8 == 0`` and ``n <= 8``, else the reference."""
    op = "expand_to_mhc_bwd"
    _check.tensor(op, "o_grad", o_grad, dtype=BF16, ndim=3, contiguous=True)
    _check.tensor(op, "x_grad", x_grad, dtype=BF16, shape=(o_grad.shape[0], o_grad.shape[2]), contiguous=True,
                  device=o_grad.device)
    F.expand_bwd_into(o_grad, x_grad)


# ----------------------------------------------------------------------------------------------------
# §2.2 prenorm projection


def _check_norm_weight(op: str, fn: torch.Tensor, normw: torch.Tensor) -> None:
    _check.tensor(op, "fn", fn, dtype=F32, ndim=2, contiguous=True)
    _check.tensor(op, "normw", normw, dtype=F32, shape=(fn.shape[1],), contiguous=True, device=fn.device)


@public("mhc", path="kernel")
def mhc_fn_normw_merge_fwd(fn: torch.Tensor, normw: torch.Tensor, out_fn: torch.Tensor) -> None:
    """v2.1: ``out_fn[j, k] = fn[j, k] * normw[k]`` (fp32, §2.2.1). CUDA: the kernel when ``K % 4 == 0``, else
    the reference."""
    op = "mhc_fn_normw_merge_fwd"
    _check_norm_weight(op, fn, normw)
    _check.tensor(op, "out_fn", out_fn, dtype=F32, shape=tuple(fn.shape), contiguous=True, device=fn.device)
    if _normw_kernel.takes_fwd(fn):
        _normw_kernel.normw_merge_fwd_cuda(fn, normw, out_fn)
    else:
        torch.mul(fn, normw, out=out_fn)


@public("mhc", path="kernel")
def mhc_fn_normw_merge_bwd(fn: torch.Tensor, normw: torch.Tensor, out_fn_grad: torch.Tensor, fn_grad: torch.Tensor,
                           normw_grad: torch.Tensor) -> None:
    """v2.1: accumulate ``fn_grad += dW * normw`` and ``normw_grad += sum_j dW[j] * fn[j]`` (rows in order, then
    one add; §2.2.1). CUDA: the kernel (bit-identical to the reference)."""
    op = "mhc_fn_normw_merge_bwd"
    _check_norm_weight(op, fn, normw)
    for name, t in (("out_fn_grad", out_fn_grad), ("fn_grad", fn_grad)):
        _check.tensor(op, name, t, dtype=F32, shape=tuple(fn.shape), contiguous=True, device=fn.device)
    _check.tensor(op, "normw_grad", normw_grad, dtype=F32, shape=(fn.shape[1],), contiguous=True, device=fn.device)
    F.normw_merge_bwd_into(fn, normw, out_fn_grad, fn_grad, normw_grad)


@public("mhc", path="kernel")
def mhc_reduce_partials_and_rmsnorm_fwd(out_mul_splitted: torch.Tensor, sqrsum_splitted: torch.Tensor,
                                        out_mul: torch.Tensor, sqrsum: torch.Tensor, out: torch.Tensor,
                                        rms_group_size: int, rms_eps: float, n_splits: int = 16) -> None:
    """v2.1: reduce ``[S, T, G, M]`` / ``[S, T, G]`` partials in split order into ``out_mul``, ``sqrsum``
    and the normalised ``out [T, M]`` (§2.2.2 steps 4-6). CUDA: the kernel when ``S <= 64``, ``G <= 8``,
    ``M <= 80`` and ``rms_group_size < 2^24``, else the reference."""
    op = "mhc_reduce_partials_and_rmsnorm_fwd"
    _check.tensor(op, "out_mul_splitted", out_mul_splitted, dtype=F32, ndim=4, contiguous=True)
    S, T, G, M = out_mul_splitted.shape
    dev = out_mul_splitted.device
    _check.tensor(op, "sqrsum_splitted", sqrsum_splitted, dtype=F32, shape=(S, T, G), contiguous=True, device=dev)
    _check.tensor(op, "out_mul", out_mul, dtype=F32, shape=(T, G, M), contiguous=True, device=dev)
    _check.tensor(op, "sqrsum", sqrsum, dtype=F32, shape=(T, G), contiguous=True, device=dev)
    _check.tensor(op, "out", out, dtype=F32, shape=(T, M), contiguous=True, device=dev)
    size = _check.integer(op, "rms_group_size", rms_group_size, min=1)
    eps = _check.real(op, "rms_eps", rms_eps)
    _check.integer(op, "n_splits", n_splits, min=1)
    if S != n_splits:
        _check.fail(op, f"out_mul_splitted must have n_splits={n_splits} partials in dim 0, got {S}")
    F.reduce_rmsnorm_fwd_into(out_mul_splitted, sqrsum_splitted, out_mul, sqrsum, out, size, eps)


@public("mhc", path="kernel")
def mhc_reduce_partials_and_rmsnorm_bwd(out_grad: torch.Tensor, out_mul: torch.Tensor, sqrsum: torch.Tensor,
                                        out_mul_grad: torch.Tensor, sqrsum_grad: torch.Tensor,
                                        rms_group_size: int, rms_eps: float) -> None:
    """v2.1: overwrite ``out_mul_grad [T, G, M]`` and ``sqrsum_grad [T, G]`` with the RMS-step gradients
    (§2.2.3 first three bullets). CUDA: the kernel when ``G <= 8``, ``M <= 80`` and ``rms_group_size < 2^24``,
    else the reference."""
    op = "mhc_reduce_partials_and_rmsnorm_bwd"
    _check.tensor(op, "out_grad", out_grad, dtype=F32, ndim=2, contiguous=True)
    T, M = out_grad.shape
    dev = out_grad.device
    _check.tensor(op, "out_mul", out_mul, dtype=F32, shape=(T, None, M), contiguous=True, device=dev)
    G = out_mul.shape[1]
    _check.tensor(op, "sqrsum", sqrsum, dtype=F32, shape=(T, G), contiguous=True, device=dev)
    _check.tensor(op, "out_mul_grad", out_mul_grad, dtype=F32, shape=(T, G, M), contiguous=True, device=dev)
    _check.tensor(op, "sqrsum_grad", sqrsum_grad, dtype=F32, shape=(T, G), contiguous=True, device=dev)
    size = _check.integer(op, "rms_group_size", rms_group_size, min=1)
    eps = _check.real(op, "rms_eps", rms_eps)
    F.reduce_rmsnorm_bwd_into(out_grad, out_mul, sqrsum, out_mul_grad, sqrsum_grad, size, eps)


def _check_norm_fn_inputs(op: str, residual, fn, norm_weight, fn_name: str = "mhc_fn",
                          weight_name: str = "mhc_norm_weight") -> None:
    """residual bf16 ``[..., n, C]``; fn fp32 ``[M, n*C]``; optional norm weight fp32 ``[n*C]``."""
    _streams(op, "residual", residual)
    K = residual.shape[-2] * residual.shape[-1]
    _check.tensor(op, fn_name, fn, dtype=F32, shape=(None, K), device=residual.device)
    if not (fn.shape[0] >= 1):
        _check.fail(op, f"{fn_name} must have at least one row, got shape {tuple(fn.shape)}")
    _check.optional(op, weight_name, norm_weight, dtype=F32, shape=(K,), device=residual.device)


@public("mhc", path="kernel")
def mhc_pre_norm_fn(residual: torch.Tensor, mhc_fn: torch.Tensor, mhc_norm_weight: torch.Tensor | None,
                    mhc_norm_eps: float, fuse_grad_acc: bool = True, n_splits: int = 16) -> torch.Tensor:
    """Mix logits ``[..., M]`` of ``residual [..., n, C]`` (RMSNorm + projection, §2.2), with autograd.

    With ``fuse_grad_acc`` the residual gradient is accumulated into the buffer that ``mhc_post``'s
    backward attached to the residual (§2.12). ``n_splits`` has no numerical effect (the kernel's split count
    depends on K alone). CUDA tensors with ``n*C % 256 == 0`` and ``M <= 32`` take the TileLang GEMM kernels
    (split-K TF32 forward; backward with fixed-order weight-gradient partials), other shapes the reference.
    """
    op = "mhc_pre_norm_fn"
    _check_norm_fn_inputs(op, residual, mhc_fn, mhc_norm_weight)
    eps = _check.real(op, "mhc_norm_eps", mhc_norm_eps)
    _check.flag(op, "fuse_grad_acc", fuse_grad_acc)
    _check.integer(op, "n_splits", n_splits, min=1)
    fn = mhc_fn if mhc_norm_weight is None else _autograd.apply(F.MHCFnNormwMergeFn, mhc_fn, mhc_norm_weight)
    return _autograd.apply(F.MHCPreNormFn, residual, fn, eps, fuse_grad_acc)


# ----------------------------------------------------------------------------------------------------
# §2.3 split mixes


def _check_scale_base(op: str, scale, base, n_scale: int, M: int, dev, scale_name="mhc_scale",
                      base_name="mhc_base") -> None:
    _check.tensor(op, scale_name, scale, dtype=F32, shape=(n_scale,), device=dev)
    _check.tensor(op, base_name, base, dtype=F32, shape=(M,), device=dev)


@public("mhc", path="kernel")
def mhc_pre_split_mixes(input_mixes: torch.Tensor, mhc_scale: torch.Tensor, mhc_base: torch.Tensor, mhc_mult: int,
                        mhc_post_mult_value: float, mhc_pre_eps: float):
    """Split ``[A, B, M]`` mix logits into ``(pre [A, B, n, 1], post [A, B, n, 1], comb [A, B, n, n])`` (§2.3).

    CUDA tensors take the TileLang kernels (forward and backward) for n <= 8, the reference otherwise."""
    op = "mhc_pre_split_mixes"
    _check.tensor(op, "input_mixes", input_mixes, dtype=F32, ndim=3, contiguous=True)
    n = _check.integer(op, "mhc_mult", mhc_mult, min=1)
    M = n * (n + 2)
    if input_mixes.shape[-1] != M:
        _check.fail(op, f"input_mixes must have mhc_mult*(mhc_mult+2)={M} columns, got shape "
                        f"{tuple(input_mixes.shape)}")
    _check_scale_base(op, mhc_scale, mhc_base, 3, M, input_mixes.device)
    v = _post_mult(op, "mhc_post_mult_value", mhc_post_mult_value)
    eps = _check.real(op, "mhc_pre_eps", mhc_pre_eps)
    return _autograd.apply(F.MHCPreSplitMixesFn, input_mixes, mhc_scale, mhc_base, n, v, eps)


@public("mhc", path="kernel")
def mhc_pre_split_mixes_fwd(input_mixes: torch.Tensor, mhc_scale: torch.Tensor, mhc_base: torch.Tensor,
                            pre_layer_mix: torch.Tensor, post_layer_mix: torch.Tensor, comb_res_mix: torch.Tensor,
                            mhc_post_mult_value: float, mhc_pre_eps: float) -> None:
    """v2.1: write the split of ``input_mixes [T, M]`` into ``pre [T, n]``, ``post [T, n]``, ``comb [T, n*n]``.

    CUDA tensors take the TileLang kernel for n <= 8, the reference otherwise."""
    op = "mhc_pre_split_mixes_fwd"
    _check.tensor(op, "input_mixes", input_mixes, dtype=F32, ndim=2, contiguous=True)
    T, M = input_mixes.shape
    n = _mult_of_m(op, "input_mixes", M)
    dev = input_mixes.device
    _check_scale_base(op, mhc_scale, mhc_base, 3, M, dev)
    for name, t, width in (("pre_layer_mix", pre_layer_mix, n), ("post_layer_mix", post_layer_mix, n),
                           ("comb_res_mix", comb_res_mix, n * n)):
        _check.tensor(op, name, t, dtype=F32, shape=(T, width), contiguous=True, device=dev)
    v = _post_mult(op, "mhc_post_mult_value", mhc_post_mult_value)
    eps = _check.real(op, "mhc_pre_eps", mhc_pre_eps)
    if dev.type == "cuda" and _mix_kernel.supports(n):
        _mix_kernel.split_mixes_fwd_cuda(input_mixes, mhc_scale, mhc_base, pre_layer_mix, post_layer_mix, comb_res_mix,
                                         v, eps)
        return
    pre, post, comb = R.mhc_pre_split_mixes_ref(input_mixes, mhc_scale, mhc_base, n, v, eps)
    pre_layer_mix.copy_(pre.view(T, n))
    post_layer_mix.copy_(post.view(T, n))
    comb_res_mix.copy_(comb.view(T, n * n))


@public("mhc", path="kernel")
def mhc_pre_split_mixes_bwd(pre_layer_mix_grad: torch.Tensor, post_layer_mix_grad: torch.Tensor,
                            comb_res_mix_grad: torch.Tensor, input_mixes: torch.Tensor, post_layer_mix: torch.Tensor,
                            mhc_scale: torch.Tensor, mhc_base: torch.Tensor, input_mixes_grad: torch.Tensor,
                            mhc_scale_grad: torch.Tensor, mhc_base_grad: torch.Tensor,
                            mhc_post_mult_value: float) -> None:
    """v2.1: write ``input_mixes_grad [T, M]``; **overwrite** ``mhc_scale_grad [3]``, ``mhc_base_grad [M]``
    with the token sums (fixed-order partials, §2.3). CUDA tensors take the TileLang kernels (a fixed number
    of partials, then their in-order sum) for n <= 8, the reference otherwise."""
    op = "mhc_pre_split_mixes_bwd"
    _check.tensor(op, "input_mixes", input_mixes, dtype=F32, ndim=2, contiguous=True)
    T, M = input_mixes.shape
    n = _mult_of_m(op, "input_mixes", M)
    dev = input_mixes.device
    for name, t, width in (("pre_layer_mix_grad", pre_layer_mix_grad, n),
                           ("post_layer_mix_grad", post_layer_mix_grad, n),
                           ("comb_res_mix_grad", comb_res_mix_grad, n * n), ("post_layer_mix", post_layer_mix, n),
                           ("input_mixes_grad", input_mixes_grad, M)):
        _check.tensor(op, name, t, dtype=F32, shape=(T, width), contiguous=True, device=dev)
    _check_scale_base(op, mhc_scale, mhc_base, 3, M, dev)
    _check_scale_base(op, mhc_scale_grad, mhc_base_grad, 3, M, dev, "mhc_scale_grad", "mhc_base_grad")
    v = _post_mult(op, "mhc_post_mult_value", mhc_post_mult_value)
    if dev.type == "cuda" and _mix_kernel.supports(n):
        _mix_kernel.split_mixes_bwd_cuda(pre_layer_mix_grad, post_layer_mix_grad, comb_res_mix_grad, input_mixes,
                                         post_layer_mix, mhc_scale, mhc_base, input_mixes_grad, mhc_scale_grad,
                                         mhc_base_grad, v)
        return
    d_input, d_scale, d_base = R.mhc_pre_split_mixes_bwd_ref(
        pre_layer_mix_grad, post_layer_mix_grad, comb_res_mix_grad, input_mixes, post_layer_mix, mhc_scale, mhc_base,
        v, F.num_partials(dev))
    input_mixes_grad.copy_(d_input)
    mhc_scale_grad.copy_(d_scale)
    mhc_base_grad.copy_(d_base)


# ----------------------------------------------------------------------------------------------------
# §2.4 Sinkhorn


def _sinkhorn_args(op: str, repeat, eps) -> tuple[int, float]:
    return _check.integer(op, "repeat", repeat, min=1), _check.real(op, "eps", eps)


def _square(op: str, name: str, t, **kwargs) -> torch.Tensor:
    _check.tensor(op, name, t, dtype=F32, **kwargs)
    if not (t.dim() >= 2 and t.shape[-1] == t.shape[-2] and t.shape[-1] >= 1):
        _check.fail(op, f"{name} must be [..., n, n] with n >= 1, got shape {tuple(t.shape)}")
    return t


@public("mhc", path="kernel")
def sinkhorn_normalize(x: torch.Tensor, repeat: int = 10, eps: float = 1e-6) -> torch.Tensor:
    """Sinkhorn-normalise fp32 logits ``[..., n, n]`` (§2.4), with autograd.

    CUDA tensors with n in {2, 4} take the TileLang kernels (forward; backward for ``repeat <= 32``); other n,
    longer backward chains and CPU tensors take the reference."""
    op = "sinkhorn_normalize"
    _square(op, "x", x)
    repeat, eps = _sinkhorn_args(op, repeat, eps)
    return _autograd.apply(F.SinkhornNormalizeFn, x.contiguous(), repeat, eps)


@public("mhc", path="kernel")
def mhc_sinkhorn_fwd(comb_res_mix: torch.Tensor, comb_res_mix_out: torch.Tensor, repeat: int, eps: float) -> None:
    """v2.1: write the Sinkhorn of ``comb_res_mix [T, n, n]`` into ``comb_res_mix_out``.

    CUDA tensors with n in {2, 4} take the TileLang kernel; other n and CPU tensors take the reference."""
    op = "mhc_sinkhorn_fwd"
    _square(op, "comb_res_mix", comb_res_mix, ndim=3, contiguous=True)
    _check.tensor(op, "comb_res_mix_out", comb_res_mix_out, dtype=F32, shape=tuple(comb_res_mix.shape),
                  contiguous=True, device=comb_res_mix.device)
    repeat, eps = _sinkhorn_args(op, repeat, eps)
    if _sinkhorn_kernel.fwd_supported(comb_res_mix, repeat):
        _sinkhorn_kernel.sinkhorn_fwd_cuda(comb_res_mix, comb_res_mix_out, repeat, eps)
        return
    comb_res_mix_out.copy_(R.sinkhorn_normalize_ref(comb_res_mix, repeat, eps))


@public("mhc", path="kernel")
def mhc_sinkhorn_bwd(grad_output: torch.Tensor, x: torch.Tensor, grad_input: torch.Tensor, repeat: int,
                     eps: float) -> None:
    """v2.1: write the Sinkhorn input gradient into ``grad_input [T, n, n]`` (§2.4 backward).

    CUDA tensors with n in {2, 4} and ``repeat <= 32`` take the TileLang kernel (it keeps every step's iterate
    in registers); others take the reference."""
    op = "mhc_sinkhorn_bwd"
    _square(op, "x", x, ndim=3, contiguous=True)
    for name, t in (("grad_output", grad_output), ("grad_input", grad_input)):
        _check.tensor(op, name, t, dtype=F32, shape=tuple(x.shape), contiguous=True, device=x.device)
    repeat, eps = _sinkhorn_args(op, repeat, eps)
    if _sinkhorn_kernel.bwd_supported(x, repeat):
        _sinkhorn_kernel.sinkhorn_bwd_cuda(grad_output, x, grad_input, repeat, eps)
        return
    grad_input.copy_(R.sinkhorn_normalize_bwd_ref(grad_output, x, repeat, eps))


# ----------------------------------------------------------------------------------------------------
# §2.5 apply pre mix


@public("mhc", path="kernel")
def mhc_pre_apply_mix(x: torch.Tensor, mix: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Sub-layer input ``[..., C] = sum_i mix[..., i] * x[..., i, :]`` (bf16, §2.5), with autograd.

    Backward accumulates into the residual's side-channel buffer when ``mhc_post`` attached one (§2.12).
    CUDA tensors take the TileLang kernels (``_apply_mix_kernel``: the spec's fma chains) when ``C % 8 == 0``
    and ``n <= 8``, else the reference.
    """
    op = "mhc_pre_apply_mix"
    _streams(op, "x", x)
    _check.tensor(op, "mix", mix, dtype=F32, shape=(*x.shape[:-1], 1), device=x.device)
    _check.optional(op, "out", out, dtype=BF16, shape=(*x.shape[:-2], x.shape[-1]), device=x.device)
    return _autograd.apply(F.MHCPreApplyMixFn, x, mix, out)


def _check_apply_flat(op: str, x, mix) -> tuple[int, int, int]:
    _check.tensor(op, "x", x, dtype=BF16, ndim=3, contiguous=True)
    T, n, C = x.shape
    _check.tensor(op, "mix", mix, dtype=F32, shape=(T, n), contiguous=True, device=x.device)
    return T, n, C


@public("mhc", path="kernel")
def mhc_pre_apply_mix_fwd(x: torch.Tensor, mix: torch.Tensor, o: torch.Tensor) -> None:
    """v2.1: write ``o [T, C] = sum_i mix[:, i] * x[:, i, :]`` for ``x [T, n, C]``, ``mix [T, n]``. CUDA: the
    kernel when ``C % 8 == 0`` and ``n <= 8``, else the reference."""
    op = "mhc_pre_apply_mix_fwd"
    T, n, C = _check_apply_flat(op, x, mix)
    _check.tensor(op, "o", o, dtype=BF16, shape=(T, C), contiguous=True, device=x.device)
    F.apply_mix_fwd_into(x, mix, o)


@public("mhc", path="kernel")
def mhc_pre_apply_mix_bwd(o_grad: torch.Tensor, x: torch.Tensor, mix: torch.Tensor,
                          x_grad: torch.Tensor) -> torch.Tensor:
    """v2.1: **accumulate** ``x_grad [T, n, C] = bf(x_grad + mix * o_grad)``; return a new ``mix_grad [T, n]``.
    CUDA: the kernel (``bf(fma(mix, o_grad, x_grad))``) when ``C % 8 == 0`` and ``n <= 8``, else the
    reference."""
    op = "mhc_pre_apply_mix_bwd"
    T, n, C = _check_apply_flat(op, x, mix)
    _check.tensor(op, "o_grad", o_grad, dtype=BF16, shape=(T, C), contiguous=True, device=x.device)
    _check.tensor(op, "x_grad", x_grad, dtype=BF16, shape=(T, n, C), contiguous=True, device=x.device)
    return F.apply_mix_bwd_into(o_grad, x, mix, x_grad, True)


# ----------------------------------------------------------------------------------------------------
# §2.6 post


def _check_post(op: str, x, residual, post_layer_mix, comb_res_mix) -> None:
    """x bf16 ``[B, S, C]`` contiguous; residual bf16 ``[B, S, n, C]``; post fp32 ``[B, S, n, 1]`` and
    comb fp32 ``[B, S, n, n]``, contiguous."""
    _streams(op, "residual", residual, ndim=4)
    B, S, n, C = residual.shape
    dev = residual.device
    _check.tensor(op, "x", x, dtype=BF16, shape=(B, S, C), contiguous=True, device=dev)
    _check.tensor(op, "post_layer_mix", post_layer_mix, dtype=F32, shape=(B, S, n, 1), contiguous=True, device=dev)
    _check.tensor(op, "comb_res_mix", comb_res_mix, dtype=F32, shape=(B, S, n, n), contiguous=True, device=dev)


@public("mhc", path="kernel")
def mhc_post(x: torch.Tensor, residual: torch.Tensor, post_layer_mix: torch.Tensor, comb_res_mix: torch.Tensor,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """New residual ``R'[o] = post[o] * x + sum_i comb[i, o] * R[i]`` (bf16 ``[B, S, n, C]``, §2.6), with
    autograd. Backward attaches the residual gradient to the residual as the side channel (§2.12).

    CUDA tensors with n in (2, 4, 8) and C % 8 == 0 take the TileLang kernels (``_post_kernel``), forward and
    backward; other inputs take the reference."""
    op = "mhc_post"
    _check_post(op, x, residual, post_layer_mix, comb_res_mix)
    _check.optional(op, "out", out, dtype=BF16, shape=tuple(residual.shape), device=residual.device)
    return _autograd.apply(F.MHCPostFn, x, residual, post_layer_mix, comb_res_mix, out)


@public("mhc", path="kernel")
def mhc_post_fwd(x: torch.Tensor, residual: torch.Tensor, post_layer_mix: torch.Tensor, comb_res_mix: torch.Tensor,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """§2.6 forward without autograd; writes ``out`` if given and returns it. Kernel or reference as ``mhc_post``."""
    op = "mhc_post_fwd"
    _check_post(op, x, residual, post_layer_mix, comb_res_mix)
    _check.optional(op, "out", out, dtype=BF16, shape=tuple(residual.shape), device=residual.device)
    return F.post_forward(x, residual, post_layer_mix, comb_res_mix, out)


@public("mhc", path="kernel")
def mhc_post_bwd(x: torch.Tensor, residual: torch.Tensor, post_layer_mix: torch.Tensor, comb_res_mix: torch.Tensor,
                 d_o: torch.Tensor, fuse_grad_acc: bool = True):
    """§2.6 backward: ``(d_x, d_residual, d_post [B, S, n, 1], d_comb [B, S, n, n])``.

    With ``fuse_grad_acc`` (v1 default) ``d_residual`` is also attached to the residual as the side channel.
    Kernel or reference as ``mhc_post``; ``d_post``/``d_comb`` are per-token sums over C (no sum over tokens).
    """
    op = "mhc_post_bwd"
    _check_post(op, x, residual, post_layer_mix, comb_res_mix)
    _check.tensor(op, "d_o", d_o, dtype=BF16, shape=tuple(residual.shape), device=residual.device)
    _check.flag(op, "fuse_grad_acc", fuse_grad_acc)
    return F.post_backward(x, residual, post_layer_mix, comb_res_mix, d_o.contiguous(), fuse_grad_acc)


# ----------------------------------------------------------------------------------------------------
# §2.7 head mix


@public("mhc", path="kernel")
def mhc_head_compute_mix(input_mix: torch.Tensor, mhc_scale: torch.Tensor, mhc_base: torch.Tensor,
                         mhc_pre_eps: float) -> torch.Tensor:
    """Head mix ``sigmoid(m * s + b) + eps_pre`` of ``input_mix [A, B, n]`` (§2.7), with autograd. CUDA tensors
    take the TileLang kernels (forward and backward) for n <= 8, the reference otherwise."""
    op = "mhc_head_compute_mix"
    _check.tensor(op, "input_mix", input_mix, dtype=F32, ndim=3, contiguous=True)
    _check_scale_base(op, mhc_scale, mhc_base, 1, input_mix.shape[-1], input_mix.device)
    eps = _check.real(op, "mhc_pre_eps", mhc_pre_eps)
    return _autograd.apply(F.MHCHeadComputeMixFn, input_mix, mhc_scale, mhc_base, eps)


def _check_head_flat(op: str, input_mix, mhc_scale, mhc_base, token_block_size) -> tuple[int, int, int]:
    _check.tensor(op, "input_mix", input_mix, dtype=F32, ndim=2, contiguous=True)
    T, n = input_mix.shape
    _check_scale_base(op, mhc_scale, mhc_base, 1, n, input_mix.device)
    block = _check.integer(op, "token_block_size", token_block_size, min=0)
    return T, n, block or R.TOKEN_BLOCK


@public("mhc", path="kernel")
def mhc_head_compute_mix_fwd(input_mix: torch.Tensor, mhc_scale: torch.Tensor, mhc_base: torch.Tensor,
                             output_mix: torch.Tensor, mhc_pre_eps: float, token_block_size: int = 0) -> None:
    """v2.1: write the head mix of ``input_mix [T, n]`` into ``output_mix`` (``token_block_size`` has no
    numerical effect). CUDA tensors take the TileLang kernel for n <= 8, the reference otherwise."""
    op = "mhc_head_compute_mix_fwd"
    T, n, _ = _check_head_flat(op, input_mix, mhc_scale, mhc_base, token_block_size)
    _check.tensor(op, "output_mix", output_mix, dtype=F32, shape=(T, n), contiguous=True, device=input_mix.device)
    eps = _check.real(op, "mhc_pre_eps", mhc_pre_eps)
    if input_mix.is_cuda and _mix_kernel.supports(n):
        _mix_kernel.head_mix_fwd_cuda(input_mix, mhc_scale, mhc_base, output_mix, eps)
        return
    output_mix.copy_(R.mhc_head_compute_mix_ref(input_mix, mhc_scale, mhc_base, eps))


@public("mhc", path="kernel")
def mhc_head_compute_mix_bwd(output_mix_grad: torch.Tensor, input_mix: torch.Tensor, mhc_scale: torch.Tensor,
                             mhc_base: torch.Tensor, input_mix_grad: torch.Tensor,
                             mhc_scale_grad_partial: torch.Tensor, mhc_base_grad_partial: torch.Tensor,
                             num_sms: int, token_block_size: int = 0) -> None:
    """v2.1: write ``input_mix_grad [T, n]`` and the parameter-gradient partials ``[num_sms, 1]``,
    ``[num_sms, n]`` (token blocks of ``token_block_size`` or 32, block b -> partial b mod num_sms; §2.7).
    The caller sums the partials. CUDA tensors take the TileLang kernel for n <= 8, the reference otherwise."""
    op = "mhc_head_compute_mix_bwd"
    T, n, block = _check_head_flat(op, input_mix, mhc_scale, mhc_base, token_block_size)
    P = _check.integer(op, "num_sms", num_sms, min=1)
    dev = input_mix.device
    for name, t, shape in (("output_mix_grad", output_mix_grad, (T, n)), ("input_mix_grad", input_mix_grad, (T, n)),
                           ("mhc_scale_grad_partial", mhc_scale_grad_partial, (P, 1)),
                           ("mhc_base_grad_partial", mhc_base_grad_partial, (P, n))):
        _check.tensor(op, name, t, dtype=F32, shape=shape, contiguous=True, device=dev)
    if dev.type == "cuda" and _mix_kernel.supports(n):
        _mix_kernel.head_mix_bwd_cuda(output_mix_grad, input_mix, mhc_scale, mhc_base, input_mix_grad,
                                      mhc_scale_grad_partial, mhc_base_grad_partial, block)
        return
    d_input, scale_partial, base_partial = R.mhc_head_compute_mix_bwd_ref(output_mix_grad, input_mix, mhc_scale,
                                                                          mhc_base, P, block)
    input_mix_grad.copy_(d_input)
    mhc_scale_grad_partial.copy_(scale_partial)
    mhc_base_grad_partial.copy_(base_partial)


# ----------------------------------------------------------------------------------------------------
# §2.8 fused pre (inference)


def _check_fuse_scalars(op: str, rms_eps, mhc_pre_eps, mhc_sinkhorn_eps, mhc_post_mult_value, sinkhorn_repeat,
                        n_splits) -> tuple:
    return (_check.real(op, "rms_eps", rms_eps), _check.real(op, "mhc_pre_eps", mhc_pre_eps),
            _check.real(op, "mhc_sinkhorn_eps", mhc_sinkhorn_eps), _post_mult(op, "mhc_post_mult_value", mhc_post_mult_value),
            _check.integer(op, "sinkhorn_repeat", sinkhorn_repeat, min=1),
            _check.integer(op, "n_splits", n_splits, min=1))


@public("mhc", path="kernel")
def mhc_pre_big_fuse(residual: torch.Tensor, fn: torch.Tensor, mhc_scale: torch.Tensor, mhc_base: torch.Tensor,
                     rms_eps: float, mhc_pre_eps: float, mhc_sinkhorn_eps: float, mhc_post_mult_value: float,
                     sinkhorn_repeat: int, n_splits: int = 16):
    """Inference pre (§2.8): ``(post_mix [..., n, 1], comb_mix [..., n, n], layer_input [..., C])``,
    bit-identical to norm_fn -> split -> Sinkhorn -> apply: on CUDA the same kernels (``_functions.pre_chain``:
    step by step, or the reduce, split and Sinkhorn in one kernel with ``_pre_mixes_kernel.ENABLED``).
    No autograd; ``n_splits`` has no numerical effect (v1: one partial)."""
    op = "mhc_pre_big_fuse"
    _check_norm_fn_inputs(op, residual, fn, None, fn_name="fn")
    n, C = residual.shape[-2:]
    M = n * (n + 2)
    if fn.shape[0] != M:
        _check.fail(op, f"fn must have n*(n+2)={M} rows for n={n}, got shape {tuple(fn.shape)}")
    _check_scale_base(op, mhc_scale, mhc_base, 3, M, residual.device)
    rms_eps, pre_eps, sk_eps, v, repeat, _ = _check_fuse_scalars(
        op, rms_eps, mhc_pre_eps, mhc_sinkhorn_eps, mhc_post_mult_value, sinkhorn_repeat, n_splits)
    lead = residual.shape[:-2]
    flat = residual.reshape(-1, n, C)
    with torch.no_grad():
        out_mul, sqrsum = F.norm_fn_partials(flat, fn)  # the unfused op's partials: bit-identical chains (§3)
        post, comb, layer_input = F.pre_chain(out_mul, sqrsum, flat, mhc_scale, mhc_base, rms_eps, pre_eps, sk_eps,
                                              v, repeat)
    return post.view(*lead, n, 1), comb.view(*lead, n, n), layer_input.view(*lead, C)


@public("mhc", path="kernel")
def mhc_pre_big_fuse_fwd(gemm_out_mul: torch.Tensor, gemm_out_sqrsum: torch.Tensor, mhc_scale: torch.Tensor,
                         mhc_base: torch.Tensor, residual: torch.Tensor, post_mix: torch.Tensor,
                         comb_mix: torch.Tensor, layer_input: torch.Tensor, rms_eps: float, mhc_pre_eps: float,
                         mhc_sinkhorn_eps: float, mhc_post_mult_value: float, sinkhorn_repeat: int,
                         n_splits: int = 16) -> None:
    """v2.1 fused pre from external split-K GEMM partials ``[S, T, M]``, ``[S, T]`` (§5.2): writes
    ``post_mix [T, n]``, ``comb_mix [T, n*n]``, ``layer_input [T, C]``; bit-identical to
    reduce -> split -> Sinkhorn -> apply with the same S."""
    op = "mhc_pre_big_fuse_fwd"
    _check.tensor(op, "residual", residual, dtype=BF16, ndim=3, contiguous=True)
    T, n, C = residual.shape
    if not (n >= 1):
        _check.fail(op, f"residual must have n >= 1 streams, got shape {tuple(residual.shape)}")
    M = n * (n + 2)
    dev = residual.device
    _check.tensor(op, "gemm_out_mul", gemm_out_mul, dtype=F32, shape=(None, T, M), contiguous=True, device=dev)
    S = gemm_out_mul.shape[0]
    _check.tensor(op, "gemm_out_sqrsum", gemm_out_sqrsum, dtype=F32, shape=(S, T), contiguous=True, device=dev)
    _check_scale_base(op, mhc_scale, mhc_base, 3, M, dev)
    _check.tensor(op, "post_mix", post_mix, dtype=F32, shape=(T, n), contiguous=True, device=dev)
    _check.tensor(op, "comb_mix", comb_mix, dtype=F32, shape=(T, n * n), contiguous=True, device=dev)
    _check.tensor(op, "layer_input", layer_input, dtype=BF16, shape=(T, C), contiguous=True, device=dev)
    rms_eps, pre_eps, sk_eps, v, repeat, n_splits = _check_fuse_scalars(
        op, rms_eps, mhc_pre_eps, mhc_sinkhorn_eps, mhc_post_mult_value, sinkhorn_repeat, n_splits)
    if S != n_splits:
        _check.fail(op, f"gemm_out_mul must have n_splits={n_splits} partials in dim 0, got {S}")
    F.pre_chain(gemm_out_mul.unsqueeze(2), gemm_out_sqrsum.unsqueeze(2), residual, mhc_scale, mhc_base, rms_eps,
                pre_eps, sk_eps, v, repeat, (post_mix, comb_mix, layer_input))


# ----------------------------------------------------------------------------------------------------
# §2.9 multi-layer recompute


def _stream_mix(op: str, name: str, t, lead: tuple, n: int, dev) -> None:
    """A per-stream fp32 mix ``[*lead, n]`` or ``[*lead, n, 1]``, contiguous."""
    _check.tensor(op, name, t, dtype=F32, contiguous=True, device=dev)
    if tuple(t.shape) not in ((*lead, n), (*lead, n, 1)):
        _check.fail(op, f"{name} must have shape {(*lead, n)} or {(*lead, n, 1)}, got {tuple(t.shape)}")


@public("mhc", path="kernel")
def mhc_multilayer_recompute(initial_residual: torch.Tensor, pre_mix_list, layer_output_list, post_mix_list,
                             comb_mix_list, layer_input_list, residual_list) -> None:
    """Replay the apply/post chain of L layers (§2.9), writing ``layer_input_list[l]`` (bf16 ``[..., C]``)
    and ``residual_list[l]`` (the residual after layer l, bf16 ``[..., n, C]``); P == L or L - 1 post steps.

    CUDA tensors with ``n`` in {2, 4, 8} and ``C % 8 == 0`` run one fused kernel
    (``_recompute_kernel``: each token's residual read once and kept in registers across the layers); other CUDA
    inputs run the apply-mix and post kernels layer by layer, and CPU tensors the reference. All paths give the
    same bits (the spec's bit-identity with the unfused ops)."""
    op = "mhc_multilayer_recompute"
    _streams(op, "initial_residual", initial_residual, contiguous=True)
    lead, (n, C) = tuple(initial_residual.shape[:-2]), initial_residual.shape[-2:]
    dev = initial_residual.device
    lists = {"pre_mix_list": pre_mix_list, "layer_output_list": layer_output_list, "post_mix_list": post_mix_list,
             "comb_mix_list": comb_mix_list, "layer_input_list": layer_input_list, "residual_list": residual_list}
    for name, lst in lists.items():
        if not isinstance(lst, (list, tuple)):
            _check.fail(op, f"{name} must be a list of tensors, got {type(lst).__name__}", TypeError)
    L, P = len(pre_mix_list), len(post_mix_list)
    _check.expect(L > 0, op, "pre_mix_list must hold at least one layer, got 0")
    if len(layer_input_list) != L:
        _check.fail(op, f"layer_input_list must have len(pre_mix_list)={L} tensors, got {len(layer_input_list)}")
    for name in ("layer_output_list", "comb_mix_list", "residual_list"):
        if len(lists[name]) != P:
            _check.fail(op, f"{name} must have len(post_mix_list)={P} tensors, got {len(lists[name])}")
    if P not in (L, L - 1):
        _check.fail(op, f"post_mix_list must have {L} or {L - 1} tensors (L={L}), got {P}")
    for l in range(L):
        _stream_mix(op, f"pre_mix_list[{l}]", pre_mix_list[l], lead, n, dev)
        _check.tensor(op, f"layer_input_list[{l}]", layer_input_list[l], dtype=BF16, shape=(*lead, C),
                      contiguous=True, device=dev)
    for l in range(P):
        _check.tensor(op, f"layer_output_list[{l}]", layer_output_list[l], dtype=BF16, shape=(*lead, C),
                      contiguous=True, device=dev)
        _stream_mix(op, f"post_mix_list[{l}]", post_mix_list[l], lead, n, dev)
        _check.tensor(op, f"comb_mix_list[{l}]", comb_mix_list[l], dtype=F32, shape=(*lead, n, n), contiguous=True,
                      device=dev)
        _check.tensor(op, f"residual_list[{l}]", residual_list[l], dtype=BF16, shape=(*lead, n, C), contiguous=True,
                      device=dev)
    args = (initial_residual, pre_mix_list, layer_output_list, post_mix_list, comb_mix_list, layer_input_list,
            residual_list)
    if _recompute_kernel.takes(*args):
        _recompute_kernel.recompute_cuda(*args)
        return
    residual = initial_residual
    for l in range(L):  # each step through the helper its unfused op takes (the kernels on CUDA): the same bits
        F.apply_mix_fwd_into(residual, pre_mix_list[l].reshape(*lead, n, 1), layer_input_list[l])
        if l < P:
            F.post_forward(layer_output_list[l], residual, post_mix_list[l].reshape(*lead, n, 1), comb_mix_list[l],
                           residual_list[l])
            residual = residual_list[l]
