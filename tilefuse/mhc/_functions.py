"""Autograd Functions behind the v1 mHC ops (mhc.md §1.2), and the residual-gradient side channel (§2.12).

The Functions take already validated arguments (the public wrappers in ``ops.py`` check them) and call
the reference math, so they also run in float64 for gradcheck. A CUDA kernel plugs in where a Function
calls ``R.*``: the ``*_into`` helpers below choose between a family's kernel (CUDA tensors of a shape it
takes) and the reference, for the Functions and the v2.1 ops alike; the split and head mixes take
``_mix_kernel`` for fp32 CUDA tensors.
"""
from __future__ import annotations

import torch

from tilefuse.reference import mhc as R

from . import _apply_mix_kernel, _expand_kernel, _mix_kernel, _norm_fn_kernel, _post_kernel, _sinkhorn_kernel
from . import _normw_kernel, _pre_mixes_kernel, _reduce_norm_kernel

# §2.12: the attribute of a residual's untyped storage that holds its fused bf16 gradient buffer.
SIDE_CHANNEL = "grad_from_mhc_post"


num_partials = _mix_kernel.num_partials  # P of the parameter gradients' token partials: a constant on CUDA


def attach_residual_grad(residual: torch.Tensor, grad: torch.Tensor) -> None:
    """Store ``grad`` as the side-channel buffer of ``residual``'s storage (§2.12 step 1)."""
    setattr(residual.untyped_storage(), SIDE_CHANNEL, grad)


def peek_residual_grad(residual: torch.Tensor) -> torch.Tensor | None:
    """The side-channel buffer attached to ``residual``'s storage, viewed as ``residual``, or None.

    A buffer of another element count or dtype (a different tensor sharing the storage) is ignored.
    """
    buf = getattr(residual.untyped_storage(), SIDE_CHANNEL, None)
    if buf is None or buf.numel() != residual.numel() or buf.dtype != residual.dtype:
        return None
    return buf.view(residual.shape)


def pop_residual_grad(residual: torch.Tensor) -> torch.Tensor:
    """Take (and detach from the storage) the side-channel buffer; raise AttributeError if absent (§2.12 step 3)."""
    buf = peek_residual_grad(residual)
    if buf is None:
        raise AttributeError(
            "mhc_pre_norm_fn: fuse_grad_acc=True needs the residual gradient that mhc_post's backward attaches "
            "to the residual; call mhc_post on the same residual, or pass fuse_grad_acc=False")
    delattr(residual.untyped_storage(), SIDE_CHANNEL)
    return buf


def _write(out: torch.Tensor | None, result: torch.Tensor, ctx) -> torch.Tensor:
    """Return ``result``, or copy it into the caller's ``out`` (marked dirty) and return that."""
    if out is None:
        return result
    out.copy_(result)
    ctx.mark_dirty(out)
    return out


def _f32_packed(*ts: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.is_contiguous() for t in ts)


def normw_merge_fwd(fn: torch.Tensor, normw: torch.Tensor) -> torch.Tensor:
    """§2.2.1 forward ``fn * w``: the kernel on packed fp32 CUDA tensors it takes, else the reference."""
    if _normw_kernel.takes_fwd(fn) and _f32_packed(fn, normw):
        out = torch.empty_like(fn)
        _normw_kernel.normw_merge_fwd_cuda(fn, normw, out)
        return out
    return fn * normw


def normw_merge_bwd_into(fn, normw, out_fn_grad, fn_grad, normw_grad) -> None:
    """§2.2.1 backward, accumulated: ``fn_grad += dW * w``; ``normw_grad += sum_j dW[j] * fn[j]``. CUDA: the
    kernel (same bits) when every buffer is packed fp32."""
    if _normw_kernel.takes_bwd(fn) and _f32_packed(fn, normw, fn_grad, normw_grad) and \
            out_fn_grad.dtype == torch.float32:
        _normw_kernel.normw_merge_bwd_cuda(fn, normw, out_fn_grad.contiguous(), fn_grad, normw_grad)
        return
    d_fn, d_w = R.mhc_fn_normw_merge_bwd_ref(fn, normw, out_fn_grad)
    fn_grad.add_(d_fn)
    normw_grad.add_(d_w)


def _reduce_takes(out_mul: torch.Tensor, S: int, size: int) -> bool:
    """The reduce/RMS kernels take ``out_mul [..., G, M]`` (fp32 CUDA) with ``S`` splits and group size ``size``."""
    G, M = out_mul.shape[-2:]
    return _reduce_norm_kernel.takes(out_mul, S, G, M, size)


def reduce_rmsnorm_fwd_into(out_mul_splitted, sqrsum_splitted, out_mul, sqrsum, out, size: int, eps: float) -> None:
    """§2.2.2 steps 4-6 into packed ``out_mul [T, G, M]``, ``sqrsum [T, G]``, ``out [T, M]``: the kernel on CUDA
    inputs it takes, else the reference."""
    if _reduce_takes(out_mul_splitted, out_mul_splitted.shape[0], size) and \
            _f32_packed(out_mul_splitted, sqrsum_splitted, out_mul, sqrsum, out):
        _reduce_norm_kernel.reduce_fwd_cuda(out_mul_splitted, sqrsum_splitted, out_mul, sqrsum, out, size, eps)
        return
    pm, qm, o = R.mhc_reduce_partials_and_rmsnorm_ref(out_mul_splitted, sqrsum_splitted, size, eps)
    out_mul.copy_(pm)
    sqrsum.copy_(qm)
    out.copy_(o)


def reduce_rmsnorm_bwd_into(out_grad, out_mul, sqrsum, out_mul_grad, sqrsum_grad, size: int, eps: float) -> None:
    """§2.2.3 first three bullets into packed ``out_mul_grad [T, G, M]``, ``sqrsum_grad [T, G]`` (see above)."""
    if _reduce_takes(out_mul, 1, size) and _f32_packed(out_grad, out_mul, sqrsum, out_mul_grad, sqrsum_grad):
        _reduce_norm_kernel.reduce_bwd_cuda(out_grad, out_mul, sqrsum, out_mul_grad, sqrsum_grad, size, eps)
        return
    d_mul, d_sq = R.mhc_reduce_partials_and_rmsnorm_bwd_ref(out_grad, out_mul, sqrsum, size, eps)
    out_mul_grad.copy_(d_mul)
    sqrsum_grad.copy_(d_sq)


def reduce_rmsnorm(out_mul_splitted, sqrsum_splitted, size: int, eps: float):
    """§2.2.2 steps 4-6 into fresh buffers: ``(out_mul [T, G, M], sqrsum [T, G], out [T, M])`` (kernel or
    reference as ``reduce_rmsnorm_fwd_into``)."""
    _, T, G, M = out_mul_splitted.shape
    out_mul, sqrsum = out_mul_splitted.new_empty((T, G, M)), sqrsum_splitted.new_empty((T, G))
    out = out_mul_splitted.new_empty((T, M))
    reduce_rmsnorm_fwd_into(out_mul_splitted.contiguous(), sqrsum_splitted.contiguous(), out_mul, sqrsum, out, size,
                            eps)
    return out_mul, sqrsum, out


def _norm_fn_kernel_takes(residual: torch.Tensor, fn: torch.Tensor) -> bool:
    """CUDA bf16 residual and fp32 weight of a shape the projection kernels take (K % 256 == 0, M <= 32)."""
    K = residual.shape[-2] * residual.shape[-1]
    return (residual.is_cuda and residual.dtype == torch.bfloat16 and fn.dtype == torch.float32
            and _norm_fn_kernel.takes(K, fn.shape[0]))


def norm_fn_partials(residual: torch.Tensor, fn: torch.Tensor):
    """§2.2.2 steps 1-3: split partials ``(out_mul [S, T, 1, M], sqrsum [S, T, 1])``: the GEMM kernel with
    ``S = _norm_fn_kernel.splits(K)`` where it takes the shape, else the reference with one split. A fused pre
    (§2.8) that must equal the unfused chain bit for bit takes its partials from here too."""
    K = residual.shape[-2] * residual.shape[-1]
    if not _norm_fn_kernel_takes(residual, fn):
        return R.mhc_pre_norm_fn_partials_ref(residual, fn, 1)
    x = residual.reshape(-1, K).contiguous()
    S, T, M = _norm_fn_kernel.splits(K), x.shape[0], fn.shape[0]
    out_mul = x.new_empty((S, T, M), dtype=torch.float32)
    sqrsum = x.new_empty((S, T), dtype=torch.float32)
    _norm_fn_kernel.norm_fn_partials_cuda(x, fn.contiguous(), out_mul, sqrsum)
    return out_mul.unsqueeze(2), sqrsum.unsqueeze(2)


def norm_fn_gemm_bwd(d_mul: torch.Tensor, d_sq: torch.Tensor, residual: torch.Tensor, fn: torch.Tensor,
                     buf: torch.Tensor | None):
    """§2.2.3 GEMMs from ``d_mul [T, M]``, ``d_sq [T]``: ``(dx, d_fn)``; with a side-channel ``buf`` (the
    residual's shape) the residual gradient is accumulated into it and ``dx`` is None. The kernels (fixed-order
    weight-gradient partials) where they take the shape, else the reference."""
    if not _norm_fn_kernel_takes(residual, fn):
        dx, d_fn = R.mhc_pre_norm_fn_gemm_bwd_ref(d_mul, d_sq, residual, fn, buf)
        if buf is None:
            return dx, d_fn
        buf.copy_(dx)
        return None, d_fn
    K = fn.shape[1]
    x = residual.reshape(-1, K).contiguous()
    d_fn = fn.new_empty(fn.shape)
    args = (d_mul.contiguous(), d_sq.contiguous(), x, fn.contiguous())
    if buf is None:
        dx = torch.empty_like(x)
        _norm_fn_kernel.norm_fn_gemm_bwd_cuda(*args, dx, d_fn, False)
        return dx.view(residual.shape), d_fn
    _into(buf, (-1, K), lambda b: _norm_fn_kernel.norm_fn_gemm_bwd_cuda(*args, b, d_fn, True))
    return None, d_fn


def norm_fn_forward(residual: torch.Tensor, fn: torch.Tensor, eps: float):
    """§2.2.2: ``(out [T, M], out_mul [T, 1, M], sqrsum [T, 1])`` from the split partials (``norm_fn_partials``),
    reduced in split order (``reduce_rmsnorm``)."""
    K = residual.shape[-2] * residual.shape[-1]
    out_mul, sqrsum, out = reduce_rmsnorm(*norm_fn_partials(residual, fn), K, eps)
    return out, out_mul, sqrsum


def pre_chain(out_mul_splitted, sqrsum_splitted, residual, scale, base, rms_eps, pre_eps, sinkhorn_eps,
              post_mult_value, sinkhorn_repeat, out=None):
    """The fused pre of §2.8 on flattened tensors: reduce + RMS, split, Sinkhorn, apply, so the chain's bits are the
    unfused ops' (§3). With ``_pre_mixes_kernel.ENABLED`` (the default), where the reduce,
    split and Sinkhorn kernels would all be taken, one kernel does the three (the same operations in the same order)
    and the apply follows: two launches; otherwise each step goes through the helper its unfused op takes (the
    kernels on CUDA), one launch a step.

    Returns ``(post_mix [T, n, 1], comb_mix [T, n, n], layer_input [T, C])``, written into ``out`` (three
    contiguous buffers of ``T n``, ``T n^2`` and ``T C`` elements) where given.
    """
    T, n, C = residual.shape
    post_out, comb_out, layer_input = out if out is not None else (None, None, residual.new_empty(T, C))
    if _pre_mixes_kernel.takes(out_mul_splitted, sqrsum_splitted, n, C, sinkhorn_repeat):
        S = out_mul_splitted.shape[0]
        f32 = dict(dtype=torch.float32, device=out_mul_splitted.device)
        pre = torch.empty(T, n, **f32)
        post = torch.empty(T, n, **f32) if post_out is None else post_out.view(T, n)
        comb = torch.empty(T, n * n, **f32) if comb_out is None else comb_out.view(T, n * n)
        _pre_mixes_kernel.pre_mixes_cuda(out_mul_splitted.reshape(S, T, n * (n + 2)).contiguous(),
                                         sqrsum_splitted.reshape(S, T).contiguous(), scale, base, pre, post, comb,
                                         n * C, rms_eps, post_mult_value, pre_eps, sinkhorn_repeat, sinkhorn_eps)
        apply_mix_fwd_into(residual, pre, layer_input)
        return post.view(T, n, 1), comb.view(T, n, n), layer_input
    _, _, mixes = reduce_rmsnorm(out_mul_splitted, sqrsum_splitted, n * C, rms_eps)
    pre, post, comb = split_mixes_fwd(mixes, scale, base, n, post_mult_value, pre_eps, post_out)
    comb = sinkhorn_fwd(comb.contiguous(), sinkhorn_repeat, sinkhorn_eps,
                        None if comb_out is None else comb_out.view(T, n, n))
    apply_mix_fwd_into(residual, pre, layer_input)
    return post, comb, layer_input


def _kernel_rows(t: torch.Tensor, n: int, takes) -> bool:
    """A CUDA bf16 tensor whose ``n`` streams of rows (last dim) a family's kernel takes."""
    return t.is_cuda and t.dtype == torch.bfloat16 and takes(n, t.shape[-1])


def _into(dst: torch.Tensor, shape: tuple, launch) -> None:
    """Run ``launch(view)`` on ``dst`` viewed as ``shape``; a non-contiguous ``dst`` goes through a contiguous
    copy (read by an accumulating kernel, then copied back)."""
    if dst.is_contiguous():
        launch(dst.view(shape))
        return
    tmp = dst.contiguous()
    launch(tmp.view(shape))
    dst.copy_(tmp)


def expand_fwd_into(x: torch.Tensor, o: torch.Tensor) -> None:
    """§2.1 forward into ``o [..., n, C]`` from ``x [..., C]``: the kernel on CUDA rows it takes (``C % 8 == 0``,
    ``n <= 8``), else the reference."""
    n, C = o.shape[-2:]
    if _kernel_rows(x, n, _expand_kernel.takes):
        _into(o, (-1, n, C), lambda ov: _expand_kernel.expand_fwd_cuda(x.reshape(-1, C), ov))
    else:
        o.copy_(R.expand_to_mhc_ref(x, n))


def expand_bwd_into(o_grad: torch.Tensor, x_grad: torch.Tensor) -> None:
    """§2.1 backward: overwrite ``x_grad [..., C]`` with the in-order stream sum of ``o_grad [..., n, C]``."""
    n, C = o_grad.shape[-2:]
    if _kernel_rows(o_grad, n, _expand_kernel.takes):
        _into(x_grad, (-1, C), lambda xv: _expand_kernel.expand_bwd_cuda(o_grad.reshape(-1, n, C), xv))
    else:
        x_grad.copy_(R.expand_to_mhc_bwd_ref(o_grad))


class ExpandToMHCFn(torch.autograd.Function):
    """§2.1: copy to every stream; backward sums the streams in order."""

    @staticmethod
    def forward(ctx, hidden, mhc_mult, out):
        if not _kernel_rows(hidden, mhc_mult, _expand_kernel.takes):
            return _write(out, R.expand_to_mhc_ref(hidden, mhc_mult), ctx)
        o = out if out is not None else hidden.new_empty((*hidden.shape[:-1], mhc_mult, hidden.shape[-1]))
        expand_fwd_into(hidden, o)
        if out is not None:
            ctx.mark_dirty(out)
        return o

    @staticmethod
    def backward(ctx, grad):
        if not _kernel_rows(grad, grad.shape[-2], _expand_kernel.takes):
            return R.expand_to_mhc_bwd_ref(grad), None, None
        x_grad = grad.new_empty((*grad.shape[:-2], grad.shape[-1]))
        expand_bwd_into(grad, x_grad)
        return x_grad, None, None


class MHCFnNormwMergeFn(torch.autograd.Function):
    """§2.2.1: ``W = fn * w``; gradients accumulate into ``main_grad`` when the parameter has one."""

    @staticmethod
    def forward(ctx, fn, normw):
        ctx.save_for_backward(fn, normw)
        ctx.main_grads = (getattr(fn, "main_grad", None), getattr(normw, "main_grad", None))
        return normw_merge_fwd(fn, normw)

    @staticmethod
    def backward(ctx, grad):
        fn, normw = ctx.saved_tensors
        fn_main, w_main = ctx.main_grads
        fn_grad = fn_main if fn_main is not None else torch.zeros_like(fn)
        w_grad = w_main if w_main is not None else torch.zeros_like(normw)
        normw_merge_bwd_into(fn, normw, grad, fn_grad, w_grad)
        return (None if fn_main is not None else fn_grad), (None if w_main is not None else w_grad)


class MHCPreNormFn(torch.autograd.Function):
    """§2.2.2-2.2.3: mix logits; saves the residual, the weight and the reduced partials."""

    @staticmethod
    def forward(ctx, residual, fn, eps, fuse_grad_acc):
        out, out_mul, sqrsum = norm_fn_forward(residual, fn, eps)
        ctx.save_for_backward(residual, fn, out_mul, sqrsum)
        ctx.eps, ctx.fuse_grad_acc = eps, fuse_grad_acc
        return out.view(*residual.shape[:-2], fn.shape[0])

    @staticmethod
    def backward(ctx, grad):
        residual, fn, out_mul, sqrsum = ctx.saved_tensors
        K = fn.shape[1]
        d_mul, d_sq = torch.empty_like(out_mul), torch.empty_like(sqrsum)
        reduce_rmsnorm_bwd_into(grad.reshape(-1, fn.shape[0]).contiguous(), out_mul, sqrsum, d_mul, d_sq, K, ctx.eps)
        buf = pop_residual_grad(residual) if ctx.fuse_grad_acc else None
        dx, d_fn = norm_fn_gemm_bwd(d_mul[:, 0], d_sq[:, 0], residual, fn, buf)
        return dx, d_fn, None, None


def _mix_kernel_takes(x: torch.Tensor, n: int) -> bool:
    """Whether the mix kernels (split mixes, head mix) take these fp32 CUDA logits at multiplicity n."""
    return x.is_cuda and x.dtype == torch.float32 and _mix_kernel.supports(n)


def split_mixes_fwd(input_mixes, scale, base, n: int, post_mult_value: float, pre_eps: float, post_out=None):
    """§2.3 forward: ``(pre [..., n, 1], post [..., n, 1], comb [..., n, n])``; the mix kernel on fp32 CUDA
    logits it takes, else the reference. ``post_out`` (contiguous, ``n`` values a token), where given, receives
    the post mix (the kernel writes it there)."""
    lead = input_mixes.shape[:-1]
    if not _mix_kernel_takes(input_mixes, n):
        pre, post, comb = R.mhc_pre_split_mixes_ref(input_mixes, scale, base, n, post_mult_value, pre_eps)
        return pre, post if post_out is None else post_out.view(*lead, n, 1).copy_(post), comb
    flat = input_mixes.reshape(-1, n * (n + 2))
    pre, comb = flat.new_empty(flat.shape[0], n), flat.new_empty(flat.shape[0], n * n)
    post = flat.new_empty(flat.shape[0], n) if post_out is None else post_out.view(-1, n)
    _mix_kernel.split_mixes_fwd_cuda(flat, scale, base, pre, post, comb, post_mult_value, pre_eps)
    return pre.view(*lead, n, 1), post.view(*lead, n, 1), comb.view(*lead, n, n)


class MHCPreSplitMixesFn(torch.autograd.Function):
    """§2.3: split mix logits; saves the logits, the post mix, scale and base. CUDA: the mix kernels."""

    @staticmethod
    def forward(ctx, input_mixes, scale, base, mhc_mult, post_mult_value, pre_eps):
        pre, post, comb = split_mixes_fwd(input_mixes, scale, base, mhc_mult, post_mult_value, pre_eps)
        ctx.save_for_backward(input_mixes, post, scale, base)
        ctx.post_mult_value = post_mult_value
        return pre, post, comb

    @staticmethod
    def backward(ctx, d_pre, d_post, d_comb):
        input_mixes, post, scale, base = ctx.saved_tensors
        n = post.shape[-2]
        if _mix_kernel_takes(input_mixes, n):
            flat = input_mixes.reshape(-1, input_mixes.shape[-1])
            d_input, d_scale, d_base = torch.empty_like(flat), scale.new_empty(3), base.new_empty(base.shape[0])
            _mix_kernel.split_mixes_bwd_cuda(
                d_pre.reshape(-1, n).contiguous(), d_post.reshape(-1, n).contiguous(),
                d_comb.reshape(-1, n * n).contiguous(), flat, post.reshape(-1, n), scale, base, d_input, d_scale,
                d_base, ctx.post_mult_value)
            return d_input.view(input_mixes.shape), d_scale, d_base, None, None, None
        d_input, d_scale, d_base = R.mhc_pre_split_mixes_bwd_ref(
            d_pre.reshape(-1, n), d_post.reshape(-1, n), d_comb.reshape(-1, n * n),
            input_mixes.reshape(-1, input_mixes.shape[-1]), post.reshape(-1, n), scale, base,
            ctx.post_mult_value, num_partials(input_mixes.device))
        return d_input.view(input_mixes.shape), d_scale, d_base, None, None, None


def sinkhorn_fwd(x: torch.Tensor, repeat: int, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """§2.4 forward into ``out`` (a new tensor if None; contiguous, ``x``'s shape): the Sinkhorn kernel where it
    takes ``x`` (contiguous ``[..., n, n]``, seen as ``[T, n, n]``), else the reference."""
    if not _sinkhorn_kernel.fwd_supported(x, repeat):
        result = R.sinkhorn_normalize_ref(x, repeat, eps)
        return result if out is None else out.copy_(result)
    out = torch.empty_like(x) if out is None else out
    n = x.shape[-1]
    _sinkhorn_kernel.sinkhorn_fwd_cuda(x.view(-1, n, n), out.view(-1, n, n), repeat, eps)
    return out


class SinkhornNormalizeFn(torch.autograd.Function):
    """§2.4: Sinkhorn; saves only the input and replays the forward in backward."""

    @staticmethod
    def forward(ctx, x, repeat, eps):
        ctx.save_for_backward(x)
        ctx.repeat, ctx.eps = repeat, eps
        return sinkhorn_fwd(x, repeat, eps)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        if _sinkhorn_kernel.bwd_supported(x, ctx.repeat):
            n = x.shape[-1]
            d_x = torch.empty_like(x)
            _sinkhorn_kernel.sinkhorn_bwd_cuda(grad.reshape(-1, n, n).contiguous(), x.view(-1, n, n),
                                               d_x.view(-1, n, n),
                                 ctx.repeat, ctx.eps)
            return d_x, None, None
        return R.sinkhorn_normalize_bwd_ref(grad, x, ctx.repeat, ctx.eps), None, None


def apply_mix_fwd_into(x: torch.Tensor, mix: torch.Tensor, o: torch.Tensor) -> None:
    """§2.5 forward into ``o [..., C]`` from ``x [..., n, C]`` and ``mix [..., n]`` (or ``[..., n, 1]``): the kernel
    on CUDA rows it takes (``C % 8 == 0``, ``n <= 8``), else the reference."""
    n, C = x.shape[-2:]
    if _kernel_rows(x, x.shape[-2], _apply_mix_kernel.takes):
        _into(o, (-1, C), lambda ov: _apply_mix_kernel.apply_mix_fwd_cuda(x.reshape(-1, n, C), mix.reshape(-1, n), ov))
    else:
        o.copy_(R.mhc_pre_apply_mix_ref(x, mix.reshape(*x.shape[:-1], 1)))


def apply_mix_bwd_into(o_grad: torch.Tensor, x: torch.Tensor, mix: torch.Tensor, x_grad: torch.Tensor,
                       accumulate: bool) -> torch.Tensor:
    """§2.5 backward: ``x_grad = bf(fma(mix, g, x_grad))`` (``accumulate``) or ``bf(mix * g)``; returns the mix
    gradient ``[T, n]`` (T: x's leading dims flattened). The kernel on CUDA rows it takes (``C % 8 == 0``, ``n <=
    8``), else the reference."""
    n, C = x.shape[-2:]
    if _kernel_rows(x, x.shape[-2], _apply_mix_kernel.takes):
        out = []
        _into(x_grad, (-1, n, C), lambda xv: out.append(_apply_mix_kernel.apply_mix_bwd_cuda(
            o_grad.reshape(-1, C), x.reshape(-1, n, C), mix.reshape(-1, n), xv, accumulate)))
        return out[0]
    dx, d_mix = R.mhc_pre_apply_mix_bwd_ref(o_grad, x, mix.reshape(*x.shape[:-1], 1), x_grad if accumulate else None)
    x_grad.copy_(dx)
    return d_mix.reshape(-1, n)


class MHCPreApplyMixFn(torch.autograd.Function):
    """§2.5: apply the pre mix; backward accumulates dx into the side channel when one is attached."""

    @staticmethod
    def forward(ctx, x, mix, out):
        ctx.save_for_backward(x, mix)
        if not _kernel_rows(x, x.shape[-2], _apply_mix_kernel.takes):
            return _write(out, R.mhc_pre_apply_mix_ref(x, mix), ctx)
        o = out if out is not None else x.new_empty((*x.shape[:-2], x.shape[-1]))
        apply_mix_fwd_into(x, mix, o)
        if out is not None:
            ctx.mark_dirty(out)
        return o

    @staticmethod
    def backward(ctx, grad):
        x, mix = ctx.saved_tensors
        buf = peek_residual_grad(x)
        if not _kernel_rows(x, x.shape[-2], _apply_mix_kernel.takes):
            dx, d_mix = R.mhc_pre_apply_mix_bwd_ref(grad, x, mix, buf)
            if buf is not None:
                buf.copy_(dx)
                dx = None
            return dx, d_mix, None
        if buf is not None:
            d_mix = apply_mix_bwd_into(grad, x, mix, buf, True)
            dx = None
        else:
            dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
            d_mix = apply_mix_bwd_into(grad, x, mix, dx, False)
        return dx, d_mix.view(mix.shape), None


def post_forward(x, residual, post_layer_mix, comb_res_mix, out=None):
    """§2.6 forward: the kernel where it takes the arguments (``_post_kernel.takes``), else the reference;
    writes ``out`` when given and returns it."""
    if _post_kernel.takes(x, residual, post_layer_mix, comb_res_mix):
        return _post_kernel.post_fwd_cuda(x, residual, post_layer_mix, comb_res_mix, out)
    result = R.mhc_post_ref(x, residual, post_layer_mix, comb_res_mix)
    return result if out is None else out.copy_(result)


def post_backward(x, residual, post_layer_mix, comb_res_mix, d_o, fuse_grad_acc: bool):
    """§2.6 backward (the kernel where it takes the arguments, else the reference); with ``fuse_grad_acc`` the
    residual gradient also becomes the side channel."""
    if _post_kernel.takes(x, residual, post_layer_mix, comb_res_mix, d_o):
        d_x, d_residual, d_post, d_comb = _post_kernel.post_bwd_cuda(x, residual, post_layer_mix, comb_res_mix, d_o)
    else:
        d_x, d_residual, d_post, d_comb = R.mhc_post_bwd_ref(x, residual, post_layer_mix, comb_res_mix, d_o)
    if fuse_grad_acc:
        attach_residual_grad(residual, d_residual)
    return d_x, d_residual, d_post, d_comb


class MHCPostFn(torch.autograd.Function):
    """§2.6: new residual; backward attaches the residual gradient as the side channel (v1)."""

    @staticmethod
    def forward(ctx, x, residual, post_layer_mix, comb_res_mix, out):
        ctx.save_for_backward(x, residual, post_layer_mix, comb_res_mix)
        if out is not None:
            ctx.mark_dirty(out)
        return post_forward(x, residual, post_layer_mix, comb_res_mix, out)

    @staticmethod
    def backward(ctx, grad):
        return (*post_backward(*ctx.saved_tensors, grad, True), None)


class MHCHeadComputeMixFn(torch.autograd.Function):
    """§2.7: head mix; parameter gradients through P token partials reduced in order. CUDA: the mix kernels."""

    @staticmethod
    def forward(ctx, input_mix, scale, base, pre_eps):
        ctx.save_for_backward(input_mix, scale, base)
        n = input_mix.shape[-1]
        if _mix_kernel_takes(input_mix, n):
            out = torch.empty_like(input_mix)
            _mix_kernel.head_mix_fwd_cuda(input_mix.reshape(-1, n), scale, base, out.view(-1, n), pre_eps)
            return out
        return R.mhc_head_compute_mix_ref(input_mix, scale, base, pre_eps)

    @staticmethod
    def backward(ctx, grad):
        input_mix, scale, base = ctx.saved_tensors
        n = input_mix.shape[-1]
        if _mix_kernel_takes(input_mix, n):
            flat = input_mix.reshape(-1, n)
            d_input, d_scale, d_base = torch.empty_like(flat), scale.new_empty(1), base.new_empty(n)
            _mix_kernel.head_mix_bwd_sums_cuda(grad.reshape(-1, n).contiguous(), flat, scale, base, d_input, d_scale,
                                               d_base)
            return d_input.view(input_mix.shape), d_scale, d_base, None
        d_input, scale_partial, base_partial = R.mhc_head_compute_mix_bwd_ref(
            grad.reshape(-1, n), input_mix.reshape(-1, n), scale, base, num_partials(input_mix.device))
        return d_input.view(input_mix.shape), R.seq_sum(scale_partial, 0), R.seq_sum(base_partial, 0), None
